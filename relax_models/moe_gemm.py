"""The expert projections of a mixture-of-experts layer as TIR kernels (see moe_kernels.py for the routing):
`expert_gemv` for one token's k experts (decode), `grouped_gemm` for rows grouped by expert (prefill, batches).
Both read W[e] only for the experts some row selected."""

from __future__ import annotations

from tvm.relax.frontend.nn import Tensor, op
from tvm.script import tirx as T

from .moe_kernels import (_OPAQUE, LANES, THREADS, ExpertFormat, _gpu, _loader, _scale_dtype, _tagged, _tile,
                          _weight_shapes)


def expert_gemv(x: Tensor, ids: Tensor, weights: list[Tensor], fmt: ExpertFormat, n: int, target) -> Tensor:
    """x [R, K] (R = 1: one input for every expert; R = k: one per expert), ids [k] → out [k, n] with
    out[j] = x[j or 0] · W[ids[j]]ᵀ."""
    rows_x, kdim = (int(d) for d in x.shape)
    (k,) = (int(d) for d in ids.shape)
    num_experts = int(weights[0].shape[0])
    dtype = fmt.dtype
    w_shape, w_dtype, s_shape = _weight_shapes(fmt, num_experts, n, kdim)
    gpu = _gpu(target)
    lanes = LANES if kdim % LANES == 0 else 1
    tile = _tile(n)
    shared_x = rows_x == 1

    def x_row(j):
        return 0 if shared_x else j

    @T.macro
    def dot(xb, load, acc, j, e, col):
        for ko in T.serial(kdim // lanes):
            for lane in T.vectorized(lanes):
                acc[lane] = acc[lane] + T.Cast("float32", xb[x_row(j), ko * lanes + lane]) * load(
                    e, col, ko * lanes + lane)

    @T.macro
    def element(xb, idb, load, out, j, col):
        acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
        acc[0] = T.float32(0)
        for kk in T.serial(kdim):
            acc[0] = acc[0] + T.Cast("float32", xb[x_row(j), kk]) * load(idb[j], col, kk)
        out[j, col] = T.Cast(dtype, acc[0])

    @T.prim_func(private=True, s_tir=True)
    def func(x_h: T.handle, ids_h: T.handle, w_h: T.handle, s_h: T.handle, out_h: T.handle):
        T.func_attr(_OPAQUE)
        xb = T.match_buffer(x_h, (rows_x, kdim), dtype)
        idb = T.match_buffer(ids_h, (k,), "int32")
        wb = T.match_buffer(w_h, w_shape, w_dtype)
        sb = T.match_buffer(s_h, s_shape, _scale_dtype(fmt))
        out = T.match_buffer(out_h, (k, n), dtype)
        if gpu:
            for bx in T.thread_binding((k * n + THREADS - 1) // THREADS, thread="blockIdx.x"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    with T.sblock("gemv"):
                        T.reads()
                        T.writes()
                        if bx * THREADS + tx < k * n:
                            element(xb, idb, _loader(fmt, wb, sb), out, (bx * THREADS + tx) // n,
                                    (bx * THREADS + tx) % n)
        else:
            for task in T.parallel(k * (n // tile)):
                with T.sblock("gemv"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((lanes,), "float32", scope="local")
                    for i in T.serial(tile):
                        for lane in T.serial(lanes):
                            acc[lane] = T.float32(0)
                        dot(xb, _loader(fmt, wb, sb), acc, task // (n // tile), idb[task // (n // tile)],
                            task % (n // tile) * tile + i)
                        for lane in T.serial(lanes - 1):
                            acc[0] = acc[0] + acc[lane + 1]
                        out[task // (n // tile), task % (n // tile) * tile + i] = T.Cast(dtype, acc[0])

    scale = weights[1] if fmt.scheme is not None else op.zeros([1], dtype)
    return op.tensor_ir_op(_tagged(func, fmt), "moe_expert_gemv", [x, ids, weights[0], scale],
                           Tensor.placeholder([k, n], dtype))


def grouped_gemm(x: Tensor, row_slot: Tensor, ids: Tensor, indptr: Tensor, weights: list[Tensor], fmt: ExpertFormat,
                 n: int, k: int, gather: bool, target) -> Tensor:
    """Rows grouped by expert (rows indptr[e]..indptr[e+1] belong to expert e) times W[e]ᵀ → out [rows, n].
    gather: row r reads x[row_slot[r] // k] (x holds one row per token); else x[r] (x is already in row order).
    ids: the flat expert id of each slot (the GPU kernel finds a row's expert through it)."""
    kdim = int(x.shape[1])
    (rows,) = row_slot.shape
    num_experts = int(weights[0].shape[0])
    dtype = fmt.dtype
    w_shape, w_dtype, s_shape = _weight_shapes(fmt, num_experts, n, kdim)
    gpu = _gpu(target)
    lanes = LANES if kdim % LANES == 0 else 1
    tile = _tile(n)
    col_tiles = n // tile

    def src(rs, r):
        """The input row of grouped row r."""
        return rs[r] // k if gather else r

    @T.macro
    def expert_tile(xb, rs, ip, load, out, e, c0):
        lo: T.let[T.int32] = ip[e]
        hi: T.let[T.int32] = ip[e + 1]
        if hi > lo:
            wt = T.sblock_alloc_buffer((tile, kdim), "float32")
            acc = T.sblock_alloc_buffer((lanes,), "float32", scope="local")
            for i in T.serial(tile):
                for kk in T.serial(kdim):
                    wt[i, kk] = load(e, c0 + i, kk)
            for p in T.serial(hi - lo):
                for i in T.serial(tile):
                    for lane in T.serial(lanes):
                        acc[lane] = T.float32(0)
                    for ko in T.serial(kdim // lanes):
                        for lane in T.vectorized(lanes):
                            acc[lane] = acc[lane] + T.Cast("float32", xb[src(rs, lo + p), ko * lanes + lane]) * wt[
                                i, ko * lanes + lane]
                    for lane in T.serial(lanes - 1):
                        acc[0] = acc[0] + acc[lane + 1]
                    out[lo + p, c0 + i] = T.Cast(dtype, acc[0])

    @T.macro
    def element(xb, rs, idb, load, out, r, c):
        acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
        acc[0] = T.float32(0)
        for kk in T.serial(kdim):
            acc[0] = acc[0] + T.Cast("float32", xb[src(rs, r), kk]) * load(idb[rs[r]], c, kk)
        out[r, c] = T.Cast(dtype, acc[0])

    @T.prim_func(private=True, s_tir=True)
    def func(x_h: T.handle, rs_h: T.handle, ids_h: T.handle, ip_h: T.handle, w_h: T.handle, s_h: T.handle,
             out_h: T.handle):
        T.func_attr(_OPAQUE)
        m = T.int64()
        r = T.int64()
        xb = T.match_buffer(x_h, (m, kdim), dtype)
        rs = T.match_buffer(rs_h, (r,), "int32")
        idb = T.match_buffer(ids_h, (r,), "int32")
        ip = T.match_buffer(ip_h, (num_experts + 1,), "int32")
        wb = T.match_buffer(w_h, w_shape, w_dtype)
        sb = T.match_buffer(s_h, s_shape, _scale_dtype(fmt))
        out = T.match_buffer(out_h, (r, n), dtype)
        if gpu:
            for bx in T.thread_binding((r * n + THREADS - 1) // THREADS, thread="blockIdx.x"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    with T.sblock("gemm"):
                        T.reads()
                        T.writes()
                        if bx * THREADS + tx < r * n:
                            element(xb, rs, idb, _loader(fmt, wb, sb), out, (bx * THREADS + tx) // n,
                                    (bx * THREADS + tx) % n)
        else:
            for task in T.parallel(num_experts * col_tiles):
                with T.sblock("gemm"):
                    T.reads()
                    T.writes()
                    expert_tile(xb, rs, ip, _loader(fmt, wb, sb), out, task // col_tiles, task % col_tiles * tile)

    scale = weights[1] if fmt.scheme is not None else op.zeros([1], dtype)
    return op.tensor_ir_op(_tagged(func, fmt), "moe_grouped_gemm", [x, row_slot, ids, indptr, weights[0], scale],
                           Tensor.placeholder([rows, n], dtype))
