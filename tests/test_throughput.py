"""`mlcc bench throughput`: the in-process throughput benchmark, on a tiny compiled model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mlcc import Engine
from mlcc.errors import ArtifactError
from mlcc.runtime.serve.throughput import run_throughput, synthetic_prompts


def test_synthetic_prompts_have_the_length_and_distinct_first_tokens():
    prompts = synthetic_prompts(1000, 50, 7, seed=3)
    assert len(prompts) == 50 and all(len(p) == 7 for p in prompts)
    assert len({p[0] for p in prompts}) == 50 and max(max(p) for p in prompts) < 990
    assert synthetic_prompts(1000, 50, 7, seed=3) == prompts


def test_cli_writes_a_row_with_every_answer_full_length(compiled, tmp_path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "-m", "mlcc", "bench", "throughput", str(compiled("llama", "q0f32")),
                        "--target", "llvm", "--input-len", "8", "--output-len", "6", "--num-requests", "6",
                        "--max-batch", "4", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = json.loads(out.read_text())
    assert row["bench"] == "throughput" and (row["input_len"], row["output_len"], row["max_batch"]) == (8, 6, 4)
    assert row["errors"] == 0 and row["requests"] == 6 and row["output_tokens"] == 36
    assert row["output_tok_s"] > 0 and row["total_tok_s"] > row["output_tok_s"]
    assert 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"] and 0 < row["itl_ms"]["p50"] <= row["itl_ms"]["p99"]
    assert 0 <= row["peak_kv_tokens"] <= row["kv_capacity_tokens"]
    assert row["quant"] == "q0f32" and row["target"] == "llvm"


def test_poisson_arrivals_and_a_too_long_request(compiled):
    with Engine(compiled("llama", "q0f32"), target="llvm", max_batch=2) as engine:
        row = run_throughput(engine, 5, 4, 4, request_rate=50.0, warmup=0)
        assert row["errors"] == 0 and row["output_tokens"] == 16 and row["request_rate"] == 50.0
        with pytest.raises(ValueError, match="exceeds the context window"):
            run_throughput(engine, engine.context_window, 4, 1)


def test_a_shape_only_build_runs_with_its_placeholder_tokenizer(hf_models, tmp_path):
    from mlcc.compiler.build import compile_shape_only

    hf_config = json.loads((hf_models("llama") / "config.json").read_text())
    out = tmp_path / "shape"
    compile_shape_only("llama", hf_config, "llvm", "q0f32", out)
    with pytest.raises(ArtifactError, match=r"shape-only build: it has no weight files.*`--weights random`"):
        Engine(out, target="llvm")
    with Engine(out, target="llvm", weights="random", max_batch=2) as engine:
        assert engine.model.config["tokenizer"]["placeholder"] is True
        row = run_throughput(engine, 6, 5, 3, warmup=0)
        assert row["errors"] == 0 and row["output_tokens"] == 15
