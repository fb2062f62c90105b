"""Paged decode attention on CUDA: TVM's kernel vs mlcc's split-KV kernel, both checked against numpy first.

    python bench/decode_attention.py build --out .dev/attn     # here: one library per (shape, kernel)
    python3 bench/decode_attention.py run --libs .dev/attn --out $OUT   # device: check, then time
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from cli import build_and_run

SHAPES = {"llama3-8b": (8, 32, 128), "qwen2.5-0.5b": (2, 14, 64), "smollm2-135m": (3, 9, 64)}
PAGE = 16
CASES = [(1, [1]), (1, [17]), (1, [256]), (1, [1000]), (1, [4000]), (3, [5, 300, 1500])]


def cmd_build(a) -> None:
    import tvm
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode

    from mlcc.schedules.cuda_decode_attention import make_split_decode
    from mlcc.targets import get_target

    target = get_target("cuda").tvm_target()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, (hk, hq, d) in SHAPES.items():
        for kind, func in (("tvm", _attention_decode(hk, hq, d, "float16", False, {}, target)),
                           ("mlcc", make_split_decode(hk, hq, d, "float16", PAGE))):
            tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target).export_library(
                str(out / f"{name}-{kind}.so"))
            print("built", name, kind)


def _case(hk, hq, d, lens, rng):
    n_pages = [-(-n // PAGE) for n in lens]
    total = sum(n_pages)
    perm = rng.permutation(total + 3).astype(np.int32)  # pages scattered, some unused
    pages = (rng.standard_normal((total + 3, 2, hk, PAGE, d)) * 0.5).astype(np.float16)
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    values = perm[:total]
    last = np.array([n - (p - 1) * PAGE for n, p in zip(lens, n_pages)], np.int32)
    q = rng.standard_normal((len(lens), hq, d)).astype(np.float16)
    return q, pages, indptr, values, last


def _reference(q, pages, indptr, values, lens, hk, sm_scale):
    b, hq, d = q.shape
    out = np.zeros((b, hq, d), np.float32)
    lse = np.zeros((b, hq), np.float32)
    for i, n in enumerate(lens):
        pg = values[indptr[i]:indptr[i + 1]]
        k = pages[pg, 0].transpose(1, 0, 2, 3).reshape(hk, -1, d)[:, :n].astype(np.float32)
        v = pages[pg, 1].transpose(1, 0, 2, 3).reshape(hk, -1, d)[:, :n].astype(np.float32)
        for h in range(hq):
            s = k[h // (hq // hk)] @ q[i, h].astype(np.float32) * sm_scale
            p = np.exp(s - s.max())
            out[i, h] = p @ v[h // (hq // hk)] / p.sum()
            lse[i, h] = (s.max() + np.log(p.sum())) * math.log2(math.e)
    return out, lse


def cmd_run(a) -> None:
    import tvm

    from gemv_kernels import cuda_device

    dev = cuda_device("sm_90")
    rng = np.random.default_rng(0)
    rows = []
    for name, (hk, hq, d) in SHAPES.items():
        libs = {k: tvm.runtime.load_module(str(Path(a.libs) / f"{name}-{k}.so")) for k in ("tvm", "mlcc")}
        for b, lens in CASES:
            q, pages, indptr, values, last = _case(hk, hq, d, lens, rng)
            sm = 1 / math.sqrt(d)
            want, want_lse = _reference(q, pages, indptr, values, lens, hk, sm)
            row = {"shape": name, "batch": b, "lens": lens}
            for kind, lib in libs.items():
                zero_i = np.zeros(b, np.int32)
                args = [tvm.runtime.tensor(x, dev) for x in (q, pages, indptr, values, last, zero_i, zero_i,
                                                             np.zeros_like(q), np.zeros((b, hq), np.float32))]
                lib["main"](*args, 0, 1.0, 10000.0, sm)
                err = float(np.abs(args[7].numpy().astype(np.float32) - want).max())
                lse_err = float(np.abs(args[8].numpy() - want_lse).max())
                us = lib.time_evaluator("main", dev, number=100, repeat=3)(*args, 0, 1.0, 10000.0, sm).mean * 1e6
                row[kind] = {"us": us, "max_abs_err": err, "lse_abs_err": lse_err, "ok": err < 2e-2 and lse_err < 1e-2}
            rows.append(row)
            print(f"{name:13} b={b} lens={lens}: " + "  ".join(
                f"{k} {row[k]['us']:7.1f} us err {row[k]['max_abs_err']:.1e}/{row[k]['lse_abs_err']:.1e} "
                f"{'ok' if row[k]['ok'] else 'WRONG'}" for k in ("tvm", "mlcc")), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "decode_attention.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    build_and_run(cmd_build, cmd_run)
