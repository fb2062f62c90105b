"""Paged prefill attention for the few query rows of a speculative verify, on CUDA.

A verify scores a handful of new tokens per sequence against the whole cached context: the KV cache runs them as a
prefill, and TVM's paged prefill kernel tiles query rows (tokens x query heads of a KV head), so 5 tokens of a
Llama-3-8B layer are one tile per KV head, 8 blocks each walking the whole context alone: 1.25 ms a layer at 1,024
tokens of context on an H200, most of the verify. Here each query row is one decode-shaped query of the split-KV
kernel (cuda_decode_attention: chunks of the context on their own blocks, then a merge), with the causal limit of
the row where the call asks for one. Rows re-read their sequence's KV, from L2 mostly, so the kernel only runs up
to FEW_QUERY_ROWS rows: a host function with TVM's signature (host_dispatch) calls it or TVM's kernel by the
call's row count.
"""

from __future__ import annotations

import logging

import tvm

from .attention_softcap import ATTR, softcap_of
from .cuda_decode_attention import PagedKV, split_kv_macros, splits_for, supported
from .host_dispatch import host_dispatch

log = logging.getLogger(__name__)

def make_few_query_paged_prefill(h_kv: int, h_qo: int, d: int, dtype: str, page_size: int, splits: int = 0,
                                 tokens: int = 0, softcap: float = 0.0):
    """The split-KV kernel with the signature of TVM's `batch_prefill_paged_kv` (queries [rows, heads, dim] in
    sequences by q_indptr, attending to each sequence's paged KV, `causal` hiding what follows a row): one decode-
    shaped pass per query row. For the few rows of a speculative verify; see few_query_prefill_pass."""
    from tvm.relax.frontend.nn.llm._kernel_common import _declare_length_info
    from tvm.script import tirx as T

    splits = splits_for(h_kv, splits)
    chunk, merge, (tp, group, lanes) = split_kv_macros(h_kv, h_qo, d, dtype, page_size, splits, tokens, False,
                                                         softcap)

    @T.prim_func(s_tir=True)
    def batch_prefill_paged_kv_few(
        var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
        var_page_values: T.handle, var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle, var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "batch_prefill_paged_kv_few"})
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        pages_elem_offset = T.int64()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()

        q = T.match_buffer(var_q, (total_len, h_qo, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, page_size, d), dtype,
                               elem_offset=pages_elem_offset)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        _k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        _q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(var_output, (total_len, h_qo, d), dtype)
        lse = T.match_buffer(var_lse, (total_len, h_qo), "float32")
        length_info = _declare_length_info(var_length_info, batch_size, False, length_info_elem_offset)

        part_o = T.sblock_alloc_buffer((total_len, h_qo, splits, d), "float32", scope="global")
        part_md = T.sblock_alloc_buffer((total_len, h_qo, splits, 2), "float32", scope="global")

        for bx in T.thread_binding(total_len, thread="blockIdx.x"):
            for by in T.thread_binding(h_kv * splits, thread="blockIdx.y"):
                for tz in T.thread_binding(tp, thread="threadIdx.z"):
                    for ty in T.thread_binding(group, thread="threadIdx.y"):
                        for tx in T.thread_binding(lanes, thread="threadIdx.x"):
                            chunk(q, PagedKV(pages, page_indptr, page_values, length_info, page_size, False),
                                  part_o, part_md, sm_scale, bx, q_indptr, batch_size, causal, splits, by, tz, ty,
                                  tx)
        for bx in T.thread_binding(total_len, thread="blockIdx.x"):
            for by in T.thread_binding(h_qo, thread="blockIdx.y"):
                for tx in T.thread_binding(lanes, thread="threadIdx.x"):
                    merge(part_o, part_md, output, lse, splits, bx, by, tx)

    return batch_prefill_paged_kv_few


# Up to this many query rows in one call the paged prefill takes the split-KV kernel: TVM's tiles put a verify's
# few rows (5 tokens x 4 query heads per KV head: one tile) on one block per KV head, which walks the whole
# context alone (1.25 ms a layer at 1,024 tokens of context on an H200, most of a 5-token verify of the 8B shape).
FEW_QUERY_ROWS = 32


SYMBOL = "batch_prefill_paged_kv"


def _paged_prefill_shape(func) -> tuple[int, int, int, str, int] | None:
    """(kv heads, query heads, head dim, dtype, page size) of TVM's paged prefill kernel."""
    if func.attrs is None or func.attrs.get("global_symbol") != SYMBOL or len(func.params) != 15:
        return None
    try:
        q, pages = func.params[0], func.params[2]
        _, h_qo, d = (int(x) if i else x for i, x in enumerate(q.shape))
        _, _, h_kv, page_size, d2 = (int(x) if i else x for i, x in enumerate(pages.shape))
    except (TypeError, ValueError, AttributeError):
        return None
    if d != d2 or h_qo % h_kv or str(q.dtype) != str(pages.dtype):
        return None
    return h_kv, h_qo, d, str(q.dtype), page_size


def few_query_prefill_pass() -> tvm.transform.Pass:
    """TVM's paged prefill kernel (not the sliding-window one) behind a host dispatch, with the split-KV kernel
    for calls of few rows; soft-capped as it was. Runs after the kernels' other rebuilds (the tiled one is kept
    as it is then)."""

    @tvm.transform.module_pass(opt_level=0, name="mlcc_cuda_few_query_prefill")
    def _pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, tvm.tirx.PrimFunc):
                continue
            shape = _paged_prefill_shape(func)
            if shape is None:
                continue
            h_kv, h_qo, d, dtype, page_size = shape
            if not supported(h_kv, h_qo, d):
                continue
            few_name, tiled_name = f"{SYMBOL}_few", f"{SYMBOL}_tiled"
            cap = softcap_of(func)
            few = make_few_query_paged_prefill(h_kv, h_qo, d, dtype, page_size, softcap=cap)
            # (the query rows: q's first dimension)
            dispatch = host_dispatch(func, func.params[0].shape[0], FEW_QUERY_ROWS, few_name, tiled_name,
                                     {"global_symbol": SYMBOL})
            mod[tvm.ir.GlobalVar(few_name)] = few.with_attr(ATTR, cap) if cap else few
            mod[tvm.ir.GlobalVar(tiled_name)] = func.with_attr("global_symbol", tiled_name)
            mod[gv] = dispatch.with_attr(ATTR, cap) if cap else dispatch
            log.debug("paged prefill: split-KV kernel up to %d query rows", FEW_QUERY_ROWS)
        return mod

    return _pass
