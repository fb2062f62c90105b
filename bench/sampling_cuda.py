"""Device sampling on CUDA (issue 3): the compiled sampler's frequencies, and seeded sampled text equal to the CPU build.

    python bench/sampling_cuda.py build --out .dev/samp      # here: tiny random Llama + tokenizer, llvm and cuda
    python3 bench/sampling_cuda.py run --dir .dev/samp --out $OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from cli import build_and_run

KW = dict(messages=[{"role": "user", "content": "Hello there"}], max_tokens=24, temperature=0.8, top_p=0.9, seed=11)


def cmd_build(a) -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from conftest import make_hf_model

    from mlcc.compiler.build import compile_model

    out = Path(a.out)
    hf = make_hf_model("llama", out / "hf")
    for target in ("llvm", "cuda"):
        compile_model(hf, target, "q0f32", out / target)
    from mlcc.runtime.engine import Engine

    with Engine(out / "llvm", target="llvm") as e:
        ref = e.chat.completions.create(**KW).choices[0].message.content
    (out / "cpu_sampled.json").write_text(json.dumps({"text": ref}))
    import shutil

    shutil.rmtree(out / "hf")


def cmd_run(a) -> None:
    from mlcc.runtime.engine import Engine

    d = Path(a.dir)
    e = Engine(d / "cuda", target="cuda")
    m, dev = e.model, e.model._to_dev
    f = m.vm["sample_top_p_top_k"]
    logits = np.full((1, m.vocab), -30.0, np.float32)
    logits[0, [3, 7, 11, 19]] = [0.0, 1.0, 2.0, 3.0]
    us = np.random.default_rng(0).random(3000)
    counts = np.bincount([int(f(dev(logits), dev(np.array([1.0], np.float32)), dev(np.array([1.0], np.float32)),
                                dev(np.array([m.vocab], np.int32)), dev(np.array([u], np.float32)),
                                dev(np.array([0], np.int32))).numpy()[0]) for u in us], minlength=m.vocab)
    p = np.exp(logits[0, [3, 7, 11, 19]] - 3.0)
    p /= p.sum()
    freq = counts[[3, 7, 11, 19]] / len(us)
    text = e.chat.completions.create(**KW).choices[0].message.content
    ref = json.loads((d / "cpu_sampled.json").read_text())["text"]
    e.shutdown()
    res = {"freq": freq.tolist(), "softmax": p.tolist(), "max_abs_dev": float(np.abs(freq - p).max()),
           "sampled_equals_cpu": text == ref, "cuda_text": text, "cpu_text": ref}
    res["pass"] = res["max_abs_dev"] < 4 * np.sqrt(0.25 / len(us)) and res["sampled_equals_cpu"]
    print(json.dumps(res, indent=1))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "sampling_cuda.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    build_and_run(cmd_build, cmd_run, run_input="--dir")
