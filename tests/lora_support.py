"""PEFT LoRA adapters for the tests, built from random init on the conftest's tiny models, and peft's own greedy
tokens as the reference (transformers with the adapter merged: merge_and_unload)."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, seed: int, r: int, targets: list[str], alpha: float = 16,
                 rslora: bool = False) -> Path:
    """A PEFT adapter of `base` with random A and B (init_lora_weights=False: B is not zero), saved to `out`."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, use_rslora=rslora)
    get_peft_model(model, config).save_pretrained(out)
    return out


def merged(model, adapter: Path | None):
    """A copy of `model` (a transformers model, not changed) with `adapter` merged into it (None: the copy)."""
    import copy

    from peft import PeftModel

    model = copy.deepcopy(model)
    return PeftModel.from_pretrained(model, adapter).merge_and_unload() if adapter is not None else model


def peft_greedy(model, prompt: list[int], adapter: Path | None, n: int) -> list[int]:
    """Greedy ids of `model` with `adapter` merged."""
    with torch.no_grad():
        out = merged(model, adapter).generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                              eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def peft_last_logits(model, prompt: list[int], adapter: Path | None):
    """The last position's logits of `model` with `adapter` merged, as float64 numpy."""
    with torch.no_grad():
        return merged(model, adapter)(torch.tensor([prompt])).logits[0, -1].double().numpy()
