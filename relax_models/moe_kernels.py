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
model dtype or MLC's q4 layout (uint32[E, N, K/8] codes and scale[E, N, K/32]); accumulation is in float32.
"""

from __future__ import annotations

import dataclasses

from tvm.relax.frontend.nn import Tensor, op
from tvm.script import tirx as T

LANES = 16   # float32 lanes of a vector dot on the CPU (one AVX-512 register, two AVX2 ones)
THREADS = 64  # threads per GPU block
_OPAQUE = {"op_pattern": 8, "tirx.is_scheduled": True, "tirx.noalias": True}  # kept out of FuseOps


@dataclasses.dataclass(frozen=True)
class ExpertFormat:
    """How stacked expert weights are stored: `bits` 0 for plain model-dtype weights, else group quantization."""

    dtype: str            # the model dtype (activations, scales)
    bits: int = 0
    group_size: int = 32

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    @property
    def max_int(self) -> int:
        return (1 << (self.bits - 1)) - 1


def _loader(fmt: ExpertFormat, w, s):
    """W[e, n, k] as float32, from its buffers (s: the scales, unused for plain weights)."""
    if not fmt.bits:
        return lambda e, n, k: T.Cast("float32", w[e, n, k])

    def load(e, n, k):
        word = w[e, n, k // fmt.per_word]
        code = T.bitwise_and(T.shift_right(word, T.Cast("uint32", k % fmt.per_word * fmt.bits)),
                             T.uint32((1 << fmt.bits) - 1))
        return (T.Cast("float32", code) - T.float32(fmt.max_int)) * T.Cast("float32", s[e, n, k // fmt.group_size])

    return load


def _weight_shapes(fmt: ExpertFormat, e: int, n: int, k: int) -> tuple[tuple, str, tuple]:
    if not fmt.bits:
        return (e, n, k), fmt.dtype, (1,)
    return (e, n, k // fmt.per_word), "uint32", (e, n, k // fmt.group_size)


def _gpu(target) -> bool:
    return "gpu" in target.keys


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


def sort_by_expert(ids: Tensor, num_experts: int, target) -> tuple[Tensor, Tensor, Tensor]:
    """Flat expert ids [n] (one per slot) → (row_slot [n]: the slot at each row of the grouped order,
    slot_row [n]: its inverse, indptr [E+1]). Within an expert, rows keep slot order."""
    (slots,) = ids.shape
    gpu = _gpu(target)
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
            for bx in T.thread_binding((E + THREADS - 1) // THREADS, thread="blockIdx.x"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
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
            for bx in T.thread_binding((n + THREADS - 1) // THREADS, thread="blockIdx.x"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
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


def weighted_sum(y: Tensor, weights: Tensor, slot_row: Tensor | None, target) -> Tensor:
    """out[t, h] = Σ_j weights[t, j] · y[row(t·k + j), h]: y holds one row per slot, in slot order where
    `slot_row` is None (decode), else in the grouped order `slot_row` maps slots to."""
    tokens, k = weights.shape
    rows, hidden = y.shape
    dtype = y.dtype
    gpu = _gpu(target)
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
            for bx in T.thread_binding((n * hidden + THREADS - 1) // THREADS, thread="blockIdx.x"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
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
