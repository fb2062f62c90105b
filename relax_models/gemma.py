"""Gemma (v1): embeddings scaled by sqrt(hidden), RMSNorm with (1 + weight), GeGLU MLP, wide heads."""

from __future__ import annotations

from typing import Any

import numpy as np
from tvm.relax.frontend.nn import Tensor

from . import llama


class GemmaConfig(llama.LlamaConfig):
    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "GemmaConfig":
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act == "gelu":  # HF maps Gemma's legacy "gelu" to the tanh approximation as well
            act = "gelu_pytorch_tanh"
        base = llama.LlamaConfig.from_hf({**cfg, "hidden_act": act, "tie_word_embeddings": True,
                                          "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6)})
        return cls(**base.__dict__)


class GemmaForCausalLM(llama.LlamaForCausalLM):
    def embed_scale(self, h: Tensor) -> Tensor:
        # HF rounds the normalizer to the activation dtype before multiplying
        return h * np.array(self.cfg.hidden_size**0.5, dtype=self.dtype).item()


hf_weight_plan = llama.hf_weight_plan


def hf_fixups(cfg: llama.LlamaConfig) -> dict[str, Any]:
    """HF Gemma norms compute x̂·(1 + w); storing 1 + w lets the plain RMSNorm do the same math."""
    plus_one = lambda w: w.astype(np.float32) + 1.0  # noqa: E731
    names = ["model.norm.weight"]
    for i in range(cfg.num_hidden_layers):
        names += [f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.post_attention_layernorm.weight"]
    return {n: plus_one for n in names}
