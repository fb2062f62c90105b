"""Model families, registered by HF `model_type` and GGUF `general.architecture`.

Every family builds the shared decoder (blocks.py); its module parses the config (`config_from_hf`), says where the
weights live (`hf_weight_plan`, optional `hf_fixups`), and reads GGUF metadata (`gguf_config`, optional
`gguf_fixups`, and `gguf_weight_plan` where llama.cpp lays the tensors out other than HF does, not only renamed); a
family whose model is not the plain decoder names its class `MODEL_CLS` (the MoE families).
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any, Callable

from mlcc.errors import UnknownArchitectureError

from . import deepseek, gemma, gemma2, gemma3, gemma3_vision, gpt_oss, granite, llama, llava, mixtral, olmo2, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe
from .blocks import DecoderConfig, DecoderForCausalLM
from .weight_plans import check_tensor_parallel, shard_weight


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    module: ModuleType
    model_cls: type = DecoderForCausalLM

    def config_from_hf(self, cfg: dict[str, Any]) -> DecoderConfig:
        return self.module.config_from_hf(cfg)

    def weight_plan(self, cfg: DecoderConfig, source: str = "hf") -> dict[str, tuple[list[str], Callable | None]]:
        """Where each parameter comes from in a checkpoint of kind `source` ("hf" | "gguf")."""
        if source == "gguf" and hasattr(self.module, "gguf_weight_plan"):
            return self.module.gguf_weight_plan(cfg)
        return self.module.hf_weight_plan(cfg)

    def hf_fixups(self, cfg: DecoderConfig) -> dict[str, Callable]:
        return getattr(self.module, "hf_fixups", lambda c: {})(cfg)

    def gguf_config(self, fields: dict[str, Any], arch: str, vocab_size: int, has_output: bool) -> dict[str, Any]:
        return self.module.gguf_config(fields, arch, vocab_size, has_output)

    def gguf_fixups(self, cfg: DecoderConfig) -> dict[str, Callable]:
        return getattr(self.module, "gguf_fixups", lambda c: {})(cfg)

    # every family fuses q/k/v and gate/up the same way, so they shard the same way
    def check_tensor_parallel(self, cfg: DecoderConfig, shards: int, group_size: int | None) -> None:
        check_tensor_parallel(cfg, shards, group_size)

    def shard_weight(self, name: str, w: Any, cfg: DecoderConfig, rank: int, shards: int) -> Any:
        return shard_weight(name, w, cfg, rank, shards)


_FAMILIES = {m.__name__.rsplit(".", 1)[1]: Family(m.__name__.rsplit(".", 1)[1], m,
                                                  getattr(m, "MODEL_CLS", DecoderForCausalLM))
             for m in (llama, qwen2, qwen3, gemma, gemma2, gemma3, gemma3_vision, phi3, olmo2, granite, mixtral,
                       qwen2_moe, qwen3_moe, gpt_oss, deepseek, llava)}

# HF model_type → family
ARCHITECTURES: dict[str, Family] = {
    "llama": _FAMILIES["llama"],
    "mistral": _FAMILIES["llama"],
    "smollm2": _FAMILIES["llama"],
    "qwen2": _FAMILIES["qwen2"],
    "qwen3": _FAMILIES["qwen3"],
    "gemma": _FAMILIES["gemma"],
    "gemma2": _FAMILIES["gemma2"],
    "gemma3_text": _FAMILIES["gemma3"],
    "gemma3": _FAMILIES["gemma3_vision"],   # (Gemma3ForConditionalGeneration; its text model without vision_config)
    "llava": _FAMILIES["llava"],
    "phi3": _FAMILIES["phi3"],
    "olmo2": _FAMILIES["olmo2"],
    "granite": _FAMILIES["granite"],
    "mixtral": _FAMILIES["mixtral"],
    "qwen2_moe": _FAMILIES["qwen2_moe"],
    "qwen3_moe": _FAMILIES["qwen3_moe"],
    "gpt_oss": _FAMILIES["gpt_oss"],
    "deepseek_v2": _FAMILIES["deepseek"],
    "deepseek_v3": _FAMILIES["deepseek"],
}

# GGUF general.architecture → family
GGUF_ARCHITECTURES: dict[str, Family] = {
    **{name: _FAMILIES[name] for name in ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "olmo2",
                                          "granite")},
    "qwen2moe": _FAMILIES["qwen2_moe"], "qwen3moe": _FAMILIES["qwen3_moe"],
    "mixtral": _FAMILIES["mixtral"],  # (what gguf_model_type calls llama.cpp's `llama` files with experts)
    "gpt-oss": _FAMILIES["gpt_oss"], "deepseek2": _FAMILIES["deepseek"],
}


def gguf_model_type(arch: str, fields: dict[str, Any]) -> str:
    """The GGUF_ARCHITECTURES key of a GGUF file: its `general.architecture`, except that llama.cpp writes
    Mixtral as `llama` with an expert count."""
    return "mixtral" if arch == "llama" and int(fields.get("llama.expert_count") or 0) > 0 else arch


def family_for(model_type: str, source: str = "hf") -> Family:
    table = GGUF_ARCHITECTURES if source == "gguf" else ARCHITECTURES
    if model_type not in table:
        raise UnknownArchitectureError(
            f"unknown architecture '{model_type}' ({source}); supported: {', '.join(sorted(table))}")
    return table[model_type]
