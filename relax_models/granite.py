"""Granite (3.x): the Llama block with multipliers on the embedding, each residual branch, the attention scores
and the logits."""

from __future__ import annotations

from typing import Any

from mlcc.errors import UnsupportedConfigError

from .blocks import DecoderConfig
from .config_utils import decoder_config
from .llama import gguf_config as llama_gguf_config
from .llama import gguf_fixups  # noqa: F401 - llama.cpp converts Granite as Llama, permuting q/k the same way
from .weight_plans import Plan, decoder_plan


def config_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    if cfg.get("mlp_bias"):
        raise UnsupportedConfigError("mlp_bias: biases on the MLP projections are not supported")
    bias = bool(cfg.get("attention_bias", False))
    return decoder_config(
        cfg, o_bias=bias,
        embedding_scale=float(cfg.get("embedding_multiplier", 1.0)),
        residual_scale=float(cfg.get("residual_multiplier", 1.0)),
        attention_scale=float(cfg.get("attention_multiplier", 1.0)),
        logit_scale=1.0 / float(cfg.get("logits_scaling", 1.0)))


def hf_weight_plan(cfg: DecoderConfig) -> Plan:
    return decoder_plan(cfg)


def gguf_config(fields: dict[str, Any], arch: str, vocab_size: int, has_output: bool) -> dict[str, Any]:
    cfg = llama_gguf_config(fields, arch, vocab_size, has_output)
    for key, hf in (("embedding_scale", "embedding_multiplier"), ("residual_scale", "residual_multiplier"),
                    ("attention.scale", "attention_multiplier"), ("logit_scale", "logits_scaling")):
        if fields.get(f"{arch}.{key}") is not None:
            cfg[hf] = float(fields[f"{arch}.{key}"])
    return cfg
