"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama block with q/k/v and gate/up stored fused, partial rotary and LongRoPE."""

from __future__ import annotations

from typing import Any

import numpy as np

from .blocks import DecoderConfig
from .config_utils import decoder_config, rope_theta_and_scaling
from .llama import gguf_config as llama_gguf_config
from .weight_plans import Plan, decoder_plan


def config_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    _, scaling = rope_theta_and_scaling(cfg)
    if scaling and scaling["rope_type"] == "longrope":
        original = int(cfg.get("original_max_position_embeddings")
                       or scaling.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
        # HF: the scale factor is the context growth over the original context when the config says both
        scaling = {**scaling, "original_max_position_embeddings": original,
                   "factor": cfg["max_position_embeddings"] / original}
    return decoder_config(cfg, sliding_pattern=lambda i: True, rope_scaling=scaling)


def hf_weight_plan(cfg: DecoderConfig) -> Plan:
    return decoder_plan(cfg, fused_qkv=True, fused_gate_up=True)


def gguf_config(fields: dict[str, Any], arch: str, vocab_size: int, has_output: bool) -> dict[str, Any]:
    cfg = llama_gguf_config(fields, arch, vocab_size, has_output)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rot = fields.get(f"{arch}.rope.dimension_count")
    if rot:
        cfg["partial_rotary_factor"] = int(rot) / head_dim
    original = fields.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        cfg["original_max_position_embeddings"] = int(original)
    return cfg


def gguf_rope_factors(tensors: dict[str, np.ndarray], cfg: dict[str, Any]) -> None:
    """llama.cpp keeps LongRoPE's factors as the tensors rope_factors_long/short: back into the config."""
    if "rope_factors_long.weight" in tensors and "rope_factors_short.weight" in tensors:
        cfg["rope_scaling"] = {"rope_type": "longrope",
                               "long_factor": [float(x) for x in tensors["rope_factors_long.weight"]],
                               "short_factor": [float(x) for x in tensors["rope_factors_short.weight"]]}
