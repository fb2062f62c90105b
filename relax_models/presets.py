"""Model shape presets: one table of real models' Hugging Face configs, for builds without a checkpoint.

Benchmarks, tests and shape-only compiles (`compile_shape_only(preset.family, preset.hf_config(), ...)`, then
`LoadedModel(dir, weights="random")`) share these instead of each keeping its own copy. Only the fields that fix
the shape and the numerics are given (what `config.json` of the named checkpoint says for them); speed does not
depend on the weights' values, so none are needed.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    family: str              # HF `model_type`, the relax_models family that builds it
    config: dict[str, Any]   # HF config.json fields

    def hf_config(self) -> dict[str, Any]:
        """A copy of the config, safe to change."""
        return copy.deepcopy(self.config)

    @property
    def head_dim(self) -> int:
        return self.config.get("head_dim") or self.config["hidden_size"] // self.config["num_attention_heads"]


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

PRESETS: dict[str, Preset] = {p.name: p for p in (
    # meta-llama/Meta-Llama-3-8B's shape, with Llama 3.1's RoPE scaling (llama3 rope_type) over 8,192 positions
    Preset("llama3-8b", "llama", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False, rope_scaling=_LLAMA3_ROPE)),
    # Qwen/Qwen2.5-0.5B
    Preset("qwen2.5-0.5b", "qwen2", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True)),
    # Qwen/Qwen3-8B: per-head q/k norms, head_dim 128
    Preset("qwen3-8b", "qwen3", dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=False)),
    # google/gemma-2-9b: sandwich norms, soft-capped scores and logits, every other layer a 4,096-token window
    Preset("gemma2-9b", "gemma2", dict(
        hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, vocab_size=256000, max_position_embeddings=8192, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0)),
    # HuggingFaceTB/SmolLM2-135M(-Instruct), also the bundled default model's shape
    Preset("smollm2-135m", "llama", dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=100000.0, tie_word_embeddings=True)),
)}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None
