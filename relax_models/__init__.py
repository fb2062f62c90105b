"""Model families, registered by HF `model_type` and GGUF `general.architecture`."""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any, Callable

from mlcc.errors import UnknownArchitectureError

from . import gemma, llama, qwen2


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config_cls: type
    model_cls: type
    module: ModuleType

    def weight_plan(self, cfg: Any) -> dict[str, tuple[list[str], Callable | None]]:
        return self.module.hf_weight_plan(cfg)

    def hf_fixups(self, cfg: Any) -> dict[str, Callable]:
        return getattr(self.module, "hf_fixups", lambda c: {})(cfg)

    def gguf_fixups(self, cfg: Any) -> dict[str, Callable]:
        return self.module.gguf_fixups(cfg)

    # every family shares Llama's fused q/k/v and gate/up layout, so they shard the same way
    def check_tensor_parallel(self, cfg: Any, shards: int, group_size: int | None) -> None:
        llama.check_tensor_parallel(cfg, shards, group_size)

    def shard_weight(self, name: str, w: Any, cfg: Any, rank: int, shards: int) -> Any:
        return llama.shard_weight(name, w, cfg, rank, shards)


_LLAMA = Family("llama", llama.LlamaConfig, llama.LlamaForCausalLM, llama)
_QWEN2 = Family("qwen2", qwen2.Qwen2Config, qwen2.Qwen2ForCausalLM, qwen2)
_GEMMA = Family("gemma", gemma.GemmaConfig, gemma.GemmaForCausalLM, gemma)

# HF model_type → family
ARCHITECTURES: dict[str, Family] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "smollm2": _LLAMA,
    "qwen2": _QWEN2,
    "gemma": _GEMMA,
}

# GGUF general.architecture → family
GGUF_ARCHITECTURES: dict[str, Family] = {"llama": _LLAMA, "qwen2": _QWEN2}


def family_for(model_type: str, source: str = "hf") -> Family:
    table = GGUF_ARCHITECTURES if source == "gguf" else ARCHITECTURES
    if model_type not in table:
        raise UnknownArchitectureError(
            f"unknown architecture '{model_type}' ({source}); supported: {', '.join(sorted(table))}")
    return table[model_type]
