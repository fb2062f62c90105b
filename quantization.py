"""The quantization schemes: one description of each weight layout, read by the quantizer, the numpy packers and
every kernel that decodes quantized weights. No TVM import here, so runtime-only tools can use it.

A group scheme stores each weight row as `bits`-bit codes packed low code first into `storage_dtype` words, with
one scale (in `scale_dtype`) per `group_size` consecutive codes along K. Symmetric schemes decode a code as
(code - zero_code) · scale; a zero-point scheme carries a second per-group tensor, the zero points packed like the
codes (uint32[out, ceil(groups/per_word)], group g in word g // per_word), and decodes (code - zero) · scale.
q4f16_1 / q4f32_1 are bit-compatible with MLC-LLM: uint32[out, in/8] of 8 nibbles, scale[out, in/32] in the model
dtype, q = clamp(round(w/scale) + 7, 0, 14).

q8f16_1 / q8f32_1 are int8 weight-only quantization (TensorRT-LLM's "INT8 weight-only"): symmetric 8-bit codes,
4 a uint32 word low byte first (uint32[out, in/4], the same words every target reads: WGSL has no 8-bit types),
stored offset by 128 (the int8 value with its sign bit flipped, so code - 128 decodes it, the form the magic-number
int-to-float decode wants), and one scale in the model dtype per group of 32 along K, absmax / 127. Group scales
rather than TensorRT-LLM's one scale per output row: groups of 32 are the machinery every kernel here already
decodes (CPU GEMM, the CUDA cuBLASLt scratch decoder, dlight, WebGPU) and tensor-parallel splits already respect,
and they are llama.cpp's Q8_0 block (32 int8 codes, one fp16 scale), so a GGUF Q8_0 tensor re-quantizes to the
same codes and scales; the cost is 0.5 (f16) or 1 (f32) bit per weight of scales over per-row ones. Like q4f16_1
they quantize the embedding and LM head too. Kernels that read the codes: the CPU decode GEMV and many-token GEMM
(schedules/cpu_gemv.py, cpu_gemm.py), CUDA's batch-1 decode GEMV (schedules/cuda_gemv.py, q8f16_1); CUDA projections
over 16 tokens decode into a float16 scratch for cuBLASLt (compiler/vendor_gemm.py: mlcc has no int8 GEMM, and
dlight's generic one is what would read them otherwise, as it does for 16 tokens or fewer and on WebGPU, Metal and
ROCm).

The published 4-bit checkpoints (AWQ, GPTQ, compressed-tensors pack-quantized; compiler/int4_checkpoint.py) keep
their codes and group size: q4f16_awq / q4f32_awq carry their zero points (AWQ, asymmetric GPTQ and
compressed-tensors), q4f16_g128 / q4f32_g128 are their symmetric form, codes 0..15 centred on 8. Both use group 128,
what those checkpoints are published with, and leave the embedding and LM head in the model dtype, as they do.

A float8 scheme stores each weight as one 8-bit float (`storage_dtype`, e.g. float8_e4m3fn) with one float32 scale
per output channel (row), w ≈ code · scale, scale = absmax(row) / the format's largest finite value. Its embedding
and LM head stay in the model dtype (they are few and the most sensitive to rounding). `activations` names the
dtype many-token GEMMs quantize their activations to, per token, on the fly (cuBLASLt FP8 on CUDA); every other
path multiplies in the model dtype. e4m3_e4m3_f16 follows MLC's naming: e4m3 weights, e4m3 activations, float16
model.

MXFP4 (OCP microscaling FP4, gpt-oss's published experts) is no `--quant` choice: a checkpoint that stores its expert
weights so keeps them as they are, whatever the scheme of the rest. Its codes are E2M1 floats (sign, two exponent
bits, one mantissa bit: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}), eight a uint32 word low nibble first like q4's, and each 32
codes along K share one power of two stored as a biased exponent (uint8 E8M0: 2^(e - 127)). Only the expert kernels
(relax_models/moe_kernels.py) read it.

The quantizer tags every quantized projection with its scheme's name (TAG): an annotation on the "dequantize"
block of a dense projection (fusion rewrites functions and drops their attributes, but keeps blocks) and a
function attribute on the opaque expert kernels. Kernels look the scheme up by that name instead of assuming one.
"""

from __future__ import annotations

import dataclasses
import re

from mlcc.errors import UnknownQuantizationError

TAG = "mlcc.quant"  # annotation / attribute naming a quantized projection's scheme


@dataclasses.dataclass(frozen=True)
class Quantization:
    name: str
    model_dtype: str          # activations and unquantized parameters
    kind: str                 # "none" | "group" | "float8" | "mxfp4" (stacked experts as published only)
    group_size: int = 32      # codes along K sharing one scale (float8: 0, one scale per row)
    bits: int = 4             # per code
    storage_dtype: str = "uint32"  # the words codes are packed into
    symmetric: bool = True    # codes centred on zero_code; False: a per-group zero point (the q_zero tensor)
    zero: int | None = None   # the code that decodes to 0 in a symmetric scheme where it is not max_int
    # int -> float by OR-ing the code into a float's mantissa (exact, and cheaper than a convert on GPUs);
    # off for WGSL, which has no 16-bit integers to build the f16 bit pattern from
    magic_int_to_float: bool = True
    scale: str | None = None  # the scales' dtype where it is not the model dtype
    activations: str | None = None  # many-token GEMMs quantize activations to this dtype per token (None: they don't)
    quantize_embedding: bool = True  # False: embedding (and a tied LM head) stay in the model dtype
    quantize_lm_head: bool = True

    @property
    def scale_dtype(self) -> str:
        return self.scale or self.model_dtype

    @property
    def float_max(self) -> float:
        """The largest finite value of a float8 scheme's codes (what the row's absmax maps to)."""
        return _FLOAT8_MAX[self.storage_dtype]

    def weight_shape(self, n: int, k: int) -> tuple[int, int]:
        """The stored codes of a [n, k] weight."""
        return n, k // self.per_word

    def scale_shape(self, n: int, k: int) -> tuple[int, ...]:
        """The scales of a [n, k] weight: one per group of a row, or one per row (float8)."""
        return (n,) if self.kind == "float8" else (n, k // self.group_size)

    def zero_shape(self, n: int, k: int) -> tuple[int, int]:
        """The packed zero points of a [n, k] weight in a zero-point scheme: one code per group, per_word a word."""
        return n, -(-(k // self.group_size) // self.per_word)

    @property
    def zero_code(self) -> int:
        """The code that decodes to zero in a symmetric scheme."""
        return self.max_int if self.zero is None else self.zero

    @property
    def max_int(self) -> int:
        """The code that decodes to zero (symmetric schemes), and the largest magnitude a code stands for."""
        return (1 << (self.bits - 1)) - 1

    @property
    def code_mask(self) -> int:
        return (1 << self.bits) - 1

    @property
    def storage_bits(self) -> int:
        return int(re.search(r"\d+", self.storage_dtype).group())

    @property
    def per_word(self) -> int:
        """Codes per storage word."""
        return self.storage_bits // self.bits

    @property
    def words_per_group(self) -> int:
        return self.group_size // self.per_word


_FLOAT8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}

QUANTIZATIONS: dict[str, Quantization] = {
    "q0f32": Quantization("q0f32", "float32", "none"),
    "q0f16": Quantization("q0f16", "float16", "none"),
    "q4f16_1": Quantization("q4f16_1", "float16", "group"),
    "q4f32_1": Quantization("q4f32_1", "float32", "group"),
    "q8f16_1": Quantization("q8f16_1", "float16", "group", bits=8, zero=128),
    "q8f32_1": Quantization("q8f32_1", "float32", "group", bits=8, zero=128),
    "e4m3_e4m3_f16": Quantization("e4m3_e4m3_f16", "float16", "float8", group_size=0, bits=8,
                                  storage_dtype="float8_e4m3fn", scale="float32", activations="float8_e4m3fn",
                                  quantize_embedding=False, quantize_lm_head=False),
    **{f"q4{f}_{kind}": Quantization(f"q4{f}_{kind}", dtype, "group", group_size=128, symmetric=kind == "g128",
                                     zero=8 if kind == "g128" else None, quantize_embedding=False,
                                     quantize_lm_head=False)
       for kind in ("awq", "g128") for f, dtype in (("f16", "float16"), ("f32", "float32"))},
}


# (kind "mxfp4": the scale is an exponent, the code a float; see the module docstring)
MXFP4 = Quantization("mxfp4", "float32", "mxfp4", scale="uint8", quantize_embedding=False, quantize_lm_head=False)


def get_quantization(name: str) -> Quantization:
    if name not in QUANTIZATIONS:
        raise UnknownQuantizationError(
            f"unknown quantization '{name}'; choose one of: {', '.join(QUANTIZATIONS)}")
    return QUANTIZATIONS[name]


def weight_scheme(weights: str) -> Quantization | None:
    """The quantized scheme (group or float8) a kernel's `weights` names, or None where it names a plain dtype
    ("float16")."""
    q = QUANTIZATIONS.get(weights)
    return q if q is not None and q.kind != "none" else None
