"""Gemma 3 (text): Gemma 2's block with per-head q/k norms instead of attention soft-capping, local layers (5 of
every 6 in the released models) with their own RoPE base, and RoPE scaling on the global layers only."""

from __future__ import annotations

from typing import Any, Callable

from mlcc.errors import UnsupportedConfigError

from .blocks import DecoderConfig
from .config_utils import decoder_config, rope_theta_and_scaling
from .gemma import gemma_switches
from .llama import gguf_config as llama_gguf_config
from .weight_plans import SANDWICH_NORMS, Plan, decoder_plan, norm_names, norm_plus_one

# where the multimodal checkpoints (a `text_config`) keep the language model, as transformers saves them; the
# Hub's original files say "language_model.model", which ModelSource resolves as an alias
_MULTIMODAL_PREFIX = "model.language_model"


def config_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    outer = cfg
    if "text_config" in cfg:
        cfg = {**cfg["text_config"], "tie_word_embeddings": True}
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedConfigError("use_bidirectional_attention: mlcc compiles causal decoders only")
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
    if isinstance(pattern, list):  # llama.cpp's per-layer form: true where a layer slides
        cfg = {**cfg, "layer_types": ["sliding_attention" if f else "full_attention" for f in pattern]}
        pattern = 6
    pattern = int(pattern)
    local_theta, _ = rope_theta_and_scaling(cfg, "sliding_attention")
    if "rope_local_base_freq" in cfg:
        local_theta = float(cfg["rope_local_base_freq"])
    out = decoder_config(
        cfg, sliding_pattern=lambda i: (i + 1) % pattern != 0, **gemma_switches(cfg), pre_norms=True,
        post_norms=True, qk_norm="head", o_bias=bool(cfg.get("attention_bias", False)),
        attention_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        rope_local_theta=local_theta, weight_prefix=_MULTIMODAL_PREFIX if "text_config" in outer else "model")
    return out


def hf_weight_plan(cfg: DecoderConfig) -> Plan:
    return decoder_plan(cfg, SANDWICH_NORMS, prefix=cfg.weight_prefix)


def hf_fixups(cfg: DecoderConfig) -> dict[str, Callable]:
    return norm_plus_one(norm_names(hf_weight_plan(cfg)))


def gguf_config(fields: dict[str, Any], arch: str, vocab_size: int, has_output: bool) -> dict[str, Any]:
    cfg = llama_gguf_config(fields, arch, vocab_size, has_output)
    # llama.cpp's Gemma 3 defaults: local layers at base 10,000, every 6th layer global, the query scaled by
    # head_dim except in the 27B (62 layers: hidden / heads)
    cfg["rope_local_base_freq"] = float(fields.get(f"{arch}.rope.freq_base_swa") or 10000.0)
    pattern = fields.get(f"{arch}.attention.sliding_window_pattern")
    if pattern is not None:
        cfg["sliding_window_pattern"] = list(pattern) if isinstance(pattern, (list, tuple)) else int(pattern)
    if cfg["num_hidden_layers"] == 62:
        cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    scale = fields.get(f"{arch}.rope.scaling.factor")
    if scale and float(scale) != 1.0:
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(scale)}
    return cfg
