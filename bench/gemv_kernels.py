"""Per-kernel bandwidth of the 8B decode GEMVs under different dlight rules (where issue 4's time goes).

    python bench/gemv_kernels.py build --out .dev/gemv      # here: one library per rule variant
    python3 bench/gemv_kernels.py run --libs .dev/gemv      # device: time each kernel, print GB/s

Each kernel is the fused dequantize+matmul of one Llama-3-8B projection at batch 1, built exactly as the model
pipeline builds it, then scheduled by the rule named in the variant ("mlcc": the hand-written q4 kernel of
mlcc.schedules.cuda_gemv, which the model pipeline uses; "mlccpdl": the same with programmatic dependent launch,
as the model pipeline builds it on sm_90). Every kernel's output is checked against numpy
on random inputs before it is timed. Since session 7 each kernel runs on enough weight copies that none is still in
L2 when its turn comes back (`time_rotating`); the JSON files of sessions 1-5 timed one copy over and over, so their
projections under 50 MB (all q4 ones but gate_up and lm_head, fp16 o_proj) read partly from L2.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from cli import build_and_run

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


L2_DEFEAT_BYTES = 320 << 20  # weight copies per kernel: several times the H200's 50 MB L2


def cuda_device(arch: str = "sm_90a"):
    """The GPU, with what the libraries built here need to load on it: TVM's CUDA runtime, and mlcc's JIT for the
    kernels shipped as CUDA source (compiled for `arch`)."""
    import tvm

    from mlcc.runtime.model import _load_backend_runtimes, _register_cuda_jit

    _load_backend_runtimes("cuda")
    _register_cuda_jit(arch)
    return tvm.cuda(0)


def time_rotating(f, x, weight_sets, out, dev, calls: int = 600) -> float:
    """Seconds per call, each call on the next weight copy (so the weights come from DRAM, as in a model step). The
    calls are queued from Python (~3 us each): kernels shorter than that measure the launch path."""
    for ws in weight_sets:
        f(x, *ws, out)
    dev.sync()
    t = time.perf_counter()
    for i in range(calls):
        f(x, *weight_sets[i % len(weight_sets)], out)
    dev.sync()
    return (time.perf_counter() - t) / calls


def time_graph(f, x, weight_sets, out, dev, calls: int = 600) -> float:
    """Seconds per call as time_rotating, but the calls are captured once into a CUDA graph and replayed, so a
    kernel shorter than the ~3 us Python takes to queue a call is timed by itself (back to back, as in the model's
    graph). Through the CUDA runtime TVM loaded (TVM launches on tvm-ffi's env stream, which is set to a capturing
    stream here). Written after session 8's device time was spent: validate against time_rotating on the long
    kernels (gate_up, down, lm_head) before trusting it on the short ones."""
    import ctypes

    import tvm_ffi

    from mlcc.runtime.token_fetch import cuda_runtime

    cuda = cuda_runtime()
    if cuda is None:
        raise RuntimeError("the CUDA runtime is not reachable from Python")
    stream = dev.create_raw_stream()
    s = ctypes.c_void_p(stream)
    graph, exe, start, end = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    try:
        with tvm_ffi.use_raw_stream(dev, stream):
            for ws in weight_sets:  # loads the module and warms the copies outside the capture
                f(x, *ws, out)
            dev.sync(stream)
            cuda("cudaStreamBeginCapture", s, ctypes.c_int(2))  # cudaStreamCaptureModeRelaxed
            for i in range(calls):
                f(x, *weight_sets[i % len(weight_sets)], out)
            cuda("cudaStreamEndCapture", s, ctypes.byref(graph))
        cuda("cudaGraphInstantiate", ctypes.byref(exe), graph, ctypes.c_ulonglong(0))
        cuda("cudaEventCreate", ctypes.byref(start))
        cuda("cudaEventCreate", ctypes.byref(end))
        cuda("cudaGraphLaunch", exe, s)  # warm-up replay
        cuda("cudaEventRecord", start, s)
        cuda("cudaGraphLaunch", exe, s)
        cuda("cudaEventRecord", end, s)
        cuda("cudaEventSynchronize", end)
        ms = ctypes.c_float()
        cuda("cudaEventElapsedTime", ctypes.byref(ms), start, end)
        return ms.value / 1e3 / calls
    finally:
        for name, h in (("cudaEventDestroy", start), ("cudaEventDestroy", end), ("cudaGraphExecDestroy", exe),
                        ("cudaGraphDestroy", graph)):
            if h.value:
                cuda(name, h)
        dev.free_raw_stream(stream)


def _target():
    """The same CUDA target `mlcc compile --target cuda` uses (the preset, not a tag of its own)."""
    from mlcc.targets import get_target

    return get_target("cuda").tvm_target()


def kernels(quant: str):
    """(name, PrimFunc, bytes read) for each projection, from the real model pipeline before scheduling."""
    import tvm
    from tvm import relax

    from mlcc.compiler.quantize import GroupQuantLinear, get_quantization
    from tvm.relax.frontend import nn

    q = get_quantization(quant)
    out = []
    for name, (n, k) in SHAPES.items():
        class M(nn.Module):
            def __init__(self):
                self.proj = GroupQuantLinear(k, n, False, q) if q.kind == "group" else nn.Linear(k, n, bias=False)

            def forward(self, x):
                return self.proj(x)

        m = M()
        if q.kind == "none":
            m.to(q.model_dtype)
        mod, _ = m.export_tvm({"forward": {"x": nn.spec.Tensor([1, 1, k], q.model_dtype),
                                           "$": {"param_mode": "plain", "effect_mode": "none"}}})
        with _target():
            mod = tvm.transform.Sequential([relax.transform.FuseTransposeMatmul(), relax.transform.LegalizeOps(),
                                            relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(),
                                            relax.transform.FuseTIR()])(mod)
        (func,) = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
        nbytes = n * k // 2 + n * k // 32 * 2 if q.kind == "group" else n * k * 2
        out.append((name, func, nbytes + k * 2 + n * 2))
    return out


def cmd_build(a) -> None:
    import tvm
    from tvm.s_tir import dlight as dl

    from mlcc.schedules.cuda_pdl import tir_pipeline_for
    from mlcc.schedules.cuda_gemv import GemvShape, make_gemv
    from mlcc.targets.toolchains import toolchain_for

    variants = {"gemv": []}
    target = _target()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for quant in ("q4f16_1", "q0f16"):
        ks = kernels(quant)
        for vname, passes in variants.items():
            mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f, _ in ks})
            with target, toolchain_for("cuda"):
                mod = tvm.transform.Sequential(passes + [dl.ApplyDefaultSchedule(dl.gpu.GEMV(), dl.gpu.Fallback())])(mod)
                tvm.compile(mod, target).export_library(str(out / f"{quant}-{vname}.so"))
        if quant == "q4f16_1":
            # the hand-written kernel launched plainly, and with programmatic dependent launch (first weights load
            # before the wait; back-to-back launches of one kernel then overlap one's tail with the next's start)
            for vname, pdl in (("mlcc", False), ("mlccpdl", True)):
                mod = tvm.IRModule({name: make_gemv(GemvShape(*SHAPES[name], "none"), pdl=pdl)
                                    .with_attr("global_symbol", name) for name, _, _ in ks})
                with target, toolchain_for("cuda"):
                    tvm.compile(mod, target, tir_pipeline=tir_pipeline_for(target) if pdl else "default") \
                        .export_library(str(out / f"{quant}-{vname}.so"))
        print("built", quant)
    meta = {}
    for quant in ("q4f16_1", "q0f16"):
        for name, _, nb in kernels(quant):
            n, k = SHAPES[name]
            args = ([[[1, 1, k], "float16"], [[n, k // 8], "uint32"], [[n, k // 32], "float16"]] if quant == "q4f16_1"
                    else [[[1, 1, k], "float16"], [[n, k], "float16"]])
            meta[f"{quant}/{name}"] = {"bytes": nb, "args": args + [[[1, 1, n], "float16"]]}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def _inputs(specs, quant: str) -> list[np.ndarray]:
    """x ~ N(0, 1), random 4-bit codes, scales ~ 0.01: values like a real layer's, so errors are visible."""
    rng = np.random.default_rng(0)
    out = []
    for shape, dtype in specs[:-1]:
        if dtype == "uint32":
            out.append(rng.integers(0, 1 << 32, size=shape, dtype=np.uint32))
        elif len(out) == 0:
            out.append(rng.standard_normal(shape).astype(dtype))
        else:
            out.append((rng.standard_normal(shape) * (0.01 if quant == "q4f16_1" else 0.02)).astype(dtype))
    return out + [np.zeros(specs[-1][0], dtype=specs[-1][1])]


def _reference(host: list[np.ndarray], quant: str) -> np.ndarray:
    from mlcc.compiler.quant_schemes import get_quantization, group_dequantize

    x = host[0].astype(np.float32).reshape(-1)
    if quant == "q4f16_1":
        w = group_dequantize(host[1], host[2], get_quantization(quant))
    else:
        w = host[1].astype(np.float32)
    return w @ x


def cmd_run(a) -> None:
    import tvm

    dev = cuda_device()
    libs = Path(a.libs)
    meta = json.loads((libs / "meta.json").read_text())
    rows = []
    for lib in sorted(libs.glob("*.so")):
        quant, variant = lib.stem.split("-")
        m = tvm.runtime.load_module(str(lib))
        for name in ("qkv", "o", "gate_up", "down", "lm_head"):
            spec = meta[f"{quant}/{name}"]
            host = _inputs(spec["args"], quant)
            args = [tvm.runtime.tensor(h, dev) for h in host]
            copies = max(2, -(-L2_DEFEAT_BYTES // sum(h.nbytes for h in host[1:-1])))
            weight_sets = [args[1:-1]] + [[tvm.runtime.tensor(h, dev) for h in host[1:-1]] for _ in range(copies - 1)]
            try:
                m[name](*args)
                got = args[-1].numpy().astype(np.float32).reshape(-1)
                want = _reference(host, quant)
                rel = float(np.abs(got - want).max() / np.abs(want).max())
                ok = rel < 2e-2  # fp16 output and fp16 (dlight) or fp16-per-group (mlcc) partial sums
                t = min(time_rotating(m[name], args[0], weight_sets, args[-1], dev) for _ in range(3))
                rows.append({"quant": quant, "rule": variant, "kernel": name, "us": t * 1e6,
                             "GB_s": spec["bytes"] / t / 1e9, "max_rel_err": rel, "check_ok": ok})
            except Exception as e:  # noqa: BLE001
                rows.append({"quant": quant, "rule": variant, "kernel": name, "error": str(e)[:200]})
            r = rows[-1]
            print(f"{quant:8} {variant:9} {name:8} " + (f"{r['us']:9.1f} us {r['GB_s']:7.0f} GB/s  err {r['max_rel_err']:.1e} {'ok' if r['check_ok'] else 'WRONG'}" if "us" in r
                                                        else r["error"]), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gemv_kernels.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    build_and_run(cmd_build, cmd_run)
    sys.exit(0)
