"""TVM's prefill attention kernels rebuilt with enough thread blocks for a big GPU.

TVM's `batch_prefill_ragged_kv` / `batch_prefill_paged_kv` walk the query tiles with a fixed grid of 16 blocks per
KV head (NUM_BLKS in `_get_prefill_kernel_config`): 128 blocks of 4 warps for Llama-3-8B, one per SM with the SM's
other slots empty. On an H200 that kernel was 73% of a 2048-token prefill (354 of 486 ms; profile in
bench/results). The kernels already stride their tile walk by NUM_BLKS, so the same kernel source with a larger
grid is the same computation spread wider; we rebuild it with a grid of about eight blocks per SM.

The rebuilt kernels take no rope_scaling: the model's KV cache applies RoPE before attention (NORMAL rope mode,
what mlcc's models use), so the inline-RoPE branch they compile is never taken.
"""

from __future__ import annotations

import logging

import tvm

from mlcc.tvm_compat import prefill_kernel_blocks

from .attention_softcap import softcap_of, softcap_scores

log = logging.getLogger(__name__)

BLOCKS_PER_GPU = 132 * 8  # H100/H200 SMs x resident blocks of this kernel we aim for


def _num_blocks(h_kv: int) -> int:
    return max(16, BLOCKS_PER_GPU // h_kv)


def _rebuild(kind: str, func, target):
    from tvm.relax.frontend.nn.llm import _prefill_kernels as pk

    p = func.params
    h_q, d_qk = int(p[0].shape[1]), int(p[0].shape[2])  # q: [tokens, heads, dim] in both kernels
    if kind == "ragged":  # k, v: [tokens, kv heads, dim]
        h_kv, d_v = int(p[2].shape[1]), int(p[3].shape[2])
    else:  # pages: [pages, 2, kv heads, page size, dim]
        h_kv, d_v = int(p[2].shape[2]), int(p[2].shape[4])
    dtype = str(p[0].dtype)

    with prefill_kernel_blocks(_num_blocks(h_kv)):
        if kind == "ragged":
            return pk._attention_prefill_ragged(h_kv, h_q, d_qk, d_v, dtype, {}, target)
        return pk._attention_prefill(h_kv, h_q, d_qk, dtype, False, {}, target)


# (not the sliding-window paged kernel: rebuilt with a wider grid it gave wrong cross-attention on an H200, and its
# work is bounded by the window anyway)
_KINDS = {"batch_prefill_ragged_kv": "ragged", "batch_prefill_paged_kv": "paged"}


def wide_prefill_attention_pass() -> tvm.transform.Pass:
    """TVM's two prefill attention kernels rebuilt for the current target with a grid of _num_blocks."""

    @tvm.transform.module_pass(opt_level=0, name="mlcc_cuda_wide_prefill_attention")
    def _pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        target = tvm.target.Target.current()
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is None:
                continue
            kind = _KINDS.get(str(func.attrs.get("global_symbol", "")))
            if kind is None:
                continue
            try:
                wide = _rebuild(kind, func, target)
                cap = softcap_of(func)
                mod[gv] = softcap_scores(wide, cap) if cap else wide
            except Exception as e:  # noqa: BLE001 - a TVM whose kernel builder changed: keep its own kernel
                log.warning("keeping TVM's %s prefill kernel: %s", kind, e)
        return mod

    return _pass
