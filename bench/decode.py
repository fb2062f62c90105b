"""Batch-1 decode and prefill speed on CUDA: mlcc, transformers eager and torch.compile, and the memory-bandwidth
roofline, every column from one run; A/B runs between builds; where a step's GPU time goes.

    # any machine (no GPU needed): shape-only CUDA libraries of the preset shapes (+ their compile times), then the
    # CPU build's logits of the small shapes, which the GPU run checks the CUDA builds against before timing them
    python bench/decode.py build --out .dev/bench
    python bench/decode.py reference --out .dev/bench
    # the CUDA machine (`bash bench/gpu.sh decode` runs these three)
    python bench/decode.py mlcc --libs .dev/bench --out OUT
    python bench/decode.py hf --out OUT
    python bench/decode.py table OUT/decode_mlcc.json OUT/decode_hf.json [--markdown]

Weights are random (speed does not depend on values); the output length is fixed (EOS ignored). mlcc decodes with
the engine's pipelined loop (runtime.device.graph_decode: a lone greedy request) and, in alternating rounds over the
same contexts, the synchronous loop (decode, argmax, read the id, repeat); every id reaches the host, as in
serving. Before timing, every build is checked: argmax against numpy, decode_graph against plain decode (exact
logits over several metadata layouts), pipelined against synchronous ids, and the small shapes' logits against
the CPU build. Roofline = bytes that must be read per decode token (weights once, the KV cache of the context)
divided by the device-to-device copy bandwidth measured in the same run. transformers runs the same shape in fp16
with a static cache: generate() eager, and one-token steps through torch.compile(mode="reduce-overhead",
fullgraph=True) gpt-fast style (generate() itself does not compile on transformers 5.17).
`build --option KEY=VALUE` builds with other CompileOptions (e.g. `--option pdl=0` for a profile whose kernel
times are their own).

A/B of builds of one shape: every variant loaded in one process and timed in interleaved rounds, which cancels the
drift between runs (the step time moves by a few percent from one run to the next, more than one kernel change is
worth).

    python bench/decode.py ab-build --out .dev/ab --model llama3-8b-q4f16_1 --variants base,no-pdl
    python bench/decode.py reference --out .dev/ab                 # optional: the small shapes' CPU logits
    python bench/decode.py ab-run --libs .dev/ab --out OUT          # the CUDA machine

A variant is a CompileOptions value: a name from VARIANTS, or fields joined by '+' (`pdl=0+decode_graph=0`).
"sync" is base's library timed with the synchronous loop instead of the engine's pipelined loop. Any other folder
under --libs holding the model is a variant too: to compare against another commit, build there (`git worktree add
/tmp/wt REV`, then `PYTHONPATH=/tmp/wtpkg python bench/decode.py ab-build ...` with /tmp/wtpkg/mlcc linked to
/tmp/wt, since PYTHONPATH wins over the editable install) and copy its base folder in under another name. Each
variant is checked before it is timed, as above; `--fixed-context` starts every round from the same 128-token
prompt, so rounds differ only in time (clocks, temperature), not in context length.

Where a batch-1 decode step (or a prefill, or a verify) spends its GPU time, kernel by kernel: torch.profiler
(CUPTI) records every CUDA kernel in the process, TVM's included; per token, each kernel's calls and time, and the
GPU's idle gaps over 2 us by the kernels around them. With PDL the profiler counts a kernel's wait for its
predecessor as its own busy time, so kernel times come from a build without it and idle gaps from the default one:

    python bench/decode.py build --out .dev/prof-nopdl --only llama3-8b/q4f16_1 --option pdl=0
    python bench/decode.py profile --libs .dev/prof-nopdl --model llama3-8b-q4f16_1 --out OUT
    python bench/decode.py profile --libs .dev/bench --model llama3-8b-q4f16_1 --prefill 2048 --steps 3 --out OUT
    python bench/decode.py profile --libs .dev/bench --model llama3-8b-q4f16_1 --verify 5 --out OUT

--verify K profiles a speculative verify forward of K tokens after a 1,024-token context, as runtime.spec.speculative
calls it (the logits of every position, their argmax read, the K tokens popped again). --batch N profiles batched
decode steps of N sequences with 128-token contexts, as a serving step at that batch makes them.
"""
from __future__ import annotations

import collections
import gc
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import add_options_argument, build_info, cli, parse_options, presets, write_json

from mlcc.artifact import built_options
from mlcc.options import CompileOptions

MODELS = {name: (p.family, p.config) for name, p in presets().items()}
RUNS = [("llama3-8b", "q4f16_1"), ("llama3-8b", "q0f16"), ("qwen3-8b", "q4f16_1"), ("gemma2-9b", "q4f16_1"),
        ("qwen2.5-0.5b", "q4f16_1"), ("smollm2-135m", "q4f16_1")]
PROMPT, STEPS, ROUNDS = 128, 256, 4   # 2 x 256 steps: pipelined and synchronous rounds alternate
CHECKED = ("smollm2-135m", "qwen2.5-0.5b")   # small enough to run on the CPU here as the reference
# checked against a CPU reference too, though not in the table: the float16 decode GEMV kernel's small shapes
EXTRA_CHECKED = [("smollm2-135m", "q0f16")]
# a few hundred tokens of context, so decode attention runs multi-step chunks
CHECK_PROMPT = [7, 1, 99, 3000, 42, 5, 123, 8] + [(37 * i) % 40000 + 10 for i in range(250)]
CHECK_FORCED = [11, 2024, 5, 777, 31000, 9, 400, 16000]
CHECK_STEPS = len(CHECK_FORCED)


def teacher_forced_logits(m, forced: list[int]) -> tuple[np.ndarray, list[int]]:
    """Logits after the check prompt and after each decode step fed a fixed token (random weights make the greedy
    tokens of both builds constant, which would test little), so both builds see identical inputs."""
    m.create_kv_cache(1, 1024, 512)
    m.add_sequence(0)
    rows = [m.prefill([0], [CHECK_PROMPT]).numpy().reshape(-1)]
    toks = []
    for i in range(CHECK_STEPS):
        toks.append(int(rows[-1].argmax()))
        rows.append(m.decode([0], [forced[i]]).numpy().reshape(-1))
    m.remove_sequence(0)
    return np.stack(rows).astype(np.float32), toks


def decode_steps(m, tok: int, steps: int, pipelined: bool, fetcher=None, seq: int = 0) -> tuple[list[int], float]:
    """`steps` greedy batch-1 decode steps of sequence `seq` from token `tok`; (the new ids, seconds). Each id
    reaches the host, as in serving: pipelined = the engine's loop for a lone greedy request
    (runtime.device.graph_decode), else the synchronous loop (decode, argmax, read, repeat)."""
    from mlcc.runtime.core.sampler import DeviceDraw
    from mlcc.runtime.device.graph_decode import decode_pipelined

    argmax = m.argmax
    got: list[int] = []
    t = time.perf_counter()
    if pipelined:
        decode_pipelined(m, seq, tok, DeviceDraw(argmax), fetcher, lambda in_flight: len(got) + in_flight < steps,
                         lambda t_: got.append(t_) or True)
    else:
        for _ in range(steps):
            tok = int(argmax(m.decode([seq], [tok])).numpy()[0])
            got.append(tok)
    return got, time.perf_counter() - t


def cmd_reference(a) -> None:
    """The CPU (llvm) build of each checked shape, same quantization and the same seeded random weights."""
    from mlcc.compiler.build import compile_shape_only
    from mlcc.runtime.device.model import LoadedModel

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ref = {}
    with tempfile.TemporaryDirectory(prefix="mlcc-ref-") as tmp:
        for model, quant in RUNS + EXTRA_CHECKED:
            if model not in CHECKED or not _selected(a, model, quant):
                continue
            arch, cfg = MODELS[model]
            d = Path(tmp) / f"{model}-{quant}"
            compile_shape_only(arch, cfg, "llvm", quant, d)
            logits, toks = teacher_forced_logits(LoadedModel(d, weights="random"), CHECK_FORCED)
            ref[f"{model}/{quant}/logits"], ref[f"{model}/{quant}/tokens"] = logits, np.array(toks)
            print(model, quant, "reference tokens", toks, flush=True)
    np.savez_compressed(out / "reference.npz", **ref)


def _selected(a, model: str, quant: str) -> bool:
    return not a.only or f"{model}/{quant}" in a.only.split(",")


def check_argmax(m) -> bool:
    """The compiled argmax against numpy on rows with ties, a maximum in the last partial chunk, and random rows."""
    import tvm

    vocab = m.config["vocab_size"]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, vocab)).astype(np.float32)
    x[1, [5, vocab - 1]] = 100.0      # tie: the lower index wins, like numpy
    x[2, vocab - 1] = 100.0           # the last element
    got = m.argmax(tvm.runtime.tensor(x, m.dev)).numpy()
    return bool((got == x.argmax(-1)).all())


def check_pipelined_decode(m, fetcher, steps: int = 100) -> dict:
    """The pipelined loop's greedy ids against the synchronous loop's, from the same prompt (two sequences)."""
    m.create_kv_cache(2, 4096, 2048)
    ids = {}
    for seq, pipelined in ((0, False), (1, True)):
        m.add_sequence(seq)
        first = int(m.argmax(m.prefill([seq], [[7, 1, 99, 3000, 42]])).numpy()[0])
        ids[pipelined] = [first] + decode_steps(m, first, steps, pipelined, fetcher, seq)[0]
    same = sum(a == b for a, b in zip(ids[False], ids[True]))
    return {"ok": ids[False] == ids[True], "same": same, "of": len(ids[False]), "overlaps": fetcher.overlaps}


def check_graph_decode(m, steps: int = 200) -> dict:
    """decode_graph against plain decode: two sequences of one cache fed the same tokens (prompt 7, then `steps`
    steps: several metadata layouts, so several captured graphs), logits compared exactly. The graph is told to
    forget sequence 1, which therefore decodes through the plain `decode` function."""
    if m.graph is None:
        return {"graph": False}
    m.create_kv_cache(2, 2 * (steps + 64), 512)
    toks = np.random.default_rng(2).integers(0, m.vocab, steps + 7).tolist()
    rows = {}
    for seq in (1, 2):
        m.add_sequence(seq)
        if seq == 1:
            m.graph.forget(seq)
        rows[seq] = [m.prefill([seq], [toks[:7]]).numpy()] + [m.decode([seq], [t]).numpy() for t in toks[7:]]
    assert not m.graph.serves(1) and m.graph.serves(2)
    same = sum(bool(np.array_equal(a, b)) for a, b in zip(rows[1], rows[2]))
    m.remove_sequence(1)
    m.remove_sequence(2)
    return {"graph": True, "graph_equal_steps": f"{same}/{len(rows[1])}", "ok": same == len(rows[1])}


def check_against_reference(m, ref, key: str) -> dict:
    """Max |logit difference| relative to the largest reference logit, and greedy agreement, per step."""
    logits, _ = teacher_forced_logits(m, CHECK_FORCED)
    want = ref[f"{key}/logits"]
    rel = float(np.abs(logits - want).max() / np.abs(want).max())
    same = int((logits.argmax(-1) == want.argmax(-1)).sum())
    return {"max_rel_err": rel, "argmax_equal": f"{same}/{len(want)}", "ok": rel < 5e-2 and same >= len(want) - 1}


def cmd_build(a) -> None:
    from mlcc.compiler.build import compile_shape_only

    out = Path(a.out)
    options = parse_options(a.option)
    info = {**build_info(options), "compile_s": {}}
    # --only may name any preset and quantization (a float32 reference build, say), not just the table's rows
    for model, quant in [tuple(r.split("/")) for r in a.only.split(",")] if a.only else RUNS:
        arch, cfg = MODELS[model]
        s = compile_shape_only(arch, cfg, "cuda", quant, out / f"{model}-{quant}", options=options)
        info["compile_s"][f"{model}/{quant}"] = s
        print(f"{model} {quant}: compiled for cuda in {s:.1f}s", flush=True)
        write_json(out, "build.json", info)  # after every library: a build cut short keeps what it made


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy (the achievable memory bandwidth)."""
    import torch

    x = torch.empty(1 << 30, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = 20
    for _ in range(n):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 4 * n / (time.perf_counter() - t)
    del x, y
    torch.cuda.empty_cache()
    return bw


def bytes_per_token(cfg: dict, params: list[dict], ctx: int, kv_itemsize: int) -> int:
    """Weights read once per token (the embedding table contributes one row, unless it is also the LM head)."""
    total = 0
    for p in params:
        n = int(np.prod(p["shape"])) * np.dtype(p["dtype"]).itemsize
        if p["name"].startswith("model.embed_tokens") and not cfg["tie_word_embeddings"]:
            n //= p["shape"][0]
        total += n
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    total += 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * kv_itemsize * ctx
    return total


def cmd_mlcc(a) -> None:
    import torch

    from mlcc.runtime.device.model import LoadedModel
    from mlcc.runtime.device.token_fetch import TokenFetcher

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth()
    build = json.loads((Path(a.libs) / "build.json").read_text())
    ref_file = Path(a.libs) / "reference.npz"
    ref = np.load(ref_file) if ref_file.exists() else None
    rows = []
    for model, quant in RUNS:
        d = Path(a.libs) / f"{model}-{quant}"
        if not _selected(a, model, quant) or not d.is_dir():
            continue
        _, cfg = MODELS[model]
        free0 = torch.cuda.mem_get_info()[0]
        t = time.perf_counter()
        m = LoadedModel(d, weights="random")
        load_s = time.perf_counter() - t
        if not check_argmax(m):
            rows.append({"model": model, "quant": quant, "engine": "mlcc", "error": "argmax_logits differs from numpy"})
            print(rows[-1], flush=True)
            continue
        graph_check = check_graph_decode(m)
        print(model, quant, "decode_graph vs decode:", graph_check, flush=True)
        if not graph_check.get("ok", True):
            rows.append({"model": model, "quant": quant, "engine": "mlcc", "check": graph_check,
                         "error": "decode_graph differs from decode: not timed"})
            continue
        check = None
        if ref is not None and f"{model}/{quant}/logits" in ref:
            check = check_against_reference(m, ref, f"{model}/{quant}")
            print(model, quant, "check vs CPU build:", check, flush=True)
            if not check["ok"]:
                rows.append({"model": model, "quant": quant, "engine": "mlcc", "check": check,
                             "error": "logits differ from the CPU build: not timed"})
                continue
        fetcher = TokenFetcher(m.dev)
        pipe_check = check_pipelined_decode(m, fetcher)
        print(model, quant, "pipelined vs synchronous decode:", pipe_check, flush=True)
        if not pipe_check["ok"]:
            rows.append({"model": model, "quant": quant, "engine": "mlcc", "check": pipe_check,
                         "error": "pipelined decode differs from synchronous decode: not timed"})
            continue
        m.create_kv_cache(1, 4096, 2048)
        argmax = m.argmax
        # decode: one token per step, every id reaches the host; the pipelined loop (what the engine runs for a
        # lone greedy request) and the synchronous one, in alternating rounds over the same context lengths
        m.add_sequence(0)
        m.prefill([0], [[7] * PROMPT])
        tok = decode_steps(m, 7, 5, pipelined=False)[0][-1]
        spent = {True: 0.0, False: 0.0}
        for r in range(ROUNDS):
            for pipelined in ((True, False) if r % 2 else (False, True)):
                got, s = decode_steps(m, tok, STEPS // ROUNDS, pipelined, fetcher)
                tok, spent[pipelined] = got[-1], spent[pipelined] + s
        decode_s, sync_s = spent[True] / STEPS, spent[False] / STEPS
        # where the step goes, measured with a sync after each phase
        phases = {"embed": 0.0, "model": 0.0, "argmax+copy": 0.0}
        for _ in range(32):
            t0 = time.perf_counter()
            emb = m.embed([tok])
            m.dev.sync()
            t1 = time.perf_counter()
            logits = m.decode([0], [tok])
            m.dev.sync()
            t2 = time.perf_counter()
            tok = int(argmax(logits).numpy()[0])
            t3 = time.perf_counter()
            phases["embed"] += (t1 - t0) / 32 * 1e3
            phases["model"] += (t2 - t1 - (t1 - t0)) / 32 * 1e3  # decode() embeds again: subtract that
            phases["argmax+copy"] += (t3 - t2) / 32 * 1e3
            del emb
        m.remove_sequence(0)
        prefill = {}
        for n in (512, 2048):
            best = float("inf")
            for r in range(4):
                m.add_sequence(0)
                m.dev.sync()
                t = time.perf_counter()
                m.prefill([0], [[1 + i % 1000 for i in range(n)]]).numpy()
                best = min(best, time.perf_counter() - t) if r else best
                m.remove_sequence(0)
            prefill[n] = n / best
        peak = (free0 - torch.cuda.mem_get_info()[0]) / 2**30
        nbytes = bytes_per_token(cfg, m.config["params"], PROMPT + STEPS, 2)
        row = {"model": model, "quant": quant, "engine": "mlcc", "decode_tok_s": 1 / decode_s,
               "decode_tok_s_synchronous": 1 / sync_s, "pipelined_check": pipe_check,
               "roofline_tok_s": bw / nbytes, "bytes_per_token": nbytes, "copy_bw_GBs": bw / 1e9,
               "prefill_tok_s_512": prefill[512], "prefill_tok_s_2048": prefill[2048], "gpu_mem_GiB": peak,
               "load_s": load_s, "compile_s": build["compile_s"].get(f"{model}/{quant}"),
               "build": {k: build.get(k) for k in ("commit", "host", "cpus", "options")},
               "step_ms": {k: round(v, 3) for k, v in phases.items()}, "check_vs_cpu": check}
        row["fraction_of_roofline"] = row["decode_tok_s"] / row["roofline_tok_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_json(out, "decode_mlcc.json", rows)
        del m, argmax
        import gc

        gc.collect()
    write_json(out, "decode_mlcc.json", rows)


def static_cache_decode(hf, conf, steps: int, compiled: bool, warm: int = 8) -> tuple[float, list[int]]:
    """gpt-fast style: a StaticCache, eager prefill, then one-token decode steps through
    torch.compile(mode="reduce-overhead") (CUDA graphs). Returns (decode tok/s, greedy ids)."""
    import inspect

    import torch
    from transformers import StaticCache

    dev = next(hf.parameters()).device
    cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    try:
        cache = StaticCache(config=conf, max_cache_len=PROMPT + warm + steps + 8)
    except TypeError:  # older transformers
        cache = StaticCache(config=conf, max_batch_size=1, max_cache_len=PROMPT + warm + steps + 8, device=dev,
                            dtype=next(hf.parameters()).dtype)

    def step(ids, pos):
        return hf(input_ids=ids, position_ids=pos.unsqueeze(0), cache_position=pos, use_cache=True,
                  **{cache_kw: cache}).logits[:, -1]

    fn = torch.compile(step, mode="reduce-overhead", fullgraph=True) if compiled else step
    ids = torch.full((1, PROMPT), 7, device=dev)
    with torch.no_grad():
        tok = step(ids, torch.arange(PROMPT, device=dev)).argmax(-1, keepdim=True)
        out = [int(tok)]
        pos = PROMPT
        for i in range(warm + steps):
            if i == warm:
                torch.cuda.synchronize() if dev.type == "cuda" else None
                t = time.perf_counter()
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            tok = fn(tok, torch.tensor([pos], device=dev)).argmax(-1, keepdim=True).clone()
            out.append(int(tok))  # the id reaches the host every step, as in mlcc's loop
            pos += 1
        dt = time.perf_counter() - t
    return steps / dt, out


def cmd_hf(a) -> None:
    import torch
    import transformers as tf

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in a.models.split(","):
        arch, cfg = MODELS[model]
        conf = tf.AutoConfig.for_model(arch, **{k: v for k, v in cfg.items() if k != "rope_scaling"})
        if cfg.get("rope_scaling"):
            conf.rope_parameters = {**cfg["rope_scaling"], "rope_theta": cfg["rope_theta"]}
        with torch.device("cuda"):
            hf = tf.AutoModelForCausalLM.from_config(conf, torch_dtype=torch.float16).eval()
        ids = torch.full((1, PROMPT), 7, device="cuda")
        gen = dict(max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, cache_implementation="static",
                   pad_token_id=0)
        for mode in a.modes.split(","):
            if mode in ("compile-static", "eager-static"):  # the same one-token loop, compiled or not
                try:
                    tok_s, _ = static_cache_decode(hf, conf, STEPS, compiled=mode == "compile-static")
                    rows.append({"model": model, "quant": "fp16", "engine": f"transformers-{mode}",
                                 "decode_tok_s": tok_s, "transformers": tf.__version__, "torch": torch.__version__})
                except Exception as e:  # noqa: BLE001 - report, keep going
                    rows.append({"model": model, "engine": f"transformers-{mode}", "error": str(e)[:300]})
                print(json.dumps(rows[-1]))
                write_json(out, a.name, rows)
                continue
            if mode == "compile":
                hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
            try:
                with torch.no_grad():
                    hf.generate(ids, **{**gen, "max_new_tokens": 16, "min_new_tokens": 16})
                    hf.generate(ids, **gen)  # warm-up (compiles / captures graphs)
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    hf.generate(ids, **gen)
                    torch.cuda.synchronize()
                    dt = time.perf_counter() - t
                rows.append({"model": model, "quant": "fp16", "engine": f"transformers-{mode}",
                             "decode_tok_s": STEPS / dt, "transformers": tf.__version__})
            except Exception as e:  # noqa: BLE001 - report, keep going
                rows.append({"model": model, "engine": f"transformers-{mode}", "error": str(e)[:300]})
            print(json.dumps(rows[-1]))
            # written after every row: a run cut short keeps what it measured
            write_json(out, a.name, rows)
        del hf
        torch.cuda.empty_cache()
    write_json(out, a.name, rows)


def cmd_table(a) -> None:
    rows = [r for f in a.files for r in json.loads(Path(f).read_text())]
    hf = {(r["model"], r["engine"]): r.get("decode_tok_s") for r in rows if r["engine"].startswith("transformers")}
    cols = ["model", "quant", "mlcc tok/s", "sync loop", "roofline", "fraction", "transformers eager / +compile",
            "x compile", "prefill 512 / 2048", "GPU mem", "compile"]
    table = []
    for r in rows:
        if r["engine"] != "mlcc":
            continue
        if "decode_tok_s" not in r:
            print(f"{r['model']} {r['quant']}: {r.get('error')}")
            continue
        e = hf.get((r["model"], "transformers-eager-static")) or hf.get((r["model"], "transformers-eager"))
        c = hf.get((r["model"], "transformers-compile-static")) or hf.get((r["model"], "transformers-compile"))
        table.append([r["model"], r["quant"], f"{r['decode_tok_s']:.0f}", f"{r['decode_tok_s_synchronous']:.0f}",
                      f"{r['roofline_tok_s']:.0f}", f"{r['fraction_of_roofline']:.1%}",
                      f"{e:.0f} / {c:.0f}" if e and c else "—", f"{r['decode_tok_s'] / c:.2f}x" if c else "—",
                      f"{r['prefill_tok_s_512']:.0f} / {r['prefill_tok_s_2048']:.0f}", f"{r['gpu_mem_GiB']:.1f} GiB",
                      f"{r['compile_s']:.1f} s" if r.get("compile_s") is not None else "—"])
    if a.markdown:
        print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        for t in table:
            print("| " + " | ".join(t) + " |")
        return
    widths = [max(len(c), *(len(t[i]) for t in table)) if table else len(c) for i, c in enumerate(cols)]
    for t in [cols] + table:
        print("  ".join(x.rjust(w) if i > 1 else x.ljust(w) for i, (x, w) in enumerate(zip(t, widths))))


# --- A/B of builds, interleaved in one process ----------------------------------------------------------------------

VARIANTS = {
    "base": CompileOptions(),
    "no-pdl": CompileOptions(pdl=False),                          # no programmatic dependent launch
    "no-graph": CompileOptions(decode_graph=False),               # the VM launches every kernel of a step
    "dlight-gemv": CompileOptions(decode_gemv=False),             # dlight's GEMV rule instead of mlcc's kernels
    "no-gemv-fusion": CompileOptions(fuse_decode_gemv=False),     # RMSNorm and SwiGLU not folded into the GEMVs
    "tvm-attention": CompileOptions(split_decode_attention=False),  # TVM's paged decode attention kernel
    "splits16": CompileOptions(decode_attention_splits=16),       # every context cut into 16 chunks
    "attn-4-tokens": CompileOptions(decode_attention_tokens=4),   # 4 tokens scored per block and step
}
RUNTIME_VARIANTS = ("sync",)   # base's library, another loop


def variant_options(name: str) -> CompileOptions:
    if name in VARIANTS:
        return VARIANTS[name]
    if "=" in name:
        return CompileOptions.parse(name.split("+"))
    raise SystemExit(f"unknown variant {name!r}: one of {', '.join(VARIANTS)}, or KEY=VALUE fields joined by '+'")


def _ab_order(variant: str) -> tuple[int, str]:
    names = list(VARIANTS) + list(RUNTIME_VARIANTS)
    return (names.index(variant) if variant in names else len(names), variant)


def cmd_ab_build(a) -> None:
    from mlcc.compiler.build import compile_shape_only

    out = Path(a.out)
    for v in a.variants.split(","):
        if v in RUNTIME_VARIANTS:
            continue
        options = variant_options(v)
        info = {**build_info(options), "compile_s": {}}
        for model in a.model.split(","):
            name, quant = model.rsplit("-", 1)
            arch, cfg = MODELS[name]
            s = compile_shape_only(arch, cfg, "cuda", quant, out / v / model, options=options)
            info["compile_s"][model] = s
            print(f"{v} {model}: {s:.1f}s", flush=True)
        write_json(out / v, "build.json", info)


def cmd_ab_run(a) -> None:
    import numpy as np

    from mlcc.runtime.device.model import LoadedModel
    from mlcc.runtime.device.token_fetch import TokenFetcher

    libs = Path(a.libs)
    ref_file = libs / "reference.npz"
    ref = np.load(ref_file) if ref_file.exists() else None
    rows = []
    for model in sorted(p.name for p in (libs / "base").iterdir() if p.is_dir()):
        name, quant = model.rsplit("-", 1)
        loaded = {}
        built = [p.name for p in libs.iterdir() if (p / model).is_dir()]
        for v in sorted(set(built) | set(a.variants.split(",")), key=_ab_order):
            folder = libs / v / model if (libs / v / model).is_dir() else libs / "base" / model
            if v not in RUNTIME_VARIANTS and folder == libs / "base" / model and v != "base":
                print(model, v, "not built: skipped", flush=True)
                continue
            m = LoadedModel(folder, weights="random")
            fetcher = TokenFetcher(m.dev)
            try:
                check = {"argmax_ok": check_argmax(m), "graph": check_graph_decode(m),
                         "pipelined": check_pipelined_decode(m, fetcher)}
            except Exception as e:  # noqa: BLE001 - one broken variant must not cost the run's other rows
                print(model, v, "check raised:", repr(e), flush=True)
                rows.append({"model": model, "variant": v, "error": f"check raised {e!r}: not timed"})
                continue
            if ref is not None and f"{name}/{quant}/logits" in ref:
                check.update(check_against_reference(m, ref, f"{name}/{quant}"))
            print(model, v, "check:", check, flush=True)
            if not check["argmax_ok"] or not check["graph"].get("ok", True) or not check.get("ok", True) \
                    or not check["pipelined"]["ok"]:
                rows.append({"model": model, "variant": v, "check": check, "error": "check failed: not timed"})
                continue
            m.create_kv_cache(1, 4096, 2048)
            m.add_sequence(0)
            m.prefill([0], [[7] * 128])
            options = built_options(m.config).to_dict()
            loaded[v] = [m, 7, [], fetcher, options]
        for _ in range(a.rounds):
            for v, state in loaded.items():
                m, tok, times, fetcher, _ = state
                if a.fixed_context:
                    m.remove_sequence(0)
                    m.add_sequence(0)
                    m.prefill([0], [[7] * 128])
                tok = decode_steps(m, tok, 4, v != "sync", fetcher)[0][-1]
                got, seconds = decode_steps(m, tok, a.steps, v != "sync", fetcher)
                times.append(a.steps / seconds)
                state[1] = got[-1]
        for v, (m, _, times, _, options) in loaded.items():
            rows.append({"model": model, "variant": v, "options": options, "tok_s_median": statistics.median(times),
                         "tok_s_rounds": [round(x, 1) for x in times]})
            print(f"{model:24} {v:16} median {rows[-1]['tok_s_median']:8.1f} tok/s  rounds "
                  f"{rows[-1]['tok_s_rounds']}", flush=True)
        del loaded
        gc.collect()
        write_json(a.out, "ab_decode.json", rows)
    write_json(a.out, "ab_decode.json", rows)


# --- where a step's GPU time goes -----------------------------------------------------------------------------------

def _folded(kernel: str) -> str:
    """A kernel's name with its numeric suffixes folded (one row per kind of kernel, not per layer)."""
    return re.sub(r"\d+", "#", re.sub(r"(_kernel)?(_\d+)?$", "", kernel))


def cmd_profile(a) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mlcc.runtime.device.model import LoadedModel

    torch.cuda.init()
    m = LoadedModel(Path(a.libs) / a.model, weights="random")
    batch = a.batch if not (a.verify or a.prefill) else 1
    seqs = [0] + list(range(2, batch + 1))  # id 1 is the profiled prefill's
    m.create_kv_cache(batch + 1, 4096 + batch * 512, 2048)
    for s in seqs:
        m.add_sequence(s)
        m.prefill([s], [[7 + s % 1000] * (1024 if a.verify else 128)])
    argmax = m.argmax
    tok = 7
    toks = [7] * batch
    for _ in range(5):
        toks = [int(t) for t in argmax(m.decode(seqs, toks)).numpy()[:batch]]
    tok = toks[0]
    prompt = [1 + i % 1000 for i in range(a.prefill)]
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(a.steps):
            if a.verify:
                argmax(m.verify([0], [[tok] * a.verify])).numpy()
                m.popn(0, a.verify)
            elif a.prefill:
                m.add_sequence(1)
                m.prefill([1], [prompt]).numpy()
                m.remove_sequence(1)
            else:
                toks = [int(t) for t in argmax(m.decode(seqs, toks)).numpy()[:batch]]
        wall = (time.perf_counter() - t) / a.steps * 1e3
    kernels = collections.defaultdict(lambda: [0, 0.0])
    gaps = collections.defaultdict(lambda: [0, 0.0])  # idle GPU time, by the kernel before and after it
    spans = sorted((e.time_range.start, e.time_range.end, _folded(e.name))
                   for e in prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0)
    for (_, end, before), (start, _, after) in zip(spans, spans[1:]):
        if start - end > 2:  # us
            gaps[f"{before[:28]} -> {after[:28]}"][0] += 1
            gaps[f"{before[:28]} -> {after[:28]}"][1] += (start - end) / 1e3
    gpu_total = 0.0
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            name = _folded(e.name)
            kernels[name][0] += 1
            kernels[name][1] += e.device_time_total / 1e3  # ms
            gpu_total += e.device_time_total / 1e3
    rows = sorted(((k, c / a.steps, t / a.steps) for k, (c, t) in kernels.items()), key=lambda r: -r[2])
    unit = (f"prefill of {a.prefill}" if a.prefill else f"verify of {a.verify}" if a.verify
            else f"step of {batch}" if batch > 1 else "token")
    print(f"{a.model}: wall {wall:.3f} ms/{unit}, GPU busy {gpu_total / a.steps:.3f} ms/{unit} "
          f"({gpu_total / a.steps / wall:.0%}), kernels/token {sum(r[1] for r in rows):.0f}")
    print(f"{'kernel (digits folded)':60} {'calls/tok':>9} {'ms/tok':>8}")
    for k, c, t in rows[:25]:
        print(f"{k[:60]:60} {c:9.1f} {t:8.3f}")
    gap_rows = sorted(((k, c / a.steps, t / a.steps) for k, (c, t) in gaps.items()), key=lambda r: -r[2])
    print(f"{'GPU idle > 2 us, between':60} {'count/tok':>9} {'ms/tok':>8}")
    for k, c, t in gap_rows[:10]:
        print(f"{k[:60]:60} {c:9.1f} {t:8.3f}")
    name = f"profile_{a.model}{f'_prefill{a.prefill}' if a.prefill else ''}{f'_verify{a.verify}' if a.verify else ''}{f'_batch{batch}' if batch > 1 else ''}"
    write_json(a.out, f"{name}.json",
               {"model": a.model, "options": built_options(m.config).to_dict(), "unit": unit,
                "wall_ms_per_token": wall, "gpu_busy_ms_per_token": gpu_total / a.steps,
                "kernels": [{"name": k, "calls_per_token": c, "ms_per_token": t} for k, c, t in rows],
                "idle_gaps": [{"between": k, "per_token": c, "ms_per_token": t} for k, c, t in gap_rows]})


def _build_args(p) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--only", default=None, help="comma-separated model/quant pairs, e.g. llama3-8b/q4f16_1")
    add_options_argument(p)


def _reference_args(p) -> None:
    p.add_argument("--out", required=True, help="folder for reference.npz (the libraries' folder: mlcc reads it)")
    p.add_argument("--only", default=None, help="comma-separated model/quant pairs")


def _mlcc_args(p) -> None:
    p.add_argument("--libs", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--only", default=None, help="comma-separated model/quant pairs")


def _hf_args(p) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="llama3-8b", help=f"comma-separated presets ({', '.join(MODELS)})")
    p.add_argument("--modes", default="eager,compile-static",
                   help="eager / compile: generate(); eager-static / compile-static: the gpt-fast-style loop")
    p.add_argument("--name", default="decode_hf.json", help="result file name")


def _table_args(p) -> None:
    p.add_argument("files", nargs="+")
    p.add_argument("--markdown", action="store_true")


def _ab_build_args(p) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama3-8b-q4f16_1,qwen2.5-0.5b-q4f16_1,smollm2-135m-q4f16_1",
                   help="comma-separated PRESET-QUANT")
    p.add_argument("--variants", default="base", help=f"comma-separated: {', '.join(VARIANTS)} or KEY=VALUE+...")


def _ab_run_args(p) -> None:
    p.add_argument("--libs", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="base,sync", help="variants to time besides every folder under --libs")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--fixed-context", action="store_true")


def _profile_args(p) -> None:
    p.add_argument("--libs", required=True)
    p.add_argument("--model", default="llama3-8b-q4f16_1")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prefill", type=int, default=0, help="profile prefills of this many tokens instead of decode")
    p.add_argument("--verify", type=int, default=0, help="profile verify forwards of this many tokens instead")
    p.add_argument("--batch", type=int, default=1, help="profile decode steps of this many sequences (128-token contexts)")
    p.add_argument("--out", required=True)


if __name__ == "__main__":
    cli(__doc__, {"build": (cmd_build, _build_args), "reference": (cmd_reference, _reference_args),
                  "mlcc": (cmd_mlcc, _mlcc_args), "hf": (cmd_hf, _hf_args), "table": (cmd_table, _table_args),
                  "ab-build": (cmd_ab_build, _ab_build_args), "ab-run": (cmd_ab_run, _ab_run_args),
                  "profile": (cmd_profile, _profile_args)})
