"""Prefill GEMMs on tensor cores for CUDA: the many-token projections (M = prompt tokens, N x K = the weight), fp16
activations times fp16 or q4f16_1 weights, as the templated kernel in cuda/tc_gemm.cuh (mma.sync.m16n8k16 fed by
ldmatrix from a cp.async multi-stage shared-memory ring; q4 weights are dequantized in shared memory, so they stay
4-bit in global memory), with the epilogues a projection needs: + bias, + residual, SwiGLU of gate_up.

The kernel's parameters are explicit (`GemmParams`: block tile, warp grid, pipeline stages) so that a search can
try others; `default_params` is the table an untuned build uses. `kernel_source` wraps one instantiation as a
standalone `extern "C"` kernel (the benchmark and the NVRTC tests compile exactly that); `make_gemm` gives the TIR
PrimFunc that calls it from a compiled model (the template call goes through the helper insertion of cuda_source).
"""

from __future__ import annotations

import dataclasses

from mlcc.quantization import weight_scheme

from .cuda_source import decodes_q4, q4_scheme

EPILOGUES = {"none": 0, "bias": 1, "add": 2, "swiglu": 3}
HELPER = "mlcc_tc_gemm"
# dynamic shared memory a block may have, by SM version (CUDA's "maximum shared memory per block, opt-in")
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}


@dataclasses.dataclass(frozen=True)
class GemmParams:
    bm: int = 128     # block tile rows (tokens)
    bn: int = 128     # block tile columns (output features)
    wm: int = 2       # warps along M
    wn: int = 4       # warps along N
    stages: int = 3   # cp.async pipeline depth (k-tiles in flight)
    bk: int = 32      # K per stage: 32 or 64 (one or two q4 scale groups)
    split: int = 1    # split-K: blocks along K, partials summed by a second kernel (few tokens)

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn

    def smem_bytes(self, q4: bool) -> int:
        """Dynamic shared memory of one block: the A ring, the B ring (q4: one dequantized tile, plus the ring of
        packed words and scale pairs), as tc_gemm.cuh carves it."""
        a = self.stages * self.bm * self.bk * 2
        b = (1 if q4 else self.stages) * self.bn * self.bk * 2
        return a + b + (self.stages * self.bn * (self.bk // 2 + 4) if q4 else 0)

    def valid(self, q4: bool, sm: int = 90) -> bool:
        wtm, wtn, ch = self.bm // self.wm, self.bn // self.wn, self.bk // 8
        limit = SMEM_LIMIT.get(sm, SMEM_LIMIT[max(v for v in SMEM_LIMIT if v <= sm)] if sm >= 80 else 0)
        # a thread's fp32 accumulators within half its register budget (65536 a block, 255 a thread): more spills
        acc = wtm * wtn // 32
        return (self.stages >= 2 and self.bk in (32, 64) and wtm % 16 == 0 and wtm >= 16 and wtn % 16 == 0
                and acc <= min(128, 32768 // self.threads)
                and (self.bm * ch) % self.threads == 0 and (self.bn * ch) % self.threads == 0
                and self.smem_bytes(q4) <= limit)

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


# Before sm_90 (no measurements there): 128 x 128 tiles of 8 warps, 3 stages of 32, which fit 48 KB. On an H200
# (bench/prefill.py gemm-run over an 8B model's projections at 512-8,192 tokens) 256 x 128 tiles with 4 stages of 64 won most
# shapes (192 KB of shared memory a block): 300-380 TFLOP/s fp16, 300-320 q4f16_1 from 2,048 tokens up.
_DEFAULTS = {  # (q4 weights, tokens, sm_90+)
    (False, "large", True): GemmParams(256, 128, 4, 2, 4, 64),
    (True, "large", True): GemmParams(256, 128, 4, 2, 4, 64),
    (False, "large", False): GemmParams(128, 128, 2, 4, 3),
    (True, "large", False): GemmParams(128, 128, 2, 4, 3),
    (False, "small", False): GemmParams(64, 128, 2, 2, 4),
    (True, "small", False): GemmParams(64, 128, 2, 2, 4),
}


def reads(weights: str) -> bool:
    """Whether the kernel takes `weights`: "float16", or a scheme its q4 path decodes."""
    return weights == "float16" or decodes_q4(weight_scheme(weights))


def is_q4(weights: str) -> bool:
    """`weights` names a group scheme (which the kernel's q4 path must decode: cuda_source.decodes_q4), not
    "float16"."""
    if weight_scheme(weights) is None:
        return False
    q4_scheme(weights)  # (refuses a scheme the q4 path does not decode)
    return True


def default_params(weights: str, m_hint: int | None = None, sm: int = 90) -> GemmParams:
    """The untuned choice for `weights` ("float16" or a q4 scheme) on SM version `sm`; `m_hint`: expected tokens
    (None: a long prompt)."""
    size = "small" if m_hint is not None and m_hint < 256 else "large"
    q4 = is_q4(weights)
    return _DEFAULTS.get((q4, size, sm >= 90), _DEFAULTS[(q4, size, False)])


def supported(n: int, k: int, params: GemmParams, epilogue: str = "none") -> bool:
    """Whether the kernel handles an N x K weight with these parameters (it checks no bounds on N or K)."""
    tile_n = params.bn // 2 if epilogue == "swiglu" else params.bn
    if params.split > 1 and (epilogue == "swiglu" or k % (params.split * max(64, params.bk))):
        return False
    return k % 64 == 0 and n % params.bn == 0 and (epilogue != "swiglu" or (n // 2) % tile_n == 0)


SMALL_M = 64           # up to this many tokens the few-token kernel runs (batched decode, speculative verify)
# Where the default 256-row tiles would launch fewer blocks than this, 128 x 128 ones run: at 512 tokens they won
# for the 8B's o and down projections (64 blocks: 1.4-1.5x) and lost for qkv and gate_up (96 and 448 blocks).
MID_BLOCKS = 80


def mid_params(weights: str, sm: int = 90) -> GemmParams:
    return GemmParams(128, 128, 2, 4, 4, 64) if sm >= 90 else default_params(weights, sm=sm)
BLOCKS_WANTED = 528    # 4 blocks for each of an H100/H200's 132 SMs


def few_token_params(n: int, k: int, weights: str, sm: int = 90) -> GemmParams:
    """32-row tiles, K split until the grid has BLOCKS_WANTED blocks (each split keeps >= 4 k-tiles of 64)."""
    p = GemmParams(32, 128, 2, 4, 4, 64)
    if not p.valid(is_q4(weights), sm):
        p = GemmParams(32, 128, 2, 4, 3, 32)
    split = 1
    while (n // p.bn) * split < BLOCKS_WANTED and k % (split * 2 * 256) == 0 and split < 16:
        split *= 2
    return dataclasses.replace(p, split=split)


def template_call(weights: str, epilogue: str, params: GemmParams) -> str:
    p = params
    q4 = "true" if is_q4(weights) else "false"
    if p.split > 1:  # (the partials take the epilogue in the reduction)
        return f"{HELPER}<{p.bm}, {p.bn}, {p.bk}, {p.wm}, {p.wn}, {p.stages}, {q4}, 0, {p.split}>"
    return f"{HELPER}<{p.bm}, {p.bn}, {p.bk}, {p.wm}, {p.wn}, {p.stages}, {q4}, {EPILOGUES[epilogue]}>"


def reduce_call(epilogue: str, params: GemmParams) -> str:
    return f"{HELPER}_reduce<{params.split}, {EPILOGUES[epilogue]}>"


REDUCE_THREADS = 256


def kernel_name(weights: str, epilogue: str, params: GemmParams) -> str:
    p = params
    split = f"_k{p.split}" if p.split > 1 else ""
    return f"mlcc_gemm_{weights}_{epilogue}_{p.bm}x{p.bn}x{p.bk}_w{p.wm}x{p.wn}_s{p.stages}{split}"


def kernel_source(weights: str, epilogue: str, params: GemmParams, with_header: bool = True) -> str:
    """A standalone kernel: name(A, W, S, E, C, M, N, K), grid (N' / bn, ceil(M / bm)), `params.threads` threads,
    `params.smem_bytes(q4)` bytes of dynamic shared memory, where N' is N (for "swiglu", W's 2I rows: the grid then
    covers 2I / bn blocks of bn / 2 outputs each)."""
    from .cuda_source import HELPER_DIR

    head = (HELPER_DIR / "tc_gemm.cuh").read_text() if with_header else ""
    split = params.split > 1  # (then also P, the partials, and a reduction kernel: reduce_source)
    return (f"{head}\nextern \"C\" __global__ void __launch_bounds__({params.threads}) "
            f"{kernel_name(weights, epilogue, params)}(const half* A, const void* W, const half* S, const half* E, "
            f"half* C, int M, int N, int K{', float* P' if split else ''}) {{\n"
            f"  extern __shared__ __align__(128) unsigned char smem[];\n"
            f"  {template_call(weights, epilogue, params)}(A, W, S, E, C, M, N, K, smem{', P' if split else ''});"
            "\n}\n")


def reduce_source(epilogue: str, params: GemmParams) -> str:
    """The split-K reduction as a standalone kernel: name(P, E, C, M, N), ceil(M * N / 2 / REDUCE_THREADS) blocks."""
    return (f"extern \"C\" __global__ void __launch_bounds__({REDUCE_THREADS}) mlcc_reduce_k{params.split}_"
            f"{epilogue}(const float* P, const half* E, half* C, int M, int N) {{\n"
            f"  {reduce_call(epilogue, params)}(P, E, C, M, N);\n}}\n")


def grid(m: int, n: int, params: GemmParams) -> tuple[int, int]:
    """(blocks along N, blocks along M) for an M x N weight product (N: W's rows)."""
    return n // params.bn, -(-m // params.bm)
