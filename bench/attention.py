"""Prefill attention on CUDA, kernel by kernel: mlcc's tensor-core kernel (schedules/cuda_flash_prefill.py) against
TVM's ragged prefill kernel as a model library builds it (the wide grid of schedules/cuda_prefill_attention.py) and
torch's scaled_dot_product_attention (its flash backend), causal, on Llama-3-8B's heads (32 query, 8 KV, 128) and
Qwen2.5-0.5B's (14, 2, 64).

    python bench/attention.py build --out .dev/attn          # here: one CUDA library with both kernels per shape
    run(command="bash bench/gpu.sh run python3 bench/attention.py run --lib .dev/attn --out $OUT",
        carry=[".gpu-rt", ".dev/attn"])

The run checks first: a ragged batch of four sequences (1, 100, 700 and 64 tokens) against float32 attention in
torch, output and log-sum-exp (base 2, what TVM's KV cache merges), for both kernels, causal and not; then times one
sequence of 512, 2,048 and 8,192 tokens (best of 10 after a warm-up). Rows of $OUT/attention.json:
{"bench": "prefill_attention", "shape", "tokens", "kernel", "ms", "tflops", "ratio_vs_sdpa"}; the FLOP count is
the causal half, 2 * 2 * L^2 / 2 * heads * head_dim.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from harness import cli, write_json

SHAPES = {"llama3-8b": (8, 32, 128), "qwen2.5-0.5b": (2, 14, 64)}
TOKENS = (512, 2048, 8192)
CHECK_LENS = (1, 100, 700, 64)


def cmd_build(a) -> None:
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
    for name, (h_kv, h_q, d) in SHAPES.items():
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
    (out / "attention.json").write_text(json.dumps({"arch": str(target.attrs["arch"]), "shapes": SHAPES}))
    print(f"{len(funcs)} kernels in {time.time() - t:.1f} s -> {out}")


def _reference(torch, q, k, v, lens, scale, causal):
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


def cmd_run(a) -> None:
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
        total = sum(CHECK_LENS)
        q = torch.randn(total, h_q, d, device=dev).half()
        k = torch.randn(total, h_kv, d, device=dev).half()
        v = torch.randn(total, h_kv, d, device=dev).half()
        for causal in (1, 0):
            ref_o, ref_lse = _reference(torch, q, k, v, CHECK_LENS, scale, causal)
            for kernel in ("flash", "tvm"):
                run, o, lse = call(lib[f"{kernel}_{key}"], q, k, v, CHECK_LENS, causal, scale)
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
            for n in TOKENS:
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


def _build_args(p) -> None:
    p.add_argument("--out", default=".dev/attn")


def _run_args(p) -> None:
    p.add_argument("--lib", default=".dev/attn")
    p.add_argument("--out", default="/tmp/out")


if __name__ == "__main__":
    cli(__doc__, {"build": (cmd_build, _build_args), "run": (cmd_run, _run_args)})
