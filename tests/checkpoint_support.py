"""What the tests of published quantized checkpoints share (tests/test_fp8_checkpoint.py, tests/test_awq_gptq.py):
transformers float32 carrying a checkpoint's dequantized weights as the reference, the comparison of a compiled
library's logits and greedy ids with it, and an edited copy of a checkpoint for the refusal tests."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from conftest import PROMPT


def reference_model(src: Path, weights: dict[str, torch.Tensor], keep_missing: bool = False):
    """transformers float32 of the model in `src` with the checkpoint's dequantized weights: every parameter, or with
    keep_missing those `weights` has (the others as `src` holds them)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in weights or not keep_missing:
                p.copy_(weights[name].to(torch.float32))
    return model


def rel_err(a, b) -> float:
    """Largest |a - b| relative to the largest |b|."""
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def assert_matches_reference(artifacts: Path, hf, steps: int = 16, tol: float = 1e-4) -> None:
    """The library's logits over PROMPT and `steps` greedy decode steps within `tol` of `hf`'s, and its greedy ids
    those of hf.generate."""
    from mlcc.runtime.device.model import LoadedModel

    m = LoadedModel(artifacts)
    m.create_kv_cache(2, 256, 64)
    m.add_sequence(0)
    ours = m.prefill([0], [PROMPT]).numpy()[0]   # 13 tokens: the many-token projections
    ids, errs = list(PROMPT), []
    for _ in range(steps):
        with torch.no_grad():
            errs.append(rel_err(ours, hf(torch.tensor([ids])).logits[0, -1].double().numpy()))
        ids.append(int(np.argmax(ours)))
        ours = m.decode([0], [ids[-1]]).numpy()[0]
    assert max(errs) <= tol, errs
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(PROMPT):].tolist()
    assert ids[len(PROMPT):] == ref


def edited(folder: Path, out: Path, config: Callable[[dict], None] | None = None,
           tensors: Callable[[dict], None] | None = None) -> Path:
    """A copy of `folder` with config.json's quantization_config edited by `config` and its tensors by `tensors`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    if config is not None:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg["quantization_config"])
        (out / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        state = load_file(out / "model.safetensors")
        tensors(state)
        save_file(state, out / "model.safetensors")
    return out
