"""mlcc's WebGPU build on a real GPU, run by the web engine in Node.js through Dawn's Vulkan backend (npm `webgpu`),
against the CUDA build of the same model on the same machine: SmolLM2-135M and the Qwen2.5-0.5B shape, q4f16_1 and
q4f32_1, seeded random weights.

    python bench/vulkan_bench.py build --out .dev/vkbench      # libraries (webgpu, cuda, llvm), the CPU build's
                                                               # answers, the random weights, a site (mlcc web);
                                                               # needs emscripten and npm, as `mlcc web` does
    python bench/vulkan_bench.py run --build .dev/vkbench --out OUT            # the CUDA machine: all of it
    python bench/vulkan_bench.py run --build .dev/vkbench --out OUT --short    # a CPU Vulkan (lavapipe,
                                                               # SwiftShader): SmolLM2 only, a few tokens, no CUDA

run: Dawn's adapter first (bench/vulkan_bench.mjs --probe; where it finds none, the Vulkan loader's own account),
then the CUDA builds (`cuda`), then each WebGPU build in a node process of its own (a crash or hang costs one
build; the 0.5B shape first, its ratio being the goal), the report after each. Limits: --cuda-timeout, --web-timeout
(one web build), --web-deadline (no web build starts after it); --builds picks builds; the env vars VK_DECODE,
VK_PREFILL, VK_PREFILL_REPEATS, VK_PROFILE_TOKENS, VK_VARIANTS shorten the node side's job. Results:
OUT/vulkan_webgpu.json (rows: target, device, tok_per_s, cuda_tok_per_s, checks, per-token dispatch counts, shader
time), the raw outputs under OUT/raw, the table on stdout. The steps run alone too:

    python bench/vulkan_bench.py jobs --out DIR       # the job files and the site again from DIR's libraries
    python bench/vulkan_bench.py weights MODEL_DIR    # the same random weights written again (a folder copied
                                                      # without them), checked against build's sha256
    python bench/vulkan_bench.py cuda --libs DIR/cuda --expected DIR/expected.json --out OUT
    node bench/vulkan_bench.mjs DIR/site BUILD DIR/job-MODEL.json --backend vulkan > OUT/web-BUILD.json
    python bench/vulkan_bench.py report --expected E --cuda C --web W... --out OUT   # rows + table

Weights are seeded random values (runtime.device.model's weights="random"): the webgpu, cuda and llvm builds of one
model and quantization take the same parameter list, so every build runs the same model. A shape-only build has no
tokenizer, so prompts are token ids, and "greedy text identical" is checked as identical greedy ids (random weights
make greedy decoding repeat a few tokens, so the numeric check is the teacher-forced logits: the CPU build's
argmax and values at sampled vocabulary indices after a prompt and after each of 8 forced tokens).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import build_info, cli, presets, write_json

MODELS = ("smollm2-135m", "qwen2.5-0.5b")
QUANTS = ("q4f16_1", "q4f32_1")
PROMPT = [(37 * i) % 40000 + 10 for i in range(128)]   # ids below every checked vocabulary (SmolLM2: 49152)
GREEDY_CHECKED = 64      # greedy ids compared with the CPU build (of `decode`)
DECODE = 256             # timed greedy steps
PREFILL = [1 + i % 1000 for i in range(512)]
CHECK_PROMPT = [7, 1, 99, 3000, 42, 5, 123, 8] + [(37 * i) % 40000 + 10 for i in range(250)]
CHECK_FORCED = [11, 2024, 5, 777, 31000, 9, 400, 16000]
N_SAMPLED = 2048
# host-side variants of the WebGPU runtime's dispatch path, timed in the same process (bench/vulkan_bench.mjs)
VARIANTS = ("no_bind_group_cache", "one_pass")
SHARD_BYTES = 64 << 20
# a minimal valid tokenizer.json: the web engine loads one, and shape-only builds are driven by token ids
TOKENIZER_STUB = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
                  "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
                  "model": {"type": "WordLevel", "vocab": {"<unk>": 0}, "unk_token": "<unk>"}}


def build_id(model: str, quant: str) -> str:
    return f"{model}-{quant}"


def job(decode: int = DECODE, prefill: int = len(PREFILL), vocab: int = 49152, profile_tokens: int = 16) -> dict:
    """What the Node.js side runs (bench/vulkan_bench.mjs), the same for every model."""
    idx = np.random.default_rng(3).choice(vocab, N_SAMPLED, replace=False)
    return {"prompt": PROMPT, "decode": decode, "prefill": PREFILL[:prefill], "prefill_repeats": 3,
            "check_prompt": CHECK_PROMPT, "check_forced": CHECK_FORCED, "sample_idx": sorted(int(i) for i in idx),
            "profile_tokens": profile_tokens, "variants": list(VARIANTS)}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def write_random_weights(model_dir: Path, seed: int = 0) -> list[str]:
    """tensor-cache.json + shards of the seeded random weights that LoadedModel(weights="random") draws, in the
    parameter order of mlcc-config.json; a stub tokenizer.json. Returns the shards' sha256."""
    from mlcc.runtime.device.model import _random_param

    cfg = json.loads((model_dir / "mlcc-config.json").read_text())
    rng = np.random.default_rng(seed)
    shards, cur, off = [], None, 0

    def flush():
        nonlocal cur, off
        if cur is not None:
            cur["file"].close()
            del cur["file"]
            cur["nbytes"] = off
            shards.append(cur)
        cur, off = None, 0

    for p in cfg["params"]:
        a = np.ascontiguousarray(_random_param(p, rng))
        if cur is None or off + a.nbytes > SHARD_BYTES:
            flush()
            name = f"params_shard_{len(shards)}.bin"
            cur = {"dataPath": name, "format": "raw-shard", "records": [], "file": open(model_dir / name, "wb")}
        cur["records"].append({"name": p["name"], "shape": list(a.shape), "dtype": p["dtype"], "format": "raw",
                               "nbytes": a.nbytes, "byteOffset": off})
        cur["file"].write(a.tobytes())
        off += a.nbytes
    flush()
    for s in shards:
        s["sha256"] = _sha256(model_dir / s["dataPath"])
    cache = {"metadata": {"ParamSize": len(cfg["params"]), "ParamBytes": sum(s["nbytes"] for s in shards)},
             "records": [{k: s[k] for k in ("dataPath", "format", "nbytes", "sha256", "records")} for s in shards]}
    (model_dir / "tensor-cache.json").write_text(json.dumps(cache, indent=1))
    if not (model_dir / "tokenizer.json").exists():
        (model_dir / "tokenizer.json").write_text(json.dumps(TOKENIZER_STUB))
    return [s["sha256"] for s in shards]


def cmd_weights(a) -> None:
    """Write the random weights into each MODEL_DIR; where a tensor-cache.json was there (the site `build` made),
    its sha256 must come out the same, else this machine's numpy draws other values and the CPU check is void."""
    for d in map(Path, a.model_dirs):
        t = time.perf_counter()
        old = d / "tensor-cache.json"
        want = [s.get("sha256") for s in json.loads(old.read_text())["records"]] if old.exists() else None
        got = write_random_weights(d, a.seed)
        same = want is None or want == got
        print(f"weights: {d.name}: {len(got)} shard(s) in {time.perf_counter() - t:.1f}s"
              + ("" if want is None else f", same as build's: {same}"), flush=True)
        if not same:
            (d / "WEIGHTS_DIFFER").write_text("numpy here drew other random weights than where `build` ran\n")


def cpu_reference(d: Path, vocab_idx: list[int]) -> dict:
    """The llvm build's answers: teacher-forced check rows and greedy ids (the same loop as the other builds)."""
    from mlcc.runtime.device.model import LoadedModel

    m = LoadedModel(d, weights="random")
    check, ids = measure_check(m, vocab_idx), greedy(m, GREEDY_CHECKED)[0]
    return {"check": check, "greedy_ids": ids}


def measure_check(m, vocab_idx: list[int]) -> dict:
    m.create_kv_cache(1, 1024, 512)
    m.add_sequence(0)
    rows = [m.prefill([0], [CHECK_PROMPT]).numpy().reshape(-1)]
    for f in CHECK_FORCED:
        rows.append(m.decode([0], [f]).numpy().reshape(-1))
    m.remove_sequence(0)
    r = np.stack(rows).astype(np.float32)
    return {"argmax": r.argmax(-1).tolist(), "max_abs": np.abs(r).max(-1).tolist(),
            "sampled": r[:, vocab_idx].tolist(), "finite": bool(np.isfinite(r).all())}


def greedy(m, steps: int, pipelined: bool = False, fetcher=None) -> tuple[list[int], float, float]:
    """PROMPT, then `steps` - 1 greedy decode steps, every id read back: (ids, prefill s, decode tok/s)."""
    from decode import decode_steps

    m.create_kv_cache(1, 4096, 2048)
    m.add_sequence(0)
    t = time.perf_counter()
    first = int(m.argmax(m.prefill([0], [PROMPT])).numpy()[0])
    prefill_s = time.perf_counter() - t
    ids, s = decode_steps(m, first, steps - 1, pipelined, fetcher)
    m.remove_sequence(0)
    return [first] + ids, prefill_s, (steps - 1) / s


def cmd_build(a) -> None:
    from mlcc.compiler.build import compile_shape_only
    from mlcc.web.site import build_site

    out = Path(a.out)
    pre = presets()
    models = [m for m in MODELS if not a.models or m in a.models.split(",")]
    want = {"build": build_info(), "prompt": PROMPT, "decode": DECODE, "greedy_checked": GREEDY_CHECKED,
            "prefill": len(PREFILL), "check_prompt": CHECK_PROMPT, "check_forced": CHECK_FORCED, "models": {}}
    web_dirs = []
    with tempfile.TemporaryDirectory(prefix="mlcc-vk-cpu-") as tmp:
        tmp = out / "llvm" if a.reuse else Path(tmp)   # --reuse keeps the CPU builds too
        for model in models:
            fam, cfg = pre[model].family, pre[model].config
            idx = job(vocab=cfg["vocab_size"])["sample_idx"]
            for quant in QUANTS:
                b = build_id(model, quant)
                times = {}
                for target, where in (("webgpu", out / "web" / b), ("cuda", out / "cuda" / b),
                                      ("llvm", Path(tmp) / b)):
                    if not (a.reuse and (where / "mlcc-config.json").exists()):
                        times[target] = compile_shape_only(fam, cfg, target, quant, where)
                        print(f"{b}: compiled for {target} in {times[target]:.1f}s", flush=True)
                ref = cpu_reference(Path(tmp) / b, idx)
                print(f"{b}: CPU greedy ids {ref['greedy_ids'][:16]}... check argmax {ref['check']['argmax']}",
                      flush=True)
                write_random_weights(out / "web" / b)
                want["models"][b] = {"model": model, "quant": quant, "vocab": cfg["vocab_size"], "compile_s": times,
                                     **ref}
                web_dirs.append(out / "web" / b)
    build_site(web_dirs, out / "site", title="mlcc vulkan bench")
    write_json(out, "expected.json", want)
    write_jobs(out, models)
    print(f"build: {len(web_dirs)} builds, site {out / 'site'}, expected {out / 'expected.json'}", flush=True)


def write_jobs(out: Path, models) -> None:
    pre = presets()
    for m in models:
        write_json(out, f"job-{m}.json", job(vocab=pre[m].config["vocab_size"]))


def cmd_jobs(a) -> None:
    """The Node.js side's job files and the site again, from the libraries already built (a build folder made
    before a change to job() or to the web engine)."""
    from mlcc.web.site import build_site

    out = Path(a.out)
    want = json.loads((out / "expected.json").read_text())
    write_jobs(out, sorted({e["model"] for e in want["models"].values()}))
    build_site([out / "web" / b for b in want["models"]], out / "site", title="mlcc vulkan bench")


def cmd_cuda(a) -> None:
    from mlcc.runtime.device.model import LoadedModel
    from mlcc.runtime.device.token_fetch import TokenFetcher

    want = json.loads(Path(a.expected).read_text())
    rows = {}
    for b, e in sorted(want["models"].items(), key=lambda kv: kv[1]["model"] != "qwen2.5-0.5b"):
        d = Path(a.libs) / b
        if not d.is_dir():
            continue
        t = time.perf_counter()
        try:
            m = LoadedModel(d, weights="random")
            load_s = time.perf_counter() - t
            idx = job(vocab=e["vocab"])["sample_idx"]
            check = measure_check(m, idx)
            ids, prefill_s, sync_tok_s = greedy(m, DECODE)
            fetcher = TokenFetcher(m.dev)
            greedy(m, 8, True, fetcher)   # warm-up of the pipelined loop's graphs
            pids, _, pipe_tok_s = greedy(m, DECODE, True, fetcher)
            best = float("inf")
            for r in range(4):
                m.create_kv_cache(1, 4096, 2048)
                m.add_sequence(0)
                m.dev.sync()
                t = time.perf_counter()
                m.argmax(m.prefill([0], [PREFILL])).numpy()
                best = min(best, time.perf_counter() - t) if r else best
                m.remove_sequence(0)
            rows[b] = {"device": _cuda_name(), "load_s": load_s, "check": check, "greedy_ids": ids,
                       "pipelined_ids_equal": pids == ids, "prompt_prefill_s": prefill_s,
                       "decode_tok_s": pipe_tok_s, "decode_tok_s_synchronous": sync_tok_s,
                       "prefill_tok_s": len(PREFILL) / best, "prefill_tokens": len(PREFILL)}
            print(f"cuda {b}: decode {pipe_tok_s:.1f} tok/s (synchronous {sync_tok_s:.1f}), prefill "
                  f"{rows[b]['prefill_tok_s']:.0f} tok/s", flush=True)
            del m, fetcher
        except Exception as ex:   # one build failing leaves the others measured
            rows[b] = {"error": f"{type(ex).__name__}: {ex}"[:2000]}
            print(f"cuda {b}: ERROR {rows[b]['error']}", flush=True)
        write_json(a.out, "cuda.json", rows)
    write_json(a.out, "cuda.json", rows)


def _cuda_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0)
    except Exception:
        return None


def compare_check(got: dict, want: dict) -> dict:
    g, w = np.asarray(got["sampled"], np.float64), np.asarray(want["sampled"], np.float64)
    rel = float(np.abs(g - w).max() / max(max(want["max_abs"]), 1e-30)) if g.shape == w.shape else float("inf")
    same = sum(x == y for x, y in zip(got["argmax"], want["argmax"]))
    return {"argmax_equal": f"{same}/{len(want['argmax'])}", "max_rel_err": rel, "finite": got.get("finite", True),
            "ok": bool(got.get("finite", True) and rel < 5e-2 and same >= len(want["argmax"]) - 1)}


def greedy_match(ids: list[int], want: list[int]) -> dict:
    """Greedy ids against the CPU build's, over as many as both have (a short local run checks fewer)."""
    n = min(len(want), len(ids))
    same = next((i for i, (x, y) in enumerate(zip(ids[:n], want)) if x != y), n)
    return {"identical": ids[:n] == want[:n], "same_prefix": f"{same}/{n}"}


def cmd_report(a) -> None:
    want = json.loads(Path(a.expected).read_text())
    cuda = json.loads(Path(a.cuda).read_text()) if a.cuda and Path(a.cuda).exists() else {}
    web = {}
    for f in a.web:
        p = Path(f)
        b = p.stem.removeprefix("web-")
        try:
            web[b] = json.loads(p.read_text().strip().splitlines()[-1])
        except (ValueError, IndexError, OSError) as ex:
            web[b] = {"error": f"no result ({ex}); see {p.with_suffix('.err')}"}
        err = p.with_suffix(".err")
        if "error" in web[b] or "adapter" not in web[b]:
            web[b].setdefault("error", "no result")
            if err.exists():
                text = err.read_text()
                web[b]["stderr_tail"] = text[-1500:]
                said = [ln for ln in text.splitlines() if ln.startswith("vulkan_bench: error:")]
                if said:   # what the run itself said, rather than the missing result line
                    web[b]["error"] = said[-1].removeprefix("vulkan_bench: error: ")
    rows = []
    for b, e in want["models"].items():
        w, c = web.get(b, {"error": "not run"}), cuda.get(b, {"error": "not run"})
        base = {"model": e["model"], "quant": e["quant"], "target": "webgpu", "backend": "dawn-vulkan",
                "device": (w.get("adapter") or {}).get("description"), "cuda_device": c.get("device"),
                "weights": "random (seed 0)", "commit": want["build"]["commit"]}
        wc = compare_check(w["check"], e["check"]) if "check" in w else None
        cc = compare_check(c["check"], e["check"]) if "check" in c else None
        gm = greedy_match(w["greedy_ids"], e["greedy_ids"]) if "greedy_ids" in w else None
        cgm = greedy_match(c["greedy_ids"], e["greedy_ids"]) if "greedy_ids" in c else None
        if "error" in w:   # the CUDA side's numbers stay in the row
            rows.append({**base, "error": w["error"], "stderr_tail": w.get("stderr_tail"), "tok_per_s": None,
                         "cuda_tok_per_s": c.get("decode_tok_s"), "cuda_prefill_tok_per_s": c.get("prefill_tok_s"),
                         "cuda_check_vs_cpu": cc, "cuda_greedy_vs_cpu": cgm, "cuda_error": c.get("error")})
            continue
        differ = a.site and (Path(a.site) / "models" / b / "WEIGHTS_DIFFER").exists()
        common = {"check_vs_cpu": wc, "greedy_vs_cpu": gm, "cuda_check_vs_cpu": cc, "cuda_greedy_vs_cpu": cgm,
                  "weights_same_as_prepare": None if not a.site else not differ,
                  "adapter": w.get("adapter"), "load_s": w.get("load_s"), "cuda_error": c.get("error")}
        rows.append({**base, "phase": "decode", "tok_per_s": w["decode_tok_s"],
                     "cuda_tok_per_s": c.get("decode_tok_s"),
                     "cuda_tok_per_s_synchronous": c.get("decode_tok_s_synchronous"),
                     "ratio": _ratio(w["decode_tok_s"], c.get("decode_tok_s")),
                     "ratio_vs_synchronous": _ratio(w["decode_tok_s"], c.get("decode_tok_s_synchronous")),
                     "tokens": want["decode"], "context": f"{len(want['prompt'])} + {want['decode']}",
                     "per_token": w.get("per_token"), "profile": w.get("profile"),
                     "variants": w.get("variants"), **common})
        rows.append({**base, "phase": "prefill", "tok_per_s": w["prefill_tok_s"],
                     "cuda_tok_per_s": c.get("prefill_tok_s"), "ratio": _ratio(w["prefill_tok_s"],
                                                                               c.get("prefill_tok_s")),
                     "tokens": w["prefill_tokens"], **common})
    write_json(a.out, "vulkan_webgpu.json", rows)
    print(f"\n{'build':22s} {'phase':7s} {'webgpu tok/s':>12s} {'cuda tok/s':>10s} {'ratio':>6s} "
          f"{'check vs CPU':>14s} {'greedy':>8s} {'disp/tok':>8s} {'bg/tok':>6s} {'sub/tok':>7s} "
          f"{'shader ms':>9s} {'step ms':>7s}  "
          "device")
    for r in rows:
        b = f"{r['model']}-{r['quant']}"
        if "error" in r:
            print(f"{b:22s} webgpu ERROR (cuda decode {_f(r['cuda_tok_per_s'])} tok/s) {str(r['error'])[:400]}")
            continue
        chk = r["check_vs_cpu"]
        pt = r.get("per_token") or {}
        prof = r.get("profile") or {}
        print(f"{b:22s} {r['phase']:7s} {r['tok_per_s']:12.1f} {_f(r['cuda_tok_per_s']):>10s} "
              f"{_f(r['ratio'], 2):>6s} {chk['argmax_equal'] + (' ok' if chk['ok'] else ' BAD'):>14s} "
              f"{r['greedy_vs_cpu']['same_prefix']:>8s} "
              f"{_f(pt.get('dispatch'), 0) if r['phase'] == 'decode' else '':>8s} "
              f"{_f(pt.get('bindGroup'), 0) if r['phase'] == 'decode' else '':>6s} "
              f"{_f(pt.get('submit'), 1) if r['phase'] == 'decode' else '':>7s} "
              f"{_f(prof.get('shader_ms_per_token'), 3) if r['phase'] == 'decode' else '':>9s} "
              f"{_f(pt.get('step_ms'), 3) if r['phase'] == 'decode' else '':>7s}  {r['device']}")
    for r in rows:
        for v, x in (r.get("variants") or {}).items() if r.get("phase") == "decode" else ():
            if "error" in x:
                print(f"{r['model']}-{r['quant']}: variant {v}: ERROR {x['error'][:300]}")
                continue
            pt, tok_s = x["per_token"], x["decode_tok_s"]
            print(f"{r['model']}-{r['quant']}: variant {v}: decode {tok_s:.1f} tok/s (x{tok_s / r['tok_per_s']:.2f}; "
                  f"cuda ratio {_f(_ratio(tok_s, r['cuda_tok_per_s']), 2)}), ids equal {x['ids_equal']}, "
                  f"step {pt['step_ms']:.3f} ms, wait {pt['sync_wait_ms']:.3f} ms, bind groups created/token "
                  f"{pt.get('bindGroup', 0):.1f}, passes/token {pt.get('realPass') or pt.get('pass', 0):.1f}")
    for r in rows:
        if r.get("phase") == "decode" and (r.get("profile") or {}).get("kernels"):
            print(f"\n{r['model']}-{r['quant']}: top kernels by shader time per decode token "
                  f"(of {r['profile']['shader_ms_per_token']:.3f} ms; wall {r['profile']['wall_ms_per_token']:.3f})")
            for k in r["profile"]["kernels"][:8]:
                print(f"  {k['us_per_token']:9.1f} us  {k['calls_per_token']:5.1f} calls  {k['kernel']}")


MJS = Path(__file__).resolve().parent / "vulkan_bench.mjs"
# the node side's job cut short for a CPU Vulkan, where one 0.5B build's checks alone take over 20 minutes
SHORT_JOB = {"VK_DECODE": "6", "VK_PREFILL": "64", "VK_PREFILL_REPEATS": "1", "VK_PROFILE_TOKENS": "2"}


def probe_adapter(node: str, env: dict[str, str], backend: str) -> bool:
    """Whether Dawn finds an adapter; where it does not, the Vulkan loader's own account of why."""
    cmd = [node, str(MJS), "--probe", "--backend", backend]
    if subprocess.run(cmd, env=env, timeout=60, check=False).returncode == 0:
        return True
    print("Dawn found no adapter; the Vulkan loader's own account:", flush=True)
    r = subprocess.run(cmd, env={**env, "VK_LOADER_DEBUG": "error,warn,driver"}, timeout=60, check=False,
                       capture_output=True, text=True)
    print("\n".join([ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()][-40:]), flush=True)
    return False


def cmd_run(a) -> None:
    from mlcc.web.npm_deps import node_modules

    build, out = Path(a.build), Path(a.out)
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    want = json.loads((build / "expected.json").read_text())
    if a.builds:
        builds = a.builds.split(",")
    elif a.short:
        builds = [b for b in want["models"] if b.startswith("smollm2")]
    else:   # the 0.5B shape first: its ratio is the goal, should the time run out
        builds = sorted(want["models"], key=lambda b: not b.startswith("qwen"))
    node = shutil.which("node")
    if node is None:
        raise SystemExit("no node here: install Node.js (18 or later), as `mlcc web`'s Node.js chat needs")
    env = {**os.environ, "NODE_PATH": str(node_modules()), **(SHORT_JOB if a.short else {})}
    t0 = time.time()
    dawn_ok = probe_adapter(node, env, a.backend)
    cuda = raw / "cuda.json"
    if not a.short and shutil.which("nvidia-smi"):   # CUDA first: a web run cut short still has its ratio
        print(f"== cuda {time.time() - t0:.0f}s", flush=True)
        try:
            subprocess.run([sys.executable, __file__, "cuda", "--libs", str(build / "cuda"), "--expected",
                            str(build / "expected.json"), "--out", str(raw)], timeout=a.cuda_timeout, check=False)
        except subprocess.TimeoutExpired:
            print(f"cuda: stopped after {a.cuda_timeout}s", flush=True)
    webs: list[Path] = []

    def report() -> None:
        cmd_report(argparse.Namespace(expected=str(build / "expected.json"), cuda=str(cuda),
                                      web=[str(w) for w in webs], site=str(build / "site"), out=str(out)))

    for b in builds if dawn_ok else []:
        gone = time.time() - t0
        if gone > a.web_deadline:
            print(f"web {b}: skipped, {gone:.0f}s gone", flush=True)
            continue
        print(f"== web {b}", flush=True)
        model = want["models"][b]["model"]
        webs.append(raw / f"web-{b}.json")
        with webs[-1].open("w") as so, webs[-1].with_suffix(".err").open("w") as se:
            try:
                rc = subprocess.run([node, str(MJS), str(build / "site"), b, str(build / f"job-{model}.json"),
                                     "--backend", a.backend], stdout=so, stderr=se, env=env, timeout=a.web_timeout,
                                    check=False).returncode
            except subprocess.TimeoutExpired:
                rc = f"timeout after {a.web_timeout}s"
        print(f"   rc {rc} in {time.time() - t0 - gone:.0f}s", flush=True)
        report()   # after each build: a run cut short still has what it measured
    print(f"== report {time.time() - t0:.0f}s", flush=True)
    report()


def _ratio(x, y):
    return x / y if x and y else None


def _f(v, nd=1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


if __name__ == "__main__":
    def _build(p):
        p.add_argument("--out", required=True)
        p.add_argument("--models", default=os.environ.get("VK_MODELS", ""), help="comma-separated subset")
        p.add_argument("--reuse", action="store_true", help="keep libraries already built in --out")

    def _weights(p):
        p.add_argument("model_dirs", nargs="+")
        p.add_argument("--seed", type=int, default=0)

    def _cuda(p):
        p.add_argument("--libs", required=True)
        p.add_argument("--expected", required=True)
        p.add_argument("--out", required=True)

    def _report(p):
        p.add_argument("--expected", required=True)
        p.add_argument("--cuda", default=None)
        p.add_argument("--web", nargs="*", default=[])
        p.add_argument("--site", default=None, help="the site the web runs used (its weights' check marks)")
        p.add_argument("--out", required=True)

    def _run(p):
        p.add_argument("--build", required=True, help="the folder `build` wrote")
        p.add_argument("--out", required=True)
        p.add_argument("--short", action="store_true", help="SmolLM2 only, a few tokens, no CUDA (a CPU Vulkan)")
        p.add_argument("--builds", default="", help="comma-separated builds (default: all of --build's)")
        p.add_argument("--backend", default="vulkan", help="Dawn's backend")
        p.add_argument("--cuda-timeout", type=float, default=600, help="seconds for the CUDA builds")
        p.add_argument("--web-timeout", type=float, default=900, help="seconds for one web build")
        p.add_argument("--web-deadline", type=float, default=3600, help="no web build starts after this (s)")

    cli(__doc__, {"build": (cmd_build, _build), "run": (cmd_run, _run),
                  "jobs": (cmd_jobs, lambda p: p.add_argument("--out", required=True)),
                  "weights": (cmd_weights, _weights), "cuda": (cmd_cuda, _cuda),
                  "report": (cmd_report, _report)})
