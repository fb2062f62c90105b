"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's block (q/k/v biases) with a sparse MoE MLP plus a shared
expert behind a sigmoid gate; `decoder_sparse_step` / `mlp_only_layers` keep some layers dense."""

from __future__ import annotations

from typing import Any

from .config_utils import decoder_config
from .moe import MoEConfig, MoEForCausalLM
from .qwen_moe import moe_config, qwen_moe_gguf_config
from .qwen_moe import qwen_moe_plan as hf_weight_plan  # noqa: F401

MODEL_CLS = MoEForCausalLM


def config_from_hf(cfg: dict[str, Any]) -> MoEConfig:
    first = int(cfg.get("max_window_layers", cfg["num_hidden_layers"]))
    base = decoder_config({**cfg, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
                           "use_sliding_window": bool(cfg.get("use_sliding_window", False))},
                          sliding_pattern=lambda i: i >= first, attention_bias=bool(cfg.get("qkv_bias", True)))
    return moe_config(cfg, base, shared=True)


def gguf_config(fields: dict[str, Any], arch: str, vocab_size: int, has_output: bool) -> dict[str, Any]:
    return qwen_moe_gguf_config(fields, arch, vocab_size, has_output, normalize=False)
