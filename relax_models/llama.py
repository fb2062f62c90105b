"""Llama 2/3, Mistral, SmolLM2: the shared decoder with its defaults."""

from __future__ import annotations

from typing import Any

import numpy as np

from .blocks import DecoderConfig
from .config_utils import decoder_config
from .weight_plans import Plan, decoder_plan


def config_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    if cfg.get("mlp_bias"):
        from mlcc.errors import UnsupportedConfigError

        raise UnsupportedConfigError("mlp_bias: biases on the MLP projections are not supported")
    bias = bool(cfg.get("attention_bias", False))
    # Mistral slides every layer when its config sets a window (HF: all layers use config.sliding_window)
    return decoder_config(cfg, sliding_pattern=lambda i: True, o_bias=bias)


def hf_weight_plan(cfg: DecoderConfig) -> Plan:
    return decoder_plan(cfg)


def gguf_config(fields: dict[str, Any], arch: str, vocab_size: int, has_output: bool) -> dict[str, Any]:
    """HF-style config dict from GGUF metadata (llama.cpp key names)."""
    g = lambda k, d=None: fields.get(f"{arch}.{k}", d)  # noqa: E731
    n_heads = int(g("attention.head_count"))
    cfg = {
        "hidden_size": int(g("embedding_length")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(g("attention.head_count_kv", n_heads)),
        "vocab_size": vocab_size,
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 4096)),
        "tie_word_embeddings": not has_output,
    }
    if g("attention.key_length"):
        cfg["head_dim"] = int(g("attention.key_length"))
    if g("attention.sliding_window"):
        cfg["sliding_window"] = int(g("attention.sliding_window"))
    return cfg


def unpermute_gguf_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf permutation of q/k rows (interleaved → half-split RoPE layout)."""
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_fixups(cfg: DecoderConfig) -> dict[str, Any]:
    """Per-HF-name transforms applied to dequantized GGUF tensors: llama.cpp permutes Llama's q/k."""
    fix = {}
    for i in range(cfg.num_hidden_layers):
        fix[f"model.layers.{i}.self_attn.q_proj.weight"] = lambda w: unpermute_gguf_qk(w, cfg.num_attention_heads)
        fix[f"model.layers.{i}.self_attn.k_proj.weight"] = lambda w: unpermute_gguf_qk(w, cfg.num_key_value_heads)
    return fix
