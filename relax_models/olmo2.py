"""OLMo 2: RMSNorm only on the attention and MLP outputs (none before them), q/k RMSNorm over the whole
projection before RoPE."""

from __future__ import annotations

from typing import Any

from .blocks import DecoderConfig
from .config_utils import decoder_config
from .llama import gguf_config  # noqa: F401 - same metadata keys
from .weight_plans import POST_NORMS, Plan, decoder_plan


def config_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    bias = bool(cfg.get("attention_bias", False))
    return decoder_config(cfg, pre_norms=False, post_norms=True, qk_norm="projection", o_bias=bias)


def hf_weight_plan(cfg: DecoderConfig) -> Plan:
    return decoder_plan(cfg, POST_NORMS)
