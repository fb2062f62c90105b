"""Mixtral: the Mistral block with a sparse MoE MLP in every layer (top-2 of 8 in the released models, the k
weights always renormalised). llama.cpp writes it as GGUF architecture `llama` with `llama.expert_count` set and
the experts stacked (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`, router `ffn_gate_inp`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .config_utils import decoder_config
from .llama import gguf_config as llama_gguf_config
from .llama import gguf_fixups  # noqa: F401 - llama.cpp converts Mixtral as Llama, permuting q/k the same way
from .moe import MoEConfig, MoEForCausalLM, check_moe_config
from .weight_plans import Plan, decoder_plan, moe_plan

MODEL_CLS = MoEForCausalLM


def config_from_hf(cfg: dict[str, Any]) -> MoEConfig:
    base = decoder_config(cfg, sliding_pattern=lambda i: True)
    return check_moe_config(MoEConfig(
        **dataclasses.asdict(base), num_experts=int(cfg["num_local_experts"]),
        experts_per_token=int(cfg["num_experts_per_tok"]), moe_intermediate_size=int(cfg["intermediate_size"]),
        norm_topk_prob=True))


def hf_weight_plan(cfg: MoEConfig) -> Plan:
    return moe_plan(cfg, decoder_plan(cfg), "block_sparse_moe", ("w1", "w3", "w2"))


def gguf_config(fields: dict[str, Any], arch: str, vocab_size: int, has_output: bool) -> dict[str, Any]:
    cfg = llama_gguf_config(fields, arch, vocab_size, has_output)
    cfg["num_local_experts"] = int(fields[f"{arch}.expert_count"])
    cfg["num_experts_per_tok"] = int(fields[f"{arch}.expert_used_count"])
    return cfg
