"""Attention over a quantized KV cache (--kv-cache-dtype int8 / fp8_e4m3) on CUDA.

The cache is TVM's PagedKVCache seen as bytes (relax_models/kv_quant.py): every K/V row is head_dim 8-bit codes
then its float32 scale, and the query and output heads travel as the model dtype's bytes in int8 tensors. TVM's
CUDA kernels would read those bytes as numbers, so every kernel that reads the cache or the byte outputs is
replaced here, by name, as schedules/cpu_attention.py does on the CPU: decode and paged prefill (plain and
sliding-window), the ragged prefill of the new tokens, and the merge of two partial states.

All of them are the split-KV kernel's two phases (cuda_decode_attention.split_kv_macros: a block per query row and
KV head chunk with an online softmax, then a merge), reading codes through PagedKV/RaggedKV and scaling scores and
values by their rows' scales. Decode is the same kernel as for a float cache; prefill runs one decode-shaped pass
per query row over the whole context (no tensor cores), correct at every length but far slower than the float
cache's flash prefill: the quantized cache trades prefill speed for KV memory (twice the sequences of a float16
cache). Speculative tree attention keeps TVM's kernels, which cannot read these rows: the runtime does not offer
tree speculation with a quantized cache.
"""

from __future__ import annotations

import re

import tvm
from tvm.ir import IRModule

from mlcc import kv_cache_format
from mlcc.errors import UnsupportedKVCacheDtypeError

from .cuda_decode_attention import PagedKV, RaggedKV, split_kv_macros, splits_for, supported

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def _geometry(h_q: int, d: int, dtype: str) -> tuple[int, int]:
    """(query heads of the cache's byte tensors, bytes of a row)."""
    return h_q * _ITEMSIZE[dtype], d + kv_cache_format.SCALE_BYTES


def decode(h_kv: int, h_q: int, d: int, dtype: str, kv: str, page_size: int, sliding: bool, softcap: float = 0.0):
    from tvm.relax.frontend.nn.llm._kernel_common import _declare_length_info
    from tvm.script import tirx as T

    from .cuda_decode_attention import active_splits

    hq_c, w = _geometry(h_q, d, dtype)
    splits = splits_for(h_kv)
    chunk, merge, (tp, group, lanes) = split_kv_macros(h_kv, h_q, d, dtype, page_size, splits, 0, sliding,
                                                         softcap, kv)

    @T.prim_func(s_tir=True)
    def batch_decode_paged_kv_quantized(
        Q_handle: T.handle, pages_handle: T.handle, page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle, var_length_info: T.handle, k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle, output_handle: T.handle, lse_handle: T.handle,
        rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True,
                     "global_symbol": "batch_decode_paged_kv_quantized" + ("_sliding_window" if sliding else "")})
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        pages_elem_offset = T.int64()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        Q_c = T.match_buffer(Q_handle, (B, hq_c, w), "int8")
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, h_kv, page_size, w), "int8",
                               elem_offset=pages_elem_offset)
        page_table_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32",
                                           elem_offset=page_indptr_elem_offset)
        page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32",
                                           elem_offset=page_values_elem_offset)
        _k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32",  # (binds the signature)
                                            elem_offset=k_rope_pos_offset_elem_offset)
        _q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32",
                                          elem_offset=q_rope_position_elem_offset)
        output_c = T.match_buffer(output_handle, (B, hq_c, w), "int8")
        lse = T.match_buffer(lse_handle, (B, hq_c), "float32")
        length_info = _declare_length_info(var_length_info, B, sliding, length_info_elem_offset)
        Q = T.decl_buffer((B, h_q, w), dtype, data=Q_c.data)
        output = T.decl_buffer((B, h_q, w), dtype, data=output_c.data)
        scales = T.decl_buffer((max_num_pages * 2 * h_kv * page_size * (w // 4),), "float32", data=pages.data,
                               elem_offset=pages_elem_offset // 4)

        part_o = T.sblock_alloc_buffer((B, h_q, splits, d), "float32", scope="global")
        part_md = T.sblock_alloc_buffer((B, h_q, splits, 2), "float32", scope="global")
        for bx in T.thread_binding(B, thread="blockIdx.x"):
            for by in T.thread_binding(h_kv * active_splits(B, h_kv, splits), thread="blockIdx.y"):
                for tz in T.thread_binding(tp, thread="threadIdx.z"):
                    for ty in T.thread_binding(group, thread="threadIdx.y"):
                        for tx in T.thread_binding(lanes, thread="threadIdx.x"):
                            chunk(Q, PagedKV(pages, page_table_indptr, page_table_values, length_info, page_size,
                                          sliding, kv, scales, h_kv, d),
                                  part_o, part_md, sm_scale, bx, None, B, 0,
                                  active_splits(B, h_kv, splits), by, tz, ty, tx)
        for bx in T.thread_binding(B, thread="blockIdx.x"):
            for by in T.thread_binding(h_q, thread="blockIdx.y"):
                for tx in T.thread_binding(lanes, thread="threadIdx.x"):
                    merge(part_o, part_md, output, lse, active_splits(B, h_kv, splits), bx, by, tx)

    return batch_decode_paged_kv_quantized


# Prefill rows each walk their whole context on one block per KV head: the partial states are one per row, and a
# prefill of thousands of rows already fills the GPU.
_PREFILL_SPLITS = 1


def paged_prefill(h_kv: int, h_q: int, d: int, dtype: str, kv: str, page_size: int, sliding: bool,
                  softcap: float = 0.0):
    from tvm.relax.frontend.nn.llm._kernel_common import _declare_length_info
    from tvm.script import tirx as T

    hq_c, w = _geometry(h_q, d, dtype)
    splits = _PREFILL_SPLITS
    chunk, merge, (tp, group, lanes) = split_kv_macros(h_kv, h_q, d, dtype, page_size, splits, 0, sliding,
                                                         softcap, kv)

    @T.prim_func(s_tir=True)
    def batch_prefill_paged_kv_quantized(
        var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
        var_page_values: T.handle, var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle, var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True,
                     "global_symbol": "batch_prefill_paged_kv_quantized" + ("_sliding_window" if sliding else "")})
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
        q_c = T.match_buffer(var_q, (total_len, hq_c, w), "int8")
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, page_size, w), "int8",
                               elem_offset=pages_elem_offset)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        _k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                            elem_offset=k_rope_pos_offset_elem_offset)
        _q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32",
                                          elem_offset=q_rope_position_elem_offset)
        output_c = T.match_buffer(var_output, (total_len, hq_c, w), "int8")
        lse = T.match_buffer(var_lse, (total_len, hq_c), "float32")
        length_info = _declare_length_info(var_length_info, batch_size, sliding, length_info_elem_offset)
        q = T.decl_buffer((total_len, h_q, w), dtype, data=q_c.data)
        output = T.decl_buffer((total_len, h_q, w), dtype, data=output_c.data)
        scales = T.decl_buffer((max_num_pages * 2 * h_kv * page_size * (w // 4),), "float32", data=pages.data,
                               elem_offset=pages_elem_offset // 4)

        part_o = T.sblock_alloc_buffer((total_len, h_q, splits, d), "float32", scope="global")
        part_md = T.sblock_alloc_buffer((total_len, h_q, splits, 2), "float32", scope="global")
        for bx in T.thread_binding(total_len, thread="blockIdx.x"):
            for by in T.thread_binding(h_kv * splits, thread="blockIdx.y"):
                for tz in T.thread_binding(tp, thread="threadIdx.z"):
                    for ty in T.thread_binding(group, thread="threadIdx.y"):
                        for tx in T.thread_binding(lanes, thread="threadIdx.x"):
                            chunk(q, PagedKV(pages, page_indptr, page_values, length_info, page_size, sliding, kv,
                                             scales, h_kv, d),
                                  part_o, part_md, sm_scale, bx, q_indptr, batch_size, causal, splits, by,
                                  tz, ty, tx)
        for bx in T.thread_binding(total_len, thread="blockIdx.x"):
            for by in T.thread_binding(h_q, thread="blockIdx.y"):
                for tx in T.thread_binding(lanes, thread="threadIdx.x"):
                    merge(part_o, part_md, output, lse, splits, bx, by, tx)

    return batch_prefill_paged_kv_quantized


def ragged_prefill(h_kv: int, h_q: int, d: int, dtype: str, kv: str, softcap: float = 0.0):
    from tvm.script import tirx as T

    hq_c, w = _geometry(h_q, d, dtype)
    splits = _PREFILL_SPLITS
    chunk, merge, (tp, group, lanes) = split_kv_macros(h_kv, h_q, d, dtype, 16, splits, 0, False, softcap, kv)

    @T.prim_func(s_tir=True)
    def batch_prefill_ragged_kv_quantized(
        var_q: T.handle, var_q_indptr: T.handle, var_k: T.handle, var_v: T.handle, var_kv_indptr: T.handle,
        var_q_rope_position: T.handle, var_k_rope_pos_offset: T.handle, var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True,
                     "global_symbol": "batch_prefill_ragged_kv_quantized"})
        batch_size = T.int32()
        qo_total = T.int32()
        kv_total = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_c = T.match_buffer(var_q, (qo_total, hq_c, w), "int8")
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        k = T.match_buffer(var_k, (kv_total, h_kv, w), "int8")
        v = T.match_buffer(var_v, (kv_total, h_kv, w), "int8")
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_elem_offset)
        _q_rope_position = T.match_buffer(var_q_rope_position, (qo_total,), "int32",
                                          elem_offset=q_rope_position_elem_offset)
        _k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                            elem_offset=k_rope_pos_offset_elem_offset)
        output_c = T.match_buffer(var_output, (qo_total, hq_c, w), "int8")
        lse = T.match_buffer(var_lse, (qo_total, hq_c), "float32")
        q = T.decl_buffer((qo_total, h_q, w), dtype, data=q_c.data)
        output = T.decl_buffer((qo_total, h_q, w), dtype, data=output_c.data)
        k_scales = T.decl_buffer((kv_total * h_kv * (w // 4),), "float32", data=k.data)
        v_scales = T.decl_buffer((kv_total * h_kv * (w // 4),), "float32", data=v.data)

        part_o = T.sblock_alloc_buffer((qo_total, h_q, splits, d), "float32", scope="global")
        part_md = T.sblock_alloc_buffer((qo_total, h_q, splits, 2), "float32", scope="global")
        for bx in T.thread_binding(qo_total, thread="blockIdx.x"):
            for by in T.thread_binding(h_kv * splits, thread="blockIdx.y"):
                for tz in T.thread_binding(tp, thread="threadIdx.z"):
                    for ty in T.thread_binding(group, thread="threadIdx.y"):
                        for tx in T.thread_binding(lanes, thread="threadIdx.x"):
                            chunk(q, RaggedKV(k, v, kv_indptr, kv, k_scales, v_scales, h_kv, d),
                                  part_o, part_md, sm_scale, bx, q_indptr, batch_size, causal, splits, by,
                                  tz, ty, tx)
        for bx in T.thread_binding(qo_total, thread="blockIdx.x"):
            for by in T.thread_binding(h_q, thread="blockIdx.y"):
                for tx in T.thread_binding(lanes, thread="threadIdx.x"):
                    merge(part_o, part_md, output, lse, splits, bx, by, tx)

    return batch_prefill_ragged_kv_quantized


def merge_state(h_q: int, d: int, dtype: str):
    """TVM's merge of two partial attention states (output, log2-sum-exp) of one query, through model-dtype views
    of the byte outputs: o = (o * a + o_other * b) / (a + b)."""
    from tvm.script import tirx as T

    hq_c, w = _geometry(h_q, d, dtype)

    @T.prim_func(s_tir=True)
    def merge_state_inplace_quantized(v: T.handle, s: T.handle, v_other: T.handle, s_other: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True,
                     "global_symbol": "merge_state_inplace_quantized"})
        N = T.int32()
        V_c = T.match_buffer(v, (N, hq_c, w), "int8")
        S = T.match_buffer(s, (N, hq_c), "float32")
        V_other_c = T.match_buffer(v_other, (N, hq_c, w), "int8")
        S_other = T.match_buffer(s_other, (N, hq_c), "float32")
        V = T.decl_buffer((N, h_q, w), dtype, data=V_c.data)
        V_other = T.decl_buffer((N, h_q, w), dtype, data=V_other_c.data)
        for n in T.thread_binding(N, thread="blockIdx.x"):
            for h in T.thread_binding(h_q, thread="blockIdx.y"):
                for i in T.thread_binding(d, thread="threadIdx.x"):
                    with T.sblock("merge"):
                        T.reads()
                        T.writes()
                        ab = T.sblock_alloc_buffer((3,), "float32", scope="local")
                        ab[2] = T.max(S[n, h], S_other[n, h])
                        ab[0] = T.exp2(S[n, h] - ab[2])
                        ab[1] = T.exp2(S_other[n, h] - ab[2])
                        V[n, h, i] = T.Cast(dtype, (T.Cast("float32", V[n, h, i]) * ab[0]
                                                    + T.Cast("float32", V_other[n, h, i]) * ab[1]) / (ab[0] + ab[1]))
                        # every thread has read S before the first one rewrites it
                        T.evaluate(T.tvm_storage_sync("shared"))
                        if i == 0:
                            S[n, h] = T.log2(ab[0] + ab[1]) + ab[2]

    return merge_state_inplace_quantized


def _refusing(func: tvm.tirx.PrimFunc, symbol: str) -> tvm.tirx.PrimFunc:
    """A kernel of `func`'s signature that raises when called: TVM's tree attention reads the cache's bytes as
    numbers (and does not compile for int8 on CUDA), and the runtime never calls it (its speculation verifies a
    linear draft through the paged prefill), so the library carries this in its place."""
    from tvm import tirx

    message = f"{symbol}: tree attention cannot read a quantized KV cache (--kv-cache-dtype auto)"
    # (the FFI constructor's order: condition, error kind, message parts)
    body = tirx.AssertStmt(tirx.const(False, "bool"), tvm.ir.StringImm("RuntimeError"), [tvm.ir.StringImm(message)])
    return tvm.tirx.PrimFunc(func.params, body).with_attrs({"global_symbol": symbol + "_quantized",
                                                            "tirx.is_scheduled": True})


def replace_cuda_quantized_attention(mod: IRModule, h_kv: int, h_q: int, d: int, dtype: str, softcap: float,
                                     kv: str, page_size: int = 16) -> IRModule:
    """`mod` (an exported model for a CUDA target with a quantized cache) with TVM's attention kernels swapped for
    these (by the names TVM's KV-cache builder gives them)."""
    if not supported(h_kv, h_q, d):
        raise UnsupportedKVCacheDtypeError(
            f"--kv-cache-dtype {kv} on CUDA: no attention kernel for {h_q} query heads over {h_kv} KV heads of "
            f"{d} dimensions (mlcc's split-KV kernel's shapes); use --kv-cache-dtype auto")
    kernels = {
        "batch_decode_paged_kv": lambda: decode(h_kv, h_q, d, dtype, kv, page_size, False, softcap),
        "batch_decode_paged_kv_sliding_window": lambda: decode(h_kv, h_q, d, dtype, kv, page_size, True, softcap),
        "batch_prefill_paged_kv": lambda: paged_prefill(h_kv, h_q, d, dtype, kv, page_size, False, softcap),
        "batch_prefill_paged_kv_sliding_window": lambda: paged_prefill(h_kv, h_q, d, dtype, kv, page_size, True,
                                                                       softcap),
        "batch_prefill_ragged_kv": lambda: ragged_prefill(h_kv, h_q, d, dtype, kv, softcap),
        "tir_attention_merge_state": lambda: merge_state(h_q, d, dtype),
    }
    replaced = set()
    mod = tvm.IRModule(mod.functions, attrs=mod.attrs)
    for gv in list(mod.functions.keys()):
        name = re.sub(r"\d+$", "", gv.name_hint)  # (the block builder numbers repeated names)
        if name in kernels:
            mod[gv] = kernels[name]()
            replaced.add(name)
        elif name in ("tree_attn_paged_kv", "batch_tree_attn"):
            mod[gv] = _refusing(mod[gv], name)
    missing = {"batch_prefill_ragged_kv", "batch_prefill_paged_kv", "batch_decode_paged_kv",
               "tir_attention_merge_state"} - replaced
    if missing:  # TVM renamed its kernels: fail the build rather than run ones that read codes as numbers
        raise RuntimeError(f"TVM's CUDA attention kernels {sorted(missing)} not found in the exported module")
    return mod
