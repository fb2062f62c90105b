"""Mixture-of-experts decode and prefill speed on CUDA (Qwen3-30B-A3B and Mixtral-8x7B shapes, q4f16_1): mlcc,
transformers on the same shapes in fp16, and the roofline from the bytes a token actually reads, from one run.

    # any machine (no GPU needed): shape-only CUDA libraries (the two shapes and two small checked ones), then the
    # CPU build's logits of the small ones, which the GPU run checks the CUDA builds against first
    python bench/moe.py build --out .dev/moe
    python bench/moe.py reference --out .dev/moe
    # the CUDA machine
    python bench/moe.py mlcc --libs .dev/moe --out OUT
    python bench/moe.py hf --out OUT
    python bench/moe.py table OUT/moe_mlcc.json OUT/moe_hf.json

Weights are random (seeded, drawn on the GPU machine; speed does not depend on their values, and random routers
spread tokens over the experts). Active bytes per token = the k selected experts' weights of every sparse layer
(k/E of the stacked expert tensors), attention, routers, norms, the LM head and one embedding row, plus the KV
cache of the context; the roofline divides them by the device-to-device copy bandwidth measured in the same run.
Before timing: the small shapes' logits (prefill, then teacher-forced decode steps) against the CPU build, and on
the timed shapes the compiled argmax, decode_graph against plain decode (exact) and the pipelined loop against the
synchronous one. transformers (default experts implementation: grouped_mm) runs the gpt-fast-style static-cache
loop of bench/decode.py, eager and, time permitting, torch.compile.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import decode as dense
import numpy as np
from harness import add_options_argument, build_info, cli, parse_options, write_json

QWEN3_30B_A3B = dict(  # Qwen/Qwen3-30B-A3B
    hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
    tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
MIXTRAL_8X7B = dict(  # mistralai/Mixtral-8x7B-v0.1
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
    tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2, sliding_window=None)
MODELS = {
    "qwen3-30b-a3b": ("qwen3_moe", QWEN3_30B_A3B),
    "mixtral-8x7b": ("mixtral", MIXTRAL_8X7B),
    # small enough for the CPU reference; the same routing (128 experts, top 8 / 8 experts, top 2)
    "qwen3-moe-small": ("qwen3_moe", {**QWEN3_30B_A3B, "hidden_size": 512, "num_hidden_layers": 3,
                                      "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                                      "moe_intermediate_size": 256, "vocab_size": 32000}),
    "mixtral-small": ("mixtral", {**MIXTRAL_8X7B, "hidden_size": 512, "num_hidden_layers": 3,
                                  "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 1024}),
}
TIMED = ["qwen3-30b-a3b", "mixtral-8x7b"]
CHECKED = ["qwen3-moe-small", "mixtral-small"]
QUANT = "q4f16_1"
STEPS, ROUNDS = 256, 4
HF_STEPS = 64


def cmd_build(a) -> None:
    from mlcc.compiler.build import compile_shape_only

    out = Path(a.out)
    options = parse_options(a.option)
    info = {**build_info(options), "compile_s": {}}
    for model in CHECKED + TIMED:
        if a.only and model not in a.only.split(","):
            continue
        arch, cfg = MODELS[model]
        s = compile_shape_only(arch, cfg, "cuda", QUANT, out / model, options=options)
        info["compile_s"][model] = s
        print(f"{model}: compiled for cuda in {s:.1f}s", flush=True)
        write_json(out, "build.json", info)


def cmd_reference(a) -> None:
    from mlcc.compiler.build import compile_shape_only
    from mlcc.runtime.device.model import LoadedModel

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ref = {}
    with tempfile.TemporaryDirectory(prefix="mlcc-ref-") as tmp:
        for model in CHECKED:
            arch, cfg = MODELS[model]
            compile_shape_only(arch, cfg, "llvm", QUANT, Path(tmp) / model)
            logits, toks = dense.teacher_forced_logits(LoadedModel(Path(tmp) / model, weights="random"),
                                                       dense.CHECK_FORCED)
            ref[f"{model}/{QUANT}/logits"], ref[f"{model}/{QUANT}/tokens"] = logits, np.array(toks)
            print(model, "reference tokens", toks, flush=True)
    np.savez_compressed(out / "reference.npz", **ref)


def active_bytes_per_token(cfg: dict, params: list[dict], ctx: int, kv_itemsize: int = 2) -> dict[str, int]:
    """Bytes one decode token reads, by part: a stacked expert tensor [E, ...] counts k/E of itself."""
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    k = cfg["num_experts_per_tok"]
    parts = {"experts": 0, "attention": 0, "router": 0, "embed+head": 0, "other": 0}
    for p in params:
        n = int(np.prod(p["shape"])) * np.dtype(p["dtype"]).itemsize
        name = p["name"]
        if ".experts." in name:
            parts["experts"] += n * k // experts
        elif name.startswith("model.embed_tokens"):
            parts["embed+head"] += n // p["shape"][0]
        elif name.startswith("lm_head"):
            parts["embed+head"] += n
        elif ".self_attn." in name:
            parts["attention"] += n
        elif name.endswith("mlp.gate.weight"):
            parts["router"] += n
        else:
            parts["other"] += n
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    parts["kv_cache"] = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * kv_itemsize * ctx
    parts["total"] = sum(parts.values())
    return parts


def _prefill_tok_s(m, n: int, budget_s: float) -> float:
    """Best of up to 3 timed prefills of n tokens after one warm-up (fewer when one takes long)."""
    best, spent = float("inf"), 0.0
    for r in range(4):
        m.add_sequence(0)
        m.dev.sync()
        t = time.perf_counter()
        m.prefill([0], [[1 + i % 1000 for i in range(n)]]).numpy()
        dt = time.perf_counter() - t
        m.remove_sequence(0)
        spent += dt
        if r:
            best = min(best, dt)
        if r and spent > budget_s:
            break
    return n / best


def cmd_mlcc(a) -> None:
    import torch

    from mlcc.runtime.device.model import LoadedModel
    from mlcc.runtime.device.token_fetch import TokenFetcher

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = dense.copy_bandwidth()
    libs = Path(a.libs)
    build = json.loads((libs / "build.json").read_text())
    ref = np.load(libs / "reference.npz") if (libs / "reference.npz").exists() else None
    rows = []
    for model in CHECKED:
        if ref is None or not (libs / model).is_dir():
            continue
        t = time.perf_counter()
        m = LoadedModel(libs / model, weights="random")
        check = dense.check_against_reference(m, ref, f"{model}/{QUANT}")
        check["load_s"] = time.perf_counter() - t
        rows.append({"model": model, "quant": QUANT, "engine": "mlcc", "check_vs_cpu": check})
        print(model, "check vs CPU build:", check, flush=True)
        write_json(out, "moe_mlcc.json", rows)
        del m
    for model in TIMED:
        d = libs / model
        if a.only and model not in a.only.split(",") or not d.is_dir():
            continue
        _, cfg = MODELS[model]
        free0 = torch.cuda.mem_get_info()[0]
        t = time.perf_counter()
        m = LoadedModel(d, weights="random")
        load_s = time.perf_counter() - t
        row = {"model": model, "quant": QUANT, "engine": "mlcc", "load_s": load_s,
               "compile_s": build["compile_s"].get(model),
               "build": {k: build.get(k) for k in ("commit", "host", "cpus", "options")}}
        checks = {"argmax": dense.check_argmax(m), "graph": dense.check_graph_decode(m, steps=96)}
        fetcher = TokenFetcher(m.dev)
        checks["pipelined"] = dense.check_pipelined_decode(m, fetcher, steps=64)
        row["checks"] = checks
        print(model, "checks:", checks, flush=True)
        if not (checks["argmax"] and checks["graph"].get("ok", True) and checks["pipelined"]["ok"]):
            row["error"] = "a check failed: not timed"
            rows.append(row)
            write_json(out, "moe_mlcc.json", rows)
            continue
        m.create_kv_cache(1, 4096, 2048)
        m.add_sequence(0)
        m.prefill([0], [[7] * dense.PROMPT])
        tok = dense.decode_steps(m, 7, 5, pipelined=False)[0][-1]
        spent = {True: 0.0, False: 0.0}
        for r in range(ROUNDS):
            for pipelined in ((True, False) if r % 2 else (False, True)):
                got, s = dense.decode_steps(m, tok, STEPS // ROUNDS, pipelined, fetcher)
                tok, spent[pipelined] = got[-1], spent[pipelined] + s
        m.remove_sequence(0)
        row["decode_tok_s"], row["decode_tok_s_synchronous"] = STEPS / spent[True], STEPS / spent[False]
        for n in (512, 2048):
            row[f"prefill_tok_s_{n}"] = _prefill_tok_s(m, n, budget_s=6.0)
            print(model, f"prefill {n}: {row[f'prefill_tok_s_{n}']:.0f} tok/s", flush=True)
        nbytes = active_bytes_per_token(cfg, m.config["params"], dense.PROMPT + STEPS)
        row.update(active_bytes=nbytes, copy_bw_GBs=bw / 1e9, roofline_tok_s=bw / nbytes["total"],
                   gpu_mem_GiB=(free0 - torch.cuda.mem_get_info()[0]) / 2**30)
        row["fraction_of_roofline"] = row["decode_tok_s"] / row["roofline_tok_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_json(out, "moe_mlcc.json", rows)
        del m
        import gc

        gc.collect()
    write_json(out, "moe_mlcc.json", rows)


def cmd_hf(a) -> None:
    import torch
    import transformers as tf

    deadline = time.time() + a.budget_s
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    out = Path(a.out)
    rows = []
    for model in a.models.split(","):
        arch, cfg = MODELS[model]
        conf = tf.AutoConfig.for_model(arch, **cfg)
        t = time.perf_counter()
        with torch.device(a.device):
            hf = tf.AutoModelForCausalLM.from_config(conf, dtype=torch.float16).eval()
        init_s = time.perf_counter() - t
        base = {"model": model, "quant": "fp16", "transformers": tf.__version__, "torch": torch.__version__,
                "init_s": init_s, "experts_implementation": getattr(conf, "_experts_implementation", None)}
        for n in (512, 2048):
            try:
                with torch.no_grad():
                    ids = torch.randint(0, cfg["vocab_size"], (1, n), device=a.device)
                    hf(ids)
                    sync()
                    t = time.perf_counter()
                    hf(ids)
                    sync()
                base[f"prefill_tok_s_{n}"] = n / (time.perf_counter() - t)
            except Exception as e:  # noqa: BLE001 - report, keep going
                base[f"prefill_{n}_error"] = str(e)[:200]
        for mode in a.modes.split(","):
            if time.time() > deadline:
                rows.append({**base, "engine": f"transformers-{mode}", "error": "skipped: out of time"})
                continue
            try:
                tok_s, _ = dense.static_cache_decode(hf, conf, HF_STEPS, compiled=mode == "compile-static")
                rows.append({**base, "engine": f"transformers-{mode}", "decode_tok_s": tok_s})
            except Exception as e:  # noqa: BLE001 - report, keep going
                rows.append({**base, "engine": f"transformers-{mode}", "error": str(e)[:300]})
            print(json.dumps(rows[-1]), flush=True)
            write_json(out, "moe_hf.json", rows)
        del hf
        torch.cuda.empty_cache()
    write_json(out, "moe_hf.json", rows)


def cmd_table(a) -> None:
    rows = [r for f in a.files if Path(f).exists() for r in json.loads(Path(f).read_text())]
    hf = {(r["model"], r["engine"]): r for r in rows if r["engine"].startswith("transformers")}
    cols = ["model", "mlcc tok/s", "sync loop", "active GB/token", "roofline", "fraction",
            "transformers eager / compile", "x transformers", "prefill 512 / 2048", "transformers prefill 512 / 2048",
            "GPU mem"]
    table = []
    for r in rows:
        if r["engine"] != "mlcc":
            continue
        if "check_vs_cpu" in r:
            print(f"{r['model']}: check vs CPU build {r['check_vs_cpu']}")
            continue
        if "decode_tok_s" not in r:
            print(f"{r['model']}: {r.get('error')} {r.get('checks')}")
            continue
        e = hf.get((r["model"], "transformers-eager-static"), {})
        c = hf.get((r["model"], "transformers-compile-static"), {})
        best = max(e.get("decode_tok_s") or 0, c.get("decode_tok_s") or 0)
        fmt = lambda x: f"{x:.0f}" if x else "—"  # noqa: E731
        table.append([r["model"], f"{r['decode_tok_s']:.0f}", f"{r['decode_tok_s_synchronous']:.0f}",
                      f"{r['active_bytes']['total'] / 1e9:.2f}", f"{r['roofline_tok_s']:.0f}",
                      f"{r['fraction_of_roofline']:.1%}",
                      f"{fmt(e.get('decode_tok_s'))} / {fmt(c.get('decode_tok_s'))}",
                      f"{r['decode_tok_s'] / best:.2f}x" if best else "—",
                      f"{r['prefill_tok_s_512']:.0f} / {r['prefill_tok_s_2048']:.0f}",
                      f"{fmt(e.get('prefill_tok_s_512'))} / {fmt(e.get('prefill_tok_s_2048'))}",
                      f"{r['gpu_mem_GiB']:.1f} GiB"])
    if a.markdown:
        print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        for t in table:
            print("| " + " | ".join(t) + " |")
        return
    widths = [max(len(c), *(len(t[i]) for t in table)) if table else len(c) for i, c in enumerate(cols)]
    for t in [cols] + table:
        print("  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(t, widths))))


def _build_args(p) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--only", default=None, help=f"comma-separated models ({', '.join(MODELS)})")
    add_options_argument(p)


def _reference_args(p) -> None:
    p.add_argument("--out", required=True, help="the libraries' folder (reference.npz travels with them)")


def _mlcc_args(p) -> None:
    p.add_argument("--libs", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--only", default=None, help="comma-separated timed models")


def _hf_args(p) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--models", default=",".join(TIMED))
    p.add_argument("--modes", default="eager-static,compile-static",
                   help="eager-static / compile-static: bench/decode.py's static-cache one-token loop")
    p.add_argument("--budget-s", type=float, default=150.0, help="modes not started by then are skipped")
    p.add_argument("--device", default="cuda", help="(cpu: a dry run of this path on the small shapes)")


def _table_args(p) -> None:
    p.add_argument("files", nargs="+")
    p.add_argument("--markdown", action="store_true")


if __name__ == "__main__":
    cli(__doc__, {"build": (cmd_build, _build_args), "reference": (cmd_reference, _reference_args),
                  "mlcc": (cmd_mlcc, _mlcc_args), "hf": (cmd_hf, _hf_args), "table": (cmd_table, _table_args)})
