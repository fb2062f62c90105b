"""SmolLM2-135M on CUDA: check logits against the CPU build, then time decode/prefill. One device run.

Here (CPU):   python bench/smollm2_cuda.py reference --cpu DIR_LLVM --out ref.npz
There (GPU):  python bench/smollm2_cuda.py run --cuda DIR_CUDA --ref ref.npz --out RESULTS_DIR

The reference is the CPU build of the same quantization, teacher-forced over its own greedy tokens, so the GPU
run sees identical inputs at every step and logits can be compared row by row.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
STEPS = 16


def prompt_ids(model_dir: Path) -> list[int]:
    from mlcc.artifact import read_config
    from mlcc.runtime.tokenizer import Tokenizer

    tok = Tokenizer(model_dir, read_config(model_dir)["tokenizer"])
    return tok.encode(tok.apply_chat_template(PROMPT))


def teacher_forced(m, ids: list[int], forced: list[int] | None) -> tuple[np.ndarray, list[int]]:
    m.create_kv_cache(1, 2048, 512)
    m.add_sequence(0)
    rows, toks = [m.prefill([0], [ids]).numpy()[0]], []
    for i in range(STEPS):
        toks.append(int(rows[-1].argmax()))
        rows.append(m.decode([0], [forced[i] if forced else toks[-1]]).numpy()[0])
    m.remove_sequence(0)
    return np.stack(rows), toks


def cmd_reference(a) -> None:
    from mlcc.runtime.model import LoadedModel

    d = Path(a.cpu)
    ids = [int(x) for x in a.ids.split(",")] if a.ids else prompt_ids(d)
    logits, toks = teacher_forced(LoadedModel(d), ids, None)
    np.savez_compressed(a.out, logits=logits.astype(np.float32), tokens=np.array(toks), prompt=np.array(ids))
    print("reference tokens", toks)


def time_decode(m, n_prompt: int, n_steps: int) -> float:
    m.create_kv_cache(1, 4096, 2048)
    m.add_sequence(0)
    m.prefill([0], [[1] * n_prompt])
    argmax = m.vm["argmax_logits"]
    tok = 1
    for _ in range(3):
        tok = int(argmax(m.decode([0], [tok])).numpy()[0])
    m.dev.sync()
    t = time.perf_counter()
    for _ in range(n_steps):
        tok = int(argmax(m.decode([0], [tok])).numpy()[0])  # the id must reach the host each step, as in serving
    m.dev.sync()
    dt = time.perf_counter() - t
    m.remove_sequence(0)
    return n_steps / dt


def time_prefill(m, n: int, reps: int = 5) -> float:
    m.create_kv_cache(1, 4096, 2048)
    best = float("inf")
    for r in range(reps + 1):
        m.add_sequence(0)
        m.dev.sync()
        t = time.perf_counter()
        m.prefill([0], [[1 + (i % 1000) for i in range(n)]]).numpy()
        dt = time.perf_counter() - t
        m.remove_sequence(0)
        if r:
            best = min(best, dt)
    return n / best


def cmd_run(a) -> None:
    from mlcc.runtime.model import LoadedModel

    d, out = Path(a.cuda), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ref = np.load(a.ref)
    t = time.perf_counter()
    m = LoadedModel(d)
    load_s = time.perf_counter() - t
    logits, toks = teacher_forced(m, ref["prompt"].tolist(), ref["tokens"].tolist())
    err = np.abs(logits - ref["logits"]).max(axis=1) / np.abs(ref["logits"]).max(axis=1)
    same = int(sum(int(a == b) for a, b in zip(toks, ref["tokens"].tolist())))
    ok = bool(err.max() <= 3e-2 and same == STEPS)
    rows = [("load (incl. NVRTC compile of kernels)", f"{load_s:.1f} s"),
            ("max rel. logit error vs CPU build", f"{err.max():.2e} (tol 3e-2)"),
            ("greedy tokens equal to CPU build", f"{same}/{STEPS}")]
    if a.parity_only:
        print("\n".join(f"  {k}: {v}" for k, v in rows), "\nPASS" if ok else "\nFAIL")
        return
    from mlcc.runtime.engine import Engine

    with Engine(d, target="cuda", max_batch=1) as e:
        r = e.chat.completions.create(messages=PROMPT, max_tokens=24, temperature=0)
    answer = r.choices[0].message.content
    rows.append(("engine answer", repr(answer)))
    results = {"ok": ok, "load_s": load_s, "max_rel_err": float(err.max()), "greedy_equal": same,
               "answer": answer}
    if ok:
        results["decode_tok_s_ctx32"] = time_decode(m, 32, 200)
        results["decode_tok_s_ctx1024"] = time_decode(m, 1024, 200)
        results["prefill_tok_s_512"] = time_prefill(m, 512)
        results["prefill_tok_s_2048"] = time_prefill(m, 2048)
        rows += [("decode tok/s (batch 1, ctx 32)", f"{results['decode_tok_s_ctx32']:.0f}"),
                 ("decode tok/s (batch 1, ctx 1024)", f"{results['decode_tok_s_ctx1024']:.0f}"),
                 ("prefill tok/s (512)", f"{results['prefill_tok_s_512']:.0f}"),
                 ("prefill tok/s (2048)", f"{results['prefill_tok_s_2048']:.0f}")]
    import tvm

    results["device"] = tvm.cuda(0).device_name
    results["host"] = platform.node()
    results["artifacts"] = json.loads((d / "mlcc-config.json").read_text())["stamp"]
    print(f"SmolLM2-135M-Instruct {results['artifacts']['quantization']} on {results['device']}")
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    print("PASS" if ok else "FAIL")
    (out / "smollm2_cuda.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reference")
    r.add_argument("--cpu", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--ids", default=None, help="comma-separated prompt ids (models without a tokenizer)")
    g = sub.add_parser("run")
    g.add_argument("--cuda", required=True)
    g.add_argument("--ref", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--parity-only", action="store_true", help="no engine, no timing (models without a tokenizer)")
    a = p.parse_args()
    {"reference": cmd_reference, "run": cmd_run}[a.cmd](a)


if __name__ == "__main__":
    main()
