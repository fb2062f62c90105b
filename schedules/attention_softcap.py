"""Attention-score soft-capping (Gemma 2: scores become cap · tanh(score / cap)) in TVM's GPU attention kernels.

TVM's paged-KV attention kernels have no soft-cap. Each keeps its scores in log2 units (q·k · sm_scale · log2 e) and
writes every score once before its online softmax reads it: the prefill kernels in `S_smem[i, j] = S_local[i, j]`,
the decode kernel in `S_local[j] = t0[0]` after the cross-thread sum. Those stores are rewritten to store the capped
score, in the same units: C · tanh(s / C) with C = cap · log2 e. Masked positions are overwritten or skipped after
that store, so the mask is unchanged.

The rewritten kernels carry the cap as a function attribute, so passes that rebuild or replace a kernel later
(schedules/cuda_prefill_attention.py, cuda_decode_attention.py) apply it to what they build.
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import tirx

ATTR = "mlcc.attn_softcap"
# (stored buffer, loaded buffer) of the score store, per TVM kernel
_SCORE_STORES = {("S_smem", "S_local"), ("S_local", "t0")}
KERNELS = ("batch_prefill_ragged_kv", "batch_prefill_paged_kv", "batch_prefill_paged_kv_sliding_window",
           "batch_decode_paged_kv", "batch_decode_paged_kv_sliding_window")


def capped(score, cap: float):
    """`score` (log2 units) soft-capped at `cap` (natural units)."""
    c = tirx.const(cap * math.log2(math.e), "float32")
    return c * tirx.tanh(score / c)


def softcap_of(func: tirx.PrimFunc) -> float:
    return float(func.attrs.get(ATTR, 0.0)) if func.attrs is not None else 0.0


def softcap_scores(func: tirx.PrimFunc, cap: float) -> tirx.PrimFunc:
    """`func` (one of TVM's attention kernels) storing capped scores."""
    hits = []

    def store(s):
        if isinstance(s.value, tvm.ir.expr.TensorLoad) and (s.buffer.name, s.value.source.name) in _SCORE_STORES:
            hits.append(s)
            return tirx.BufferStore(s.buffer, capped(s.value, cap), s.indices)
        return s

    out = tvm_ffi.structural_map(func, (tirx.BufferStore, store))
    if not hits:
        raise RuntimeError(f"attention soft-capping: no score store found in TVM's kernel "
                           f"{func.attrs.get('global_symbol')}: its kernel builder changed")
    return out.with_attr(ATTR, float(cap))


def apply_attention_softcap(mod: tvm.IRModule, cap: float) -> tvm.IRModule:
    """Every GPU attention kernel of `mod` (an exported model) with scores capped at `cap`."""
    mod = tvm.IRModule(mod.functions, attrs=mod.attrs)
    done = set()
    for gv, func in list(mod.functions.items()):
        name = func.attrs.get("global_symbol") if isinstance(func, tirx.PrimFunc) and func.attrs else None
        if name in KERNELS:
            mod[gv] = softcap_scores(func, cap)
            done.add(name)
    missing = {"batch_prefill_ragged_kv", "batch_prefill_paged_kv", "batch_decode_paged_kv"} - done
    if missing:
        raise RuntimeError(f"attention soft-capping: TVM's kernels {sorted(missing)} not found")
    return mod
