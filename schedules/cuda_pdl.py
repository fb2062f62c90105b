"""Programmatic dependent launch (PDL) for every CUDA kernel of a library (sm_90+, CompileOptions.pdl).

At batch-1 decode a Llama-3-8B step is ~330 short kernels; each one normally starts only after its predecessor has
fully drained and the launch has gone through the front end again, so the GPU idles ~1 µs between kernels and every
kernel's first DRAM reads start cold. With PDL a kernel may be launched while its predecessor is still running: its
blocks become resident, do whatever does not depend on the predecessor (the decode GEMVs load their first weights),
then `griddepcontrol.wait` blocks until the predecessor has finished and its writes are visible. Each kernel also
executes `griddepcontrol.launch_dependents` right after that wait, so at most one kernel waits ahead of the running
one and a waiting kernel never holds slots its predecessor still needs.

Correctness does not depend on the predecessor: `griddepcontrol.wait` is a no-op when a kernel was launched without
the attribute, and a kernel that was launched with it waits for all its prerequisite grids (CUDA graphs keep the
programmatic edges when they capture such launches). TVM's CUDA runtime launches with the attribute when the
kernel's launch tags contain `tirx.use_programtic_dependent_launch` (sic), which the device pass below adds. The
device functions WAIT and LAUNCH_DEPENDENTS are in cuda/pdl.cuh.
"""

from __future__ import annotations

import tvm

WAIT = "mlcc_pdl_wait"
LAUNCH_DEPENDENTS = "mlcc_pdl_launch_dependents"
PDL_TAG = "tirx.use_programtic_dependent_launch"
PIPELINE_NAME = "mlcc_cuda_pdl"


def supported(target: tvm.target.Target) -> bool:
    """griddepcontrol exists from sm_90 on."""
    return sm_version(target) >= 90


def enabled(target: tvm.target.Target, options) -> bool:
    """Whether a build's kernels use PDL: asked for (options.pdl) and the GPU has it."""
    return bool(options.pdl) and supported(target)


def sm_version(target: tvm.target.Target) -> int:
    """90 for sm_90a; 0 for anything that is not a CUDA target with an arch."""
    arch = str(target.attrs.get("arch", "")) if target.kind.name == "cuda" else ""
    digits = "".join(c for c in arch.removeprefix("sm_") if c.isdigit())
    return int(digits) if digits else 0


def _calls(func: tvm.tirx.PrimFunc, name: str) -> bool:
    # (this TVM exposes no TIR statement visitor to Python; the printed body names every extern it calls)
    return f'"{name}"' in str(func.body)


@tvm.transform.module_pass(opt_level=0, name="mlcc_cuda_pdl_kernels")
def pdl_kernels_pass(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
    """Device kernels (after SplitHostDevice): wait for the predecessor first and release the successor right
    after (a kernel that places its own wait places the release too), and ask the runtime for a PDL launch."""
    out = {}
    for gv, func in mod.functions.items():
        launch = func.attrs.get("tirx.kernel_launch_params") if func.attrs is not None else None
        tags = [str(t) for t in launch] if launch is not None else None
        if not isinstance(func, tvm.tirx.PrimFunc) or tags is None or PDL_TAG in tags:
            out[gv] = func
            continue
        if not _calls(func, WAIT):
            func = func.with_body(tvm.tirx.SeqStmt([
                tvm.tirx.Evaluate(tvm.tirx.call_extern("void", WAIT)),
                tvm.tirx.Evaluate(tvm.tirx.call_extern("void", LAUNCH_DEPENDENTS)), func.body]))
        # the runtime requires the dynamic-shared-memory tag to stay last
        at = len(tags) - 1 if tags and tags[-1] == "tirx.use_dyn_shared_memory" else len(tags)
        out[gv] = func.with_attr("tirx.kernel_launch_params", tags[:at] + [PDL_TAG] + tags[at:])
    return tvm.IRModule(out, attrs=mod.attrs)


def _pdl_pipeline(**kwargs):
    from tvm.tirx.compilation_pipeline import get_tir_pipeline

    pipeline, finalize_host, finalize_device = get_tir_pipeline("s_tir", **kwargs)
    return pipeline, finalize_host, lambda: tvm.transform.Sequential([pdl_kernels_pass, finalize_device()])


def tir_pipeline_for(target: tvm.target.Target, options) -> str:
    """The TIR pipeline name to hand tvm.compile: PDL kernels where asked for and the GPU has them, TVM's default
    elsewhere."""
    if not enabled(target, options):
        return "default"
    from tvm.tirx.compilation_pipeline import PIPELINE_MAP

    PIPELINE_MAP.setdefault(PIPELINE_NAME, _pdl_pipeline)
    return PIPELINE_NAME
