"""Qwen3: per-head q/k RMSNorm before RoPE, an explicit head_dim, no q/k/v bias."""

from __future__ import annotations

from typing import Any

from .blocks import DecoderConfig
from .config_utils import decoder_config
from .llama import gguf_config  # noqa: F401 - same metadata keys (head_dim from attention.key_length)
from .weight_plans import Plan, decoder_plan


def config_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    first = int(cfg.get("max_window_layers", cfg["num_hidden_layers"]))
    bias = bool(cfg.get("attention_bias", False))
    return decoder_config({**cfg, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
                           "use_sliding_window": bool(cfg.get("use_sliding_window", False))},
                          sliding_pattern=lambda i: i >= first, qk_norm="head", o_bias=bias)


def hf_weight_plan(cfg: DecoderConfig) -> Plan:
    return decoder_plan(cfg)
