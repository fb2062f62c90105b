"""Gemma 2: Gemma with norms before and after attention and MLP, soft-capped attention scores and logits,
alternating sliding / global layers and a query scale of query_pre_attn_scalar ** -0.5."""

from __future__ import annotations

from typing import Any, Callable

from .blocks import DecoderConfig
from .config_utils import decoder_config
from .gemma import gemma_switches
from .llama import gguf_config as llama_gguf_config
from .weight_plans import SANDWICH_NORMS, Plan, decoder_plan, norm_names, norm_plus_one


def config_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    return decoder_config(
        cfg, sliding_pattern=lambda i: i % 2 == 0, **gemma_switches(cfg), pre_norms=True, post_norms=True,
        attention_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0))


def hf_weight_plan(cfg: DecoderConfig) -> Plan:
    return decoder_plan(cfg, SANDWICH_NORMS)


def hf_fixups(cfg: DecoderConfig) -> dict[str, Callable]:
    return norm_plus_one(norm_names(hf_weight_plan(cfg)))


def gguf_config(fields: dict[str, Any], arch: str, vocab_size: int, has_output: bool) -> dict[str, Any]:
    cfg = llama_gguf_config(fields, arch, vocab_size, has_output)
    cfg.setdefault("sliding_window", 4096)  # llama.cpp's default for Gemma 2 files without the key
    for key, hf in (("attn_logit_softcapping", "attn_logit_softcapping"),
                    ("final_logit_softcapping", "final_logit_softcapping")):
        if fields.get(f"{arch}.{key}") is not None:
            cfg[hf] = float(fields[f"{arch}.{key}"])
    # GGUF keeps no query_pre_attn_scalar; llama.cpp knows it from the model size: hidden / heads for the 27B
    # (46 layers), head_dim for the others
    if cfg["num_hidden_layers"] == 46:
        cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg
