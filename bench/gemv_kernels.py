"""Per-kernel bandwidth of the 8B decode GEMVs under different dlight rules (where issue 4's time goes).

    python bench/gemv_kernels.py build --out .dev/gemv      # here: one library per rule variant
    python3 bench/gemv_kernels.py run --libs .dev/gemv      # device: time each kernel, print GB/s

Each kernel is the fused dequantize+matmul of one Llama-3-8B projection at batch 1, built exactly as the model
pipeline builds it, then scheduled by the rule named in the variant.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


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

    variants = {"gemv": [dl.gpu.GEMV()], "lowbatch": [dl.gpu.LowBatchGEMV()], "matmul": [dl.gpu.Matmul()]}
    target = _target()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for quant in ("q4f16_1", "q0f16"):
        ks = kernels(quant)
        for vname, rules in variants.items():
            mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f, _ in ks})
            with target:
                mod = dl.ApplyDefaultSchedule(*rules, dl.gpu.Fallback())(mod)
            tvm.compile(mod, target).export_library(str(out / f"{quant}-{vname}.so"))
            print("built", quant, vname)
    meta = {}
    for quant in ("q4f16_1", "q0f16"):
        for name, _, nb in kernels(quant):
            n, k = SHAPES[name]
            args = ([[[1, 1, k], "float16"], [[n, k // 8], "uint32"], [[n, k // 32], "float16"]] if quant == "q4f16_1"
                    else [[[1, 1, k], "float16"], [[n, k], "float16"]])
            meta[f"{quant}/{name}"] = {"bytes": nb, "args": args + [[[1, 1, n], "float16"]]}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def cmd_run(a) -> None:
    import tvm

    from mlcc.runtime.model import _load_backend_runtimes, _register_cuda_jit

    _load_backend_runtimes("cuda")
    _register_cuda_jit("sm_90a")
    dev = tvm.cuda(0)
    libs = Path(a.libs)
    meta = json.loads((libs / "meta.json").read_text())
    rows = []
    for lib in sorted(libs.glob("*.so")):
        quant, variant = lib.stem.split("-")
        m = tvm.runtime.load_module(str(lib))
        for name in ("qkv", "o", "gate_up", "down", "lm_head"):
            spec = meta[f"{quant}/{name}"]
            args = [tvm.runtime.tensor(np.zeros(s, dtype=d) if d != "uint32" else
                                       np.random.randint(0, 2**31, size=s, dtype=np.int64).astype(np.uint32), dev)
                    for s, d in spec["args"]]
            try:
                t = m.time_evaluator(name, dev, number=50, repeat=3, min_repeat_ms=50)(*args).mean
                rows.append({"quant": quant, "rule": variant, "kernel": name, "us": t * 1e6,
                             "GB_s": spec["bytes"] / t / 1e9})
            except Exception as e:  # noqa: BLE001
                rows.append({"quant": quant, "rule": variant, "kernel": name, "error": str(e)[:200]})
            r = rows[-1]
            print(f"{quant:8} {variant:9} {name:8} " + (f"{r['us']:9.1f} us {r['GB_s']:7.0f} GB/s" if "us" in r
                                                        else r["error"]), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gemv_kernels.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--libs", required=True)
    r.add_argument("--out", required=True)
    a = p.parse_args()
    {"build": cmd_build, "run": cmd_run}[a.cmd](a)
    sys.exit(0)
