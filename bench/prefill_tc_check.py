"""Tensor-core prefill on CUDA vs the CPU build, same random weights (SmolLM2 shape, q4f16_1; dims > 64 so the
tensorized GEMM path is taken). Here: `reference`; device: `run`.

    python bench/prefill_tc_check.py reference --out .dev/tc
    python3 bench/prefill_tc_check.py run --dir .dev/tc --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from decode import SMOLLM2_135M  # noqa: E402

IDS = [1 + (i * 37) % 49000 for i in range(300)]


def logits(model_dir: Path) -> np.ndarray:
    from mlcc.runtime.model import LoadedModel

    m = LoadedModel(model_dir, weights="random")
    m.create_kv_cache(1, 1024, 512)
    m.add_sequence(0)
    rows = [m.prefill([0], [IDS]).numpy()[0]]
    rows.append(m.decode([0], [5]).numpy()[0])
    return np.stack(rows)


def cmd_reference(a) -> None:
    from mlcc.compiler.build import compile_shape_only

    out = Path(a.out)
    for t in ("llvm", "cuda"):
        compile_shape_only("llama", SMOLLM2_135M, t, "q4f16_1", out / t)
    np.save(out / "cpu_logits.npy", logits(out / "llvm"))


def cmd_run(a) -> None:
    d = Path(a.dir)
    ref, got = np.load(d / "cpu_logits.npy"), logits(d / "cuda")
    err = (np.abs(got - ref).max(axis=1) / np.abs(ref).max(axis=1)).tolist()
    res = {"rel_err_prefill_then_decode": err, "argmax_equal": (got.argmax(1) == ref.argmax(1)).tolist()}
    res["pass"] = max(err) <= 3e-2
    print(json.dumps(res))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "prefill_tc_check.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reference")
    r.add_argument("--out", required=True)
    g = sub.add_parser("run")
    g.add_argument("--dir", required=True)
    g.add_argument("--out", required=True)
    a = p.parse_args()
    {"reference": cmd_reference, "run": cmd_run}[a.cmd](a)
