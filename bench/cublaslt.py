"""cuBLASLt through mlcc's shim (mlcc.native.cublaslt_shim, CompileOptions.vendor_gemm), on the GPU, in one run:

    gemm:  the shim against torch (`a @ w.T`, cuBLAS) and a float32 reference (plain, + bias, + residual, bf16, a
           (m, 1, K) activation), then both timed on the Llama-3-8B projections at 16..8,192 tokens.
    build: shape-only Llama-3-8B libraries (q0f16 with vendor_gemm on and off, the q0f32 reference), in parallel.
    model: logits of each q0f16 build against the float32 build (a 512-token prefill, a ragged two-sequence
           prefill, a decode step of 8 sequences), then prefill at 512 / 2,048 / 8,192 tokens and batched decode of
           16 and 64 sequences, for the builds whose logits pass.

    # device: carry .gpu; `source .gpu/setup.sh` first
    python3 bench/cublaslt.py gemm --out $OUT
    python3 bench/cublaslt.py build --dir /tmp/l8 && python3 bench/cublaslt.py model --dir /tmp/l8 --out $OUT

Rows: {"bench": "gemm", "device", "m", "n", "k", "shim_tflops", "torch_tflops"} and {"bench": "prefill" |
"batched_decode", "device", "model", "quant", "vendor_gemm", "prompt_tokens" | "batch", "tok_per_s"}.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import cli, write_json

# (N, K) of Llama-3-8B's projections: qkv, o, gate_up, down
SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
TOKENS = (16, 64, 128, 256, 512, 2048, 8192)
BUILDS = {"on": "vendor_gemm=1", "off": "vendor_gemm=0"}


def device_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, check=False).stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        return "unknown"


def _shim():
    import tvm_ffi

    from mlcc.cache import cache_root
    from mlcc.native import cublaslt_shim

    cublaslt_shim.load(cache_root())
    cublaslt_shim.prepare_device(0)
    return {name: tvm_ffi.get_global_func(f) for name, f in cublaslt_shim.MATMUL.items()}


def _check_gemm(fns, torch) -> list[dict]:
    """Relative max errors against float32 (and torch's cuBLAS beside them)."""
    rows = []
    ws = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype, x_shape, n, epi in ((torch.float16, (300, 4096), 6144, "none"), (torch.float16, (1, 77, 512), 256, "bias"),
                                   (torch.float16, (33, 1, 1024), 2048, "add"), (torch.bfloat16, (129, 4096), 4096, "none"),
                                   (torch.float16, (8192, 4096), 4096, "add")):
        k = x_shape[-1]
        x = torch.randn(x_shape, generator=g, device="cuda").to(dtype)
        w = (torch.randn((n, k), generator=g, device="cuda") / k ** 0.5).to(dtype)
        extra = {"none": None, "bias": torch.randn((n,), generator=g, device="cuda").to(dtype),
                 "add": torch.randn(x_shape[:-1] + (n,), generator=g, device="cuda").to(dtype)}[epi]
        out = torch.empty(x_shape[:-1] + (n,), dtype=dtype, device="cuda")
        args = [x, w] + ([extra] if extra is not None else []) + [ws, out]
        fns[epi](*args)
        torch.cuda.synchronize()
        ref = x.float() @ w.float().T + (extra.float() if extra is not None else 0)
        tor = (x @ w.T + (extra if extra is not None else 0)).float()
        scale = ref.abs().max().item()
        row = {"bench": "gemm_check", "dtype": str(dtype), "x": list(x_shape), "n": n, "epilogue": epi,
               "shim_vs_f32": (out.float() - ref).abs().max().item() / scale,
               "torch_vs_f32": (tor - ref).abs().max().item() / scale}
        row["ok"] = row["shim_vs_f32"] <= 2 * row["torch_vs_f32"] + 1e-3
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _time(fn, reps: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        stop.synchronize()
        best = min(best, start.elapsed_time(stop) / reps)
    return best  # ms


def cmd_gemm(a) -> None:
    import torch

    fns = _shim()
    dev = device_name()
    rows = _check_gemm(fns, torch)
    if not all(r["ok"] for r in rows):
        print("the shim's results differ: not timed", flush=True)
        write_json(a.out, "cublaslt_gemm.json", rows)
        return
    ws = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    for n, k in SHAPES:
        w = torch.randn((n, k), device="cuda", dtype=torch.float16) / k ** 0.5
        for m in TOKENS:
            x = torch.randn((m, k), device="cuda", dtype=torch.float16)
            out = torch.empty((m, n), device="cuda", dtype=torch.float16)
            reps = max(5, min(200, int(2e11 / (2 * m * n * k))))
            shim = _time(lambda x=x, w=w, out=out: fns["none"](x, w, ws, out), reps)
            tor = _time(lambda x=x, w=w, out=out: torch.matmul(x, w.T, out=out), reps)
            flop = 2 * m * n * k
            rows.append({"bench": "gemm", "device": dev, "dtype": "float16", "m": m, "n": n, "k": k,
                         "shim_ms": round(shim, 4), "torch_ms": round(tor, 4),
                         "shim_tflops": round(flop / shim / 1e9, 1), "torch_tflops": round(flop / tor / 1e9, 1)})
            print(json.dumps(rows[-1]), flush=True)
    write_json(a.out, "cublaslt_gemm.json", rows)


def cmd_build(a) -> None:
    """The three libraries in parallel processes (each compile is mostly single-threaded)."""
    procs = []
    for label, quant, option in (("on", "q0f16", BUILDS["on"]), ("off", "q0f16", BUILDS["off"]),
                                 ("ref", "q0f32", BUILDS["off"])):
        code = ("import sys; from mlcc.relax_models.presets import PRESETS; from mlcc.options import CompileOptions;"
                "from mlcc.compiler.build import compile_shape_only; p = PRESETS['llama3-8b'];"
                f"print('{label}', compile_shape_only(p.family, p.hf_config(), 'cuda', '{quant}', "
                f"'{a.dir}/{label}', options=CompileOptions.parse(['{option}'])), flush=True)")
        procs.append(subprocess.Popen([sys.executable, "-c", code]))
    if any(p.wait() for p in procs):
        raise SystemExit("a build failed")


PROMPTS = (512, 2048, 8192)
BATCHES = (16, 64)
CONTEXT, STEPS = 128, 32


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [1 + (i * 7 + salt) % 30000 for i in range(n)]


def _load(folder: Path):
    from mlcc.runtime.device.model import LoadedModel

    m = LoadedModel(folder, weights="random")
    m.create_kv_cache(max(BATCHES), max(PROMPTS) + max(BATCHES) * (CONTEXT + STEPS + 8) + 64, max(PROMPTS))
    return m


def _logits(m) -> dict[str, np.ndarray]:
    out = {}
    for name, lists in (("single", [_prompt(512)]), ("ragged", [_prompt(300, 1), _prompt(77, 2)])):
        ids = list(range(len(lists)))
        for s in ids:
            m.add_sequence(s)
        out[name] = m.prefill(ids, lists).numpy().astype(np.float32)
        for s in ids:
            m.remove_sequence(s)
    seqs = list(range(8))
    for s in seqs:
        m.add_sequence(s)
    m.prefill(seqs, [_prompt(40, s) for s in seqs]).numpy()
    out["batched_decode"] = m.decode(seqs, [5 + s for s in seqs]).numpy().astype(np.float32)
    for s in seqs:
        m.remove_sequence(s)
    return out


def _time_prefill(m, n: int) -> float:
    best = float("inf")
    for r in range(4):
        m.add_sequence(0)
        m.dev.sync()
        t = time.perf_counter()
        m.prefill([0], [_prompt(n)]).numpy()
        if r:
            best = min(best, time.perf_counter() - t)
        m.remove_sequence(0)
    return n / best


def _time_batched_decode(m, batch: int) -> float:
    seqs = list(range(batch))
    for s in seqs:
        m.add_sequence(s)
    toks = [int(t) for t in m.argmax(m.prefill(seqs, [_prompt(CONTEXT, s) for s in seqs])).numpy()]
    for i in range(4 + STEPS):
        if i == 4:
            m.dev.sync()
            t = time.perf_counter()
        toks = [int(t) for t in m.argmax(m.decode(seqs, toks)).numpy()]
    dt = time.perf_counter() - t
    for s in seqs:
        m.remove_sequence(s)
    return batch * STEPS / dt


def cmd_model(a) -> None:
    import gc

    dev, rows = device_name(), []
    d = Path(a.dir)
    ref = _load(d / "ref")
    exact = _logits(ref)
    del ref
    gc.collect()
    for label in ("off", "on"):
        m = _load(d / label)
        got = _logits(m)
        errs = {k: float(np.abs(got[k] - exact[k]).max() / np.abs(exact[k]).max()) for k in got}
        argmax = {k: float((got[k].argmax(-1) == exact[k].argmax(-1)).mean()) for k in got}
        rows.append({"bench": "check", "device": dev, "vendor_gemm": label, "rel_err_vs_f32": errs,
                     "argmax_match_f32": argmax})
        print(json.dumps(rows[-1]), flush=True)
        base = {"device": dev, "model": "llama3-8b", "quant": "q0f16", "vendor_gemm": label == "on"}
        for n in PROMPTS:
            rows.append({"bench": "prefill", **base, "prompt_tokens": n, "tok_per_s": round(_time_prefill(m, n), 1)})
            print(json.dumps(rows[-1]), flush=True)
        for b in BATCHES:
            rows.append({"bench": "batched_decode", **base, "batch": b,
                         "tok_per_s": round(_time_batched_decode(m, b), 1)})
            print(json.dumps(rows[-1]), flush=True)
        write_json(a.out, "cublaslt_model.json", rows)
        del m
        gc.collect()
    write_json(a.out, "cublaslt_model.json", rows)


def _out(p) -> None:
    p.add_argument("--out", required=True)


def _dir(p) -> None:
    p.add_argument("--dir", required=True)


def _dir_out(p) -> None:
    _dir(p)
    _out(p)


if __name__ == "__main__":
    cli(__doc__, {"gemm": (cmd_gemm, _out), "build": (cmd_build, _dir), "model": (cmd_model, _dir_out)})
