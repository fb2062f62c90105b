"""Tensor parallelism over one host's GPUs, in one run: logits with 2 shards against 1 on the same weights, an Engine
chat and `mlcc serve --tensor-parallel 2` (through the openai client) against 1 GPU's answer, and Llama-3-8B-shaped
batch-1 decode tok/s with 1 and 2 shards.

    python bench/tp_cuda.py build --out .dev/tp      # libraries, the small model's weights, the NCCL bridge
    python bench/tp_cuda.py run --libs .dev/tp --out OUT      # on a machine with two or more CUDA GPUs

The small model (random Llama, q4f16_1, byte tokenizer) checks the numerics; the 8B shape has random weights
(speed does not depend on values). NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from harness import cli, presets

from mlcc.compiler.byte_tokenizer import VOCAB, write_byte_tokenizer

LLAMA3_8B = presets()["llama3-8b"].config

SMALL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=1024)
PROMPT, STEPS = 128, 128


def cmd_build(a) -> None:
    import torch
    import transformers as tf

    from mlcc.compiler.build import compile_model, compile_shape_only
    from mlcc.runtime.device import nccl_ccl

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    src = out / "small-hf"
    if not (src / "config.json").exists():
        torch.manual_seed(0)
        tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL)).eval().save_pretrained(src)
        write_byte_tokenizer(src)
    times = {}
    for tp in (1, 2):
        compile_model(src, "cuda", "q4f16_1", out / f"small-tp{tp}", tensor_parallel=tp)
        times[f"llama3-8b/tp{tp}"] = compile_shape_only("llama", LLAMA3_8B, "cuda", "q4f16_1",
                                                        out / f"llama3-8b-tp{tp}", tensor_parallel=tp)
        print(f"8B shape, tensor_parallel={tp}: compiled in {times[f'llama3-8b/tp{tp}']:.1f}s")
    shutil.rmtree(src)
    (out / "compile_times.json").write_text(json.dumps(times, indent=1))
    shutil.copy(nccl_ccl.library_path(), out / "libmlcc_disco_nccl.so")


def _load(path: Path, tp: int, weights: str = "files"):
    from mlcc.runtime.device.model import LoadedModel
    from mlcc.runtime.device.tensor_parallel import TensorParallelModel

    return TensorParallelModel(path, weights=weights) if tp > 1 else LoadedModel(path, weights=weights)


def _greedy(m, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int]]:
    m.create_kv_cache(1, 1024, 512)
    m.add_sequence(0)
    logits = m.prefill([0], [prompt])
    first = logits.numpy().copy()
    argmax = m.argmax
    ids = [int(argmax(logits).numpy()[0])]
    for _ in range(steps - 1):
        ids.append(int(argmax(m.decode([0], [ids[-1]])).numpy()[0]))
    m.remove_sequence(0)
    return first, ids


def _decode_speed(m) -> float:
    m.create_kv_cache(1, 4096, 2048)
    argmax = m.argmax
    m.add_sequence(0)
    tok = int(argmax(m.prefill([0], [[7] * PROMPT])).numpy()[0])
    for _ in range(5):
        tok = int(argmax(m.decode([0], [tok])).numpy()[0])
    t = time.perf_counter()
    for _ in range(STEPS):
        tok = int(argmax(m.decode([0], [tok])).numpy()[0])
    m.remove_sequence(0)
    return STEPS / (time.perf_counter() - t)


def _serve_answer(model_dir: Path) -> str:
    """`mlcc serve --tensor-parallel 2` answered through the official openai client."""
    import subprocess

    import openai

    from mlcc.runtime.serve.loadgen import wait_until_healthy

    port = 8123
    proc = subprocess.Popen([sys.executable, "-m", "mlcc", "serve", str(model_dir), "--target", "cuda",
                             "--tensor-parallel", "2", "--port", str(port), "--kv-cache-tokens", "2048",
                             "--served-model-name", "tp2"])
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", proc, timeout=240)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        r = client.chat.completions.create(model="tp2", messages=[{"role": "user", "content": "hello there"}],
                                           max_tokens=24, temperature=0)
        return r.choices[0].message.content
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def cmd_run(a) -> None:
    import gc

    import tvm

    os.environ.setdefault("MLCC_NCCL_BRIDGE", str(Path(a.libs).resolve() / "libmlcc_disco_nccl.so"))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    libs, out = Path(a.libs), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {}
    # 1. numerics: same weights, one GPU vs two
    prompt = [(i * 37) % 300 + 5 for i in range(60)]
    l1, ids1 = _greedy(_load(libs / "small-tp1", 1), prompt, 32)
    gc.collect()
    l2, ids2 = _greedy(_load(libs / "small-tp2", 2), prompt, 32)
    gc.collect()
    rel = float(np.abs(l1 - l2).max() / np.abs(l1).max())
    same = sum(x == y for x, y in zip(ids1, ids2))
    result["parity"] = {"max_rel_err_first_logits": rel, "greedy_equal_tokens": same, "greedy_steps": len(ids1),
                        "argmax_first_equal": bool(l1.argmax() == l2.argmax())}
    print(json.dumps(result["parity"]))
    # 2. the Engine on two GPUs answers like the Engine on one
    from mlcc.runtime.engine import Engine

    answers = {}
    for tp in (1, 2):
        e = Engine(libs / f"small-tp{tp}", target="cuda", tensor_parallel=tp, max_batch=2, kv_cache_tokens=2048)
        r = e.chat.completions.create(messages=[{"role": "user", "content": "hello there"}], max_tokens=24,
                                      temperature=0)
        answers[tp] = r.choices[0].message.content
        e.shutdown()
        del e
        gc.collect()
    result["engine_equal"] = answers[1] == answers[2]
    result["engine_answers"] = answers
    result["serve_equal"] = _serve_answer(libs / "small-tp2") == answers[1]
    # 3. speed, 8B shape
    compile_times = json.loads((libs / "compile_times.json").read_text())
    rows = []
    for tp in (1, 2):
        t = time.perf_counter()
        m = _load(libs / f"llama3-8b-tp{tp}", tp, weights="random")
        load_s = time.perf_counter() - t
        tok_s = _decode_speed(m)
        rows.append({"model": "llama3-8b", "quant": "q4f16_1", "tensor_parallel": tp, "decode_tok_s": tok_s,
                     "load_s": load_s, "compile_s": compile_times[f"llama3-8b/tp{tp}"]})
        print(json.dumps(rows[-1]))
        del m
        gc.collect()
    result["decode"] = rows
    gpus = [tvm.cuda(i).device_name for i in range(8) if tvm.cuda(i).exist]  # after the CUDA runtime is loaded
    result["gpus"] = gpus
    (out / "tp_cuda.json").write_text(json.dumps(result, indent=1))
    p = result["parity"]
    print(f"\nGPUs: {', '.join(gpus)}")
    print(f"logits N=2 vs N=1 (same weights, q4f16_1): max rel err {p['max_rel_err_first_logits']:.2e}; greedy "
          f"{p['greedy_equal_tokens']}/{p['greedy_steps']} tokens equal; Engine chat equal: {result['engine_equal']}; "
          f"mlcc serve --tensor-parallel 2 via openai equal: {result['serve_equal']}")
    print(f"{'model':10s} {'N':>2s} {'decode tok/s':>13s} {'load s':>7s} {'compile s':>9s}")
    for r in rows:
        print(f"{r['model']:10s} {r['tensor_parallel']:2d} {r['decode_tok_s']:13.1f} {r['load_s']:7.1f} "
              f"{r['compile_s']:9.1f}")


def _build_args(p) -> None:
    p.add_argument("--out", default=".dev/tp")


def _run_args(p) -> None:
    p.add_argument("--libs", default=".dev/tp")
    p.add_argument("--out", default=os.environ.get("MLCC_BENCH_OUT", "out/bench"))


if __name__ == "__main__":
    cli(__doc__, {"build": (cmd_build, _build_args), "run": (cmd_run, _run_args)})
