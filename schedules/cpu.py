"""CPU schedule for the matmuls (plain and with fused dequantize): parallel rows, vectorised reduction.

TVM's unscheduled CPU loops materialise the dequantized weight on every call and reduce one scalar at a time;
dlight's cpu rules fix that but made LLVM codegen ~100x slower here. This rule is small: inline dequantize,
split K into (ko, ki) with ki in the vector width, rfactor ki so the inner loop is an element-wise FMA over lanes
that LLVM vectorises, and parallelise over output columns. That is the batch-1 decode path; projections over a
symbolic number of tokens (prefill, batched decode) get the register-blocked GEMM of schedules/cpu_gemm.py instead.
"""

from __future__ import annotations

import logging

import tvm
from tvm import tirx

from .cpu_gemm import gemm_for

log = logging.getLogger(__name__)

_REDUCE = 2  # IterVar.CommReduce
VECTOR = 16  # floats per lane group: two AVX2 registers, one AVX-512 register


def _reduction_block(sch):
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    best = None
    for b in blocks:
        st = sch.get(b)
        if any(iv.iter_type == _REDUCE for iv in st.iter_vars):
            if best is not None:
                return None  # more than one reduction: not a plain matmul
            best = b
    return best


def schedule_matmul(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    from tvm.s_tir import Schedule

    sch = Schedule(func)
    try:
        for name in ("dequantize",):
            try:
                sch.compute_inline(sch.get_sblock(name))
            except Exception:  # noqa: BLE001 - absent block
                pass
        block = _reduction_block(sch)
        if block is None:
            return None
        st = sch.get(block)
        kinds = [iv.iter_type for iv in st.iter_vars]
        if kinds[-1] != _REDUCE or kinds.count(_REDUCE) != 1:
            return None
        k_extent = st.iter_vars[-1].dom.extent
        if not isinstance(k_extent, tirx.IntImm) or int(k_extent) % VECTOR:
            return None
        loops = sch.get_loops(block)
        n_spatial = len(loops) - 1
        ko, ki = sch.split(loops[-1], [None, VECTOR])
        rf = sch.rfactor(ki, factor_axis=n_spatial)
        # One parallel loop over all output elements; the lane partials live in a VECTOR-sized scratch under it.
        fused = sch.fuse(*sch.get_loops(block)[:n_spatial])
        sch.parallel(fused)
        sch.compute_at(rf, fused)
        lane, k_outer = sch.get_loops(rf)[-2:]
        sch.reorder(k_outer, lane)
        sch.vectorize(lane)
        for consumer in sch.get_consumers(block):
            sch.reverse_compute_at(consumer, fused)
        return sch.mod["main"].with_attr("tirx.is_scheduled", True)
    except Exception as e:  # noqa: BLE001 - fall back to the unscheduled loop, never fail the build
        log.debug("cpu matmul schedule skipped: %s", e)
        return None


def schedule_parallel_reduction(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """One reduction's output elements split over the threads, each reduced by a plain loop (a reduction too short
    to vectorise: the LoRA expand over the adapters' rank)."""
    from tvm.s_tir import Schedule

    sch = Schedule(func)
    try:
        block = _reduction_block(sch)
        if block is None:
            return None
        spatial = [iv.iter_type != _REDUCE for iv in sch.get(block).iter_vars]
        loops = sch.get_loops(block)
        sch.parallel(sch.fuse(*[lp for lp, s in zip(loops, spatial) if s]))
        return sch.mod["main"].with_attr("tirx.is_scheduled", True)
    except Exception as e:  # noqa: BLE001 - fall back to the unscheduled loop, never fail the build
        log.debug("cpu reduction schedule skipped: %s", e)
        return None


@tvm.transform.module_pass(opt_level=0, name="mlcc_cpu_matmul_schedule")
def ApplyCPUMatmulSchedule(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:  # noqa: N802 - pass naming
    updates = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc) or (func.attrs and func.attrs.get("tirx.is_scheduled")):
            continue
        # LoRA's gathered products (relax_models/lora.py): the matmul schedule where the reduction vectorises
        lora = "lora_" in gv.name_hint
        if "matmul" not in gv.name_hint and gv.name_hint != "main" and not lora:
            continue
        new = gemm_for(func) if not lora else None
        if new is None:
            new = schedule_matmul(func)
        if new is None and lora:
            new = schedule_parallel_reduction(func)
        if new is not None:
            updates[gv] = new
    for gv, f in updates.items():
        mod[gv] = f
    return mod
