"""Paged-KV attention kernels for the CPU (llvm), in place of TVM's `*_cpu` ones.

TVM's CPU paged prefill reads its rescale factor past the end of a one-element buffer (`scale_O[d_idx]`) and leaves
the running max unset when a key is masked, so a prefill chunk after the first (long prompts, sliding windows) got
garbage, at times NaN. These keep the same signatures (the KV cache's C++ calls them by position), with one online
softmax and what the model's attention needs that TVM's lack: attention-score soft-capping (Gemma 2).
Sliding-window layers get TVM's page selection (the `_sliding_window` variants read the window's pages and offsets
from `length_info`) and its cross-attention mask. Prefill is tiled for the vector units (below: 55-90 GFLOP/s on
two Zen 4 cores, where one scalar loop per head made ~4); decode, one query row per sequence, runs a head per
thread.

Attention sinks (gpt-oss: a learned logit per head that joins every softmax's denominator) arrive as extra q heads
after the model's own, head_dim sinks each (relax_models/blocks.py), so the KV cache stores nothing for them. A
softmax starts from its head's sink (running max = the sink, sum = 1) in the one kernel call per query whose keys reach
the query's own position: the ragged prefill over the new tokens, or the paged call whose chunk holds the query's key
(decode, where the new key is appended first); the calls over a cached prefix start empty, so when TVM merges the
partial states the sink is counted once.

A negative softmax scale asks for bidirectional attention among the new tokens (the ragged prefill without its
causal mask; every kernel uses the scale's magnitude): TVM's KV cache passes the model's scale through untouched and
has no causal switch of its own, and Gemma 3's image tokens see each other both ways (relax_models/gemma3_vision.py,
whose `prefill_image` prefills one image's tokens that way).

RoPE is never applied here: mlcc's models rotate q/k before the cache (in the model or in TVM's split kernel),
so the `rotary_mode` argument is always 0 for them.

With a quantized cache (`kv`: "int8" or "fp8_e4m3", relax_models/kv_quant.py) the same kernels take the cache's
byte geometry: q and the output are int8 buffers read and written through model-dtype views of head_dim + 4
elements a head, and each K/V row is head_dim codes then a float32 scale, decoded on load (the key's scale
multiplies its score, the value's its elements).
"""

from __future__ import annotations

import math
import re

import tvm
from tvm.ir import IRModule
from tvm.script import tirx as T

from mlcc import kv_cache_format

LOG2E = math.log2(math.e)


def _score(dot, sm_scale, softcap: float):
    """log2-domain attention score of a q·k dot product."""
    s = dot * sm_scale
    if softcap:
        s = T.tanh(s / T.float32(softcap)) * T.float32(softcap)
    return s * T.float32(LOG2E)


@T.macro
def _online_softmax_step(m, den, o, s, width, value):
    """Fold one key (its log2-domain score s[0]; its value element i = value(i)) into the running max m, sum den
    and output o."""
    new_m: T.let[T.float32] = T.max(m[0], s[0])
    rescale: T.let[T.float32] = T.exp2(m[0] - new_m)
    w: T.let[T.float32] = T.exp2(s[0] - new_m)
    den[0] = den[0] * rescale + w
    for i in T.serial(width):
        o[i] = o[i] * rescale + w * value(i)
    m[0] = new_m


# Prefill: flash-style tiles. A task is one KV head x QB query tokens, and its rows are those tokens for every query
# head of the group (GQA), so each key and value is read once for the whole group. Rows are laid out head-major,
# token-minor: one 16-lane vector is one head over 16 consecutive tokens, so the scores of a key block come out as
# vectors over rows, the softmax max/sum over keys is element-wise (no horizontal reductions), and both products
# are outer products of a broadcast K or V element with row vectors of Q or P, read straight from the cache's
# [.., token, head_dim] rows without transposing them.
QB = 16  # query tokens per task: one vector lane each
LANES = 16  # float32 lanes of one AVX-512 register (two AVX2 ones)
KB = 32  # keys per block of the online softmax
NK = 8  # keys (Q.K) or head-dim entries (P.V) per register tile (fewer where head_dim is no multiple of 8)
NV = 3  # row vectors per register tile: NK x NV = 24 accumulators
MASKED = -3.0e38  # a masked score: below any real one, and exp2 of it minus the max is 0 below
# 2^f on [0, 1), degree-5 least squares, relative error 1.6e-7 in float32
_EXP2_POLY = (0.999999926924982, 0.6931529681766354, 0.24015452988670488, 0.05582360446233847,
              0.00899258403127821, 0.001876232945213916)


def _exp2(x):
    """2^x for x <= 0 that LLVM vectorizes (its exp2 becomes one libm call per lane): 2^floor(x) from the exponent
    bits times a polynomial in the fraction; below 2^-126 it flushes to about 1e-38, which no sum notices."""
    xc = T.max(x, T.float32(-126.0))
    xi = T.floor(xc)
    f = xc - xi
    p = T.float32(_EXP2_POLY[-1])
    for c in reversed(_EXP2_POLY[:-1]):
        p = p * f + T.float32(c)
    return p * T.reinterpret("float32", T.shift_left(T.Cast("int32", xi) + 127, 23))


def _element(kv: str | None, buf, idx):
    """float32 value of K/V element idx of buf, before its row's scale."""
    return kv_cache_format.decode(kv, buf[idx]) if kv else T.Cast("float32", buf[idx])


def _scaled(kv: str | None, value, scale):
    return value * scale if kv else value


class _Geometry:
    """The buffers' shapes for a model attention shape: as is, or the quantized cache's bytes (see the module
    docstring); `q_heads`/`width` are the cache's, `h_q`/`d` the model's."""

    def __init__(self, h_q: int, d: int, dtype: str, kv: str | None, sinks: bool = False):
        if kv and sinks:
            raise ValueError("attention sinks with a quantized KV cache have no CPU kernel")
        self.kv = kv
        itemsize = {"float16": 2, "bfloat16": 2, "float32": 4}[dtype] if kv else 1
        self.view_heads = h_q + (-(-h_q // d) if sinks else 0)  # q/output heads seen in the model dtype
        self.q_heads = h_q * itemsize if kv else self.view_heads
        self.width = d + kv_cache_format.SCALE_BYTES if kv else d
        self.storage = "int8" if kv else dtype


def _sink_start(q, sinks: bool, on, row, h_q: int, d: int, h):
    """The running max a softmax of q row `row`, head h starts from: its sink (log2 domain) where `on`, else TVM's
    "nothing seen" (-5e4, with the sum 1: a weight of 2^-5e4)."""
    if not sinks:
        return T.float32(-5e4)
    return T.if_then_else(on, T.Cast("float32", q[row, h_q + h // d, h % d]) * T.float32(LOG2E), T.float32(-5e4))


def _flash_prefill(h_kv: int, h_q: int, d: int, dtype: str, window: int, softcap: float, kv: str | None = None,
                   width: int = 0, sinks: bool = False):
    """The macro computing one sequence's prefill attention: every (KV head, query block) task of it in parallel.

    window > 0: TVM's sliding cross mask (with causal, row i sees the last window - i - 1 keys) instead of the
    causal one. key_base(b, j) is the flat offset of key j's row in kf; its value row is v_delta further in vf.
    Quantized (kv): kf/vf hold rows of `width` codes whose float32 scales sf/svf read at row offset + d.
    sinks: sink_on(b, q row) says whether the softmax of that query row starts from its head's sink."""
    group = h_q // h_kv
    quantized = kv is not None
    nk = math.gcd(NK, d)
    rv = group  # row vectors of a task (QB == LANES)
    rows = rv * LANES
    tiles = (rv + NV - 1) // NV
    if softcap:
        q_scale, s_scale = 1.0 / softcap, softcap * LOG2E
    else:
        q_scale, s_scale = LOG2E, 1.0

    def transform(s):
        return T.tanh(s) * T.float32(s_scale) if softcap else s

    def visible(causal, col, qi, kv_len, qo_len):
        if window:
            row_ok = col >= kv_len - T.max(window - qi - 1, 0)
        else:
            row_ok = col < kv_len - qo_len + qi + 1
        return T.Or(causal <= 0, row_ok)

    def first_key(causal, qs, kv_len):
        """The first key any row of the block starting at query row qs sees."""
        if window:
            return T.if_then_else(causal > 0, T.max(kv_len - T.max(window - qs - 1, 0), 0), 0)
        return 0

    def end_key(causal, q_last, kv_len, qo_len):
        """One past the last key any row up to q_last sees."""
        if window:
            return kv_len
        return T.if_then_else(causal > 0, T.min(kv_len, kv_len - qo_len + q_last + 1), kv_len)

    @T.macro
    def body(q, output, lse, kf, vf, sf, svf, key_base, v_delta, b, q0, qo_len, kv_len, causal, sm_scale, sink_on):
        nqb: T.let[T.int32] = (qo_len + QB - 1) // QB
        for task in T.parallel(h_kv * nqb):
            with T.sblock("flash"):
                T.reads()
                T.writes()
                qt = T.sblock_alloc_buffer((d, rows), "float32")
                ot = T.sblock_alloc_buffer((d, rows), "float32")
                s = T.sblock_alloc_buffer((KB, rows), "float32")
                m = T.sblock_alloc_buffer((rows,), "float32")
                den = T.sblock_alloc_buffer((rows,), "float32")
                alpha = T.sblock_alloc_buffer((rows,), "float32")
                koff = T.sblock_alloc_buffer((KB,), "int32")
                kscale = T.sblock_alloc_buffer((KB,), "float32")
                vscale = T.sblock_alloc_buffer((KB,), "float32")
                acc = T.sblock_alloc_buffer((nk, NV * LANES), "float32", scope="local")
                mx = T.sblock_alloc_buffer((LANES,), "float32", scope="local")
                sm = T.sblock_alloc_buffer((LANES,), "float32", scope="local")
                kvh: T.let[T.int32] = task % h_kv
                # causal blocks differ in work: alternate light and heavy ones, so the pool's contiguous
                # split of the task range gives both threads the same share
                r: T.let[T.int32] = task // h_kv
                qs: T.let[T.int32] = T.if_then_else(r % 2 == 0, r // 2, nqb - 1 - r // 2) * QB
                q_last: T.let[T.int32] = T.min(qs + QB, qo_len) - 1
                lo: T.let[T.int32] = first_key(causal, qs, kv_len)
                hi: T.let[T.int32] = T.max(lo, end_key(causal, q_last, kv_len, qo_len))
                for g, t in T.grid(group, QB):
                    for i in T.serial(d):
                        qt[i, g * LANES + t] = T.if_then_else(
                            qs + t < qo_len,
                            T.Cast("float32", q[T.min(q0 + qs + t, q0 + qo_len - 1), kvh * group + g, i])
                            * sm_scale * T.float32(q_scale), T.float32(0))
                        ot[i, g * LANES + t] = T.float32(0)
                    m[g * LANES + t] = _sink_start(
                        q, sinks, T.And(qs + t < qo_len, sink_on(b, T.min(q0 + qs + t, q0 + qo_len - 1))),
                        T.min(q0 + qs + t, q0 + qo_len - 1), h_q, d, kvh * group + g)
                    den[g * LANES + t] = T.float32(1)
                for kb in T.serial((hi - lo + KB - 1) // KB):
                    j0: T.let[T.int32] = lo + kb * KB
                    for j in T.serial(KB):
                        koff[j] = key_base(b, T.min(j0 + j, hi - 1), kvh)  # past the end: a real key, weight 0
                        if quantized:
                            kscale[j] = sf[(koff[j] + d) // 4]
                            vscale[j] = svf[(koff[j] + v_delta + d) // 4]
                    # scores: S[j, row] = K[j] . Q[row]
                    for tile in T.unroll(tiles):
                        for jt in T.serial(KB // nk):
                            for jj in T.unroll(nk):
                                for v in T.unroll(NV):
                                    if tile * NV + v < rv:
                                        for ln in T.vectorized(LANES):
                                            acc[jj, v * LANES + ln] = T.float32(0)
                            for i in T.serial(d):
                                for jj in T.unroll(nk):
                                    for v in T.unroll(NV):
                                        if tile * NV + v < rv:
                                            for ln in T.vectorized(LANES):
                                                acc[jj, v * LANES + ln] = acc[jj, v * LANES + ln] + _element(
                                                    kv, kf, koff[jt * nk + jj] + i) * qt[
                                                    i, (tile * NV + v) * LANES + ln]
                            for jj in T.unroll(nk):
                                for v in T.unroll(NV):
                                    if tile * NV + v < rv:
                                        for ln in T.vectorized(LANES):
                                            if quantized:
                                                s[jt * nk + jj, (tile * NV + v) * LANES + ln] = acc[
                                                    jj, v * LANES + ln] * kscale[jt * nk + jj]
                                            else:
                                                s[jt * nk + jj, (tile * NV + v) * LANES + ln] = acc[
                                                    jj, v * LANES + ln]
                    # online softmax, element-wise over the rows
                    for g in T.serial(rv):
                        for ln in T.vectorized(LANES):
                            mx[ln] = m[g * LANES + ln]
                            sm[ln] = T.float32(0)
                        for j in T.serial(KB):
                            for ln in T.vectorized(LANES):
                                s[j, g * LANES + ln] = T.if_then_else(
                                    T.And(j0 + j < hi, visible(causal, j0 + j, qs + ln, kv_len, qo_len)),
                                    transform(s[j, g * LANES + ln]), T.float32(MASKED))
                                mx[ln] = T.max(mx[ln], s[j, g * LANES + ln])
                        for j in T.serial(KB):
                            for ln in T.vectorized(LANES):
                                s[j, g * LANES + ln] = T.if_then_else(
                                    s[j, g * LANES + ln] > T.float32(MASKED),
                                    _exp2(s[j, g * LANES + ln] - mx[ln]), T.float32(0))
                                sm[ln] = sm[ln] + s[j, g * LANES + ln]
                        for ln in T.vectorized(LANES):
                            alpha[g * LANES + ln] = _exp2(m[g * LANES + ln] - mx[ln])
                            den[g * LANES + ln] = den[g * LANES + ln] * alpha[g * LANES + ln] + sm[ln]
                            m[g * LANES + ln] = mx[ln]
                    # O = O * alpha + P.V
                    for tile in T.unroll(tiles):
                        for it in T.serial(d // nk):
                            for ii in T.unroll(nk):
                                for v in T.unroll(NV):
                                    if tile * NV + v < rv:
                                        for ln in T.vectorized(LANES):
                                            acc[ii, v * LANES + ln] = ot[it * nk + ii, (tile * NV + v) * LANES + ln] \
                                                * alpha[(tile * NV + v) * LANES + ln]
                            for j in T.serial(KB):
                                for ii in T.unroll(nk):
                                    for v in T.unroll(NV):
                                        if tile * NV + v < rv:
                                            for ln in T.vectorized(LANES):
                                                acc[ii, v * LANES + ln] = acc[ii, v * LANES + ln] + _scaled(
                                                    kv, _element(kv, vf, koff[j] + v_delta + it * nk + ii),
                                                    vscale[j]) * s[j, (tile * NV + v) * LANES + ln]
                            for ii in T.unroll(nk):
                                for v in T.unroll(NV):
                                    if tile * NV + v < rv:
                                        for ln in T.vectorized(LANES):
                                            ot[it * nk + ii, (tile * NV + v) * LANES + ln] = acc[ii, v * LANES + ln]
                for t, g in T.grid(QB, group):
                    if qs + t < qo_len:
                        for i in T.serial(d):
                            output[q0 + qs + t, kvh * group + g, i] = T.Cast(
                                dtype, ot[i, g * LANES + t] / den[g * LANES + t])
                        lse[q0 + qs + t, kvh * group + g] = m[g * LANES + t] + T.log2(den[g * LANES + t])

    return body


def paged_prefill(h_kv: int, h_q: int, d: int, dtype: str, sliding_window: bool, window: int = 0,
                  softcap: float = 0.0, page_size: int = 16, kv: str | None = None, sinks: bool = False):
    from tvm.relax.frontend.nn.llm._kernel_common import _declare_length_info, _get_kv_chunk_len, _get_seq_offset

    g = _Geometry(h_q, d, dtype, kv, sinks)
    w, hq_c, hv, st = g.width, g.q_heads, g.view_heads, g.storage
    symbol = "batch_prefill_paged_kv_cpu" + ("_sliding_window" if sliding_window else "")
    body = _flash_prefill(h_kv, h_q, d, dtype, window if sliding_window else 0, softcap, kv, sinks=sinks)
    v_delta = h_kv * page_size * w  # pages[p, 1] is pages[p, 0] one (h_kv, page_size, width) slab further

    @T.prim_func(s_tir=True)
    def batch_prefill_paged_kv_cpu(
        var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
        var_page_values: T.handle, var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle, var_output: T.handle, var_lse: T.handle, causal: T.int32,
        rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"global_symbol": symbol, "tirx.noalias": True})
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        q_c = T.match_buffer(var_q, (total_len, hq_c, w), st)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, page_size, w), st)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32",
                                     elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        output_c = T.match_buffer(var_output, (total_len, hq_c, w), st)
        lse = T.match_buffer(var_lse, (total_len, hq_c), "float32")
        length_info = _declare_length_info(var_length_info, batch_size, sliding_window, length_info_elem_offset)
        q = T.decl_buffer((total_len, hv, w), dtype, data=q_c.data)
        output = T.decl_buffer((total_len, hv, w), dtype, data=output_c.data)
        flat = T.decl_buffer((max_num_pages * 2 * h_kv * page_size * w,), st, data=pages.data)
        scales = T.decl_buffer((max_num_pages * 2 * h_kv * page_size * w // 4,), "float32", data=pages.data)

        for b in T.serial(batch_size):
            begin: T.let[T.int32] = page_indptr[b]
            end: T.let[T.int32] = page_indptr[b + 1]
            kv_len: T.let[T.int32] = T.if_then_else(begin != end, _get_kv_chunk_len(
                end - begin, page_size, b, length_info, sliding_window), 0)
            body(q, output, lse, flat, flat, scales, scales,
                 lambda b, j, kvh: ((page_values[begin + _get_seq_offset(j, b, length_info, sliding_window)
                                                 // page_size] * 2 * h_kv + kvh) * page_size
                                    + _get_seq_offset(j, b, length_info, sliding_window) % page_size) * w,
                 v_delta, b, q_indptr[b], q_indptr[b + 1] - q_indptr[b], kv_len, causal, T.abs(sm_scale),
                 # (a chunk whose keys reach the query's own position; the prefix of a prefill never does)
                 lambda b, row: k_rope_pos_offset[b] + kv_len > q_rope_position[row])

    return batch_prefill_paged_kv_cpu


def ragged_prefill(h_kv: int, h_q: int, d_qk: int, d_v: int, dtype: str, softcap: float = 0.0,
                   kv: str | None = None, sinks: bool = False):
    if d_qk != d_v:
        raise ValueError("the CPU prefill kernel needs equal q/k and v head dims")
    d = d_qk
    g = _Geometry(h_q, d, dtype, kv, sinks)
    w, hq_c, hv, st = g.width, g.q_heads, g.view_heads, g.storage
    body = _flash_prefill(h_kv, h_q, d, dtype, 0, softcap, kv, sinks=sinks)

    @T.prim_func(s_tir=True)
    def batch_prefill_ragged_kv(
        var_q: T.handle, var_q_indptr: T.handle, var_k: T.handle, var_v: T.handle, var_kv_indptr: T.handle,
        var_q_rope_position: T.handle, var_k_rope_pos_offset: T.handle, var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"global_symbol": "batch_prefill_ragged_kv", "tirx.noalias": True})
        batch_size = T.int32()
        qo_total = T.int32()
        kv_total = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_c = T.match_buffer(var_q, (qo_total, hq_c, w), st)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        k = T.match_buffer(var_k, (kv_total, h_kv, w), st)
        v = T.match_buffer(var_v, (kv_total, h_kv, w), st)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_total,), "int32",  # noqa: F841 (binds the signature)
                                         elem_offset=q_rope_position_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",  # noqa: F841 (binds the signature)
                                           elem_offset=k_rope_pos_offset_elem_offset)
        output_c = T.match_buffer(var_output, (qo_total, hq_c, w), st)
        lse = T.match_buffer(var_lse, (qo_total, hq_c), "float32")
        q = T.decl_buffer((qo_total, hv, w), dtype, data=q_c.data)
        output = T.decl_buffer((qo_total, hv, w), dtype, data=output_c.data)
        kflat = T.decl_buffer((kv_total * h_kv * w,), st, data=k.data)
        vflat = T.decl_buffer((kv_total * h_kv * w,), st, data=v.data)
        kscales = T.decl_buffer((kv_total * h_kv * w // 4,), "float32", data=k.data)
        vscales = T.decl_buffer((kv_total * h_kv * w // 4,), "float32", data=v.data)

        for b in T.serial(batch_size):
            body(q, output, lse, kflat, vflat, kscales, vscales,
                 lambda b, j, kvh: ((kv_indptr[b] + j) * h_kv + kvh) * w, 0,
                 b, q_indptr[b], q_indptr[b + 1] - q_indptr[b], kv_indptr[b + 1] - kv_indptr[b],
                 T.if_then_else(sm_scale < T.float32(0), 0, causal), T.abs(sm_scale),
                 lambda b, row: True)

    return batch_prefill_ragged_kv


def paged_decode(h_kv: int, h_q: int, d: int, dtype: str, sliding_window: bool, softcap: float = 0.0,
                 page_size: int = 16, kv: str | None = None, sinks: bool = False):
    from tvm.relax.frontend.nn.llm._kernel_common import _declare_length_info, _get_kv_chunk_len, _get_seq_offset

    g = _Geometry(h_q, d, dtype, kv, sinks)
    w, hq_c, hv, st = g.width, g.q_heads, g.view_heads, g.storage
    group = h_q // h_kv
    symbol = "batch_decode_paged_kv_cpu" + ("_sliding_window" if sliding_window else "")

    @T.prim_func(s_tir=True)
    def batch_decode_paged_kv(
        Q_handle: T.handle, pages_handle: T.handle, page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle, var_length_info: T.handle, k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle, output_handle: T.handle, lse_handle: T.handle, rotary_mode: T.int32,
        rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": symbol, "tirx.noalias": True})
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        Q_c = T.match_buffer(Q_handle, (B, hq_c, w), st)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, h_kv, page_size, w), st)
        page_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32",
                                     elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        output_c = T.match_buffer(output_handle, (B, hq_c, w), st)
        lse = T.match_buffer(lse_handle, (B, hq_c), "float32")
        length_info = _declare_length_info(var_length_info, B, sliding_window, length_info_elem_offset)
        Q = T.decl_buffer((B, hv, w), dtype, data=Q_c.data)
        output = T.decl_buffer((B, hv, w), dtype, data=output_c.data)
        scales = T.decl_buffer((max_num_pages * 2 * h_kv * page_size * w // 4,), "float32", data=pages.data)

        for bh in T.parallel(B * h_q):
            with T.sblock("attn"):
                T.reads()
                T.writes()
                o = T.sblock_alloc_buffer((d,), "float32")
                m = T.sblock_alloc_buffer((1,), "float32")
                s = T.sblock_alloc_buffer((1,), "float32")
                den = T.sblock_alloc_buffer((1,), "float32")
                b: T.let[T.int32] = bh // h_q
                h: T.let[T.int32] = bh % h_q
                begin: T.let[T.int32] = page_indptr[b]
                end: T.let[T.int32] = page_indptr[b + 1]
                kv_len: T.let[T.int32] = T.if_then_else(begin != end, _get_kv_chunk_len(
                    end - begin, page_size, b, length_info, sliding_window), 0)
                m[0] = _sink_start(Q, sinks, k_rope_pos_offset[b] + kv_len > q_rope_position[b], b, h_q, d, h)
                den[0] = T.float32(1)
                for i in T.serial(d):
                    o[i] = T.float32(0)
                for j in T.serial(kv_len):
                    pos: T.let[T.int32] = _get_seq_offset(j, b, length_info, sliding_window)
                    page: T.let[T.int32] = page_values[begin + pos // page_size]
                    off: T.let[T.int32] = pos % page_size
                    # a row's float32 scale, after its codes (quantized caches only)
                    row: T.let[T.int32] = ((page * 2 * h_kv + h // group) * page_size + off) * w
                    s[0] = T.float32(0)
                    for i in T.serial(d):
                        s[0] = s[0] + T.Cast("float32", Q[b, h, i]) * _element(
                            kv, pages, (page, 0, h // group, off, i))
                    s[0] = _score(_scaled(kv, s[0], scales[(row + d) // 4]), T.abs(sm_scale), softcap)
                    _online_softmax_step(m, den, o, s, d, lambda i: _scaled(
                        kv, _element(kv, pages, (page, 1, h // group, off, i)),
                        scales[(row + h_kv * page_size * w + d) // 4]))
                for i in T.serial(d):
                    output[b, h, i] = T.Cast(dtype, o[i] / den[0])
                lse[b, h] = m[0] + T.log2(den[0])

    return batch_decode_paged_kv


def merge_state(h_q: int, d: int, dtype: str, kv: str):
    """TVM's merge of two partial attention states (output, log2-sum-exp) of one query, for the quantized cache's
    byte outputs: o = o * w + o_other * w_other, through model-dtype views."""
    g = _Geometry(h_q, d, dtype, kv)
    w, hq_c = g.width, g.q_heads

    @T.prim_func(s_tir=True)
    def merge_state_inplace_cpu(v: T.handle, s: T.handle, v_other: T.handle, s_other: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        N = T.int32()
        V_c = T.match_buffer(v, (N, hq_c, w), "int8")
        S = T.match_buffer(s, (N, hq_c), "float32")
        V_other_c = T.match_buffer(v_other, (N, hq_c, w), "int8")
        S_other = T.match_buffer(s_other, (N, hq_c), "float32")
        V = T.decl_buffer((N, h_q, w), dtype, data=V_c.data)
        V_other = T.decl_buffer((N, h_q, w), dtype, data=V_other_c.data)
        for nh in T.parallel(N * h_q):
            with T.sblock("merge"):
                T.reads()
                T.writes()
                n: T.let[T.int32] = nh // h_q
                h: T.let[T.int32] = nh % h_q
                s_max: T.let[T.float32] = T.max(S[n, h], S_other[n, h])
                a: T.let[T.float32] = T.exp2(S[n, h] - s_max)
                b: T.let[T.float32] = T.exp2(S_other[n, h] - s_max)
                for i in T.serial(d):
                    V[n, h, i] = T.Cast(dtype, (T.Cast("float32", V[n, h, i]) * a
                                                + T.Cast("float32", V_other[n, h, i]) * b) / (a + b))
                S[n, h] = T.log2(a + b) + s_max

    return merge_state_inplace_cpu


# TVM's other CPU KV-cache kernels, which the cache's C++ always calls with distinct tensors, marked noalias too:
# TVM's LLVM codegen emits every parallel loop body (the GEMM's, these attention kernels') once the whole module is
# compiled, with the buffer-alias information of the last function it compiled (names in order:
# tree_attn_paged_kv_cpu here). Without noalias there, every accumulator of every parallel kernel went through
# memory: the prefill GEMM ran at 90 GFLOP/s in the model library against 220 alone (two cores), prefill as a whole
# about 2.2x slower.
_DISTINCT_ARGS = {"tree_attn_paged_kv_cpu", "batch_tree_attn", "merge_state_inplace_cpu", "copy_single_page_cpu",
                  "compact_kv_copy_cpu"}


def replace_cpu_attention(mod: IRModule, h_kv: int, h_q: int, d: int, dtype: str, window: int, softcap: float,
                          kv: str | None = None, sinks: bool = False) -> IRModule:
    """`mod` (an exported model for an llvm target) with TVM's CPU attention kernels swapped for these; kv: the
    quantized cache's code ("int8", "fp8_e4m3"), None for a cache in the model's dtype; sinks: the model's
    attention sinks ride in extra q heads (see the module docstring)."""
    # keyed by the names TVM's KV-cache builder gives its CPU kernels
    kernels = {
        "batch_prefill_ragged_kv": lambda: ragged_prefill(h_kv, h_q, d, d, dtype, softcap, kv, sinks),
        "batch_prefill_paged_kv_cpu_sliding_window": lambda: paged_prefill(h_kv, h_q, d, dtype, True, window, softcap,
                                                                           kv=kv, sinks=sinks),
        "batch_prefill_paged_kv_cpu": lambda: paged_prefill(h_kv, h_q, d, dtype, False, 0, softcap, kv=kv,
                                                            sinks=sinks),
        "batch_decode_paged_kv_cpu_sliding_window": lambda: paged_decode(h_kv, h_q, d, dtype, True, softcap, kv=kv,
                                                                         sinks=sinks),
        "batch_decode_paged_kv_cpu": lambda: paged_decode(h_kv, h_q, d, dtype, False, softcap, kv=kv, sinks=sinks),
    }
    if kv:
        # TVM's merge reads the byte outputs as int8 numbers
        kernels["merge_state_inplace_cpu"] = lambda: merge_state(h_q, d, dtype, kv)
    replaced = set()
    mod = tvm.IRModule(mod.functions, attrs=mod.attrs)
    for gv in list(mod.functions.keys()):
        name = re.sub(r"\d+$", "", gv.name_hint)  # (the block builder numbers repeated names)
        if name in kernels:
            old = mod[gv].attrs.get("global_symbol") if mod[gv].attrs is not None else None
            new = kernels[name]()
            mod[gv] = new.with_attr("global_symbol", old) if old else new.without_attr("global_symbol")
            replaced.add(name)
    for gv in list(mod.functions.keys()):
        func = mod[gv]
        if re.sub(r"\d+$", "", gv.name_hint) in _DISTINCT_ARGS and not (func.attrs and func.attrs.get("tirx.noalias")):
            mod[gv] = func.with_attr("tirx.noalias", True)
    missing = {"batch_prefill_ragged_kv", "batch_prefill_paged_kv_cpu", "batch_decode_paged_kv_cpu"} - replaced
    if kv:
        missing |= {"merge_state_inplace_cpu"} - replaced
    if missing:  # TVM renamed its kernels: fail the build rather than run the broken ones
        raise RuntimeError(f"TVM's CPU attention kernels {sorted(missing)} not found in the exported module")
    return mod
