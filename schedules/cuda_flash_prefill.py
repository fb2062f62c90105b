"""Prefill attention on tensor cores for CUDA (sm_80+): TVM's `batch_prefill_ragged_kv` (causal self-attention of
the new tokens of each sequence, which is all of a fresh prompt's attention) swapped for cuda/flash_prefill.cuh,
FlashAttention-2's loop on mma.sync. TVM's kernel computes the scores on the CUDA cores (a 2,048-token prefill of
an 8B model spent most of its time there, bench/results); this one keeps the same parameters and outputs (the
output and the base-2 log-sum-exp that the KV cache merges with the paged cross-attention over cached pages), so
the KV cache calls it unchanged.

Kept as TVM's: the paged kernel (cross-attention over cached pages: prefix-cache hits, later chunks of a chunked
prefill), kernels with a score soft-cap, head sizes other than 64 / 128, and the inline-RoPE mode (mlcc's models
apply RoPE before attention: relax_models/blocks.py creates the cache with RopeMode NORMAL or NONE, and the kernel
reads rotary_mode only to pass TVM's signature).
"""

from __future__ import annotations

import logging

import tvm

from .attention_softcap import softcap_of

log = logging.getLogger(__name__)

HELPER = "mlcc_flash_prefill"
BM, THREADS = 64, 128   # query rows and threads of one block (flash_prefill.cuh)
HEAD_DIMS = (64, 128)


def smem_bytes(d: int) -> int:
    return (BM + 4 * 64) * d * 2   # Q, double-buffered K and V tiles of 64 keys


def make_flash_prefill(h_kv: int, h_q: int, d: int, dtype: str = "float16") -> tvm.tirx.PrimFunc:
    """A PrimFunc with batch_prefill_ragged_kv's parameters that launches the kernel: grid (query tiles + one per
    sequence, for the partial ones) x query heads."""
    from tvm.script import tirx as T

    call = f"{HELPER}<{d}>"
    nbytes = smem_bytes(d)

    @T.prim_func(private=True, s_tir=True)
    def func(var_q: T.handle, var_q_indptr: T.handle, var_k: T.handle, var_v: T.handle, var_kv_indptr: T.handle,
             var_q_rope_position: T.handle, var_k_rope_pos_offset: T.handle, var_output: T.handle,
             var_lse: T.handle, causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32,
             rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q = T.match_buffer(var_q, (qo_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        k = T.match_buffer(var_k, (kv_len, h_kv, d), dtype)
        v = T.match_buffer(var_v, (kv_len, h_kv, d), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_elem_offset)
        T.match_buffer(var_q_rope_position, (qo_len,), "int32", elem_offset=q_rope_position_elem_offset)
        T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=k_rope_pos_offset_elem_offset)
        output = T.match_buffer(var_output, (qo_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (qo_len, h_q), "float32")
        for bx in T.thread_binding((qo_len + (BM - 1)) // BM + batch_size, thread="blockIdx.x"):
            for by in T.thread_binding(h_q, thread="blockIdx.y"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    with T.sblock("flash_prefill"):
                        T.reads()
                        T.writes()
                        smem = T.alloc_buffer((nbytes,), "uint8", scope="shared.dyn")
                        T.evaluate(T.call_extern(
                            "void", call, q.data, T.address_of(q_indptr[0]), k.data, v.data,
                            T.address_of(kv_indptr[0]), output.data, lse.data, batch_size, h_q, h_kv, causal,
                            sm_scale, smem.data))

    return func


def _shape(func: tvm.tirx.PrimFunc) -> tuple[int, int, int, str] | None:
    p = func.params
    if len(p) != 14:
        return None
    q, k, v = p[0], p[2], p[3]   # (tirx parameters carry their buffers' shapes)
    h_q, d = int(q.shape[1]), int(q.shape[2])
    h_kv, d_v = int(k.shape[1]), int(v.shape[2])
    if d != d_v or d not in HEAD_DIMS or str(q.dtype) != "float16" or h_q % h_kv:
        return None
    return h_kv, h_q, d, str(q.dtype)


def flash_prefill_attention_pass() -> tvm.transform.Pass:
    """Swap TVM's ragged prefill attention for the tensor-core kernel (after the wide-grid rebuild, which would
    otherwise rebuild it again)."""

    @tvm.transform.module_pass(opt_level=0, name="mlcc_cuda_flash_prefill")
    def _pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is None:
                continue
            if str(func.attrs.get("global_symbol", "")) != "batch_prefill_ragged_kv" or softcap_of(func):
                continue
            shape = _shape(func)
            if shape is None:
                log.debug("keeping TVM's ragged prefill attention for %s", func.params)
                continue
            attrs = {key: val for key, val in func.attrs.items()}
            mod[gv] = make_flash_prefill(*shape).with_attrs(attrs).with_attr("tirx.is_scheduled", True)
        return mod

    return _pass
