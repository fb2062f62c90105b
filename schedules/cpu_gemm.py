"""CPU GEMM for the projections of a many-token call (prefill, batched decode): group-quantized (a scheme with float32
scales, q4f32_1) or float32 weights against float32 activations, written by hand in TIR and put in place of TVM's
fused PrimFunc.

The batch-1 rule in schedules/cpu.py dequantizes each weight row once per output element, so a prompt of M tokens
dequantizes the whole matrix M times and keeps nothing in registers. Here each thread owns a tile of `nc` output
columns: it dequantizes that tile once per call into a small [K, nc] buffer (transposed, so one row of it is one
vector per k), then sweeps the M rows `mr` at a time with an mr x nc block of accumulators in registers (outer
products: one broadcast of x[m, k] against nc/16 weight vectors per FMA group, vectorised by LLVM at the widest
width the target has). Rows left over (M % mr) get the same sweep one row at a time. Tiles of N are the parallel
loop, so both cores work on every projection of the small models (576 columns = 18 tiles of 32).

The kernel keeps the fused function's parameters and epilogue (none, `+ residual` or `+ bias`), so it replaces it
in place.
"""

from __future__ import annotations

import dataclasses
import logging

from tvm import tirx
from tvm.script import tirx as T

from mlcc.quantization import Quantization, weight_scheme

log = logging.getLogger(__name__)

VEC = 16  # float32 lanes of one AVX-512 register (two AVX2 ones)


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """Register block (mr rows x nc columns) and the column tile a thread dequantizes once per call.

    8 x 32: 16 AVX-512 accumulators, 2 weight vectors and 8 broadcasts per k; measured on a Zen 4 core at ~94
    GFLOP/s for the 3072x576 projection over 480 tokens (4x64 was within noise but compiles 6x slower, 12x32 and
    6x32 slightly slower)."""

    mr: int = 8
    nc: int = 32


DEFAULT_TILES = GemmTiles()


@dataclasses.dataclass(frozen=True)
class GemmShape:
    n: int                    # output features (rows of W)
    k: int                    # input features
    x_shape: tuple            # (1, m, k) or (m, 1, k): m symbolic
    weights: str              # a group scheme this kernel decodes (decodes) | "float32"
    epilogue: str = "none"    # "none" | "add" (a residual shaped like y) | "bias" (one value per output feature)


def tiles_for(shape: GemmShape, tiles: GemmTiles | None = None) -> GemmTiles | None:
    """The tiles to use for `shape` (None: the kernel does not apply, e.g. N not a multiple of any column tile)."""
    t = tiles or DEFAULT_TILES
    nc = t.nc
    while nc > 16 and shape.n % nc:
        nc //= 2
    if shape.n % nc or nc % 16:
        return None
    return dataclasses.replace(t, nc=nc)


def make_gemm(shape: GemmShape, tiles: GemmTiles | None = None) -> tirx.PrimFunc:
    t = tiles_for(shape, tiles)
    if t is None:
        raise ValueError(f"no GEMM tiling for {shape}")
    n, k, mr, nc = shape.n, shape.k, t.mr, t.nc
    q = weight_scheme(shape.weights)
    q4 = q is not None
    m = next(d for d in shape.x_shape if not isinstance(d, (int, tirx.IntImm)))
    x_shape = tuple(shape.x_shape)
    y_shape = x_shape[:-1] + (T.int64(n),)
    w_shape = (T.int64(n), T.int64(k // q.per_word)) if q4 else (T.int64(n), T.int64(k))
    w_dtype = q.storage_dtype if q4 else "float32"
    s_shape = (T.int64(n), T.int64(k // q.group_size)) if q4 else None
    per, bits, mask, zero = (q.per_word, q.bits, q.code_mask, q.zero_code) if q4 else (1, 0, 0, 0)
    words_per_group = q.words_per_group if q4 else 1
    add = shape.epilogue in ("add", "bias")
    bias = shape.epilogue == "bias"
    r_shape = (T.int64(n),) if bias else y_shape

    def epilogue(r, rf, row, col):
        return r[col] if bias else rf[row, col]

    # One word of each of the tile's nc rows at a time (a strided gather, once per `per` codes), unpacked into `per`
    # rows of the transposed tile with vector shifts: the gather is the transposition.
    @T.macro
    def dequantize(w, s, wt, wv, sv, no):
        if q4:
            for kw in T.serial(T.int64(k // per)):
                for c in T.vectorized(T.int64(nc)):
                    wv[c] = w[no * nc + c, kw]
                    sv[c] = s[no * nc + c, kw // words_per_group]
                for b in T.unroll(per):
                    for c in T.vectorized(T.int64(nc)):
                        wt[kw * per + b, c] = (T.Cast("float32", (wv[c] >> T.uint32(bits * b)) & T.uint32(mask))
                                               - T.float32(zero)) * sv[c]
        else:
            for kk in T.serial(T.int64(k)):
                for c in T.vectorized(T.int64(nc)):
                    wt[kk, c] = w[no * nc + c, kk]

    # One mr-row block of outputs: rows base .. base + mr - 1, read clamped to the last row (a block past the end
    # repeats it) and stored from row `first` on; the row's x values are broadcast against nc/16 weight vectors.
    @T.macro
    def row_block(r, xf, yf, rf, no, acc, wt, base, first):
        for i in T.unroll(T.int64(mr)):
            for c in T.vectorized(T.int64(nc)):
                acc[i, c] = T.float32(0)
        for kk in T.serial(T.int64(k)):
            for i in T.unroll(T.int64(mr)):
                # native-width vectors: one 32-lane vector made LLVM codegen several times slower
                for cg in T.unroll(T.int64(nc // VEC)):
                    for c in T.vectorized(T.int64(VEC)):
                        acc[i, cg * VEC + c] = acc[i, cg * VEC + c] + \
                            xf[T.min(base + i, m - T.int64(1)), kk] * wt[kk, cg * VEC + c]
        for i in T.unroll(T.int64(mr)):
            if base + i < m and base + i >= first:
                for c in T.vectorized(T.int64(nc)):
                    if add:
                        yf[base + i, no * nc + c] = acc[i, c] + epilogue(r, rf, base + i, no * nc + c)
                    else:
                        yf[base + i, no * nc + c] = acc[i, c]

    @T.macro
    def many_rows(w, s, r, xf, yf, rf, no, acc, wv, sv, wt):
        dequantize(w, s, wt, wv, sv, no)
        for mo in T.serial(m // mr):
            row_block(r, xf, yf, rf, no, acc, wt, mo * mr, mo * mr)
        if m % mr > 0:
            # the rows left over as one more block: the last mr rows, or with fewer rows than mr (a speculative
            # verify, a small batch) all of them, the last one repeated; only the left-over rows are stored. One
            # row at a time was a single FMA chain per vector, latency-bound: a 6-token verify cost 1.35x this.
            row_block(r, xf, yf, rf, no, acc, wt, T.max(m - T.int64(mr), T.int64(0)), m // mr * mr)

    @T.macro
    def body(x, w, s, r, y):
        xf = T.decl_buffer((m, T.int64(k)), "float32", data=x.data)
        yf = T.decl_buffer((m, T.int64(n)), "float32", data=y.data)
        rf = T.decl_buffer((m, T.int64(n)), "float32", data=r.data)
        for no in T.parallel(T.int64(n // nc)):
            with T.sblock("tile"):
                T.reads()
                T.writes()
                wt = T.sblock_alloc_buffer((T.int64(k), T.int64(nc)), "float32")
                acc = T.sblock_alloc_buffer((T.int64(mr), T.int64(nc)), "float32", scope="local")
                wv = T.sblock_alloc_buffer((T.int64(nc),), w_dtype, scope="local")
                sv = T.sblock_alloc_buffer((T.int64(nc),), "float32", scope="local")
                many_rows(w, s, r, xf, yf, rf, no, acc, wv, sv, wt)

    if q4 and add:
        @T.prim_func(private=True, s_tir=True)
        def gemm(var_x: T.handle, var_w: T.handle, var_s: T.handle, var_r: T.handle, var_y: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            x = T.match_buffer(var_x, x_shape, "float32")
            w = T.match_buffer(var_w, w_shape, w_dtype)
            s = T.match_buffer(var_s, s_shape, "float32")
            r = T.match_buffer(var_r, r_shape, "float32")
            y = T.match_buffer(var_y, y_shape, "float32")
            body(x, w, s, r, y)
    elif q4:
        @T.prim_func(private=True, s_tir=True)
        def gemm(var_x: T.handle, var_w: T.handle, var_s: T.handle, var_y: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            x = T.match_buffer(var_x, x_shape, "float32")
            w = T.match_buffer(var_w, w_shape, w_dtype)
            s = T.match_buffer(var_s, s_shape, "float32")
            y = T.match_buffer(var_y, y_shape, "float32")
            body(x, w, s, y, y)
    elif add:
        @T.prim_func(private=True, s_tir=True)
        def gemm(var_x: T.handle, var_w: T.handle, var_r: T.handle, var_y: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            x = T.match_buffer(var_x, x_shape, "float32")
            w = T.match_buffer(var_w, w_shape, w_dtype)
            r = T.match_buffer(var_r, r_shape, "float32")
            y = T.match_buffer(var_y, y_shape, "float32")
            body(x, w, w, r, y)
    else:
        @T.prim_func(private=True, s_tir=True)
        def gemm(var_x: T.handle, var_w: T.handle, var_y: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            x = T.match_buffer(var_x, x_shape, "float32")
            w = T.match_buffer(var_w, w_shape, w_dtype)
            y = T.match_buffer(var_y, y_shape, "float32")
            body(x, w, w, y, y)
    return gemm


def match_gemm(func: tirx.PrimFunc) -> GemmShape | None:
    """The shape of a many-token projection — dequantize→matmul in a scheme this kernel decodes or float32 NT_matmul,
    [→ + residual or bias], over activations (1, m, K) or (m, 1, K) with m symbolic — or None for anything else
    (batch-1 GEMVs included)."""
    from .gemv_match import match_many_token_projection

    found = match_many_token_projection(func, "float32")
    if found is None:
        return None
    q = weight_scheme(found[3])
    if q is not None and not decodes(q):
        return None
    # (float32 weights keep the K multiple of 32 they always had here; the kernel itself needs none)
    return GemmShape(*found) if found[1] % (q.group_size if q is not None else 32) == 0 else None


def decodes(q: Quantization) -> bool:
    """Whether the dequantizing tile decodes scheme `q`: symmetric codes (centred on its zero_code) in uint32 words,
    whole words to a scale group, float32 scales. Zero-point schemes keep the generic rule of schedules/cpu.py."""
    return (q.storage_dtype, q.symmetric, q.scale_dtype) == ("uint32", True, "float32") and \
        q.group_size % q.per_word == 0


def gemm_for(func: tirx.PrimFunc, tiles: GemmTiles | None = None) -> tirx.PrimFunc | None:
    """The GEMM kernel in place of `func` (same parameters), or None where it does not apply."""
    shape = match_gemm(func)
    if shape is None or tiles_for(shape, tiles) is None:
        return None
    return make_gemm(shape, tiles)

