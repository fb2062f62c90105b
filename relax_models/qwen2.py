"""Qwen2 / Qwen2.5: the Llama block with biases on the q/k/v projections (not on o_proj)."""

from __future__ import annotations

from typing import Any

from .blocks import DecoderConfig
from .config_utils import decoder_config
from .llama import gguf_config  # noqa: F401 - same metadata keys
from .weight_plans import Plan, decoder_plan


def config_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    # HF Qwen2: with use_sliding_window, the layers from max_window_layers on slide
    first = int(cfg.get("max_window_layers", cfg["num_hidden_layers"]))
    return decoder_config({**cfg, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
                           "use_sliding_window": bool(cfg.get("use_sliding_window", False))},
                          sliding_pattern=lambda i: i >= first, attention_bias=True)


def hf_weight_plan(cfg: DecoderConfig) -> Plan:
    return decoder_plan(cfg)
