"""What constrained decoding costs: per-token time of JSON-schema-constrained vs free decoding at 1 and 16
concurrent requests, and the time to the first token mask of a 50-property schema and of a 20-tool request.

    # the CPU default (the bundled SmolLM2, compiled on first use), here
    python bench/structured.py cpu --out bench/results/tmp [--temperature 1.0]
    # a CUDA GPU, the Llama-3-8B shape (random weights) with a real tokenizer's vocabulary: build on any machine,
    # time on the CUDA one
    python bench/structured.py build --out .dev/structured [--tokenizer-gguf QWEN.gguf]
    python bench/structured.py gpu --libs .dev/structured --out OUT
    python bench/structured.py table RESULT.json...

Greedy by default (--temperature to sample). Constrained requests answer a schema that forces a fixed-length output
(an array of 48 one-digit integers, ~97 tokens), so both kinds decode the same number of tokens: free requests
ignore EOS and stop at that length. The per-token time is taken between the first and the last streamed token of
each request (time to the first token is reported apart); aggregate_tok_s is all requests' tokens over the wall
time. The random-weight model's tokens carry no meaning; the grammar makes its output valid anyway, which is what
the mask costs are measured on.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

from harness import build_info, build_shape_with_tokenizer, cli, write_json

LENGTH = 48
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
          "minItems": LENGTH, "maxItems": LENGTH}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "digits", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": f"Write {LENGTH} random digits as a JSON array."}]
ROUNDS = 3
# greedy: the sampled path sorts the vocabulary each step, a cost that depends on the logits' values (rows masked
# to a few tokens sort faster on the CPU), which would hide the grammar's own cost; --temperature to compare
TEMPERATURE = 0.0


def _wide_schema(n: int = 50) -> dict:
    kinds = [{"type": "string", "maxLength": 20}, {"type": "integer", "minimum": 0}, {"type": "boolean"},
             {"enum": ["red", "green", "blue"]}, {"type": "array", "items": {"type": "number"}, "maxItems": 4}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _tools(n: int = 20) -> list[dict]:
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"tool number {i}",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                        "unit": {"enum": ["c", "f"]}},
                       "required": ["city"]}}} for i in range(n)]


def first_mask(engine) -> dict:
    """Milliseconds from a request's grammar to its first mask (compile, matcher, fill), cold (first of its kind)
    and cached (the same grammar again)."""
    import numpy as np

    from mlcc.runtime.api import prepare, protocol

    def once(fields: dict) -> float:
        t0 = time.perf_counter()
        req = protocol.parse_chat_request(fields)
        call = prepare.chat_call(engine, req.model_dump(exclude_none=True, by_alias=True))
        matcher = call.make_matcher()
        mask = np.zeros((1, (engine.model.vocab + 31) // 32), np.int32)
        matcher.fill_mask(mask, 0)
        return (time.perf_counter() - t0) * 1e3

    engine.grammars  # noqa: B018 - the tokenizer is built once per engine, before any request
    schema = {"messages": MESSAGES, "max_tokens": 8, "response_format": {
        "type": "json_schema", "json_schema": {"name": "wide", "schema": _wide_schema()}}}
    tools = {"messages": MESSAGES, "max_tokens": 8, "tools": _tools(), "tool_choice": "required"}
    return {"schema_50_properties_ms": once(schema), "schema_50_properties_cached_ms": once(schema),
            "tools_20_required_ms": once(tools), "tools_20_required_cached_ms": once(tools)}


async def _one(aengine, constrained: bool, seed: int) -> dict:
    kw = dict(messages=MESSAGES, temperature=TEMPERATURE, seed=seed, stream=True,
              stream_options={"include_usage": True})
    if constrained:
        kw.update(response_format=RESPONSE_FORMAT, max_tokens=4 * LENGTH)
    else:
        kw.update(max_tokens=2 * LENGTH + 1, ignore_eos=True)
    t0, stamps, tokens = time.perf_counter(), [], 0
    async for chunk in await aengine.chat.completions.create(**kw):
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return {"ttft_s": stamps[0] - t0, "decode_s": stamps[-1] - stamps[0], "tokens": tokens, "end": stamps[-1],
            "start": t0}


def decode_costs(engine, concurrency: list[int]) -> list[dict]:
    """Free and constrained at each concurrency; at 1 also constrained with the lone-request pipelining off (the
    synchronous loop: what the pipelined constrained decode saves)."""
    from mlcc import AsyncEngine

    aengine = AsyncEngine(engine)
    core, rows = engine.core, []
    variants = [(c, kind) for c in concurrency for kind in ("free", "constrained")] + [(1, "constrained, synchronous")]
    for c, kind in variants:
        rates, per_token = [], []
        core._pipeline, pipelined = kind != "constrained, synchronous" and core._pipeline, core._pipeline
        for r in range(ROUNDS):
            async def run():
                return await asyncio.gather(*[_one(aengine, kind != "free", 1000 * r + i) for i in range(c)])

            res = asyncio.run(run())
            per_token += [x["decode_s"] / max(x["tokens"] - 1, 1) for x in res]
            wall = max(x["end"] for x in res) - min(x["start"] for x in res)
            rates.append(sum(x["tokens"] for x in res) / wall)
        core._pipeline = pipelined
        rows.append({"concurrency": c, "kind": kind, "per_token_ms": 1e3 * statistics.median(per_token),
                     "aggregate_tok_s": statistics.median(rates)})
        print(rows[-1], flush=True)
    for row in rows:
        free = next(x for x in rows if x["concurrency"] == row["concurrency"] and x["kind"] == "free")
        row["cost_vs_free"] = row["per_token_ms"] / free["per_token_ms"] - 1
    return rows


def cmd_cpu(a) -> None:
    global TEMPERATURE
    from mlcc import Engine

    TEMPERATURE = a.temperature

    with Engine(max_batch=16) as e:
        e.chat.completions.create(messages=MESSAGES, max_tokens=4)   # warm: the first call loads kernels
        result = {"where": "cpu", "model": e.model_name, "vocab": e.model.vocab, **build_info(),
                  "temperature": TEMPERATURE,
                  "first_mask": first_mask(e), "decode": decode_costs(e, [1, 16])}
    print(json.dumps(result, indent=1))
    write_json(a.out, "structured_cpu.json", result)


def cmd_build(a) -> None:
    """The 8B shape for CUDA with the vocabulary of a real tokenizer (the bundled SmolLM2's, or --tokenizer-gguf)."""
    r = build_shape_with_tokenizer("llama3-8b", "q4f16_1", "cuda", Path(a.out) / "llama3-8b-q4f16_1",
                                   a.tokenizer_gguf, vocab_multiple=64)
    print(f"built {r['out']} (vocab {r['vocab_size']}, tokenizer of {r['tokenizer']}) in {r['compile_s']:.0f} s")


def check_logit_functions(model) -> dict:
    """The device's apply_bitmask, apply_logit_bias and logprobs against numpy on random logits (before timing)."""
    import numpy as np

    rng = np.random.default_rng(0)
    b, v = 3, model.vocab
    host = rng.normal(0, 4, (b, v)).astype(np.float32)
    logits = model.to_device(host)
    mask = rng.integers(-(2 ** 31), 2 ** 31, (b, (v + 31) // 32), dtype=np.int64).astype(np.int32)
    allowed = np.unpackbits(mask.view(np.uint8), bitorder="little").reshape(b, -1)[:, :v].astype(bool)
    masked = model.mask_logits(logits, mask).numpy()
    ok_mask = bool(np.array_equal(masked, np.where(allowed, host, -np.inf)))
    rows, toks = np.array([0, 2, 2], np.int32), np.array([5, 7, v - 1], np.int32)
    bias = np.array([100, -50, 3], np.float32)
    want = host.copy()
    want[rows, toks] += bias
    ok_bias = bool(np.array_equal(model.bias_logits(logits, rows, toks, bias).numpy(), want))
    ids = np.array([1, 2, 3], np.int32)
    lp, top_ids, top_lp = model.logprobs(logits, ids)
    x = host.astype(np.float64)
    ref = x - x.max(1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(1, keepdims=True))
    order = np.argsort(-ref, axis=1, kind="stable")[:, :20]
    err = float(max(np.abs(lp - ref[np.arange(b), ids]).max(),
                    np.abs(top_lp - np.take_along_axis(ref, order, 1)).max()))
    ok = ok_mask and ok_bias and err < 1e-4 and bool(np.array_equal(top_ids, order))
    return {"ok": ok, "mask_exact": ok_mask, "bias_exact": ok_bias, "logprobs_max_abs_err": err,
            "top_ids_equal": bool(np.array_equal(top_ids, order))}


def cmd_gpu(a) -> None:
    global TEMPERATURE
    from mlcc import Engine

    TEMPERATURE = a.temperature

    lib = Path(a.libs) / "llama3-8b-q4f16_1"
    with Engine(lib, target="cuda", max_batch=16, weights="random", context_window=2048) as e:
        check = check_logit_functions(e.model)
        print("check:", check, flush=True)
        if not check["ok"]:
            raise SystemExit("the device's logit functions disagree with numpy: not timing")
        e.chat.completions.create(messages=MESSAGES, max_tokens=4)
        result = {"where": "cuda", "model": "llama3-8b-shape q4f16_1 (random weights)", "vocab": e.model.vocab,
                  **build_info(), "temperature": TEMPERATURE, "check": check, "first_mask": first_mask(e),
                  "decode": decode_costs(e, [1, 16])}
    print(json.dumps(result, indent=1))
    write_json(a.out, "structured_gpu.json", result)


def cmd_table(a) -> None:
    print("| where | concurrency | decoding | ms/token | vs free | first mask: 50-property schema / 20 tools (ms) |")
    print("|---|---|---|---|---|---|")
    for path in a.results:
        r = json.loads(Path(path).read_text())
        fm = r["first_mask"]
        for x in r["decode"]:
            print(f"| {r['where']} ({r['model']}) | {x['concurrency']} | {x['kind']} | {x['per_token_ms']:.3f} | "
                  f"{100 * x['cost_vs_free']:+.1f}% | {fm['schema_50_properties_ms']:.1f} / "
                  f"{fm['tools_20_required_ms']:.1f} |")


def main() -> None:
    cli(__doc__, {
        "cpu": (cmd_cpu, lambda p: (p.add_argument("--out", required=True),
                                    p.add_argument("--temperature", type=float, default=TEMPERATURE))),
        "build": (cmd_build, lambda p: (p.add_argument("--out", required=True),
                                        p.add_argument("--tokenizer-gguf"))),
        "gpu": (cmd_gpu, lambda p: (p.add_argument("--libs", required=True), p.add_argument("--out", required=True),
                                    p.add_argument("--temperature", type=float, default=TEMPERATURE))),
        "table": (cmd_table, lambda p: p.add_argument("results", nargs="+")),
    })


if __name__ == "__main__":
    main()
