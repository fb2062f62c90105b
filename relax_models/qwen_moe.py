"""What Qwen2-MoE and Qwen3-MoE share: their HF and GGUF config keys for the experts, and where the experts live
(`mlp.experts.{e}.{gate,up,down}_proj`, router `mlp.gate`, Qwen2-MoE's `mlp.shared_expert*`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .blocks import DecoderConfig
from .llama import gguf_config as llama_gguf_config
from .moe import MoEConfig, check_moe_config, sparse_layer_flags
from .weight_plans import Plan, decoder_plan, moe_plan


def moe_config(cfg: dict[str, Any], base: DecoderConfig, shared: bool) -> MoEConfig:
    n = int(cfg["num_hidden_layers"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # (transformers 5 saves the latter)
    return check_moe_config(MoEConfig(
        **dataclasses.asdict(base), num_experts=int(experts), experts_per_token=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]), norm_topk_prob=bool(cfg.get("norm_topk_prob")),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0) if shared else 0,
        sparse_layers=sparse_layer_flags(cfg, n)))


def qwen_moe_plan(cfg: MoEConfig) -> Plan:
    return moe_plan(cfg, decoder_plan(cfg), "mlp", ("gate_proj", "up_proj", "down_proj"))


def qwen_moe_gguf_config(fields: dict[str, Any], arch: str, vocab_size: int, has_output: bool,
                         normalize: bool) -> dict[str, Any]:
    """llama.cpp's keys; `normalize`: its default for renormalising the top k, where the file does not say
    (`expert_weights_norm`)."""
    g = lambda k, d=None: fields.get(f"{arch}.{k}", d)  # noqa: E731
    cfg = llama_gguf_config(fields, arch, vocab_size, has_output)
    cfg.update(num_experts=int(g("expert_count")), num_experts_per_tok=int(g("expert_used_count")),
               moe_intermediate_size=int(g("expert_feed_forward_length")),
               norm_topk_prob=bool(g("expert_weights_norm", normalize)))
    if g("expert_shared_feed_forward_length"):
        cfg["shared_expert_intermediate_size"] = int(g("expert_shared_feed_forward_length"))
    return cfg
