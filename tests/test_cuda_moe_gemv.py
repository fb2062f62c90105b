"""The CUDA mixture-of-experts decode GEMV (schedules/cuda_moe_gemv.py, cuda/moe_gemv.cuh) without a GPU: the
standalone kernel compiles through NVRTC for the Qwen3-30B-A3B and Mixtral-8x7B shapes (and the edge layouts:
fewer units than lanes, units not a multiple of the lanes, partial load chunks, two rows a thread), a q4f16_1 MoE
library takes it in place of the TIR kernel and its whole source compiles, and the semantics it implements are
pinned on the CPU: a numpy reference against the portable TIR kernel (moe_kernels.expert_gemv_warp) in float16.
The numerics of the CUDA code itself run on the GPU: bench/moe.py checks the CUDA build of its small shapes against
the CPU build."""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_cuda_nvrtc import _assert_compiles, _cuda_source, nvrtc  # noqa: F401 (the fixture)
from test_moe import _q4_experts, _run_on_cpu

from mlcc.options import CompileOptions
from mlcc.schedules.cuda_moe_gemv import (
    ATTR,
    MoeGemv,
    MoeLayout,
    kernel_source,
    launch_layout,
    make_moe_gemv,
    match_expert_gemv,
)
from mlcc.targets import get_target

# (K, n, k, rows_x, swiglu, experts): Qwen3-30B-A3B gate_up and down, Mixtral-8x7B gate_up and down
QWEN3 = [MoeGemv(2048, 768, 8, 1, True, 128), MoeGemv(768, 2048, 8, 8, False, 128)]
MIXTRAL = [MoeGemv(4096, 14336, 2, 1, True, 8), MoeGemv(14336, 4096, 2, 2, False, 8)]
# layouts besides the default: 32 lanes on 24 units, 16 lanes with half idle on the second round, a partial last
# chunk (14 units a lane in chunks of 4), one row a thread, one row set in the last warp of a block
EDGES = [(QWEN3[1], MoeLayout(32, 1, 1)), (QWEN3[1], MoeLayout(16, 2, 2)), (MIXTRAL[1], MoeLayout(32, 1, 4)),
         (MIXTRAL[1], MoeLayout(32, 1, 7)), (MoeGemv(96, 24, 3, 3, False, 16), MoeLayout(4, 2, 1)),
         (MoeGemv(96, 24, 3, 1, True, 16), None)]


def test_launch_layouts():
    """Lanes that leave none idle (K=768: 8 lanes of 3 units), more rows a thread while a chunk stays within 16
    loads and the grid at 2048 warps, the lane's units in even chunks (Mixtral's down: 14 units a lane of 4 rows,
    chunks of 4: the last one partial)."""
    got = [(lay.lanes, lay.rows, lay.chunk, lay.warps(s)) for s in QWEN3 + MIXTRAL for lay in [launch_layout(s)]]
    assert got == [(32, 2, 2, 3072), (8, 2, 3, 2048), (32, 2, 4, 14336), (32, 4, 4, 2048)]
    assert launch_layout(MoeGemv(96, 24, 3, 1, True, 16)) == MoeLayout(4, 1, 1)  # 3 units: 4 lanes, one idle


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_standalone_kernels_compile(nvrtc, arch):  # noqa: F811
    cases = [(s, None) for s in QWEN3 + MIXTRAL] + EDGES
    src = "".join(kernel_source(s, lay, with_header=i == 0) for i, (s, lay) in enumerate(cases))
    assert src.count("__global__") == len(cases)
    _assert_compiles(nvrtc, src, arch)


# one layer of bench/moe.py's qwen3-moe-small (128 experts, top 8), a small vocabulary
QWEN3_MOE_SMALL = dict(
    hidden_size=512, intermediate_size=6144, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
    head_dim=64, vocab_size=1024, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0,
    tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=256,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], hidden_act="silu")


def test_q4_moe_library_takes_the_kernel_and_compiles(tmp_path, nvrtc):  # noqa: F811
    from mlcc.compiler.build import compile_library, export_module
    from mlcc.compiler.quantize import get_quantization
    from mlcc.compiler.weights import ModelSource

    source = ModelSource("config", tmp_path, "qwen3_moe", QWEN3_MOE_SMALL, {})
    built = export_module(source, get_target("cuda"), get_quantization("q4f16_1"))
    src = _cuda_source(compile_library(built, tmp_path / "model.so").mod)
    calls = set(re.findall(r"mlcc_moe_gemv<([^>]*)>\(", src))
    # gate_up (SwiGLU, one x) and down (x row j for expert j)
    assert calls == {"512, 256, 8, 1, true, 16, 1, 1", "256, 512, 8, 8, false, 8, 1, 1"}, calls
    assert src.count("void mlcc_moe_gemv(") == 1 and src.count("mlcc_q4x8_hfma2_s1(unsigned w") == 1
    assert "moe_grouped_gemm" in src  # prefill keeps the grouped GEMM
    _assert_compiles(nvrtc, src)


def _expert_gemv_func(fmt, rows_x: int, kdim: int, n: int, swiglu: bool, k: int = 8, experts: int = 16):
    """expert_gemv_warp's PrimFunc, as a model's module holds it."""
    import tvm
    from tvm.relax.frontend import nn

    from mlcc.relax_models.moe_kernels import expert_gemv_warp

    w_rows = 2 * n if swiglu else n
    q = fmt.scheme is not None
    w_spec = ((experts, w_rows, kdim // 8), "uint32") if q else ((experts, w_rows, kdim), fmt.dtype)

    class Kernel(nn.Module):
        def forward(self, x, ids, w, s):
            return expert_gemv_warp(x, ids, [w, s] if q else [w], fmt, n, swiglu=swiglu)

    mod, _ = Kernel().export_tvm({"forward": {
        "x": nn.spec.Tensor((rows_x, kdim), fmt.dtype), "ids": nn.spec.Tensor((k,), "int32"),
        "w": nn.spec.Tensor(*w_spec), "s": nn.spec.Tensor((experts, w_rows, kdim // 32), fmt.dtype)}})
    (func,) = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    return func


def test_the_pass_matches_q4_float16_experts_only():
    import tvm

    from mlcc.quantization import get_quantization
    from mlcc.relax_models.moe_kernels import EXPERT_GEMV_ATTR, ExpertFormat
    from mlcc.schedules import handwritten_kernel_passes
    from mlcc.schedules.cuda_moe_gemv import moe_expert_gemv_pass

    assert ATTR == EXPERT_GEMV_ATTR
    f16_q4 = ExpertFormat("float16", get_quantization("q4f16_1"))
    q4 = _expert_gemv_func(f16_q4, 8, 256, 40, False)
    assert match_expert_gemv(q4) == MoeGemv(256, 40, 8, 8, False, 16)
    assert match_expert_gemv(_expert_gemv_func(f16_q4, 1, 512, 24, True)) == MoeGemv(512, 24, 8, 1, True, 16)
    assert match_expert_gemv(_expert_gemv_func(ExpertFormat("float16"), 1, 256, 40, False)) is None
    f32_q4 = ExpertFormat("float32", get_quantization("q4f32_1"))
    assert match_expert_gemv(_expert_gemv_func(f32_q4, 1, 256, 40, False)) is None
    # in place: the same parameters and buffer shapes, the marker dropped (the replacement is not matched again)
    new = moe_expert_gemv_pass()(tvm.IRModule({"f": q4}))["f"]
    assert [([int(d) for d in p.shape], p.dtype) for p in new.params] == \
        [([int(d) for d in p.shape], p.dtype) for p in q4.params]
    assert ATTR not in new.attrs and new.attrs["op_pattern"] == 8 and "mlcc_moe_gemv<256, 40, 8, 8" in str(new)
    assert match_expert_gemv(make_moe_gemv(MoeGemv(256, 40, 8, 8, False, 16))) is None

    def names(preset: str, options: CompileOptions) -> list[str]:
        return [p.info.name for p in handwritten_kernel_passes(get_target(preset).tvm_target(), options)]

    assert "mlcc_cuda_moe_expert_gemv" in names("cuda", CompileOptions())
    assert "mlcc_cuda_moe_expert_gemv" in names("cuda-sm80", CompileOptions())
    assert "mlcc_cuda_moe_expert_gemv" not in names("cuda", CompileOptions(decode_gemv=False))


def moe_gemv_reference(x: np.ndarray, ids: np.ndarray, w: np.ndarray, n: int, swiglu: bool) -> np.ndarray:
    """The kernel's semantics: out[j, r] = x_j . W[ids[j], r] (x_j = x[0] when x has one row), W dequantized, fp32
    sums; with swiglu, gate and up (rows r and n + r) rounded to fp16, then silu(gate) * up; out in fp16."""
    xs = x.astype(np.float32)
    full = np.stack([xs[0 if len(x) == 1 else j] @ w[e].T for j, e in enumerate(ids)])
    if not swiglu:
        return full.astype(np.float16)
    g, u = (full[:, :n].astype(np.float16).astype(np.float32), full[:, n:].astype(np.float16).astype(np.float32))
    return (g / (1 + np.exp(-g)) * u).astype(np.float16)


@pytest.mark.parametrize("swiglu,rows_x,kdim,n", [(True, 1, 256, 24), (False, 4, 768, 40)])
def test_semantics_against_the_tir_kernel(swiglu, rows_x, kdim, n):
    """The numpy reference of what the CUDA kernel computes agrees with the TIR kernel it replaces (float16
    activations and scales, its thread loops run serially on the CPU)."""
    from mlcc.quantization import get_quantization
    from mlcc.relax_models.moe_kernels import ExpertFormat, expert_gemv_warp

    rng = np.random.default_rng(3)
    e, k = 16, 4
    words, scale, _ = _q4_experts(rng, e, 2 * n if swiglu else n, kdim)
    scale = scale.astype(np.float16)
    codes = (words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
    w = (codes.reshape(e, -1, kdim).astype(np.float32) - 7) * np.repeat(scale.astype(np.float32), 32, axis=2)
    x = rng.standard_normal((rows_x, kdim)).astype(np.float16)
    ids = np.array([11, 2, 15, 7], np.int32)
    fmt = ExpertFormat("float16", get_quantization("q4f16_1"))
    (got,) = _run_on_cpu(lambda xs, i, ws, ss: expert_gemv_warp(xs, i, [ws, ss], fmt, n, swiglu=swiglu, serial=True),
                         {"xs": (x.shape, "float16"), "i": ((k,), "int32"), "ws": (words.shape, "uint32"),
                          "ss": (scale.shape, "float16")}, x, ids, words, scale)
    want = moe_gemv_reference(x, ids, w, n, swiglu).astype(np.float32)
    assert got.shape == (k, n)
    # (the TIR kernel applies silu to the unrounded projections: within fp16 rounding of the reference)
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-3, atol=2e-3 * np.abs(want).max())
