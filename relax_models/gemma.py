"""Gemma (v1): embeddings scaled by √hidden, RMSNorm with (1 + weight), GeGLU MLP, wide heads."""

from __future__ import annotations

from typing import Any, Callable

from .blocks import DecoderConfig
from .config_utils import decoder_config
from .llama import gguf_config  # noqa: F401 - same metadata keys
from .weight_plans import Plan, decoder_plan, norm_names, norm_plus_one


def gemma_activation(cfg: dict[str, Any]) -> str:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    return "gelu_pytorch_tanh" if act == "gelu" else act  # HF maps Gemma's legacy "gelu" to the tanh form too


def gemma_switches(cfg: dict[str, Any]) -> dict[str, Any]:
    """What every Gemma generation shares; the config keys each generation's own."""
    return dict(hidden_act=gemma_activation(cfg), tie_word_embeddings=True,
                embedding_scale=float(cfg["hidden_size"]) ** 0.5, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6))


def config_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    return decoder_config(cfg, **gemma_switches(cfg))


def hf_weight_plan(cfg: DecoderConfig) -> Plan:
    return decoder_plan(cfg)


def hf_fixups(cfg: DecoderConfig) -> dict[str, Callable]:
    # llama.cpp's converter stores Gemma norms with the 1 added already, so only HF checkpoints need it
    return norm_plus_one(norm_names(hf_weight_plan(cfg)))
