"""transformers' defaults for the nested configs of multimodal checkpoints. The Hub's config.json files of
Gemma 3 and LLaVA (written by transformers 4.x) keep only the values that differ from the config classes'
defaults in `text_config` and `vision_config`; transformers fills in the rest when it loads them, and so does
`with_defaults`, from these tables of the classes' defaults (Gemma3TextConfig, LlamaConfig, MistralConfig,
Qwen2Config, SiglipVisionConfig, CLIPVisionConfig), in the classic key names those files use."""

from __future__ import annotations

from typing import Any

_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
                    "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096, "attention_bias": False},
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "attention_bias": False},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "sliding_window": 4096},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "use_sliding_window": False, "max_window_layers": 28},
    "siglip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                            "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 16,
                            "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
    "clip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                          "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 32,
                          "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
}


def with_defaults(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """cfg with the class defaults of `model_type` under it (its own model_type wins where it names one)."""
    kind = cfg.get("model_type", model_type)
    out = {**_DEFAULTS.get(kind, {}), "model_type": kind, **cfg}
    if kind in ("llama", "qwen2"):   # (their classes: as many KV heads as query heads unless told)
        out.setdefault("num_key_value_heads", out["num_attention_heads"])
    return out
