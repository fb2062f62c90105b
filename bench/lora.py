"""Multi-LoRA decode speed: a batch of streams spread over several adapters against the same streams on the base
model, and batch-1 decode with one adapter against base, each checked for correctness first in the same run.

    # any machine (no GPU needed): shape-only CUDA libraries of the Llama-3-8B shape, each twice: without LoRA and
    # with a pool of 8 adapters of rank up to 16 (libraries only, a few MiB each: weights are random at load)
    python bench/lora.py build --out .dev/lora8b --quant q4f16_1,q0f16
    du -sh .dev/lora8b/*/*                        # what the GPU run carries
    # the CUDA machine
    python bench/lora.py run --libs .dev/lora8b --out OUT
    # this CPU, end to end on a small shape (the same script, smaller batch and fewer steps)
    python bench/lora.py build --out .dev/lora-cpu --model smollm2-135m --quant q0f32,q4f32_1 --target llvm
    python bench/lora.py run --libs .dev/lora-cpu --out OUT --batch 8 --adapters 4 --steps 8 --rounds 3

build writes OUT/<model>-<quant>/base (no LoRA) and OUT/<model>-<quant>/lora (CompileOptions max_loras,
max_lora_rank) and OUT/build.json (commit, host, compile seconds). run loads both libraries of every folder under
--libs with the same seeded random weights (the LoRA build keeps the base projections' parameters under their own
names, so the two get identical values) and writes PEFT adapters (adapter_config.json + adapter_model.safetensors)
of rank --rank on q/k/v/o/gate/up/down of every layer, shaped from the model's config, into a temporary folder; the
runtime reads them as serving does (runtime.device.lora.read_adapter) into the LoRA library's pool.

Checks, before anything is timed (a quantization whose checks fail is reported, not timed); logits are teacher
forced (a prompt, then decode steps fed fixed tokens, several sequences in one batch) so that both sides see the
same inputs:
- the LoRA library without an adapter, and with an all-zero adapter (which runs the `*_lora` twins), against the
  base library: within the model dtype's rounding and argmax equal wherever the base's top two logits are further
  apart than that difference (a near tie may flip);
- every nonzero adapter changes the logits, and two adapters differ from each other;
- a mixed batch (several adapters and none in one step) row by row against each sequence decoded alone;
- float base weights only (q0f16, q0f32): an adapter on one layer against the base library with that layer's
  weights merged in numpy (float32 W + scale * B @ A, then the model dtype), the layer-level reference. A quantized
  base cannot be merged without quantizing the merge again, which changes the base by more than the adapter.

Timing: every variant loaded in one process and timed in interleaved rounds (the order rotating), medians over
rounds, after a few warmup steps; each variant decodes its own sequences, which all grow by the same number of
tokens per round, so the variants see the same context lengths. Batched steps read every id back (decode, argmax,
read: the engine's batched step); batch 1 runs the engine's pipelined loop for a lone greedy request
(runtime.device.graph_decode). Variants: the base library; the LoRA library with no adapter (its plain functions:
what base requests cost on a LoRA build); the LoRA library with every stream on an adapter. overhead = base tok/s /
tok/s - 1 (the extra time per token); goals: <= 15% for --batch streams over --adapters adapters, <= 10% at batch 1.
A LoRA build has no whole-step CUDA graph for batch-1 decode (the graph's decode takes no adapter inputs), so the
batch-1 "no adapter" row shows that cost apart from the adapters' products.

Rows go to OUT/lora.json: {"bench": "lora", "model", "quant", "device", "batch", "adapters", "rank", "tok_per_s",
"base_tok_per_s", "overhead", ...} (adapters 0: no adapter; the base library's own row has overhead 0).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from harness import add_options_argument, build_info, cli, device_name, parse_options, presets, write_json

MODELS = {name: (p.family, p.config) for name, p in presets().items()}
GOALS = {"batched": 0.15, "single": 0.10}   # the most time per token adapters may add (multi-stream, batch 1)
PROMPT = 128
ALPHA_PER_RANK = 2   # lora_alpha = 2 r, a common choice: every adapter's product is scaled by 2
HF_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# --- adapters -------------------------------------------------------------------------------------------------------

def projection_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """HF module kind → (in, out) of a decoder layer's projections, from the model's own config (so the adapters are
    shaped independently of the LoRA build's layout, which read_adapter then checks them against)."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    return {"q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd), "o_proj": (heads * hd, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def module_name(layer: int, kind: str) -> str:
    return f"model.layers.{layer}.{'mlp' if kind in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{kind}"


def write_adapter(folder: Path, cfg: dict[str, Any], rank: int, seed: int, layers: list[int] | None = None,
                  zero: bool = False, b_std: float = 0.02, dtype: str = "float16"
                  ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A PEFT LoRA adapter of every projection of `layers` (default: all) saved to `folder`, as `save_pretrained`
    writes one; returns module → (A, B) as float32 holding the saved values. A is scaled like PEFT's init (about
    1/sqrt(in)) and B like the base weights (b_std 0.02), so that the product moves every projection by a tenth (8B) to a
    third (SmolLM2): the logits change clearly without leaving float16's range. zero: B all zeros (the adapter's product is 0)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    shapes = projection_shapes(cfg)
    tensors, kept = {}, {}
    for layer in range(cfg["num_hidden_layers"]) if layers is None else layers:
        for kind in HF_MODULES:
            k, n = shapes[kind]
            a = (rng.standard_normal((rank, k), dtype=np.float32) / np.float32(math.sqrt(k))).astype(dtype)
            b = np.zeros((n, rank), dtype) if zero else (rng.standard_normal((n, rank), dtype=np.float32)
                                                         * np.float32(b_std)).astype(dtype)
            name = module_name(layer, kind)
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
            kept[name] = (a.astype(np.float32), b.astype(np.float32))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": ALPHA_PER_RANK * rank, "target_modules": list(HF_MODULES),
        "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False, "task_type": "CAUSAL_LM"}))
    return kept


# --- checks ---------------------------------------------------------------------------------------------------------

CHECK_PROMPT_LEN, CHECK_STEPS = 40, 8   # several KV pages of 16, then decode steps over them


def _check_prompt(seq: int, vocab: int) -> list[int]:
    return [(7 + 31 * i + 1009 * seq) % min(vocab, 30000) + 1 for i in range(CHECK_PROMPT_LEN)]


def forced_logits(m, slots: list[int | None], prompts: list[list[int]]) -> np.ndarray:
    """Logits [steps + 1, sequences, vocab] (float32) of sequences decoded side by side, sequence i reading adapter
    slot slots[i] (None: none): after one batched prefill of the prompts, then after each decode step fed a fixed
    token, so that two libraries (or two batch compositions) see the same inputs whatever their greedy ids."""
    n = len(slots)
    m.create_kv_cache(n, n * (CHECK_PROMPT_LEN + CHECK_STEPS + 32), 512)
    seqs = list(range(n))
    for s, slot in zip(seqs, slots):
        m.add_sequence(s)
        if m.lora is not None:
            m.lora.bind(s, slot)
    rows = [m.prefill(seqs, prompts).numpy().reshape(n, -1)]
    for step in range(CHECK_STEPS):
        # (from the prompt, not the row: a row fed the same prompt alone gets the same tokens)
        forced = [(977 * step + 13 * p[0] + 5) % min(m.vocab, 30000) + 1 for p in prompts]
        rows.append(m.decode(seqs, forced).numpy().reshape(n, -1))
    for s in seqs:
        if m.lora is not None:
            m.lora.bind(s, None)
        m.remove_sequence(s)
    return np.stack(rows).astype(np.float32)


def compare(got: np.ndarray, want: np.ndarray, tol: float) -> dict[str, Any]:
    """Max |difference| relative to the largest |want|, and argmax agreement per row. An argmax may differ only where
    want's two largest logits are closer than twice that row's difference (a near tie rounding may flip)."""
    err = np.abs(got - want).max(axis=-1)
    rel = float(err.max() / np.abs(want).max())
    top2 = np.sort(want, axis=-1)[..., -2:]
    decisive = top2[..., 1] - top2[..., 0] > 2 * err
    agree = got.argmax(-1) == want.argmax(-1)
    wrong = int((~agree & decisive).sum())
    return {"max_rel_err": rel, "argmax_equal": f"{int(agree.sum())}/{agree.size}", "argmax_wrong": wrong,
            "ok": bool(rel <= tol and wrong == 0)}


def differ(got: np.ndarray, want: np.ndarray, tol: float) -> dict[str, Any]:
    """got and want are apart by far more than rounding: max |difference| relative to the largest |want|."""
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    return {"max_rel_diff": rel, "ok": bool(rel > 10 * tol)}


def _tolerance(config: dict[str, Any]) -> float:
    # test_parity's bounds: float16 compute rounds at ~1e-3 per op, float32 at ~1e-7
    return 2e-2 if config["model_dtype"] in ("float16", "bfloat16") else 1e-4


def merged_check(base, lora, adapter, tensors: dict[str, tuple[np.ndarray, np.ndarray]], tol: float,
                 prompts: list[list[int]]) -> dict[str, Any]:
    """The LoRA library with an adapter on one layer against the base library with the adapter merged into that
    layer's float weights (W + scaling * B @ A, computed in float32 numpy, then cast to the weights' dtype). The base
    library's weights are put back afterwards."""
    from mlcc.lora_format import LoraLayout

    layout = LoraLayout.from_config(lora.config["lora"])
    index = {p["name"]: i for i, p in enumerate(base.config["params"])}
    scaling = np.float32(ALPHA_PER_RANK)   # lora_alpha / r
    saved = []
    try:
        for t in layout.targets:
            if not any(module in tensors for module, _ in t.parts):
                continue
            i = index[f"{t.name}.weight"]   # a KeyError here: the float weight is not stored under this name
            w = base.params[i].numpy()
            saved.append((i, w))
            merged, start = w.astype(np.float32), 0
            for module, rows in t.parts:   # each HF module's rows, in the fused weight's output order
                a, b = tensors[module]
                merged[start:start + rows] += scaling * np.float32(t.scale) * (b @ a)
                start += rows
            base.params[i].copyfrom(merged.astype(w.dtype))
        slot = lora.lora.acquire(adapter, set())
        want = forced_logits(base, [None] * len(prompts), prompts)
        got = forced_logits(lora, [slot] * len(prompts), prompts)
        unmerged = forced_logits(lora, [None] * len(prompts), prompts)
    finally:
        for i, w in saved:
            base.params[i].copyfrom(w)
    match = compare(got, want, tol)
    # one layer of many moves the logits less than a whole adapter does: what shows the product is the right one is
    # that the adapted logits sit far closer to the merged reference than to the base's
    effect = float(np.abs(got - unmerged).max() / np.abs(unmerged).max())
    return {"projections_merged": len(saved), **match, "adapter_effect_rel": effect,
            "ok": match["ok"] and effect > 5 * match["max_rel_err"]}


def run_checks(base, lora, adapters: list, zero, merge: tuple | None, tol: float) -> dict[str, Any]:
    """Every check of the docstring; "ok" when all pass."""
    vocab = base.vocab
    distinct = [_check_prompt(s, vocab) for s in range(4)]
    same = [_check_prompt(0, vocab)] * 4
    want = forced_logits(base, [None] * 4, distinct)
    checks: dict[str, Any] = {}
    checks["no_adapter_vs_base"] = compare(forced_logits(lora, [None] * 4, distinct), want, tol)
    in_use = {zero.key, adapters[0].key, adapters[1].key}
    z, a0, a1 = (lora.lora.acquire(x, in_use) for x in (zero, adapters[0], adapters[1]))
    checks["zero_adapter_vs_base"] = compare(forced_logits(lora, [z] * 4, distinct), want, tol)
    # one prompt on every row: the rows differ only by their adapter
    slots = [a0, None, a1, z]
    mixed = forced_logits(lora, slots, same)
    alone = np.concatenate([forced_logits(lora, [s], same[:1]) for s in slots], axis=1)
    checks["mixed_batch_vs_each_alone"] = compare(mixed, alone, tol)
    checks["adapter_0_vs_base"] = differ(mixed[:, 0], mixed[:, 1], tol)
    checks["adapter_1_vs_base"] = differ(mixed[:, 2], mixed[:, 1], tol)
    checks["adapter_0_vs_adapter_1"] = differ(mixed[:, 0], mixed[:, 2], tol)
    if merge is not None:
        checks["merged_layer_vs_adapter"] = merged_check(base, lora, *merge, tol, distinct[:2])
    else:
        checks["merged_layer_vs_adapter"] = {"skipped": "quantized base weights: a merge would quantize them again"}
    checks["ok"] = all(c.get("ok", True) for c in checks.values())
    return checks


# --- timing ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Variant:
    """One timed configuration: a library, its sequences (each bound to an adapter slot or none) and their last ids."""

    label: str
    model: Any
    library: str
    seqs: list[int]
    adapters: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    fetcher: Any = None
    tok_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def batch(self) -> int:
        return len(self.seqs)

    def steps(self, n: int) -> float:
        """n decode steps of every sequence; seconds."""
        if self.batch == 1:   # the engine's loop for a lone greedy request
            from decode import decode_steps

            got, seconds = decode_steps(self.model, self.tokens[0], n, True, self.fetcher, self.seqs[0])
            self.tokens = [got[-1]]
            return seconds
        argmax, toks = self.model.argmax, self.tokens
        t = time.perf_counter()
        for _ in range(n):   # the engine's batched step: decode, argmax, every id read back
            toks = [int(x) for x in argmax(self.model.decode(self.seqs, toks)).numpy()[:self.batch]]
        seconds = time.perf_counter() - t
        self.tokens = toks
        return seconds


def start(v: Variant, slots: list[int | None], vocab: int) -> Variant:
    """Add v's sequences, bind their adapters, prefill a distinct prompt each; their first ids from the prefill."""
    from mlcc.runtime.device.token_fetch import TokenFetcher

    for s, slot in zip(v.seqs, slots):
        v.model.add_sequence(s)
        if v.model.lora is not None:
            v.model.lora.bind(s, slot)
        prompt = [(11 + 37 * i + 101 * s) % min(vocab, 30000) + 1 for i in range(PROMPT)]
        v.tokens.append(int(v.model.argmax(v.model.prefill([s], [prompt])).numpy()[0]))
    v.fetcher = TokenFetcher(v.model.dev)
    return v


def time_variants(base, lora, adapters: list, a) -> list[Variant]:
    """The six variants (base, LoRA without adapters, LoRA with adapters; at --batch and at 1), timed in
    interleaved rounds."""
    per_seq = PROMPT + a.warmup + a.rounds * a.steps + 32
    base.create_kv_cache(a.batch + 1, (a.batch + 1) * per_seq, 512)
    lora.create_kv_cache(2 * a.batch + 2, (2 * a.batch + 2) * per_seq, 512)
    in_use = {x.key for x in adapters}
    slots = [lora.lora.acquire(x, in_use) for x in adapters]
    B = a.batch
    vocab = base.vocab
    variants = [
        start(Variant("base", base, "base", list(range(B)), 0), [None] * B, vocab),
        start(Variant("lora, no adapter", lora, "lora", list(range(B)), 0), [None] * B, vocab),
        start(Variant(f"lora, {len(adapters)} adapters", lora, "lora", list(range(B, 2 * B)), len(adapters)),
              [slots[i % len(slots)] for i in range(B)], vocab),
        start(Variant("base", base, "base", [B], 0), [None], vocab),
        start(Variant("lora, no adapter", lora, "lora", [2 * B], 0), [None], vocab),
        start(Variant("lora, 1 adapter", lora, "lora", [2 * B + 1], 1), [slots[0]], vocab),
    ]
    for v in variants:
        v.steps(a.warmup)
    for r in range(a.rounds):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:   # the order rotates each round
            v.tok_s.append(v.batch * a.steps / v.steps(a.steps))
        print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{v.label} b{v.batch} {v.tok_s[-1]:.1f}" for v in variants),
              flush=True)
    return variants


# --- run ------------------------------------------------------------------------------------------------------------

def _device(m) -> str:
    if m.device_kind == "cuda":
        return device_name()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    from mlcc.runtime.device.cpu_threads import configure_cpu_threads

    return f"cpu: {cpu} ({configure_cpu_threads(None)} threads)"


def run_one(folder: Path, a, build: dict[str, Any]) -> list[dict[str, Any]]:
    """Checks, then timing, of one model/quantization's two libraries; its rows."""
    from mlcc.runtime.device.lora import read_adapter
    from mlcc.runtime.device.model import LoadedModel

    base = LoadedModel(folder / "base", weights="random")
    lora = LoadedModel(folder / "lora", weights="random")
    model, quant = folder.name.rsplit("-", 1)
    head = {"bench": "lora", "model": f"{model} shape (random weights)", "quant": quant, "device": _device(base)}
    if lora.lora is None:
        raise SystemExit(f"{folder / 'lora'} has no LoRA pool: build it with `bench/lora.py build`")
    same_specs = [(p["name"], p["shape"], p["dtype"]) for p in base.config["params"]] == \
        [(p["name"], p["shape"], p["dtype"]) for p in lora.config["params"]]
    if not same_specs:   # the seeded random weights would differ, and every comparison with them
        raise SystemExit(f"{folder}: the base and LoRA libraries' parameters differ (built from other code?)")
    layout, cfg = lora.lora.layout, lora.config["model_config"]
    if not 2 <= a.adapters <= layout.max_loras or a.rank > layout.max_rank:
        raise SystemExit(f"{folder / 'lora'}: its pool holds {layout.max_loras} adapters of rank up to "
                         f"{layout.max_rank}; asked for {a.adapters} of rank {a.rank} (the checks need 2 or more)")
    tol = _tolerance(lora.config)
    with tempfile.TemporaryDirectory(prefix="mlcc-lora-bench-") as tmp:
        t = time.perf_counter()
        adapters = []
        for i in range(a.adapters):
            write_adapter(Path(tmp) / f"a{i}", cfg, a.rank, seed=100 + i)
            adapters.append(read_adapter(f"a{i}", Path(tmp) / f"a{i}", layout))
        write_adapter(Path(tmp) / "zero", cfg, a.rank, seed=99, zero=True)
        zero = read_adapter("zero", Path(tmp) / "zero", layout)
        merge = None
        if lora.config["quantization"].startswith("q0"):   # float base weights: the merged reference applies
            layer = cfg["num_hidden_layers"] // 2
            # (B larger than the others': one layer's product must still move the logits well past float16's
            # rounding, which the comparison with the merged weights allows)
            kept = write_adapter(Path(tmp) / "merge", cfg, a.rank, seed=98, layers=[layer], b_std=0.08)
            merge = (read_adapter("merge", Path(tmp) / "merge", layout), kept)
        print(f"{folder.name}: {a.adapters + 1 + (merge is not None)} adapters of rank {a.rank} written and read in "
              f"{time.perf_counter() - t:.1f}s", flush=True)
    checks = run_checks(base, lora, adapters, zero, merge, tol)
    print(f"{folder.name} checks (tolerance {tol:g}):", json.dumps(checks), flush=True)
    if not checks["ok"]:
        return [{**head, "error": "checks failed: not timed", "checks": checks}]
    variants = time_variants(base, lora, adapters, a)
    rows = []
    for v in variants:
        ref = next(b for b in variants if b.library == "base" and b.batch == v.batch)
        tok, base_tok = statistics.median(v.tok_s), statistics.median(ref.tok_s)
        row = {**head, "batch": v.batch, "adapters": v.adapters, "rank": a.rank if v.adapters else 0,
               "tok_per_s": tok, "base_tok_per_s": base_tok, "overhead": base_tok / tok - 1, "library": v.library,
               "variant": v.label, "loop": "pipelined" if v.batch == 1 else "batched, ids read back",
               "tok_per_s_rounds": [round(x, 2) for x in v.tok_s], "steps_per_round": a.steps,
               "context": [PROMPT, PROMPT + a.warmup + a.rounds * a.steps], "checks": checks,
               "build": {k: build.get(k) for k in ("commit", "host", "target")},
               "compile_s": build.get("compile_s", {}).get(f"{folder.name}/{v.library}")}
        if v.adapters:
            row["goal"] = GOALS["batched" if v.batch > 1 else "single"]
            row["goal_met"] = row["overhead"] <= row["goal"]
            plain = next(b for b in variants if b.library == "lora" and not b.adapters and b.batch == v.batch)
            row["overhead_vs_lora_no_adapter"] = statistics.median(plain.tok_s) / tok - 1
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["model", "quant", "batch", "adapters", "library", "tok/s", "base tok/s", "overhead", "vs LoRA lib, none",
            "goal"]
    table = []
    for r in rows:
        if "tok_per_s" not in r:
            print(f"{r['model']} {r['quant']}: {r.get('error')}")
            continue
        goal = f"<= {r['goal']:.0%}: {'met' if r['goal_met'] else 'NOT met'}" if "goal" in r else ""
        vs = f"{r['overhead_vs_lora_no_adapter']:+.1%}" if "overhead_vs_lora_no_adapter" in r else ""
        table.append([r["model"].split()[0], r["quant"], str(r["batch"]), str(r["adapters"]), r["library"],
                      f"{r['tok_per_s']:.1f}", f"{r['base_tok_per_s']:.1f}", f"{r['overhead']:+.1%}", vs, goal])
    widths = [max(len(c), *(len(t[i]) for t in table)) if table else len(c) for i, c in enumerate(cols)]
    for t in [cols] + table:
        print("  ".join(x.ljust(w) for x, w in zip(t, widths)), flush=True)


def cmd_run(a) -> None:
    libs = Path(a.libs)
    build_file = libs / "build.json"
    build = json.loads(build_file.read_text()) if build_file.exists() else {}
    folders = sorted(p for p in libs.iterdir() if (p / "base").is_dir() and (p / "lora").is_dir())
    if a.only:
        folders = [p for p in folders if p.name in a.only.split(",")]
    if not folders:
        raise SystemExit(f"{libs}: no <model>-<quant>/base and /lora libraries (run `bench/lora.py build` first)")
    rows: list[dict[str, Any]] = []
    for folder in folders:
        rows += run_one(folder, a, build)
        write_json(a.out, "lora.json", rows)   # after every model: a run cut short keeps what it measured
        gc.collect()   # (the two libraries' weights and KV caches, before the next pair is loaded)
    print_table(rows)
    print(f"rows: {write_json(a.out, 'lora.json', rows)}")


def _run_args(p) -> None:
    p.add_argument("--libs", required=True, help="bench/lora.py build's --out")
    p.add_argument("--out", required=True)
    p.add_argument("--only", default=None, help="comma-separated folders under --libs, e.g. llama3-8b-q4f16_1")
    p.add_argument("--batch", type=int, default=32, help="streams decoded together")
    p.add_argument("--adapters", type=int, default=8, help="adapters the streams are spread over")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=64, help="decode steps per variant and round")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=8, help="untimed decode steps per variant first")


# --- build ----------------------------------------------------------------------------------------------------------

def cmd_build(a) -> None:
    from mlcc.compiler.build import compile_shape_only

    out = Path(a.out)
    options = parse_options(a.option)
    lora_options = dataclasses.replace(options, max_loras=a.max_loras, max_lora_rank=a.max_lora_rank)
    info = {**build_info(options), "lora_options": lora_options.to_dict(), "target": a.target, "compile_s": {}}
    arch, cfg = MODELS[a.model]
    for quant in a.quant.split(","):
        for kind, opts in (("base", options), ("lora", lora_options)):
            s = compile_shape_only(arch, cfg, a.target, quant, out / f"{a.model}-{quant}" / kind, options=opts)
            info["compile_s"][f"{a.model}-{quant}/{kind}"] = s
            print(f"{a.model} {quant} {kind}: compiled for {a.target} in {s:.1f}s", flush=True)
            write_json(out, "build.json", info)   # after every library: a build cut short keeps what it made


def _build_args(p) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama3-8b", help=f"a preset shape: {', '.join(MODELS)}")
    p.add_argument("--quant", default="q4f16_1", help="comma-separated quantizations, e.g. q4f16_1,q0f16")
    p.add_argument("--target", default="cuda", help="cuda (cross-compiled here) or llvm (this CPU)")
    p.add_argument("--max-loras", type=int, default=8, help="the LoRA build's pool: adapters one step may mix")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the LoRA build's largest adapter rank")
    add_options_argument(p)


if __name__ == "__main__":
    cli(__doc__, {"build": (cmd_build, _build_args), "run": (cmd_run, _run_args)})
