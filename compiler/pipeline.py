"""The Relax pass pipeline: TVM's per-target stages with mlcc's fusions and schedules in between."""

from __future__ import annotations

import tvm
from tvm import relax

from mlcc.options import CompileOptions
from mlcc.schedules import default_schedule_passes, handwritten_kernel_passes

from .graph_decode import rewrite_cuda_graph_pass


def fusion_passes(target: tvm.target.Target) -> list[tvm.transform.Pass]:
    """Up to the fused, still unscheduled kernels."""
    from tvm.relax import pipeline as P

    return (P.library_dispatch_passes(target)
            # matmul(x, permute_dims(w)) must become one NT matmul before legalize, else decode GEMVs read W
            # through a transpose and run ~20x slower on GPUs.
            + [relax.transform.FuseTransposeMatmul(),
               relax.transform.LegalizeOps(),
               relax.transform.AnnotateTIROpPattern(),
               relax.transform.FoldConstant(),
               relax.transform.FuseOps(),
               relax.transform.FuseTIR(),
               relax.transform.DeadCodeElimination()])


def gemv_fusion_passes(target: tvm.target.Target, options: CompileOptions) -> list[tvm.transform.Pass]:
    """CUDA: RMSNorm and SwiGLU folded into the decode GEMV kernels (compiler/gemv_fusion.py), where asked for."""
    if target.kind.name != "cuda" or not (options.decode_gemv and options.fuse_decode_gemv):
        return []
    from mlcc.schedules.cuda_pdl import enabled as pdl_enabled

    from .gemv_fusion import fused_decode_gemv_pass

    return [fused_decode_gemv_pass(pdl=pdl_enabled(target, options))]


def vendor_gemm_passes(target: tvm.target.Target, options: CompileOptions) -> list[tvm.transform.Pass]:
    """CUDA: many-token float16/bfloat16 projections on cuBLASLt (compiler/vendor_gemm.py), where asked for and the
    shim builds here; it keeps each projection as it was for few tokens, for the passes after it."""
    if target.kind.name != "cuda" or not options.vendor_gemm:
        return []
    from mlcc.cache import cache_root
    from mlcc.native import cublaslt_shim

    if not cublaslt_shim.available(cache_root()):
        return []
    from mlcc.schedules.cuda_pdl import sm_version

    from .vendor_gemm import vendor_gemm_pass

    # (cuBLASLt's outer-vector FP8 scales: sm_90+)
    return [vendor_gemm_pass(q4_min_tokens=options.vendor_gemm_q4_tokens, fp8=sm_version(target) >= 90)]


def kernel_passes(target: tvm.target.Target, options: CompileOptions) -> list[tvm.transform.Pass]:
    """The fused kernels with mlcc's hand-written ones already in place: what the default rules and tuning records
    schedule, and what tuning extracts its tasks from."""
    return (fusion_passes(target) + vendor_gemm_passes(target, options) + gemv_fusion_passes(target, options)
            + handwritten_kernel_passes(target, options))


def relax_passes(target: tvm.target.Target, tuning_db: str | None, options: CompileOptions
                 ) -> list[tvm.transform.Pass]:
    """Every Relax pass of a build, in order (run under `target`)."""
    return (
        kernel_passes(target, options)
        # tuned records first (only faster-than-default ones are ever stored); the rules skip what they scheduled
        + ([relax.transform.MetaScheduleApplyDatabase(str(tuning_db))] if tuning_db else [])
        + default_schedule_passes(target)
        + [relax.transform.RewriteDataflowReshape(),
           relax.transform.ToNonDataflow(),
           relax.transform.RemovePurityChecking(),
           relax.transform.CallTIRRewrite(),
           relax.transform.StaticPlanBlockMemory()]
        # decode_graph (where compile_library added it) becomes one CUDA graph per step
        + ([rewrite_cuda_graph_pass()] if target.kind.name == "cuda" else [])
        + [relax.transform.LowerAllocTensor(),
           relax.transform.KillAfterLastUse(),
           relax.transform.LowerRuntimeBuiltin(),
           relax.transform.ComputePrimValue(),
           relax.transform.VMShapeLower(),
           relax.transform.AttachGlobalSymbol()]
    )


def build_pipeline(target: tvm.target.Target, tuning_db: str | None, options: CompileOptions) -> tvm.transform.Pass:
    @tvm.transform.module_pass(opt_level=0, name="mlcc_pipeline")
    def _pipeline(mod: tvm.ir.IRModule, _ctx: tvm.transform.PassContext) -> tvm.ir.IRModule:
        with target:
            return tvm.transform.Sequential(relax_passes(target, tuning_db, options))(mod)

    return _pipeline
