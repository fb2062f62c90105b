"""Prefill and batched decode on CUDA: mlcc's tensor-core prefill kernels (CompileOptions.flash_prefill_attention,
prefill_gemm) against the same library without them (TVM's prefill attention, dlight's GEMM rule), and
`transformers` fp16 (sdpa) on the same shape, in one device run.

    # here: shape-only CUDA libraries (bench/decode.py builds them): the base, its float32 twins (the reference),
    # and one folder per variant
    python bench/decode.py build --out .dev/base8 \\
        --only llama3-8b/q4f16_1,llama3-8b/q0f16,llama3-8b/q4f32_1,llama3-8b/q0f32
    python bench/decode.py build --out .dev/fa8 --only llama3-8b/q4f16_1,llama3-8b/q0f16 \\
        --option flash_prefill_attention=1
    python bench/decode.py build --out .dev/fapg8 --only llama3-8b/q4f16_1,llama3-8b/q0f16 \\
        --option flash_prefill_attention=1 --option prefill_gemm=1
    # device (H200), carry .gpu-rt .whl .dev/base8 .dev/fa8 .dev/fapg8
    bash bench/gpu.sh run bash -c 'python3 bench/prefill.py mlcc --base .dev/base8 \\
        --variants flash=.dev/fa8,flash+gemm=.dev/fapg8 --out $OUT && python3 bench/prefill.py hf --out $OUT'

Weights are random, seeded: every build of a model gets the same values, so logits are compared first (prefill of
a 512-token prompt, a ragged two-sequence prefill, a decode step of 8 sequences, a 5-token verify): each variant
against the float32 build of the same weights, next to the base's distance from it (fp16 logits of random
8B-shape weights differ by a few percent between any two summation orders); a variant further from float32 than
1.25x the base's distance (+2e-3) is not timed.
Prefill: one forward of the whole prompt (512, 2,048, 8,192 tokens), best of 3 after a warm-up. Batched decode:
16 and 64 sequences of 128 prompt tokens, one token per sequence per step, argmax ids read back every step as in
serving. Verify: the forward over 5 new tokens with their logits (a speculative verify) after a 512-token
context, median ms, beside one decode step's. Rows: {"bench": "prefill"|"batched_decode"|"verify", "model",
"quant", "variant", "prompt_tokens" | "batch" | "tokens", "tok_per_s" | "ms"}; transformers rows have "engine":
"transformers".
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from harness import cli, presets, write_json

PROMPTS = (512, 2048, 8192)
BATCHES = (16, 64)
VERIFY = (5,)   # tokens of a speculative verify (bench/speculative.py: its cost bounds any draft's speedup)
CONTEXT, STEPS = 128, 32


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [1 + (i * 7 + salt) % 30000 for i in range(n)]


REFERENCE = {"q0f16": "q0f32", "q4f16_1": "q4f32_1"}   # the same random weights, float32 activations


def _logits(model, lists: list[list[int]]) -> np.ndarray:
    ids = list(range(len(lists)))
    for s in ids:
        model.add_sequence(s)
    out = model.prefill(ids, lists).numpy().astype(np.float32)
    for s in ids:
        model.remove_sequence(s)
    return out


CHECK_PROMPTS = {"single": [_prompt(512)], "ragged": [_prompt(300, 1), _prompt(77, 2)]}


def _all_logits(model) -> dict[str, np.ndarray]:
    """The checked logits: the CHECK_PROMPTS prefills (many-token paths), one decode step of 8 sequences of 40
    tokens and a 5-token verify after 200 (the few-token paths: batched decode, speculative verify)."""
    out = {name: _logits(model, lists) for name, lists in CHECK_PROMPTS.items()}
    seqs = list(range(8))
    for s in seqs:
        model.add_sequence(s)
    model.prefill(seqs, [_prompt(40, s) for s in seqs]).numpy()
    out["batched_decode"] = model.decode(seqs, [5 + s for s in seqs]).numpy().astype(np.float32)
    for s in seqs:
        model.remove_sequence(s)
    model.add_sequence(0)
    model.prefill([0], [_prompt(200, 9)]).numpy()
    out["verify"] = model.verify([0], [_prompt(5, 4)]).numpy().astype(np.float32)
    model.remove_sequence(0)
    return out


def _check(got: dict, want: dict, exact: dict | None) -> dict:
    """A variant's logits (`got`) against the base's (`want`) and, where there is one, the float32 build's."""
    out = {}
    for name in got:
        g, w = got[name], want[name]
        row = {"max_rel_err_vs_base": float(np.abs(g - w).max() / np.abs(w).max()),
               "argmax_equal_base": bool((g.argmax(-1) == w.argmax(-1)).all())}
        if exact is not None:
            e = exact[name]
            scale = np.abs(e).max()
            row["variant_vs_f32"] = float(np.abs(g - e).max() / scale)
            row["base_vs_f32"] = float(np.abs(w - e).max() / scale)
            row["ok"] = row["variant_vs_f32"] <= 1.25 * row["base_vs_f32"] + 2e-3
        else:
            row["ok"] = row["max_rel_err_vs_base"] < 2e-2 and row["argmax_equal_base"]
        out[name] = row
    out["ok"] = all(v["ok"] for v in out.values())
    return out


def _time_prefill(m, n: int, repeats: int = 3) -> float:
    best = float("inf")
    for r in range(repeats + 1):
        m.add_sequence(0)
        m.dev.sync()
        t = time.perf_counter()
        m.prefill([0], [_prompt(n)]).numpy()
        if r:  # the first is the warm-up
            best = min(best, time.perf_counter() - t)
        m.remove_sequence(0)
    return n / best


def _time_batched_decode(m, batch: int) -> float:
    seqs = list(range(batch))
    for s in seqs:
        m.add_sequence(s)
    group = max(PROMPTS) // CONTEXT   # sequences per ragged prefill call (the KV cache's chunk)
    toks = []
    for g in range(0, batch, group):
        ids = seqs[g:g + group]
        toks += [int(t) for t in m.argmax(m.prefill(ids, [_prompt(CONTEXT, s) for s in ids])).numpy()]
    for i in range(4 + STEPS):
        if i == 4:
            m.dev.sync()
            t = time.perf_counter()
        toks = [int(t) for t in m.argmax(m.decode(seqs, toks)).numpy()]
    dt = time.perf_counter() - t
    for s in seqs:
        m.remove_sequence(s)
    return batch * STEPS / dt


def _load(folder: Path):
    from mlcc.runtime.device.model import LoadedModel

    m = LoadedModel(folder, weights="random")
    m.create_kv_cache(max(BATCHES), max(PROMPTS) + max(BATCHES) * (CONTEXT + STEPS + 8) + 64, max(PROMPTS))
    return m


def _time_verify(m, tokens: int, context: int = 512, repeats: int = 20) -> tuple[float, float]:
    """(ms of a forward over `tokens` new tokens with their logits, as a speculative verify runs; ms of one decode
    step), each the median after a 512-token context, the new tokens popped again."""
    m.add_sequence(0)
    m.prefill([0], [_prompt(context)]).numpy()
    times = {"verify": [], "decode": []}
    for _ in range(repeats + 2):
        t = time.perf_counter()
        m.verify([0], [_prompt(tokens, 3)]).numpy()
        times["verify"].append(time.perf_counter() - t)
        m.popn(0, tokens)
        t = time.perf_counter()
        m.decode([0], [7]).numpy()
        times["decode"].append(time.perf_counter() - t)
        m.popn(0, 1)
    m.remove_sequence(0)
    return tuple(float(np.median(times[k][2:])) * 1e3 for k in ("verify", "decode"))


def _time(m, row: dict, rows: list, out: str, benches: tuple = ("prefill", "batched_decode", "verify")) -> None:
    for n in PROMPTS if "prefill" in benches else ():
        rows.append({"bench": "prefill", **row, "prompt_tokens": n, "tok_per_s": round(_time_prefill(m, n), 1)})
        print(json.dumps(rows[-1]), flush=True)
    for b in BATCHES if "batched_decode" in benches else ():
        rows.append({"bench": "batched_decode", **row, "batch": b, "tok_per_s": round(_time_batched_decode(m, b), 1)})
        print(json.dumps(rows[-1]), flush=True)
    for n in VERIFY if "verify" in benches else ():
        v, d = _time_verify(m, n)
        rows.append({"bench": "verify", **row, "tokens": n, "ms": round(v, 3), "decode_ms": round(d, 3),
                     "ratio_vs_decode": round(v / d, 2)})
        print(json.dumps(rows[-1]), flush=True)
    write_json(out, "prefill_mlcc.json", rows)


def cmd_mlcc(a) -> None:
    import gc

    rows = []
    base_dir = Path(a.base)
    variants = {label: Path(d) for label, d in (v.split("=", 1) for v in a.variants.split(","))}
    for d in sorted(p for p in base_dir.iterdir() if (p / "model.so").exists()):
        model, quant = d.name.rsplit("-", 1)
        if quant not in REFERENCE or (a.quants and quant not in a.quants.split(",")):  # (float32: the reference)
            continue
        exact = None
        ref_dir = base_dir / f"{model}-{REFERENCE[quant]}"
        if (ref_dir / "model.so").exists():
            ref = _load(ref_dir)
            exact = _all_logits(ref)
            del ref
            gc.collect()
        base = _load(d)
        want = _all_logits(base)
        if not a.check_only:
            _time(base, {"model": model, "quant": quant, "variant": "base"}, rows, a.out, a.benches)
        del base
        gc.collect()
        for label, vdir in variants.items():
            if not (vdir / d.name / "model.so").exists():
                continue
            m = _load(vdir / d.name)
            check = _check(_all_logits(m), want, exact)
            print(model, quant, label, "vs base / float32:", json.dumps(check), flush=True)
            rows.append({"bench": "check", "model": model, "quant": quant, "variant": label, **check})
            if check["ok"] and not a.check_only:
                _time(m, {"model": model, "quant": quant, "variant": label}, rows, a.out, a.benches)
            elif not check["ok"]:
                print(model, quant, label, "logits differ: not timed", flush=True)
            del m
            gc.collect()
    write_json(a.out, "prefill_mlcc.json", rows)


def cmd_hf(a) -> None:
    import torch
    import transformers as tf

    rows = []
    for model in a.models.split(","):
        p = presets()[model]
        cfg = p.config
        conf = tf.AutoConfig.for_model(p.family, **{k: v for k, v in cfg.items() if k != "rope_scaling"})
        if cfg.get("rope_scaling"):
            conf.rope_parameters = {**cfg["rope_scaling"], "rope_theta": cfg["rope_theta"]}
        conf._attn_implementation = "sdpa"
        with torch.device("cuda"):
            hf = tf.AutoModelForCausalLM.from_config(conf, torch_dtype=torch.float16).eval()
        base = {"engine": "transformers", "model": model, "quant": "fp16", "attn": "sdpa",
                "transformers": tf.__version__, "torch": torch.__version__}
        with torch.no_grad():
            for n in PROMPTS:
                ids = torch.tensor([_prompt(n)], device="cuda")
                best = float("inf")
                for r in range(4):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    hf(input_ids=ids, use_cache=True, logits_to_keep=1)
                    torch.cuda.synchronize()
                    if r:
                        best = min(best, time.perf_counter() - t)
                rows.append({"bench": "prefill", **base, "prompt_tokens": n, "tok_per_s": round(n / best, 1)})
                print(json.dumps(rows[-1]), flush=True)
            for b in BATCHES:
                ids = torch.tensor([_prompt(CONTEXT, s) for s in range(b)], device="cuda")
                gen = dict(do_sample=False, pad_token_id=0, cache_implementation="static")
                times = {}
                for new in (1, STEPS + 1):   # the difference is STEPS decode steps
                    hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **gen)   # warm-up
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **gen)
                    torch.cuda.synchronize()
                    times[new] = time.perf_counter() - t
                tok_s = b * STEPS / (times[STEPS + 1] - times[1])
                rows.append({"bench": "batched_decode", **base, "batch": b, "tok_per_s": round(tok_s, 1)})
                print(json.dumps(rows[-1]), flush=True)
        write_json(a.out, "prefill_hf.json", rows)
        del hf
        torch.cuda.empty_cache()


def _mlcc_args(p) -> None:
    p.add_argument("--base", required=True, help="libraries with the default options (+ their float32 twins)")
    p.add_argument("--variants", required=True, help="label=folder,... : the same libraries built otherwise")
    p.add_argument("--quants", default=None, help="only these quantizations (comma-separated)")
    p.add_argument("--check-only", action="store_true", help="compare the logits, time nothing")
    p.add_argument("--benches", type=lambda v: tuple(v.split(",")), default=("prefill", "batched_decode", "verify"),
                   help="what to time (comma-separated: prefill, batched_decode, verify)")
    p.add_argument("--out", required=True)


def _hf_args(p) -> None:
    p.add_argument("--models", default="llama3-8b")
    p.add_argument("--out", required=True)


if __name__ == "__main__":
    cli(__doc__, {"mlcc": (cmd_mlcc, _mlcc_args), "hf": (cmd_hf, _hf_args)})
