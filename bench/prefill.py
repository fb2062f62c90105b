"""Prefill and batched decode on CUDA: mlcc's tensor-core prefill kernels (CompileOptions.flash_prefill_attention,
prefill_gemm) against the same library without them (TVM's prefill attention, dlight's GEMM rule), and
`transformers` fp16 (sdpa) on the same shape, in one run; then each kernel alone against its peer.

    # any machine: shape-only CUDA libraries (bench/decode.py builds them): the base, its float32 twins (the
    # reference), and one folder per variant
    python bench/decode.py build --out .dev/base8 \
        --only llama3-8b/q4f16_1,llama3-8b/q0f16,llama3-8b/q4f32_1,llama3-8b/q0f32
    python bench/decode.py build --out .dev/fa8 --only llama3-8b/q4f16_1,llama3-8b/q0f16 \
        --option flash_prefill_attention=1
    python bench/decode.py build --out .dev/fapg8 --only llama3-8b/q4f16_1,llama3-8b/q0f16 \
        --option flash_prefill_attention=1 --option prefill_gemm=1
    # the CUDA machine
    python bench/prefill.py mlcc --base .dev/base8 --variants flash=.dev/fa8,flash+gemm=.dev/fapg8 --out OUT
    python bench/prefill.py hf --out OUT

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

The attention kernel alone: mlcc's tensor-core kernel (schedules/cuda_flash_prefill.py) against TVM's ragged
prefill kernel as a model library builds it (the wide grid of schedules/cuda_prefill_attention.py) and torch's
scaled_dot_product_attention (its flash backend), causal, on Llama-3-8B's heads (32 query, 8 KV, 128) and
Qwen2.5-0.5B's (14, 2, 64).

    python bench/prefill.py attention-build --out .dev/attn       # one CUDA library with both kernels per shape
    python bench/prefill.py attention-run --lib .dev/attn --out OUT            # the CUDA machine

It checks first: a ragged batch of four sequences (1, 100, 700 and 64 tokens) against float32 attention in torch,
output and log-sum-exp (base 2, what TVM's KV cache merges), for both kernels, causal and not; then times one
sequence of 512, 2,048 and 8,192 tokens (best of 10 after a warm-up). Rows of OUT/attention.json:
{"bench": "prefill_attention", "shape", "tokens", "kernel", "ms", "tflops", "ratio_vs_sdpa"}; the FLOP count is
the causal half, 2 * 2 * L^2 / 2 * heads * head_dim.

The GEMM kernel alone: mlcc's tensor-core kernel (schedules/cuda_gemm.py) against cuBLAS fp16 through torch, on an
8B model's projection shapes, fp16 and q4f16_1 weights (q4 rows: cuBLAS on the dequantized fp16 weights).
`gemm-build` compiles every candidate parameter set (nvcc, sm_90a cubin, no GPU needed); `gemm-run` (torch + cupy,
no TVM) checks each kernel and epilogue against torch first, then times them and prints a table:

    python bench/prefill.py gemm-build --out .dev/gemm
    python bench/prefill.py gemm-run --lib .dev/gemm --out OUT                 # the CUDA machine

Rows of OUT/gemm.json: {"bench": "gemm", "dtype", "M", "N", "K", "params", "tflops", "cublas_tflops",
"ratio_vs_cublas", "default_tflops"} (tflops: the best candidate; default_tflops: the untuned table's choice).
"""
from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import numpy as np
from harness import cli, device_name, presets, write_json

PROMPTS = (512, 2048, 8192)
BATCHES = (16, 64)
VERIFY = (5,)   # tokens of a speculative verify (bench/speculative.py: its cost bounds any draft's speedup)
CONTEXT, STEPS = 128, 32


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [1 + (i * 7 + salt) % 30000 for i in range(n)]


# the same random weights, float32 activations (e4m3 has no float32 twin: its random codes are its own; its logits
# are checked against the float32 reference in the gpu-marked tests instead)
REFERENCE = {"q0f16": "q0f32", "q4f16_1": "q4f32_1", "e4m3_e4m3_f16": None}


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

    global BATCHES
    BATCHES = a.batches
    rows = []
    base_dir = Path(a.base)
    variants = {label: Path(d) for label, d in (v.split("=", 1) for v in a.variants.split(","))}
    for d in sorted(p for p in base_dir.iterdir() if (p / "model.so").exists()):
        model, quant = d.name.rsplit("-", 1)
        if quant not in REFERENCE or (a.quants and quant not in a.quants.split(",")):  # (float32: the reference)
            continue
        exact = None
        ref_dir = base_dir / f"{model}-{REFERENCE[quant]}"
        if REFERENCE[quant] and (ref_dir / "model.so").exists():
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


# --- the attention kernel alone -------------------------------------------------------------------------------------

ATTN_SHAPES = {"llama3-8b": (8, 32, 128), "qwen2.5-0.5b": (2, 14, 64)}
ATTN_TOKENS = (512, 2048, 8192)
ATTN_CHECK_LENS = (1, 100, 700, 64)


def cmd_attention_build(a) -> None:
    import tvm
    from tvm.relax.frontend.nn.llm import _prefill_kernels as pk

    from mlcc.schedules.cuda_flash_prefill import make_flash_prefill
    from mlcc.schedules.cuda_prefill_attention import _num_blocks
    from mlcc.schedules.cuda_source import add_cuda_helpers
    from mlcc.targets import get_target
    from mlcc.tvm_compat import cuda_source_postproc, prefill_kernel_blocks

    preset = get_target("cuda")
    target = preset.tvm_target()
    funcs = {}
    for name, (h_kv, h_q, d) in ATTN_SHAPES.items():
        key = name.replace(".", "_").replace("-", "_")
        funcs[f"flash_{key}"] = make_flash_prefill(h_kv, h_q, d)
        with prefill_kernel_blocks(_num_blocks(h_kv)):
            funcs[f"tvm_{key}"] = pk._attention_prefill_ragged(h_kv, h_q, d, d, "float16", {}, target)
    mod = tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in funcs.items()})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t = time.time()
    with target, cuda_source_postproc(add_cuda_helpers):
        lib = tvm.compile(mod, target)
    lib.export_library(str(out / "attention.so"))
    (out / "attention.json").write_text(json.dumps({"arch": str(target.attrs["arch"]), "shapes": ATTN_SHAPES}))
    print(f"{len(funcs)} kernels in {time.time() - t:.1f} s -> {out}")


def _attention_reference(torch, q, k, v, lens, scale, causal):
    """float32 attention per sequence: output [tokens, h_q, d] and base-2 log-sum-exp [tokens, h_q]."""
    outs, lses, s0 = [], [], 0
    group = q.shape[1] // k.shape[1]
    for n in lens:
        qs = q[s0:s0 + n].float().transpose(0, 1)                          # [h_q, n, d]
        ks = k[s0:s0 + n].float().transpose(0, 1).repeat_interleave(group, 0)
        vs = v[s0:s0 + n].float().transpose(0, 1).repeat_interleave(group, 0)
        s = qs @ ks.transpose(1, 2) * scale
        if causal:
            s = s.masked_fill(torch.ones(n, n, device=q.device, dtype=torch.bool).triu(1), float("-inf"))
        outs.append((s.softmax(-1) @ vs).transpose(0, 1))
        lses.append((torch.logsumexp(s, -1) / math.log(2)).transpose(0, 1))
        s0 += n
    return torch.cat(outs), torch.cat(lses)


def cmd_attention_run(a) -> None:
    import torch
    import tvm

    from mlcc import tvm_compat

    lib_dir = Path(a.lib)
    meta = json.loads((lib_dir / "attention.json").read_text())
    tvm_compat.load_backend_runtimes("cuda")
    tvm_compat.register_cuda_jit(meta["arch"])
    lib = tvm.runtime.load_module(str(lib_dir / "attention.so"))
    dev = "cuda"
    torch.manual_seed(0)
    as_tvm = tvm.runtime.from_dlpack

    def call(fn, q, k, v, lens, causal, scale):
        ind = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
        pos = torch.zeros(q.shape[0], dtype=torch.int32, device=dev)
        off = torch.zeros(len(lens), dtype=torch.int32, device=dev)
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=dev)
        args = [as_tvm(t) for t in (q, ind, k, v, ind, pos, off, o, lse)]
        return lambda: fn(*args, causal, 0, 1.0, 10000.0, scale), o, lse

    checks, rows, ok = [], [], True
    for shape, (h_kv, h_q, d) in meta["shapes"].items():
        key = shape.replace(".", "_").replace("-", "_")
        scale = 1 / math.sqrt(d)
        total = sum(ATTN_CHECK_LENS)
        q = torch.randn(total, h_q, d, device=dev).half()
        k = torch.randn(total, h_kv, d, device=dev).half()
        v = torch.randn(total, h_kv, d, device=dev).half()
        for causal in (1, 0):
            ref_o, ref_lse = _attention_reference(torch, q, k, v, ATTN_CHECK_LENS, scale, causal)
            for kernel in ("flash", "tvm"):
                run, o, lse = call(lib[f"{kernel}_{key}"], q, k, v, ATTN_CHECK_LENS, causal, scale)
                run()
                torch.cuda.synchronize()
                err_o = ((o.float() - ref_o).abs().max() / ref_o.abs().max()).item()
                err_lse = (lse - ref_lse).abs().max().item()
                good = err_o < 1e-2 and err_lse < 1e-2
                ok &= good
                checks.append({"shape": shape, "kernel": kernel, "causal": causal, "max_rel_err_out": err_o,
                               "max_abs_err_lse": err_lse, "ok": good})
                print(json.dumps(checks[-1]), flush=True)
    if ok:
        for shape, (h_kv, h_q, d) in meta["shapes"].items():
            key = shape.replace(".", "_").replace("-", "_")
            for n in ATTN_TOKENS:
                q = torch.randn(n, h_q, d, device=dev).half()
                k = torch.randn(n, h_kv, d, device=dev).half()
                v = torch.randn(n, h_kv, d, device=dev).half()
                flops = 2 * 2 * n * n / 2 * h_q * d
                qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
                fns = {kernel: call(lib[f"{kernel}_{key}"], q, k, v, [n], 1, 1 / math.sqrt(d))[0]
                       for kernel in ("flash", "tvm")}
                fns["torch_sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=True, enable_gqa=True)
                ms = {kernel: _best_ms(torch, fn) for kernel, fn in fns.items()}
                for kernel, t in ms.items():
                    rows.append({"bench": "prefill_attention", "shape": shape, "tokens": n, "kernel": kernel,
                                 "ms": round(t, 4), "tflops": round(flops / t / 1e9, 1),
                                 "ratio_vs_sdpa": round(ms["torch_sdpa"] / t, 3)})
                    print(json.dumps(rows[-1]), flush=True)
    write_json(a.out, "attention.json", {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "checks": checks, "rows": rows})


def _best_ms(torch, fn, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(iters):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        fn()
        t1.record()
        torch.cuda.synchronize()
        best = min(best, t0.elapsed_time(t1))
    return best


# --- the GEMM kernel alone -----------------------------------------------------------------------------------------

# (name, N = W's rows, K) of Llama-3-8B's projections
GEMM_SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
GEMM_TOKENS = [512, 2048, 8192]
GEMM_FEW_TOKENS = [1, 5, 16, 64]   # batched decode and speculative verify: the split-K kernel (few_token_params)
# (bm, bn, wm, wn, stages, bk): GemmParams' fields; shared memory is dynamic (227 KB a block on sm_90)
GEMM_CANDIDATES = [(128, 128, 2, 4, 3, 32), (128, 128, 2, 4, 5, 32), (128, 128, 2, 4, 3, 64), (128, 128, 2, 4, 4, 64),
              (128, 256, 2, 4, 4, 32), (128, 256, 2, 4, 3, 64), (128, 256, 2, 4, 4, 64), (256, 128, 4, 2, 3, 64),
              (256, 128, 4, 2, 4, 64), (128, 256, 2, 4, 5, 32), (128, 128, 2, 4, 6, 32), (64, 128, 2, 2, 4, 64),
              (128, 64, 2, 2, 4, 64), (64, 128, 2, 2, 4, 32)]
GEMM_CHECKS = [("float16", "none"), ("float16", "bias"), ("float16", "add"), ("float16", "swiglu"),
          ("q4f16_1", "none"), ("q4f16_1", "bias"), ("q4f16_1", "add"), ("q4f16_1", "swiglu")]


def cmd_gemm_build(a) -> None:
    from mlcc.schedules.cuda_gemm import (
        GemmParams,
        default_params,
        few_token_params,
        kernel_name,
        kernel_source,
        reduce_source,
    )

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    kernels, src = [], None
    for w in ("float16", "q4f16_1"):
        params = {GemmParams(*c) for c in GEMM_CANDIDATES} | {default_params(w), default_params(w, 64)}
        for p in sorted((p for p in params if p.valid(w == "q4f16_1")), key=lambda p: tuple(p.to_dict().values())):
            for epi in ("none", "bias", "add", "swiglu") if p in (default_params(w),) else ("none",):
                kernels.append({"name": kernel_name(w, epi, p), "weights": w, "epilogue": epi, "params": p.to_dict(),
                                "threads": p.threads, "smem": p.smem_bytes(w == "q4f16_1"),
                                "default": p == default_params(w)})
                src = (src or "") + kernel_source(w, epi, p, with_header=src is None)
    few = {few_token_params(n, k, w) for w in ("float16", "q4f16_1") for _, n, k in GEMM_SHAPES}
    for w in ("float16", "q4f16_1"):
        for p in sorted({f for f in few}, key=lambda p: p.split):
            for epi in ("none", "bias", "add"):
                kernels.append({"name": kernel_name(w, epi, p), "weights": w, "epilogue": epi, "params": p.to_dict(),
                                "threads": p.threads, "smem": p.smem_bytes(w == "q4f16_1"), "default": False,
                                "few": True, "reduce": f"mlcc_reduce_k{p.split}_{epi}"})
                src += kernel_source(w, epi, p, with_header=False)
    for p in sorted(few, key=lambda p: p.split):
        for epi in ("none", "bias", "add"):
            src += reduce_source(epi, p)
    (out / "gemm.cu").write_text(src)
    t = time.time()
    subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-O3", "-o", str(out / "gemm.cubin"), str(out / "gemm.cu")],
                   check=True)
    (out / "kernels.json").write_text(json.dumps(kernels, indent=1))
    print(f"{len(kernels)} kernels, nvcc {time.time() - t:.1f} s -> {out}")


def _dequant(torch, wq, s):
    """q4f16_1 [N, K/8] uint32 (as int32) + [N, K/32] fp16 scales -> [N, K] fp16."""
    n = wq.shape[0]
    shifts = torch.arange(0, 32, 4, device=wq.device, dtype=torch.int32)
    codes = (wq.unsqueeze(-1) >> shifts) & 0xF  # [N, K/8, 8]
    vals = (codes.reshape(n, -1).to(torch.float16) - 7).reshape(n, -1, 32) * s.unsqueeze(-1)
    return vals.reshape(n, -1)


def cmd_gemm_run(a) -> None:
    import cupy
    import torch

    lib = Path(a.lib)
    kernels = json.loads((lib / "kernels.json").read_text())
    mod = cupy.RawModule(path=str(lib / "gemm.cubin"))
    fns = {k["name"]: mod.get_function(k["name"]) for k in kernels}
    for k in kernels:  # past 48 KB a kernel must opt in to its dynamic shared memory
        fns[k["name"]].max_dynamic_shared_size_bytes = k["smem"]
    torch.manual_seed(0)
    dev = "cuda"

    def weights(n, k, kind):
        if kind == "float16":
            w = (torch.randn(n, k, device=dev) * 0.02).half()
            return w, None, w
        wq = torch.randint(-2**31, 2**31 - 1, (n, k // 8), device=dev, dtype=torch.int32)
        s = (torch.rand(n, k // 32, device=dev) * 0.01 + 0.001).half()
        return wq, s, _dequant(torch, wq, s)

    for k in kernels:
        if k.get("few"):
            fns[k["reduce"]] = mod.get_function(k["reduce"])
    parts = {}

    def launch(kern, x, w, s, e, c, m, n, k):
        p = kern["params"]
        args = [cupy.asarray(t) if t is not None else cupy.asarray(x) for t in (x, w, s, e)]
        if not kern.get("few"):
            grid = (n // p["bn"], -(-m // p["bm"]))
            fns[kern["name"]](grid, (kern["threads"],), (*args, cupy.asarray(c), cupy.int32(m), cupy.int32(n),
                                                           cupy.int32(k)), shared_mem=kern["smem"])
            return
        size = p["split"] * m * n
        if parts.get(size) is None:
            parts[size] = cupy.empty(size, dtype=cupy.float32)
        part = parts[size]
        grid = (n // p["bn"], -(-m // p["bm"]), p["split"])
        fns[kern["name"]](grid, (kern["threads"],), (*args, cupy.asarray(c), cupy.int32(m), cupy.int32(n),
                                                       cupy.int32(k), part), shared_mem=kern["smem"])
        fns[kern["reduce"]]((-(-(m * n // 2) // 256),), (256,), (part, args[3], cupy.asarray(c), cupy.int32(m),
                                                                 cupy.int32(n)))

    def bench(fn, flops, iters=20):
        for _ in range(3):
            fn()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(iters):
            fn()
        t1.record()
        torch.cuda.synchronize()
        return flops / (t0.elapsed_time(t1) / iters * 1e-3) / 1e12

    # correctness first: every epilogue of the default kernels, an M that is no multiple of the tile
    checks, ok = [], True
    for kern in kernels:
        m, n, k = (37, 512, 14336) if kern.get("few") else (200, 512, 1024)
        w, s, wf = weights(n, k, kern["weights"])
        x = torch.randn(m, k, device=dev).half()
        y = x.float() @ wf.float().T
        e = None
        epi = kern["epilogue"]
        if epi == "bias":
            e = torch.randn(n, device=dev).half()
            ref = y + e.float()
        elif epi == "add":
            e = torch.randn(m, n, device=dev).half()
            ref = y + e.float()
        elif epi == "swiglu":
            g, u = y[:, : n // 2].half().float(), y[:, n // 2:].half().float()
            ref = torch.nn.functional.silu(g) * u
        else:
            ref = y
        c = torch.empty(ref.shape, device=dev, dtype=torch.float16)
        launch(kern, x, w, s, e, c, m, n, k)
        torch.cuda.synchronize()
        err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
        good = err < 2e-2 and bool(torch.isfinite(c).all())
        ok &= good
        checks.append({"kernel": kern["name"], "max_rel_err": err, "ok": good})
        print(f"check {kern['name']:55s} max|err|/max|ref| {err:.2e} {'ok' if good else 'FAIL'}", flush=True)
    rows = []
    if ok:
        for kind in ("float16", "q4f16_1"):
            for name, n, k in GEMM_SHAPES:
                w, s, wf = weights(n, k, kind)
                for m in GEMM_TOKENS:
                    x = torch.randn(m, k, device=dev).half()
                    c = torch.empty(m, n, device=dev, dtype=torch.float16)
                    flops = 2 * m * n * k
                    cublas = bench(lambda: torch.matmul(x, wf.T), flops)
                    res = {}
                    for kern in kernels:
                        if kern["weights"] != kind or kern["epilogue"] != "none" or n % kern["params"]["bn"] \
                                or kern.get("few"):
                            continue
                        res[kern["name"]] = (bench(lambda: launch(kern, x, w, s, None, c, m, n, k), flops), kern)
                    best, bk = max(res.values(), key=lambda r: r[0])
                    dflt = next(t for t, kk in res.values() if kk["default"])
                    rows.append({"bench": "gemm", "dtype": kind, "proj": name, "M": m, "N": n, "K": k,
                                 "params": bk["params"], "tflops": round(best, 1), "default_tflops": round(dflt, 1),
                                 "cublas_tflops": round(cublas, 1), "ratio_vs_cublas": round(best / cublas, 3),
                                 "all": {kk: round(t, 1) for kk, (t, _) in res.items()}})
                    print(f"{kind:8s} {name:8s} M={m:5d} N={n:6d} K={k:6d}  best {best:6.1f} "
                          f"({' '.join(str(v) for v in bk['params'].values())}) default {dflt:6.1f}  "
                          f"cuBLAS {cublas:6.1f}  ratio {best / cublas:.3f}", flush=True)
    few_rows = []
    if ok:  # few tokens: the split-K kernel the build picks for the shape, against cuBLAS and the weights' bytes
        from mlcc.schedules.cuda_gemm import few_token_params, kernel_name

        for kind in ("float16", "q4f16_1"):
            for name, n, k in GEMM_SHAPES:
                w, s, wf = weights(n, k, kind)
                p = few_token_params(n, k, kind)
                kern = next(kk for kk in kernels if kk["name"] == kernel_name(kind, "none", p))
                wbytes = n * k * 2 if kind == "float16" else n * k // 2 + n * k // 32 * 2
                for m in GEMM_FEW_TOKENS:
                    x = torch.randn(m, k, device=dev).half()
                    c = torch.empty(m, n, device=dev, dtype=torch.float16)
                    us = 1e6 * 2 * m * n * k / 1e12 / bench(lambda: launch(kern, x, w, s, None, c, m, n, k),
                                                           2 * m * n * k, iters=50)
                    cub = 1e6 * 2 * m * n * k / 1e12 / bench(lambda: torch.matmul(x, wf.T), 2 * m * n * k, iters=50)
                    few_rows.append({"bench": "gemm_few_tokens", "dtype": kind, "proj": name, "M": m, "N": n, "K": k,
                                     "split": p.split, "us": round(us, 2), "cublas_fp16_us": round(cub, 2),
                                     "weight_GBps": round(wbytes / us / 1e3, 1)})
                    print(json.dumps(few_rows[-1]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "checks": checks,
                                               "rows": rows, "few_tokens": few_rows}, indent=1))


def _out_args(p) -> None:
    p.add_argument("--out", required=True)


def _mlcc_args(p) -> None:
    p.add_argument("--base", required=True, help="libraries with the default options (+ their float32 twins)")
    p.add_argument("--variants", required=True, help="label=folder,... : the same libraries built otherwise")
    p.add_argument("--quants", default=None, help="only these quantizations (comma-separated)")
    p.add_argument("--check-only", action="store_true", help="compare the logits, time nothing")
    p.add_argument("--benches", type=lambda v: tuple(v.split(",")), default=("prefill", "batched_decode", "verify"),
                   help="what to time (comma-separated: prefill, batched_decode, verify)")
    p.add_argument("--batches", type=lambda v: tuple(int(b) for b in v.split(",")), default=BATCHES,
                   help="batched decode: sequences per step (comma-separated; default %(default)s)")
    p.add_argument("--out", required=True)


def _hf_args(p) -> None:
    p.add_argument("--models", default="llama3-8b")
    p.add_argument("--out", required=True)


def _attention_build_args(p) -> None:
    p.add_argument("--out", default=".dev/attn")


def _attention_run_args(p) -> None:
    p.add_argument("--lib", default=".dev/attn")
    p.add_argument("--out", required=True)


def _gemm_build_args(p) -> None:
    p.add_argument("--out", default=".dev/gemm")


def _gemm_run_args(p) -> None:
    p.add_argument("--lib", default=".dev/gemm")
    p.add_argument("--out", required=True)


# (N, K) of Llama-3-8B's projections (qkv, o, gate_up, down) and the token counts cublaslt-gemm times
SHIM_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
SHIM_TOKENS = (16, 64, 128, 256, 512, 2048, 8192)


def _shim():
    import tvm_ffi

    from mlcc.cache import cache_root
    from mlcc.native import cublaslt_shim

    cublaslt_shim.load(cache_root())
    cublaslt_shim.prepare_device(0)
    return {name: tvm_ffi.get_global_func(f) for name, f in cublaslt_shim.MATMUL.items()}


def _check_gemm(fns, torch) -> list[dict]:
    """Relative max errors against float32 (and torch's cuBLAS beside them)."""
    rows = []
    ws = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype, x_shape, n, epi in ((torch.float16, (300, 4096), 6144, "none"), (torch.float16, (1, 77, 512), 256, "bias"),
                                   (torch.float16, (33, 1, 1024), 2048, "add"), (torch.bfloat16, (129, 4096), 4096, "none"),
                                   (torch.float16, (8192, 4096), 4096, "add")):
        k = x_shape[-1]
        x = torch.randn(x_shape, generator=g, device="cuda").to(dtype)
        w = (torch.randn((n, k), generator=g, device="cuda") / k ** 0.5).to(dtype)
        extra = {"none": None, "bias": torch.randn((n,), generator=g, device="cuda").to(dtype),
                 "add": torch.randn(x_shape[:-1] + (n,), generator=g, device="cuda").to(dtype)}[epi]
        out = torch.empty(x_shape[:-1] + (n,), dtype=dtype, device="cuda")
        args = [x, w] + ([extra] if extra is not None else []) + [ws, out]
        fns[epi](*args)
        torch.cuda.synchronize()
        ref = x.float() @ w.float().T + (extra.float() if extra is not None else 0)
        tor = (x @ w.T + (extra if extra is not None else 0)).float()
        scale = ref.abs().max().item()
        row = {"bench": "gemm_check", "dtype": str(dtype), "x": list(x_shape), "n": n, "epilogue": epi,
               "shim_vs_f32": (out.float() - ref).abs().max().item() / scale,
               "torch_vs_f32": (tor - ref).abs().max().item() / scale}
        row["ok"] = row["shim_vs_f32"] <= 2 * row["torch_vs_f32"] + 1e-3
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def cmd_cublaslt_gemm(a) -> None:
    """cuBLASLt through mlcc's shim (CompileOptions.vendor_gemm): checked against float32 and torch (plain, + bias,
    + residual, bf16, (m, 1, K) activations), then timed beside torch's `a @ w.T` on the Llama-3-8B projections."""
    import torch

    fns = _shim()
    dev = device_name()
    rows = _check_gemm(fns, torch)
    if not all(r["ok"] for r in rows):
        print("the shim's results differ: not timed", flush=True)
        write_json(a.out, "cublaslt_gemm.json", rows)
        return
    ws = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    for n, k in SHIM_SHAPES:
        w = torch.randn((n, k), device="cuda", dtype=torch.float16) / k ** 0.5
        for m in SHIM_TOKENS:
            x = torch.randn((m, k), device="cuda", dtype=torch.float16)
            out = torch.empty((m, n), device="cuda", dtype=torch.float16)
            shim = _best_ms(torch, lambda x=x, w=w, out=out: fns["none"](x, w, ws, out))
            tor = _best_ms(torch, lambda x=x, w=w, out=out: torch.matmul(x, w.T, out=out))
            flop = 2 * m * n * k
            rows.append({"bench": "gemm", "device": dev, "dtype": "float16", "m": m, "n": n, "k": k,
                         "shim_ms": round(shim, 4), "torch_ms": round(tor, 4),
                         "shim_tflops": round(flop / shim / 1e9, 1), "torch_tflops": round(flop / tor / 1e9, 1)})
            print(json.dumps(rows[-1]), flush=True)
    rows += _fp8_gemm_rows(torch, ws, dev)
    write_json(a.out, "cublaslt_gemm.json", rows)


def _fp8_gemm_rows(torch, ws, dev: str) -> list[dict]:
    """The FP8 GEMM (e4m3 activations with one scale per token, e4m3 weights with one per channel: what
    e4m3_e4m3_f16's prefill calls) against the float16 one, both through the shim, at the same shapes; the token
    quantizer's own time beside it (it runs before every FP8 projection). Checked against float32 first."""
    import ml_dtypes
    import numpy as np
    import tvm
    import tvm_ffi

    from mlcc.compiler.quantize import dequantize_weight, get_quantization, quantize_weight
    from mlcc.native import cublaslt_shim
    from mlcc.schedules.cuda_token_quantize import quantize_tokens_func
    from mlcc.targets import get_target

    q = get_quantization("e4m3_e4m3_f16")
    fp8, f16 = tvm_ffi.get_global_func(cublaslt_shim.MATMUL_FP8["none"]), tvm_ffi.get_global_func(cublaslt_shim.MATMUL["none"])
    tdev = tvm.cuda(0)
    tws = tvm.runtime.empty((32 << 20,), "uint8", tdev)
    rng = np.random.default_rng(0)
    quantizers = {}
    rows = []
    for n, k in SHIM_SHAPES:
        w, w_scale = quantize_weight((rng.standard_normal((n, k)) / k ** 0.5).astype(np.float32), q)
        w16 = tvm.runtime.tensor(dequantize_weight(w, w_scale, q).astype(np.float16), tdev)
        w8, s8 = tvm.runtime.tensor(w, tdev), tvm.runtime.tensor(w_scale, tdev)
        if k not in quantizers:
            try:
                func = quantize_tokens_func(k, q).with_attr("global_symbol", "main")
                quantizers[k] = tvm.compile(tvm.IRModule({"main": func}), get_target("cuda").tvm_target())["main"]
            except Exception as e:   # runtime-only TVM: the GEMM is timed alone
                print("token quantizer not built (", type(e).__name__, e, "): GEMM only", flush=True)
                quantizers[k] = None
        for m in SHIM_TOKENS:
            x = rng.standard_normal((1, m, k)).astype(np.float16)
            xs_np = np.maximum(np.abs(x.astype(np.float32)).max(-1) / 448, 1e-12).astype(np.float32)
            xq_np = (x.astype(np.float32) / xs_np[..., None]).astype(ml_dtypes.float8_e4m3fn)
            x16, xq, xs = tvm.runtime.tensor(x, tdev), tvm.runtime.tensor(xq_np, tdev), tvm.runtime.tensor(xs_np, tdev)
            o8, o16 = (tvm.runtime.empty((1, m, n), "float16", tdev) for _ in range(2))
            if m == SHIM_TOKENS[0] or m == 2048:
                fp8(xq, xs, w8, s8, tws, o8)
                ref = (xq_np.astype(np.float32) * xs_np[..., None]) @ dequantize_weight(w, w_scale, q).T
                err = float(np.abs(o8.numpy().astype(np.float32) - ref).max() / np.abs(ref).max())
                if err > 1e-2:
                    print(f"FP8 GEMM ({m}, {n}, {k}) differs from float32 by {err:.3g}: not timed", flush=True)
                    rows.append({"bench": "fp8_gemm_check", "device": dev, "m": m, "n": n, "k": k, "rel_err": err})
                    return rows
            t8 = _best_ms(torch, lambda: fp8(xq, xs, w8, s8, tws, o8))
            t16 = _best_ms(torch, lambda: f16(x16, w16, tws, o16))
            tq = _best_ms(torch, lambda: quantizers[k](x16, xq, xs)) if quantizers[k] else None
            flop = 2 * m * n * k
            rows.append({"bench": "gemm_fp8", "device": dev, "m": m, "n": n, "k": k,
                         "fp8_ms": round(t8, 4), "f16_ms": round(t16, 4), "quantize_ms": tq and round(tq, 4),
                         "fp8_tflops": round(flop / t8 / 1e9, 1), "f16_tflops": round(flop / t16 / 1e9, 1),
                         "speedup": round(t16 / t8, 2), "speedup_with_quantize": tq and round(t16 / (t8 + tq), 2)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    cli(__doc__, {"mlcc": (cmd_mlcc, _mlcc_args), "hf": (cmd_hf, _hf_args),
                  "attention-build": (cmd_attention_build, _attention_build_args),
                  "attention-run": (cmd_attention_run, _attention_run_args),
                  "gemm-build": (cmd_gemm_build, _gemm_build_args), "gemm-run": (cmd_gemm_run, _gemm_run_args),
                  "cublaslt-gemm": (cmd_cublaslt_gemm, _out_args)})
