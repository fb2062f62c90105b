"""The paged KV cache's append of new keys and values (`tir_kv_cache_transpose_append`), scheduled for CUDA.

TVM's kernel is an unscheduled element loop that the generic rules spread one element per thread with int64
index arithmetic and the page lookup redone per element: 2.5 ms of a 42 ms Llama-3-8B prefill of 2,048 tokens on
an H100 (8 MB a layer at ~100 GB/s). Here one block takes one token: it reads the token's slot once and each thread
moves 16 bytes of K and of V for the KV heads, so the writes are whole contiguous rows of the page. Same signature
and element order, so the cache calls it in place of TVM's; any dtype whose row is a whole number of 16-byte or
4-byte vectors (the quantized cache's int8 rows of head_dim + 4 bytes included).
"""

from __future__ import annotations

import tvm

SYMBOL = "tir_kv_cache_transpose_append"
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "int8": 1}


def vector_width(d: int, dtype: str) -> int:
    """Elements each thread moves: 16 bytes where the row allows, else 4 bytes, else 1."""
    size = _ITEMSIZE[dtype]
    for nbytes in (16, 8, 4):
        if nbytes % size == 0 and d % (nbytes // size) == 0:
            return nbytes // size
    return 1


def make_kv_append(h_kv: int, d: int, dtype: str, page_size: int) -> tvm.tirx.PrimFunc:
    from tvm.script import tirx as T

    vec = vector_width(d, dtype)
    lanes = d // vec
    threads = h_kv * lanes

    @T.prim_func(s_tir=True)
    def kv_append(var_pages: T.handle, var_k_data: T.handle, var_v_data: T.handle, var_position_map: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "global_symbol": SYMBOL})
        ntoken = T.int64()
        num_pages = T.int64()
        pages_elem_offset = T.int64()
        position_map_elem_offset = T.int32()
        pages = T.match_buffer(var_pages, (num_pages, 2, h_kv, page_size, d), dtype, elem_offset=pages_elem_offset)
        k_data = T.match_buffer(var_k_data, (ntoken, h_kv, d), dtype)
        v_data = T.match_buffer(var_v_data, (ntoken, h_kv, d), dtype)
        position_map = T.match_buffer(var_position_map, (ntoken,), "int32", elem_offset=position_map_elem_offset)
        for t in T.thread_binding(ntoken, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                with T.sblock("append"):
                    T.reads()
                    T.writes()
                    pos: T.let[T.int32] = position_map[t]
                    h: T.let[T.int32] = tx // lanes
                    col: T.let[T.int32] = tx % lanes * vec
                    if pos != -1:
                        for v in T.vectorized(vec):
                            pages[pos // page_size, 0, h, pos % page_size, col + v] = k_data[t, h, col + v]
                        for v in T.vectorized(vec):
                            pages[pos // page_size, 1, h, pos % page_size, col + v] = v_data[t, h, col + v]

    return kv_append


def _append_shape(func) -> tuple[int, int, str, int] | None:
    """(kv heads, head dim (row elements), dtype, page size) of TVM's append kernel."""
    if func.attrs is None or func.attrs.get("global_symbol") != SYMBOL or len(func.params) != 4:
        return None
    try:
        pages = func.params[0]
        _, two, h_kv, page_size, d = (int(x) if i else x for i, x in enumerate(pages.shape))
    except (TypeError, ValueError, AttributeError):
        return None
    dtype = str(pages.dtype)
    if two != 2 or dtype not in _ITEMSIZE or h_kv * d // vector_width(d, dtype) > 1024:
        return None
    return h_kv, d, dtype, page_size


def kv_append_pass() -> tvm.transform.Pass:
    """TVM's KV append replaced by the one-token-a-block kernel where its shape fits a block."""

    @tvm.transform.module_pass(opt_level=0, name="mlcc_cuda_kv_append")
    def _pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        for gv, func in list(mod.functions.items()):
            if isinstance(func, tvm.tirx.PrimFunc) and (shape := _append_shape(func)) is not None:
                mod[gv] = make_kv_append(*shape)
        return mod

    return _pass
