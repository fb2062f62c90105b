"""Kernel schedules: the default rules per target (dlight). Tuning records plug in here later."""

from __future__ import annotations

import tvm


def default_schedule_passes(target: tvm.target.Target) -> list[tvm.transform.Pass]:
    from tvm.s_tir import dlight as dl

    if "gpu" in target.keys:
        return [dl.ApplyDefaultSchedule(
            dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback())]
    # dlight's cpu rules (GEMV, Reduction) made LLVM codegen of a 2-layer model take 118 s instead of 1.3 s
    # (measured here), so the CPU gets our own small matmul rule.
    from .cpu import ApplyCPUMatmulSchedule

    return [ApplyCPUMatmulSchedule]
