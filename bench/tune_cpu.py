"""Meta-schedule tuning on this CPU: the bundled SmolLM2-135M at q4f32_1, its costliest kernels tuned (xgboost cost
model), then decode tok/s with the default schedules against the build with the tuning database.

    python bench/tune_cpu.py --trials 64 --max-tasks 3 --out /tmp/tune     # writes tune_cpu.json there

A record enters the database only when it beats the default schedule measured the same way (mlcc.schedules.tuning),
so the tuned build is never slower per kernel; the report lists each kernel's default and best tuned latency.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from harness import write_json


def decode_tok_s(model_dir: Path, n: int = 128) -> float:
    from mlcc.runtime.engine import Engine

    with Engine(model_dir, target="llvm", max_batch=1) as e:
        msgs = [{"role": "user", "content": "Tell me a story."}]
        e.chat.completions.create(messages=msgs, max_tokens=4, temperature=0)
        best = 0.0
        for _ in range(2):
            first = None
            for c in e.chat.completions.create(messages=msgs, max_tokens=n, temperature=0, ignore_eos=True,
                                               stream=True):
                if first is None and c.choices and c.choices[0].delta.content:
                    first = time.perf_counter()
            best = max(best, (n - 1) / (time.perf_counter() - first))
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--max-tasks", type=int, default=5)
    p.add_argument("--out", required=True, help="folder for tune_cpu.json")
    a = p.parse_args()
    from mlcc.compiler.build import compile_model
    from mlcc.compiler.tune import format_report, tune_model
    from mlcc.runtime.jit import default_model_path

    gguf = default_model_path()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        t = time.time()
        reports = tune_model(gguf, "llvm", "q4f32_1", a.trials, d / "db", a.max_tasks)
        tune_s = time.time() - t
        print(format_report(reports))
        compile_model(gguf, "llvm", "q4f32_1", d / "default")
        compile_model(gguf, "llvm", "q4f32_1", d / "tuned", tuning_db=d / "db")
        kernels = [{k: (v.item() if hasattr(v, "item") else v) for k, v in r.__dict__.items()} for r in reports]
        res = {"trials_per_kernel": a.trials, "max_tasks": a.max_tasks, "kernels": kernels, "tune_seconds": tune_s,
               "decode_tok_s_default": decode_tok_s(d / "default"), "decode_tok_s_tuned": decode_tok_s(d / "tuned")}
    print(json.dumps({k: v for k, v in res.items() if k != "kernels"}, indent=1))
    write_json(a.out, "tune_cpu.json", res)


if __name__ == "__main__":
    main()
