"""The TIR kernels of a mixture-of-experts layer: routing, sorting tokens by expert, the expert projections, and
the weighted sum back to tokens. Expert ids never leave the device, and only the selected experts' weights are read.

- `topk_softmax`: per token, the router's softmax and its top k (weights renormalised over the k where asked).
- `sort_by_expert`: the token-expert pairs ("slots", slot = token·k + j) grouped by expert: a per-expert count and
  rank, then each slot's row in the grouped order, the inverse map and `indptr` (expert e owns rows
  indptr[e]..indptr[e+1]). Computed on the device in three small kernels, so prefill needs no host round trip.
- `expert_gemv`: decode (one token): out[j] = x · W[ids[j]]ᵀ for the k selected experts, reading only their rows.
- `grouped_gemm`: prefill and batched decode: rows grouped by expert times that expert's weight. On the CPU each
  task is (expert, block of output columns): the block's weights are dequantized once and reused for all the
  expert's rows, so a token batch reads each active expert once. On GPUs one thread per output element (a gather
  GEMM: correct on every target, not tuned).
- `weighted_sum`: out[t] = Σ_j w[t, j] · y[row of slot (t, j)].

The kernels are written already scheduled, in two launch shapes: CPU (parallel loops, 16-lane vector dots) and GPU
(one thread per output element, 64 threads a block, within WGSL's and Metal's limits). Weights are [E, N, K] in the
model dtype or in a group scheme's layout (mlcc.quantization: codes [E, N, K/per_word], scales
[E, N, K/group_size]); accumulation is in float32.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx
from tvm.relax.frontend.nn import Tensor, op
from tvm.script import tirx as T

from mlcc.quantization import TAG, Quantization

LANES = 16   # float32 lanes of a vector dot on the CPU (one AVX-512 register, two AVX2 ones)
THREADS = 64  # threads per GPU block
_OPAQUE = {"op_pattern": 8, "tirx.is_scheduled": True, "tirx.noalias": True}  # kept out of FuseOps


@dataclasses.dataclass(frozen=True)
class ExpertFormat:
    """How stacked expert weights are stored: plain `dtype` weights, or group-quantized in `scheme`."""

    dtype: str                          # the model dtype (activations, scales)
    scheme: Quantization | None = None  # None: plain weights


def _loader(fmt: ExpertFormat, w, s):
    """W[e, n, k] as float32, from its buffers (s: the scales, unused for plain weights)."""
    q = fmt.scheme
    if q is None:
        return lambda e, n, k: T.Cast("float32", w[e, n, k])
    if q.kind == "mxfp4":
        return _mxfp4_loader(w, s)

    def load(e, n, k):
        word = w[e, n, k // q.per_word]
        code = T.bitwise_and(T.shift_right(word, T.Cast(q.storage_dtype, k % q.per_word * q.bits)),
                             tirx.const(q.code_mask, q.storage_dtype))
        return (T.Cast("float32", code) - T.float32(q.max_int)) * T.Cast("float32", s[e, n, k // q.group_size])

    return load


def _mxfp4_loader(w, s):
    """W[e, n, k] from MXFP4 codes (uint32 words of eight E2M1 nibbles) and E8M0 exponents (uint8, one per 32)."""

    def load(e, n, k):
        code = T.bitwise_and(T.shift_right(w[e, n, k // 8], T.Cast("uint32", k % 8 * 4)), T.uint32(15))
        mag = T.Cast("int32", T.bitwise_and(code, T.uint32(7)))
        # twice the magnitude, an integer: 0, 1 (subnormal); (2 + mantissa) << (exponent - 1) from 2 up
        twice = T.Select(mag < 2, mag, T.shift_left(2 + T.bitwise_and(mag, 1), T.max(T.shift_right(mag, 1) - 1, 0)))
        value = T.Cast("float32", T.Select(code >= T.uint32(8), 0 - twice, twice))
        exp = s[e, n, k // 32]
        # 2^(exp - 128) (the half undoes the doubling) as the float with that exponent field; exp 0 and 1 are the
        # subnormals 2^-128, 2^-127
        scale = T.Select(exp < T.uint8(2), T.Cast("float32", exp + T.uint8(1)) * T.float32(2.0 ** -128),
                         T.reinterpret("float32", T.shift_left(T.Cast("uint32", exp) - T.uint32(1), T.uint32(23))))
        return value * scale

    return load


def _tagged(func, fmt: ExpertFormat):
    """An expert projection's PrimFunc named with its scheme (quantization.TAG), as the dense ones are: these
    kernels are opaque to fusion, so a function attribute lasts."""
    return func.with_attr(TAG, fmt.scheme.name) if fmt.scheme is not None else func


def _weight_shapes(fmt: ExpertFormat, e: int, n: int, k: int) -> tuple[tuple, str, tuple]:
    q = fmt.scheme
    if q is None:
        return (e, n, k), fmt.dtype, (1,)
    return (e, n, k // q.per_word), q.storage_dtype, (e, n, k // q.group_size)


def _scale_dtype(fmt: ExpertFormat) -> str:
    """The scales' dtype: the model's, except where the scheme names its own (MXFP4's exponents)."""
    return fmt.scheme.scale if fmt.scheme is not None and fmt.scheme.scale else fmt.dtype


def _gpu(target) -> bool:
    return "gpu" in target.keys


def _threads(serial: bool):
    """Thread loops of the GPU kernels: bound to threads, or (serial) run one after another, which keeps a kernel's
    meaning where barriers separate its phases: the tests run the GPU kernels' index math so on the CPU."""
    if serial:
        return lambda extent, _tag: T.serial(extent)
    return lambda extent, tag: T.thread_binding(extent, thread=tag)


def _tile(n: int) -> int:
    """Output columns per CPU task: 8 where they divide evenly."""
    return next(t for t in (8, 4, 2, 1) if n % t == 0)


# -- routing ----------------------------------------------------------------------------------------------------

def topk_softmax(logits: Tensor, experts: int, k: int, renormalize: bool, target) -> tuple[Tensor, Tensor]:
    """logits [T, ≥E] float32 (columns past E are not the experts') → (weights [T, k] float32, expert ids [T, k]
    int32), in descending order; among equal logits the lower expert id first. Without `renormalize` the weights
    are the softmax over all E experts."""
    tokens, width = logits.shape
    gpu = _gpu(target)
    if gpu and experts <= MAX_RANKED_EXPERTS:
        return _topk_softmax_ranked(logits, experts, k, renormalize)

    @T.macro
    def route(lg, w, ids, t):
        m = T.sblock_alloc_buffer((1,), "float32", scope="local")
        den = T.sblock_alloc_buffer((1,), "float32", scope="local")
        tot = T.sblock_alloc_buffer((1,), "float32", scope="local")
        bv = T.sblock_alloc_buffer((1,), "float32", scope="local")
        be = T.sblock_alloc_buffer((1,), "int32", scope="local")
        pv = T.sblock_alloc_buffer((1,), "float32", scope="local")
        pe = T.sblock_alloc_buffer((1,), "int32", scope="local")
        m[0] = lg[t, 0]
        for e in T.serial(experts):
            m[0] = T.max(m[0], lg[t, e])
        den[0] = T.float32(0)
        for e in T.serial(experts):
            den[0] = den[0] + T.exp(lg[t, e] - m[0])
        tot[0] = T.float32(0)
        pv[0] = T.float32(3.4e38)
        pe[0] = -1
        for j in T.serial(k):
            be[0] = -1
            bv[0] = T.float32(-3.4e38)
            for e in T.serial(experts):
                # candidates come strictly after the previous pick in (logit desc, id asc) order
                if (lg[t, e] < pv[0]) or (lg[t, e] == pv[0] and T.Cast("int32", e) > pe[0]):
                    if be[0] < 0 or lg[t, e] > bv[0]:
                        bv[0] = lg[t, e]
                        be[0] = T.Cast("int32", e)
            ids[t, j] = be[0]
            w[t, j] = T.exp(bv[0] - m[0])
            tot[0] = tot[0] + w[t, j]
            pv[0] = bv[0]
            pe[0] = be[0]
        for j in T.serial(k):
            if renormalize:
                w[t, j] = w[t, j] / tot[0]
            else:
                w[t, j] = w[t, j] / den[0]

    @T.prim_func(private=True, s_tir=True)
    def func(lg_h: T.handle, w_h: T.handle, ids_h: T.handle):
        T.func_attr(_OPAQUE)
        n = T.int64()
        lg = T.match_buffer(lg_h, (n, width), "float32")
        w = T.match_buffer(w_h, (n, k), "float32")
        ids = T.match_buffer(ids_h, (n, k), "int32")
        if gpu:
            for bx in T.thread_binding((n + THREADS - 1) // THREADS, thread="blockIdx.x"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    with T.sblock("route"):
                        T.reads()
                        T.writes()
                        if bx * THREADS + tx < n:
                            route(lg, w, ids, bx * THREADS + tx)
        else:
            for t in T.parallel(n):
                with T.sblock("route"):
                    T.reads()
                    T.writes()
                    route(lg, w, ids, t)

    return op.tensor_ir_op(func, "moe_topk_softmax", [logits],
                           [Tensor.placeholder([tokens, k], "float32"), Tensor.placeholder([tokens, k], "int32")])


MAX_RANKED_EXPERTS = 1024  # one GPU thread per expert


def _topk_softmax_ranked(logits: Tensor, experts: int, k: int, renormalize: bool,
                         serial: bool = False) -> tuple[Tensor, Tensor]:
    """topk_softmax on GPUs: one block per token, one thread per expert. Each thread counts the experts that come
    before its own in (logit desc, id asc) order; that rank, if below k, is its slot. Then k threads normalize."""
    tokens, width = logits.shape
    threads = (experts + 31) // 32 * 32
    bind, shared = _threads(serial), "global" if serial else "shared"

    @T.prim_func(private=True, s_tir=True)
    def func(lg_h: T.handle, w_h: T.handle, ids_h: T.handle):
        T.func_attr(_OPAQUE)
        n = T.int64()
        lg = T.match_buffer(lg_h, (n, width), "float32")
        w = T.match_buffer(w_h, (n, k), "float32")
        ids = T.match_buffer(ids_h, (n, k), "int32")
        for t in bind(n, "blockIdx.x"):
            with T.sblock("route"):
                T.reads()
                T.writes()
                s_lg = T.sblock_alloc_buffer((threads,), "float32", scope=shared)
                s_top = T.sblock_alloc_buffer((k,), "float32", scope=shared)
                s_id = T.sblock_alloc_buffer((k,), "int32", scope=shared)
                for tx in bind(threads, "threadIdx.x"):
                    with T.sblock("load"):
                        T.reads()
                        T.writes()
                        if tx < experts:
                            s_lg[tx] = lg[t, tx]
                for tx in bind(threads, "threadIdx.x"):
                    with T.sblock("rank"):
                        T.reads()
                        T.writes()
                        r = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        mine = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        other = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        if tx < experts:
                            r[0] = 0
                            mine[0] = s_lg[tx]
                            for e in T.serial(experts):
                                other[0] = s_lg[e]
                                if other[0] > mine[0] or (other[0] == mine[0] and e < tx):
                                    r[0] = r[0] + 1
                            if r[0] < k:
                                s_top[r[0]] = mine[0]
                                s_id[r[0]] = T.Cast("int32", tx)
                for tx in bind(threads, "threadIdx.x"):
                    with T.sblock("normalize"):
                        T.reads()
                        T.writes()
                        den = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        if tx < k:
                            den[0] = T.float32(0)
                            if renormalize:
                                for j in T.serial(k):
                                    den[0] = den[0] + T.exp(s_top[j] - s_top[0])
                            else:
                                for e in T.serial(experts):
                                    den[0] = den[0] + T.exp(s_lg[e] - s_top[0])
                            ids[t, tx] = s_id[tx]
                            w[t, tx] = T.exp(s_top[tx] - s_top[0]) / den[0]

    return op.tensor_ir_op(func, "moe_topk_softmax", [logits],
                           [Tensor.placeholder([tokens, k], "float32"), Tensor.placeholder([tokens, k], "int32")])


def sort_by_expert(ids: Tensor, num_experts: int, target, serial: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Flat expert ids [n] (one per slot) → (row_slot [n]: the slot at each row of the grouped order,
    slot_row [n]: its inverse, indptr [E+1]). Within an expert, rows keep slot order. serial: the GPU form with
    its thread loops run one after another (tests)."""
    (slots,) = ids.shape
    gpu, bind = _gpu(target) or serial, _threads(serial)
    E = num_experts

    # 1. per expert: how many slots chose it, and each slot's rank among them
    @T.macro
    def count(ids_b, rank, counts, e):
        c = T.sblock_alloc_buffer((1,), "int32", scope="local")
        c[0] = 0
        for s in T.serial(ids_b.shape[0]):
            if ids_b[s] == T.Cast("int32", e):
                rank[s] = c[0]
                c[0] = c[0] + 1
        counts[e] = c[0]

    @T.prim_func(private=True, s_tir=True)
    def count_func(ids_h: T.handle, rank_h: T.handle, counts_h: T.handle):
        T.func_attr(_OPAQUE)
        n = T.int64()
        ids_b = T.match_buffer(ids_h, (n,), "int32")
        rank = T.match_buffer(rank_h, (n,), "int32")
        counts = T.match_buffer(counts_h, (E,), "int32")
        if gpu:
            for bx in bind((E + THREADS - 1) // THREADS, "blockIdx.x"):
                for tx in bind(THREADS, "threadIdx.x"):
                    with T.sblock("count"):
                        T.reads()
                        T.writes()
                        if bx * THREADS + tx < E:
                            count(ids_b, rank, counts, bx * THREADS + tx)
        else:
            for e in T.parallel(E):
                with T.sblock("count"):
                    T.reads()
                    T.writes()
                    count(ids_b, rank, counts, e)

    rank, counts = op.tensor_ir_op(count_func, "moe_count_by_expert", [ids],
                                   [Tensor.placeholder([slots], "int32"), Tensor.placeholder([E], "int32")])

    # 2. per slot: its row = rows of the experts before its own + its rank; slot 0 also writes indptr
    @T.macro
    def place(ids_b, rank, counts, row_slot, slot_row, indptr, s):
        off = T.sblock_alloc_buffer((1,), "int32", scope="local")
        off[0] = 0
        for e in T.serial(E):
            if T.Cast("int32", e) < ids_b[s]:
                off[0] = off[0] + counts[e]
        slot_row[s] = off[0] + rank[s]
        row_slot[off[0] + rank[s]] = T.Cast("int32", s)
        if s == 0:
            off[0] = 0
            indptr[0] = 0
            for e in T.serial(E):
                off[0] = off[0] + counts[e]
                indptr[e + 1] = off[0]

    @T.prim_func(private=True, s_tir=True)
    def place_func(ids_h: T.handle, rank_h: T.handle, counts_h: T.handle, row_slot_h: T.handle,
                   slot_row_h: T.handle, indptr_h: T.handle):
        T.func_attr(_OPAQUE)
        n = T.int64()
        ids_b = T.match_buffer(ids_h, (n,), "int32")
        rank = T.match_buffer(rank_h, (n,), "int32")
        counts = T.match_buffer(counts_h, (E,), "int32")
        row_slot = T.match_buffer(row_slot_h, (n,), "int32")
        slot_row = T.match_buffer(slot_row_h, (n,), "int32")
        indptr = T.match_buffer(indptr_h, (E + 1,), "int32")
        if gpu:
            for bx in bind((n + THREADS - 1) // THREADS, "blockIdx.x"):
                for tx in bind(THREADS, "threadIdx.x"):
                    with T.sblock("place"):
                        T.reads()
                        T.writes()
                        if bx * THREADS + tx < n:
                            place(ids_b, rank, counts, row_slot, slot_row, indptr, bx * THREADS + tx)
        else:
            for s in T.parallel(n):
                with T.sblock("place"):
                    T.reads()
                    T.writes()
                    place(ids_b, rank, counts, row_slot, slot_row, indptr, s)

    row_slot, slot_row, indptr = op.tensor_ir_op(
        place_func, "moe_place_by_expert", [ids, rank, counts],
        [Tensor.placeholder([slots], "int32"), Tensor.placeholder([slots], "int32"),
         Tensor.placeholder([E + 1], "int32")])
    return row_slot, slot_row, indptr


def weighted_sum(y: Tensor, weights: Tensor, slot_row: Tensor | None, target, serial: bool = False) -> Tensor:
    """out[t, h] = Σ_j weights[t, j] · y[row(t·k + j), h]: y holds one row per slot, in slot order where
    `slot_row` is None (decode), else in the grouped order `slot_row` maps slots to. serial: as sort_by_expert's."""
    tokens, k = weights.shape
    rows, hidden = y.shape
    dtype = y.dtype
    gpu, bind = _gpu(target) or serial, _threads(serial)
    sorted_rows = slot_row is not None

    @T.macro
    def body(yb, wb, sr, out, t, h):
        acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
        acc[0] = T.float32(0)
        for j in T.serial(k):
            if sorted_rows:
                acc[0] = acc[0] + wb[t, j] * T.Cast("float32", yb[sr[t * k + j], h])
            else:
                acc[0] = acc[0] + wb[t, j] * T.Cast("float32", yb[t * k + j, h])
        out[t, h] = T.Cast(dtype, acc[0])

    @T.prim_func(private=True, s_tir=True)
    def func(y_h: T.handle, w_h: T.handle, sr_h: T.handle, out_h: T.handle):
        T.func_attr(_OPAQUE)
        n = T.int64()
        r = T.int64()
        yb = T.match_buffer(y_h, (r, hidden), dtype)
        wb = T.match_buffer(w_h, (n, k), "float32")
        sr = T.match_buffer(sr_h, (r,), "int32")
        out = T.match_buffer(out_h, (n, hidden), dtype)
        if gpu:
            for bx in bind((n * hidden + THREADS - 1) // THREADS, "blockIdx.x"):
                for tx in bind(THREADS, "threadIdx.x"):
                    with T.sblock("combine"):
                        T.reads()
                        T.writes()
                        if bx * THREADS + tx < n * hidden:
                            body(yb, wb, sr, out, (bx * THREADS + tx) // hidden, (bx * THREADS + tx) % hidden)
        else:
            for t in T.parallel(n):
                with T.sblock("combine"):
                    T.reads()
                    T.writes()
                    for h in T.serial(hidden):
                        body(yb, wb, sr, out, t, h)

    # (decode's rows are in slot order: the kernel ignores the row map it is given there)
    if slot_row is None:
        slot_row = op.zeros([rows], "int32")
    return op.tensor_ir_op(func, "moe_weighted_sum", [y, weights, slot_row],
                           Tensor.placeholder([tokens, hidden], dtype))


# -- decode GEMV on GPUs ------------------------------------------------------------------------------------------

WARP = 32      # lanes splitting one dot product
WARP_ROWS = 8  # output elements (warps) per block
EXPERT_GEMV_ATTR = "mlcc.moe_expert_gemv"  # func attr marking expert_gemv_warp's PrimFunc (its scheme: TAG)


def expert_gemv_warp(x: Tensor, ids: Tensor, weights: list[Tensor], fmt: ExpertFormat, n: int,
                     swiglu: bool = False, serial: bool = False) -> Tensor:
    """The GPU form of moe_gemm.expert_gemv (x [1 or k, K], ids [k] → out [k, n], out[j] = x · W[ids[j]]ᵀ): one
    warp per output element, each lane reading up to 4 consecutive words of the expert's row at a time (coalesced,
    16-byte loads), partial sums added through shared memory; a q4 word's products are summed before its group
    scale is applied. swiglu: W holds gate rows [0, n) and up rows [n, 2n), and out = silu(x·gate) · (x·up)."""
    rows_x, kdim = (int(d) for d in x.shape)
    (k,) = (int(d) for d in ids.shape)
    num_experts, w_rows = int(weights[0].shape[0]), int(weights[0].shape[1])
    dtype = fmt.dtype
    w_shape, w_dtype, s_shape = _weight_shapes(fmt, num_experts, w_rows, kdim)
    q = fmt.scheme
    if q is not None and q.kind != "group":
        from mlcc.errors import UnsupportedConfigError

        raise UnsupportedConfigError(f"{q.name} expert weights have no GPU decode kernel yet; compile for --target llvm")
    per = q.per_word if q is not None else 1
    words = kdim // per
    vec = next(v for v in (4, 2, 1) if words % (WARP * v) == 0 or v == 1)
    iters = (words + WARP * vec - 1) // (WARP * vec)
    quantized = q is not None
    halves = 2 if swiglu else 1
    bind, shared = _threads(serial), "global" if serial else "shared"

    def x_row(j):
        return 0 if rows_x == 1 else j

    @T.macro
    def word_dot(xb, wl, sb, acc, xr, e, row, w, v):
        if quantized:
            part = T.sblock_alloc_buffer((1,), "float32", scope="local")
            part[0] = T.float32(0)
            for i in T.unroll(per):
                code = T.bitwise_and(T.shift_right(wl[v], T.Cast(q.storage_dtype, i * q.bits)),
                                     tirx.const(q.code_mask, q.storage_dtype))
                part[0] = part[0] + T.Cast("float32", xb[xr, w * per + i]) * (
                    T.Cast("float32", code) - T.float32(q.max_int))
            acc[0] = acc[0] + part[0] * T.Cast("float32", sb[e, row, w * per // q.group_size])
        else:
            acc[0] = acc[0] + T.Cast("float32", xb[xr, w]) * T.Cast("float32", wl[v])

    @T.prim_func(private=True, s_tir=True)
    def func(x_h: T.handle, ids_h: T.handle, w_h: T.handle, s_h: T.handle, out_h: T.handle):
        T.func_attr(_OPAQUE)
        xb = T.match_buffer(x_h, (rows_x, kdim), dtype)
        idb = T.match_buffer(ids_h, (k,), "int32")
        wb = T.match_buffer(w_h, w_shape, w_dtype)
        sb = T.match_buffer(s_h, s_shape, dtype)
        out = T.match_buffer(out_h, (k, n), dtype)
        for bx in bind((k * n + WARP_ROWS - 1) // WARP_ROWS, "blockIdx.x"):
            with T.sblock("gemv"):
                T.reads()
                T.writes()
                red = T.sblock_alloc_buffer((halves, WARP_ROWS, WARP), "float32", scope=shared)
                for ty in bind(WARP_ROWS, "threadIdx.y"):
                    for tx in bind(WARP, "threadIdx.x"):
                        with T.sblock("lanes"):
                            T.reads()
                            T.writes()
                            acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                            wl = T.sblock_alloc_buffer((vec,), w_dtype, scope="local")
                            for h in T.unroll(halves):
                                acc[0] = T.float32(0)
                                if bx * WARP_ROWS + ty < k * n:
                                    j: T.let[T.int32] = (bx * WARP_ROWS + ty) // n
                                    row: T.let[T.int32] = (bx * WARP_ROWS + ty) % n + h * n
                                    for it in T.unroll(iters) if iters <= 16 else T.serial(iters):
                                        if (it * WARP + tx) * vec < words:
                                            for v in T.vectorized(vec):
                                                wl[v] = wb[idb[j], row, (it * WARP + tx) * vec + v]
                                            for v in T.unroll(vec):
                                                word_dot(xb, wl, sb, acc, x_row(j), idb[j], row,
                                                         (it * WARP + tx) * vec + v, v)
                                red[h, ty, tx] = acc[0]
                for ty in bind(WARP_ROWS, "threadIdx.y"):
                    for tx in bind(WARP, "threadIdx.x"):
                        with T.sblock("sum"):
                            T.reads()
                            T.writes()
                            tot = T.sblock_alloc_buffer((halves,), "float32", scope="local")
                            if tx == 0 and bx * WARP_ROWS + ty < k * n:
                                for h in T.serial(halves):
                                    tot[h] = T.float32(0)
                                    for lane in T.serial(WARP):
                                        tot[h] = tot[h] + red[h, ty, lane]
                                if swiglu:
                                    out[(bx * WARP_ROWS + ty) // n, (bx * WARP_ROWS + ty) % n] = T.Cast(
                                        dtype, tot[0] / (T.float32(1) + T.exp(-tot[0])) * tot[halves - 1])
                                else:
                                    out[(bx * WARP_ROWS + ty) // n, (bx * WARP_ROWS + ty) % n] = T.Cast(
                                        dtype, tot[0])

    # (what CUDA's hand-written kernel pass, schedules/cuda_moe_gemv, reads to find and replace this kernel; the
    # kernel is opaque to fusion, so its attributes last)
    func = _tagged(func.with_attr(EXPERT_GEMV_ATTR, {"swiglu": swiglu, "dtype": dtype}), fmt)
    scale = weights[1] if q is not None else op.zeros([1], dtype)
    return op.tensor_ir_op(func, "moe_expert_gemv", [x, ids, weights[0], scale], Tensor.placeholder([k, n], dtype))
