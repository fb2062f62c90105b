"""Paged-KV attention kernels for the CPU (llvm), in place of TVM's `*_cpu` ones.

TVM's CPU paged prefill reads its rescale factor past the end of a one-element buffer (`scale_O[d_idx]`) and leaves
the running max unset when a key is masked, so a prefill chunk after the first (long prompts, sliding windows) got
garbage, at times NaN. These keep the same signatures (the KV cache's C++ calls them by position), with one online
softmax, parallel over query heads, and what the model's attention needs that TVM's lack: attention-score
soft-capping (Gemma 2). Sliding-window layers get TVM's page selection (the `_sliding_window` variants read the
window's pages and offsets from `length_info`) and its cross-attention mask.

RoPE is never applied here: mlcc's models rotate q/k before the cache (in the model or in TVM's split kernel),
so the `rotary_mode` argument is always 0 for them.
"""

from __future__ import annotations

import math
import re

import tvm
from tvm.ir import IRModule
from tvm.script import tirx as T

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


def paged_prefill(h_kv: int, h_q: int, d: int, dtype: str, sliding_window: bool, window: int = 0,
                  softcap: float = 0.0, page_size: int = 16):
    from tvm.relax.frontend.nn.llm._kernel_common import (
        _causal_or_sliding_cross_mask, _declare_length_info, _get_kv_chunk_len, _get_seq_offset)

    group = h_q // h_kv
    symbol = "batch_prefill_paged_kv_cpu" + ("_sliding_window" if sliding_window else "")

    @T.prim_func(s_tir=True)
    def batch_prefill_paged_kv_cpu(
        var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
        var_page_values: T.handle, var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle, var_output: T.handle, var_lse: T.handle, causal: T.int32,
        rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"global_symbol": symbol})
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
        q = T.match_buffer(var_q, (total_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, page_size, d), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32",
                                     elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",  # noqa: F841 (binds the signature)
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32",  # noqa: F841 (binds the signature)
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(var_output, (total_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (total_len, h_q), "float32")
        length_info = _declare_length_info(var_length_info, batch_size, sliding_window, length_info_elem_offset)

        for h in T.parallel(h_q):
            for b in T.serial(batch_size):
                with T.sblock("attn"):
                    T.reads()
                    T.writes()
                    o = T.sblock_alloc_buffer((d,), "float32")
                    m = T.sblock_alloc_buffer((1,), "float32")
                    s = T.sblock_alloc_buffer((1,), "float32")
                    den = T.sblock_alloc_buffer((1,), "float32")
                    kv_len = T.sblock_alloc_buffer((1,), "int32")
                    begin: T.let[T.int32] = page_indptr[b]
                    end: T.let[T.int32] = page_indptr[b + 1]
                    kv_len[0] = T.if_then_else(begin != end, _get_kv_chunk_len(
                        end - begin, page_size, b, length_info, sliding_window), 0)
                    qo_len: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                    for qi in T.serial(qo_len):
                        row: T.let[T.int32] = q_indptr[b] + qi
                        # TVM's convention: a state of max -5e4, sum 1 is "nothing seen" and merges as weight 0
                        m[0] = T.float32(-5e4)
                        den[0] = T.float32(1)
                        for i in T.serial(d):
                            o[i] = T.float32(0)
                        for j in T.serial(kv_len[0]):
                            if _causal_or_sliding_cross_mask(causal, row=qi, col=j, kv_len=kv_len[0], qo_len=qo_len,
                                                             sliding_window_size=window if sliding_window else 0):
                                pos: T.let[T.int32] = _get_seq_offset(j, b, length_info, sliding_window)
                                page: T.let[T.int32] = page_values[begin + pos // page_size]
                                off: T.let[T.int32] = pos % page_size
                                s[0] = T.float32(0)
                                for i in T.serial(d):
                                    s[0] = s[0] + T.Cast("float32", q[row, h, i]) * T.Cast(
                                        "float32", pages[page, 0, h // group, off, i])
                                s[0] = _score(s[0], sm_scale, softcap)
                                _online_softmax_step(m, den, o, s, d,
                                                     lambda i: T.Cast("float32", pages[page, 1, h // group, off, i]))
                        for i in T.serial(d):
                            output[row, h, i] = T.Cast(dtype, o[i] / den[0])
                        lse[row, h] = m[0] + T.log2(den[0])

    return batch_prefill_paged_kv_cpu


def ragged_prefill(h_kv: int, h_q: int, d_qk: int, d_v: int, dtype: str, softcap: float = 0.0):
    from tvm.relax.frontend.nn.llm._kernel_common import _causal_mask

    group = h_q // h_kv

    @T.prim_func(s_tir=True)
    def batch_prefill_ragged_kv(
        var_q: T.handle, var_q_indptr: T.handle, var_k: T.handle, var_v: T.handle, var_kv_indptr: T.handle,
        var_q_rope_position: T.handle, var_k_rope_pos_offset: T.handle, var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"global_symbol": "batch_prefill_ragged_kv"})
        batch_size = T.int32()
        qo_total = T.int32()
        kv_total = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q = T.match_buffer(var_q, (qo_total, h_q, d_qk), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        k = T.match_buffer(var_k, (kv_total, h_kv, d_qk), dtype)
        v = T.match_buffer(var_v, (kv_total, h_kv, d_v), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_total,), "int32",  # noqa: F841 (binds the signature)
                                         elem_offset=q_rope_position_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",  # noqa: F841 (binds the signature)
                                           elem_offset=k_rope_pos_offset_elem_offset)
        output = T.match_buffer(var_output, (qo_total, h_q, d_v), dtype)
        lse = T.match_buffer(var_lse, (qo_total, h_q), "float32")

        for h in T.parallel(h_q):
            for b in T.serial(batch_size):
                with T.sblock("attn"):
                    T.reads()
                    T.writes()
                    o = T.sblock_alloc_buffer((d_v,), "float32")
                    m = T.sblock_alloc_buffer((1,), "float32")
                    s = T.sblock_alloc_buffer((1,), "float32")
                    den = T.sblock_alloc_buffer((1,), "float32")
                    qo_len: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                    kv_len: T.let[T.int32] = kv_indptr[b + 1] - kv_indptr[b]
                    for qi in T.serial(qo_len):
                        row: T.let[T.int32] = q_indptr[b] + qi
                        m[0] = T.float32(-5e4)
                        den[0] = T.float32(1)
                        for i in T.serial(d_v):
                            o[i] = T.float32(0)
                        for j in T.serial(kv_len):
                            if _causal_mask(causal, row=qi, col=j, kv_len=kv_len, qo_len=qo_len):
                                col: T.let[T.int32] = kv_indptr[b] + j
                                s[0] = T.float32(0)
                                for i in T.serial(d_qk):
                                    s[0] = s[0] + T.Cast("float32", q[row, h, i]) * T.Cast(
                                        "float32", k[col, h // group, i])
                                s[0] = _score(s[0], sm_scale, softcap)
                                _online_softmax_step(m, den, o, s, d_v,
                                                     lambda i: T.Cast("float32", v[col, h // group, i]))
                        for i in T.serial(d_v):
                            output[row, h, i] = T.Cast(dtype, o[i] / den[0])
                        lse[row, h] = m[0] + T.log2(den[0])

    return batch_prefill_ragged_kv


def paged_decode(h_kv: int, h_q: int, d: int, dtype: str, sliding_window: bool, softcap: float = 0.0,
                 page_size: int = 16):
    from tvm.relax.frontend.nn.llm._kernel_common import _declare_length_info, _get_kv_chunk_len, _get_seq_offset

    group = h_q // h_kv
    symbol = "batch_decode_paged_kv_cpu" + ("_sliding_window" if sliding_window else "")

    @T.prim_func(s_tir=True)
    def batch_decode_paged_kv(
        Q_handle: T.handle, pages_handle: T.handle, page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle, var_length_info: T.handle, k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle, output_handle: T.handle, lse_handle: T.handle, rotary_mode: T.int32,
        rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": symbol})
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        Q = T.match_buffer(Q_handle, (B, h_q, d), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, h_kv, page_size, d), dtype)
        page_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32",
                                     elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32",  # noqa: F841 (binds the signature)
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32",  # noqa: F841 (binds the signature)
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(output_handle, (B, h_q, d), dtype)
        lse = T.match_buffer(lse_handle, (B, h_q), "float32")
        length_info = _declare_length_info(var_length_info, B, sliding_window, length_info_elem_offset)

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
                m[0] = T.float32(-5e4)
                den[0] = T.float32(1)
                for i in T.serial(d):
                    o[i] = T.float32(0)
                for j in T.serial(kv_len):
                    pos: T.let[T.int32] = _get_seq_offset(j, b, length_info, sliding_window)
                    page: T.let[T.int32] = page_values[begin + pos // page_size]
                    off: T.let[T.int32] = pos % page_size
                    s[0] = T.float32(0)
                    for i in T.serial(d):
                        s[0] = s[0] + T.Cast("float32", Q[b, h, i]) * T.Cast(
                            "float32", pages[page, 0, h // group, off, i])
                    s[0] = _score(s[0], sm_scale, softcap)
                    _online_softmax_step(m, den, o, s, d,
                                         lambda i: T.Cast("float32", pages[page, 1, h // group, off, i]))
                for i in T.serial(d):
                    output[b, h, i] = T.Cast(dtype, o[i] / den[0])
                lse[b, h] = m[0] + T.log2(den[0])

    return batch_decode_paged_kv


def replace_cpu_attention(mod: IRModule, h_kv: int, h_q: int, d: int, dtype: str, window: int, softcap: float
                          ) -> IRModule:
    """`mod` (an exported model for an llvm target) with TVM's CPU attention kernels swapped for these."""
    # keyed by the names TVM's KV-cache builder gives its CPU kernels
    kernels = {
        "batch_prefill_ragged_kv": lambda: ragged_prefill(h_kv, h_q, d, d, dtype, softcap),
        "batch_prefill_paged_kv_cpu_sliding_window": lambda: paged_prefill(h_kv, h_q, d, dtype, True, window, softcap),
        "batch_prefill_paged_kv_cpu": lambda: paged_prefill(h_kv, h_q, d, dtype, False, 0, softcap),
        "batch_decode_paged_kv_cpu_sliding_window": lambda: paged_decode(h_kv, h_q, d, dtype, True, softcap),
        "batch_decode_paged_kv_cpu": lambda: paged_decode(h_kv, h_q, d, dtype, False, softcap),
    }
    replaced = set()
    mod = tvm.IRModule(mod.functions, attrs=mod.attrs)
    for gv in list(mod.functions.keys()):
        name = re.sub(r"\d+$", "", gv.name_hint)  # (the block builder numbers repeated names)
        if name in kernels:
            old = mod[gv].attrs.get("global_symbol") if mod[gv].attrs is not None else None
            new = kernels[name]()
            mod[gv] = new.with_attr("global_symbol", old) if old else new.without_attr("global_symbol")
            replaced.add(name)
    missing = {"batch_prefill_ragged_kv", "batch_prefill_paged_kv_cpu", "batch_decode_paged_kv_cpu"} - replaced
    if missing:  # TVM renamed its kernels: fail the build rather than run the broken ones
        raise RuntimeError(f"TVM's CPU attention kernels {sorted(missing)} not found in the exported module")
    return mod
