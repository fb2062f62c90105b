"""Kernel schedules: the default rules per target (dlight). Tuning records plug in here later."""

from __future__ import annotations

import tvm

from mlcc.options import CompileOptions
from mlcc.tvm_compat import import_tensor_intrinsics, without_metal_simdgroup


def handwritten_kernel_passes(target: tvm.target.Target, options: CompileOptions) -> list[tvm.transform.Pass]:
    """Kernels we write ourselves where the generic rules fall short, those `options` ask for; they run before
    tuning records and dlight (and after the compiler's GEMV fusion, compiler/gemv_fusion.py, which needs the
    projections before the plain GEMV kernel replaces them)."""
    if target.kind.name != "cuda":
        return []
    from .cuda_decode_attention import split_decode_attention_pass
    from .cuda_gemv import decode_gemv_pass
    from .cuda_kv_append import kv_append_pass
    from .cuda_pdl import enabled as pdl_enabled
    from .cuda_pdl import sm_version
    from .cuda_prefill_attention import wide_prefill_attention_pass

    passes = []
    if options.decode_gemv:
        from .cuda_moe_gemv import moe_expert_gemv_pass

        passes.append(decode_gemv_pass(pdl=pdl_enabled(target, options)))
        passes.append(moe_expert_gemv_pass())
    if options.split_decode_attention:
        passes.append(split_decode_attention_pass(options.decode_attention_splits, options.decode_attention_tokens))
    if options.wide_prefill_attention:
        passes.append(wide_prefill_attention_pass())
    if options.few_query_attention:  # (after the wide rebuild: it keeps TVM's kernel for many rows as it is then)
        from .cuda_few_query_attention import few_query_prefill_pass

        passes.append(few_query_prefill_pass())
    sm = sm_version(target)
    if options.flash_prefill_attention and sm >= 80:  # (after the wide rebuild)
        from .cuda_flash_prefill import flash_prefill_attention_pass

        passes.append(flash_prefill_attention_pass())
    if options.few_token_gemv:  # (before the GEMM pass, which then takes the many-token projections it keeps)
        from .cuda_few_token_gemv import few_token_gemv_pass

        passes.append(few_token_gemv_pass())
    if options.prefill_gemm and sm >= 80:  # mma.sync.m16n8k16, cp.async: sm_80+
        from .cuda_gemm_tir import prefill_gemm_pass

        passes.append(prefill_gemm_pass(sm))
    passes.append(kv_append_pass())   # (no option: the same element moves as TVM's kernel, one block a token)
    return passes


def default_schedule_passes(target: tvm.target.Target) -> list[tvm.transform.Pass]:
    from tvm.s_tir import dlight as dl

    if target.kind.name == "metal":
        return [without_metal_simdgroup(dl.ApplyDefaultSchedule(
            dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()))]
    if target.kind.name == "cuda":
        import_tensor_intrinsics()  # dlight's tensor-core Matmul rule imports them on first use: ~40 s in TVM's way
    if "gpu" in target.keys:
        return [dl.ApplyDefaultSchedule(
            dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback())]
    # dlight's cpu rules (GEMV, Reduction) made LLVM codegen of a 2-layer model take 118 s instead of 1.3 s
    # (measured here), so the CPU gets our own small matmul rule, and 8-bit codes a GEMV that reads them as bytes.
    from .cpu import ApplyCPUMatmulSchedule
    from .cpu_gemv import int8_gemv_pass

    return [int8_gemv_pass, ApplyCPUMatmulSchedule]


def default_schedule_for(target: tvm.target.Target):
    """The default schedule of one PrimFunc (what a tuned record must beat)."""
    def apply(func):
        mod = tvm.IRModule({"main": func})
        with target:
            mod = tvm.transform.Sequential(default_schedule_passes(target))(mod)
        return mod["main"]

    return apply
