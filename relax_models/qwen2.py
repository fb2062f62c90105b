"""Qwen2 / Qwen2.5: the Llama block with biases on the q/k/v projections."""

from __future__ import annotations

from typing import Any

from . import llama


class Qwen2Config(llama.LlamaConfig):
    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "Qwen2Config":
        base = llama.LlamaConfig.from_hf({**cfg, "attention_bias": True, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6)})
        return cls(**base.__dict__)


class Qwen2ForCausalLM(llama.LlamaForCausalLM):
    """Same graph as Llama; the config turns the q/k/v bias on."""


hf_weight_plan = llama.hf_weight_plan
gguf_config = llama.gguf_config


def gguf_fixups(cfg: llama.LlamaConfig) -> dict[str, Any]:
    return {}  # llama.cpp does not permute Qwen2's q/k
