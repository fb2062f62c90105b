"""Kernel schedules: the default rules per target (dlight). Tuning records plug in here later."""

from __future__ import annotations

import tvm


def handwritten_kernel_passes(target: tvm.target.Target, options) -> list[tvm.transform.Pass]:
    """Kernels we write ourselves where the generic rules fall short; they run before tuning records and dlight."""
    if target.kind.name == "cuda":
        from .cuda_decode_attention import split_decode_attention_pass
        from .cuda_prefill_attention import wide_prefill_attention_pass
        from .cuda_gemv import decode_gemv_pass, fused_decode_gemv_pass

        # the SwiGLU/RMSNorm fusions first: they need the projections before the plain GEMV kernel replaces them
        return [fused_decode_gemv_pass, decode_gemv_pass, split_decode_attention_pass, wide_prefill_attention_pass]
    return []


def default_schedule_passes(target: tvm.target.Target) -> list[tvm.transform.Pass]:
    from tvm.s_tir import dlight as dl

    if target.kind.name == "metal":
        return [_without_metal_simdgroup(dl.ApplyDefaultSchedule(
            dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()))]
    if target.kind.name == "cuda":
        from .tensor_intrinsics import preload

        preload()  # dlight's tensor-core Matmul rule imports them on first use, which takes TVM ~40 s
    if "gpu" in target.keys:
        return [dl.ApplyDefaultSchedule(
            dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback())]
    # dlight's cpu rules (GEMV, Reduction) made LLVM codegen of a 2-layer model take 118 s instead of 1.3 s
    # (measured here), so the CPU gets our own small matmul rule.
    from .cpu import ApplyCPUMatmulSchedule

    return [ApplyCPUMatmulSchedule]


def default_schedule_for(target: tvm.target.Target):
    """The default schedule of one PrimFunc (what a tuned record must beat)."""
    def apply(func):
        mod = tvm.IRModule({"main": func})
        with target:
            mod = tvm.transform.Sequential(default_schedule_passes(target))(mod)
        return mod["main"]

    return apply


def _without_metal_simdgroup(inner: tvm.transform.Pass) -> tvm.transform.Pass:
    """dlight's Matmul sends Metal to its simdgroup rule, which segfaults (a native crash, past its own try/except)
    on dynamic-batch matmuls in TVM 0.27. Run the rule set with that branch disabled so Matmul uses its generic
    tiled schedule instead."""
    import tvm.s_tir.dlight.gpu.matmul as dlm

    @tvm.transform.module_pass(opt_level=0, name="mlcc_metal_schedule")
    def _pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        original = dlm.MetalMatmul.apply
        dlm.MetalMatmul.apply = lambda self, *a, **k: None
        try:
            return inner(mod)
        finally:
            dlm.MetalMatmul.apply = original

    return _pass
