"""Issue 7 on this CPU: SmolLM2-135M q4f32_1 decode tok/s with the default schedules vs with a tuning database.

    python bench/tune_cpu.py --trials 16 --max-tasks 5     # writes bench/results/tune_cpu.json (or --out)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


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
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--max-tasks", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "tune_cpu.json"))
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
        res = {"trials_per_kernel": a.trials, "kernels": [{k: (v.item() if hasattr(v, "item") else v) for k, v in r.__dict__.items()}
                                                                   for r in reports], "tune_seconds": tune_s,
               "decode_tok_s_default": decode_tok_s(d / "default"), "decode_tok_s_tuned": decode_tok_s(d / "tuned")}
    print(json.dumps({k: v for k, v in res.items() if k != "kernels"}, indent=1))
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
