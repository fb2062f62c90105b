"""Split-KV paged decode attention for CUDA.

TVM's `batch_decode_paged_kv` runs one thread block per (sequence, KV head): at batch 1 that is 8 blocks for a
Llama-3-8B layer, each walking the whole context in a serial loop — 17 us per layer on an H200 at a few hundred
tokens, a quarter of the decode step. This kernel has the same signature (the paged KV cache calls it in place of
TVM's) and splits each sequence's context into chunks (splits_for), one block each, with flash-decoding's two phases
in one PrimFunc: (1) per chunk, every query head of the KV head's group keeps an online softmax (max, sum, output)
over its tokens, several tokens in flight per block, partials to a workspace; (2) one warp per query head merges the
chunks. The number of chunks is fixed (the host cannot see the lengths, which live on the device); empty chunks add
nothing.

Scores are in log2 units (scaled by sm_scale·log2 e) and lse is max + log2(sum), as TVM's kernels write it. RoPE
must already be applied (the KV cache's NORMAL rope mode, which mlcc's models use): `rotary_mode` is ignored.
"""

from __future__ import annotations

import logging
import math

import tvm

from .attention_softcap import ATTR, softcap_of

log = logging.getLogger(__name__)

# Each block walks its chunk tokens_in_flight() tokens at a time, and every step is a chain of dependent loads (page
# table, K, then V), so a chunk's latency grows with its length: at batch 1 the kernel is latency-bound (with 4 tokens
# a step, 8B decode on an H200 fell from 500 to 390 tok/s between 200 and 1200 tokens of context). More tokens per
# step shorten it.
BLOCKS_WANTED = 128  # chunks x KV heads at batch 1: about one block per SM of an H100/H200 (256 measured slower)
GRID_BLOCKS = 1024   # chunk blocks past which a growing batch gets fewer chunks a sequence (active_splits)
MAX_TOKENS_IN_FLIGHT = 16
MAX_THREADS = 1024   # per block, on every CUDA GPU
VEC = 4              # head-dim elements per lane, more where the head needs more than a warp (Gemma's 256)


def vec_for(d: int) -> int:
    return max(VEC, d // 32)


def tokens_in_flight(h_kv: int, h_qo: int, d: int, limit: int = 0) -> int:
    """Tokens a block scores per step: the largest power of two up to `limit` (0: MAX_TOKENS_IN_FLIGHT) whose
    threads (head-dim lanes x query heads per KV head, each) fit in MAX_THREADS."""
    tp, limit = 1, limit or MAX_TOKENS_IN_FLIGHT
    while tp * 2 <= limit and (d // vec_for(d)) * (h_qo // h_kv) * tp * 2 <= MAX_THREADS:
        tp *= 2
    return tp


def supported(h_kv: int, h_qo: int, d: int, tokens: int = 0) -> bool:
    """Head dim split over a power-of-two number of lanes within a warp, and at least 4 tokens in flight."""
    lanes = d // vec_for(d)
    return d % vec_for(d) == 0 and lanes in (4, 8, 16, 32) and tokens_in_flight(h_kv, h_qo, d, tokens) >= 4


def splits_for(h_kv: int, splits: int = 0) -> int:
    """Chunks per sequence: `splits` if given, else a power of two from 16 to 64 giving ~BLOCKS_WANTED blocks
    at batch 1."""
    if splits:
        return splits
    splits = 16
    while splits < 64 and splits * h_kv < BLOCKS_WANTED:
        splits *= 2
    return splits


def active_splits(batch, h_kv: int, splits: int):
    """Chunks per sequence at run time (batch: the kernel's symbolic batch size): `splits` at batch 1, then fewer,
    keeping about GRID_BLOCKS chunk blocks. At a large batch every sequence's context in one block avoids writing and
    merging partial states and launching blocks with a token or two of work each: at batch 256 on an H100, 16 chunks
    a sequence made the attention half of the decode step."""
    from tvm import tirx

    per_chunk = batch * h_kv
    return tirx.min(splits, tirx.max(1, (GRID_BLOCKS + per_chunk - 1) // per_chunk))


class PagedKV:
    """Where `chunk` finds a sequence's keys and values: the paged cache. Token j of sequence seq sits at
    (page, offset) through the page table; with a quantized cache (kv: "int8" / "fp8_e4m3", kv_cache_format) each
    row is head_dim codes then a float32 scale, which `scales` (a float32 view of the pages) reads."""

    def __init__(self, pages, indptr, values, length_info, page_size: int, sliding: bool, kv: str | None = None,
                 scales=None, h_kv: int = 0, d: int = 0):
        self.pages, self.indptr, self.values, self.length_info = pages, indptr, values, length_info
        self.page_size, self.sliding, self.kv, self.scales, self.h_kv, self.d = page_size, sliding, kv, scales, h_kv, d

    def n_tokens(self, seq):
        from tvm.relax.frontend.nn.llm._kernel_common import _get_kv_chunk_len
        from tvm.script import tirx as T

        begin, end = self.indptr[seq], self.indptr[seq + 1]
        return T.if_then_else(begin != end, _get_kv_chunk_len(end - begin, self.page_size, seq, self.length_info,
                                                              self.sliding), 0)

    def position(self, seq, j):
        from tvm.relax.frontend.nn.llm._kernel_common import _get_seq_offset

        return _get_seq_offset(j, seq, self.length_info, self.sliding)

    def row(self, seq, pos):
        return self.values[self.indptr[seq] + pos // self.page_size]

    def offset(self, pos):
        return pos % self.page_size

    def element(self, kv_index: int, page, off, head, i):
        return _element(self.kv, self.pages[page, kv_index, head, off, i])

    def scale(self, kv_index: int, page, off, head):
        """The float32 scale of a quantized row (after its d codes; rows are d + 4 bytes)."""
        quads = (self.d + 4) // 4
        return self.scales[((page * 2 + kv_index) * self.h_kv + head) * self.page_size * quads + off * quads
                           + self.d // 4]


class RaggedKV:
    """Where `chunk` finds a sequence's keys and values in a ragged prefill: rows kv_indptr[seq] on of k and v
    (as PagedKV, quantized rows carry their scale after the codes; k_scales/v_scales are float32 views)."""

    def __init__(self, k, v, kv_indptr, kv: str | None = None, k_scales=None, v_scales=None, h_kv: int = 0,
                 d: int = 0):
        self.k, self.v, self.kv_indptr, self.kv = k, v, kv_indptr, kv
        self.k_scales, self.v_scales, self.h_kv, self.d = k_scales, v_scales, h_kv, d

    def n_tokens(self, seq):
        return self.kv_indptr[seq + 1] - self.kv_indptr[seq]

    def position(self, seq, j):
        return j

    def row(self, seq, pos):
        return self.kv_indptr[seq] + pos

    def offset(self, pos):
        return 0

    def element(self, kv_index: int, row, off, head, i):
        return _element(self.kv, (self.k if kv_index == 0 else self.v)[row, head, i])

    def scale(self, kv_index: int, row, off, head):
        quads = (self.d + 4) // 4
        return (self.k_scales if kv_index == 0 else self.v_scales)[(row * self.h_kv + head) * quads + self.d // 4]


def _element(kv: str | None, x):
    """float32 value of a cache element: as it is, or a quantized code (before its row's scale)."""
    from tvm.script import tirx as T

    from mlcc import kv_cache_format

    return kv_cache_format.decode(kv, x) if kv else T.Cast("float32", x)


def split_kv_macros(h_kv: int, h_qo: int, d: int, dtype: str, page_size: int, splits: int, tokens: int,
                    sliding: bool, softcap: float, kv: str | None = None):
    """The two phases as TIR macros, shared by the decode kernel, the few-query paged prefill kernel and the
    quantized cache's kernels (cuda_quantized_kv_attention): `chunk` (one block per (query row, KV head · split),
    reading K/V from a PagedKV or RaggedKV) and `merge` (one block per (query row, query head)). kv: the cache's
    code ("int8", "fp8_e4m3"; None: the model's dtype), whose row scales multiply the scores and the values."""
    from tvm.script import tirx as T

    from .attention_softcap import capped

    assert supported(h_kv, h_qo, d, tokens), (h_kv, h_qo, d, tokens)
    quantized = kv is not None   # (TVMScript's `if` takes a bool, not None)
    group = h_qo // h_kv
    vec = vec_for(d)
    # CUDA has vector types up to 4 floats: wider lanes (head dim 256) unroll instead
    lane_loop = T.vectorized if vec <= 4 else T.unroll
    lanes = d // vec
    tp = tokens_in_flight(h_kv, h_qo, d, tokens)
    log2e = math.log2(math.e)

    @T.macro
    def merge_state(m, den, o, new_m, w, m_other, den_other, o_other):
        # fold another online-softmax state (max, sum, output element v = o_other(v)) into (m, den, o); new_m and w
        # are scratch (the merged max and the other state's weight)
        new_m[0] = T.max(m[0], m_other)
        w[0] = T.exp2(m_other - new_m[0])
        den[0] = den[0] * T.exp2(m[0] - new_m[0]) + den_other * w[0]
        for v in lane_loop(vec):
            o[v] = o[v] * T.exp2(m[0] - new_m[0]) + o_other(v) * w[0]
        m[0] = new_m[0]

    @T.macro
    def chunk(Q, src, part_o, part_md, sm_scale, row, q_indptr, batch, causal, n_splits, by, tz, ty, tx):
        # query `row` (of Q and the partials) against its sequence's KV (src): sequence `row` (decode, q_indptr
        # None) or the one whose rows in q_indptr hold it, where `causal` hides the KV of the rows after it
        with T.sblock("chunk"):
            T.reads()
            T.writes()
            seq_of = T.sblock_alloc_buffer((1,), "int32", scope="local")
            if q_indptr is None:
                seq_of[0] = row
            else:
                seq_of[0] = 0
                for i in T.serial(batch):
                    if q_indptr[i + 1] <= row:
                        seq_of[0] = seq_of[0] + 1
            seq: T.let[T.int32] = seq_of[0]
            q = T.sblock_alloc_buffer((vec,), "float32", scope="local")
            o = T.sblock_alloc_buffer((vec,), "float32", scope="local")
            # the running max and sum of this thread's tokens; the current token's score
            # and the factor rescaling the state before it
            m = T.sblock_alloc_buffer((1,), "float32", scope="local")
            den = T.sblock_alloc_buffer((1,), "float32", scope="local")
            score = T.sblock_alloc_buffer((1,), "float32", scope="local")
            rescale = T.sblock_alloc_buffer((1,), "float32", scope="local")
            n_tok = T.sblock_alloc_buffer((1,), "int32", scope="local")
            o_sh = T.sblock_alloc_buffer((tp, group, d), "float32", scope="shared")
            md_sh = T.sblock_alloc_buffer((tp, group, 2), "float32", scope="shared")
            n_tok[0] = src.n_tokens(seq)
            if q_indptr is not None:
                if causal > 0:
                    n_tok[0] = T.max(n_tok[0] - (q_indptr[seq + 1] - 1 - row), 0)
            chunk: T.let[T.int32] = (n_tok[0] + n_splits - 1) // n_splits
            kv_head: T.let[T.int32] = by // n_splits
            start: T.let[T.int32] = by % n_splits * chunk
            for v in lane_loop(vec):
                q[v] = (T.Cast("float32", Q[row, kv_head * group + ty, tx * vec + v])
                        * sm_scale * log2e)
                o[v] = T.float32(0)
            m[0] = T.float32(-5e4)
            den[0] = T.float32(0)
            for it in T.serial((chunk + tp - 1) // tp):
                # every thread runs every step (the shuffles need whole warps, and a warp can
                # hold two token slots): tokens past the chunk read a valid one and score -5e4
                pos: T.let[T.int32] = src.position(seq, T.max(T.min(start + it * tp + tz, n_tok[0] - 1), 0))
                page: T.let[T.int32] = src.row(seq, pos)
                off: T.let[T.int32] = src.offset(pos)
                score[0] = T.float32(0)
                for v in T.unroll(vec):
                    score[0] = score[0] + q[v] * src.element(0, page, off, kv_head, tx * vec + v)
                for sh in T.unroll(5):
                    if (1 << sh) < lanes:
                        score[0] = score[0] + T.call_pure_extern(
                            "float32", "__shfl_xor_sync", T.uint32(0xFFFFFFFF), score[0],
                            1 << sh, lanes)
                if quantized:
                    score[0] = score[0] * src.scale(0, page, off, kv_head)
                if softcap > 0.0:
                    score[0] = capped(score[0], softcap)
                if it * tp + tz >= chunk or start + it * tp + tz >= n_tok[0]:
                    score[0] = T.float32(-5e4)
                rescale[0] = T.exp2(m[0] - T.max(m[0], score[0]))
                m[0] = T.max(m[0], score[0])
                score[0] = T.exp2(score[0] - m[0])  # now the token's weight
                den[0] = den[0] * rescale[0] + score[0]
                if quantized:
                    score[0] = score[0] * src.scale(1, page, off, kv_head)   # (the weight of its codes)
                for v in lane_loop(vec):
                    o[v] = o[v] * rescale[0] + score[0] * src.element(1, page, off, kv_head, tx * vec + v)
            # the tokens in flight meet in shared memory; tz == 0 merges them
            for v in lane_loop(vec):
                o_sh[tz, ty, tx * vec + v] = o[v]
            md_sh[tz, ty, 0] = m[0]
            md_sh[tz, ty, 1] = den[0]
            T.evaluate(T.tvm_storage_sync("shared"))
            if tz == 0:
                for j in T.serial(tp - 1):
                    # (score and rescale are free after the token loop: the merge's scratch)
                    merge_state(m, den, o, score, rescale, md_sh[j + 1, ty, 0], md_sh[j + 1, ty, 1],
                                lambda v: o_sh[j + 1, ty, tx * vec + v])
                for v in lane_loop(vec):
                    part_o[row, kv_head * group + ty, by % n_splits, tx * vec + v] = o[v]
                part_md[row, kv_head * group + ty, by % n_splits, 0] = m[0]
                part_md[row, kv_head * group + ty, by % n_splits, 1] = den[0]

    @T.macro
    def merge(part_o, part_md, output, lse, n_splits, bx, by, tx):
        with T.sblock("merge"):
            T.reads()
            T.writes()
            o = T.sblock_alloc_buffer((vec,), "float32", scope="local")
            m = T.sblock_alloc_buffer((1,), "float32", scope="local")
            den = T.sblock_alloc_buffer((1,), "float32", scope="local")
            new_m = T.sblock_alloc_buffer((1,), "float32", scope="local")
            w = T.sblock_alloc_buffer((1,), "float32", scope="local")
            m[0] = T.float32(-5e4)
            den[0] = T.float32(1)  # TVM's convention: an empty sequence gives 0, not NaN
            for v in lane_loop(vec):
                o[v] = T.float32(0)
            for s in T.serial(n_splits):
                merge_state(m, den, o, new_m, w, part_md[bx, by, s, 0], part_md[bx, by, s, 1],
                            lambda v: part_o[bx, by, s, tx * vec + v])
            for v in lane_loop(vec):
                output[bx, by, tx * vec + v] = T.Cast(dtype, o[v] / den[0])
            if tx == 0:
                lse[bx, by] = m[0] + T.log2(den[0])

    return chunk, merge, (tp, group, lanes)


def make_split_decode(h_kv: int, h_qo: int, d: int, dtype: str, page_size: int, splits: int = 0, tokens: int = 0,
                      sliding: bool = False, softcap: float = 0.0):
    """The kernel for one attention shape; `splits` (splits_for) and `tokens` (the limit of tokens_in_flight): 0 for
    the automatic choice. sliding: the sliding-window layers' variant, whose `length_info` is (last page length,
    window offset, sink size) per sequence and whose pages start at the window. softcap: Gemma 2's score cap."""
    from tvm.relax.frontend.nn.llm._kernel_common import _declare_length_info
    from tvm.script import tirx as T

    fixed = splits > 0
    splits = splits_for(h_kv, splits)

    def n_splits(batch):
        """Chunks per sequence for this batch: `splits` where the options fix it, else active_splits."""
        return splits if fixed else active_splits(batch, h_kv, splits)
    chunk, merge, (tp, group, lanes) = split_kv_macros(h_kv, h_qo, d, dtype, page_size, splits, tokens, sliding,
                                                         softcap)

    @T.prim_func(s_tir=True)
    def batch_decode_paged_kv_split(
        Q_handle: T.handle, pages_handle: T.handle, page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle, var_length_info: T.handle, k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle, output_handle: T.handle, lse_handle: T.handle,
        rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True,
                     "global_symbol": "batch_decode_paged_kv" + ("_sliding_window" if sliding else "")})
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        pages_elem_offset = T.int64()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()

        Q = T.match_buffer(Q_handle, (B, h_qo, d), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, h_kv, page_size, d), dtype,
                               elem_offset=pages_elem_offset)
        page_table_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32",
                                           elem_offset=page_indptr_elem_offset)
        page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32",
                                           elem_offset=page_values_elem_offset)
        _k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32",  # (binds the signature)
                                            elem_offset=k_rope_pos_offset_elem_offset)
        _q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32",
                                          elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(output_handle, (B, h_qo, d), dtype)
        lse = T.match_buffer(lse_handle, (B, h_qo), "float32")
        length_info = _declare_length_info(var_length_info, B, sliding, length_info_elem_offset)

        part_o = T.sblock_alloc_buffer((B, h_qo, splits, d), "float32", scope="global")
        part_md = T.sblock_alloc_buffer((B, h_qo, splits, 2), "float32", scope="global")
        for bx in T.thread_binding(B, thread="blockIdx.x"):
            for by in T.thread_binding(h_kv * n_splits(B), thread="blockIdx.y"):
                for tz in T.thread_binding(tp, thread="threadIdx.z"):
                    for ty in T.thread_binding(group, thread="threadIdx.y"):
                        for tx in T.thread_binding(lanes, thread="threadIdx.x"):
                            chunk(Q, PagedKV(pages, page_table_indptr, page_table_values, length_info,
                                             page_size, sliding), part_o, part_md,
                                  sm_scale, bx, None, B, 0, n_splits(B), by, tz, ty, tx)
        for bx in T.thread_binding(B, thread="blockIdx.x"):
            for by in T.thread_binding(h_qo, thread="blockIdx.y"):
                for tx in T.thread_binding(lanes, thread="threadIdx.x"):
                    merge(part_o, part_md, output, lse, n_splits(B), bx, by, tx)

    return batch_decode_paged_kv_split


_DECODE_SYMBOLS = {"batch_decode_paged_kv": False, "batch_decode_paged_kv_sliding_window": True}


def _decode_kernel_shape(func) -> tuple[int, int, int, str, int, bool] | None:
    """(kv heads, query heads, head dim, dtype, page size, sliding) of one of TVM's decode kernels."""
    attrs = func.attrs
    if attrs is None or attrs.get("global_symbol") not in _DECODE_SYMBOLS or len(func.params) != 13:
        return None
    try:
        q, pages = func.params[0], func.params[1]
        _, h_qo, d = (int(x) if i else x for i, x in enumerate(q.shape))
        _, _, h_kv, page_size, d2 = (int(x) if i else x for i, x in enumerate(pages.shape))
    except (TypeError, ValueError, AttributeError):
        return None
    if d != d2 or h_qo % h_kv or str(q.dtype) != str(pages.dtype):
        return None
    return h_kv, h_qo, d, str(q.dtype), page_size, _DECODE_SYMBOLS[attrs["global_symbol"]]


def split_decode_attention_pass(splits: int = 0, tokens: int = 0) -> tvm.transform.Pass:
    """TVM's decode attention kernels (plain and sliding-window) replaced where the split-KV kernel supports their
    shape, soft-capped as they were (schedules/attention_softcap.py); `splits` and `tokens` as for make_split_decode
    (CompileOptions.decode_attention_splits/_tokens)."""

    @tvm.transform.module_pass(opt_level=0, name="mlcc_cuda_split_decode_attention")
    def _pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, tvm.tirx.PrimFunc):
                continue
            shape = _decode_kernel_shape(func)
            if shape is None:
                continue
            h_kv, h_qo, d, dtype, page_size, sliding = shape
            if not supported(h_kv, h_qo, d, tokens):
                log.warning("decode attention (%d kv heads, %d query heads, head dim %d) keeps TVM's kernel: the "
                            "split-KV kernel does not support the shape", h_kv, h_qo, d)
                continue
            cap = softcap_of(func)
            new = make_split_decode(h_kv, h_qo, d, dtype, page_size, splits, tokens, sliding, cap)
            mod[gv] = new.with_attr(ATTR, cap) if cap else new
        return mod

    return _pass
