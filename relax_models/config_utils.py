"""Config parsing shared by the families: the HF keys common to them, and the ones that moved between transformers
versions (`rope_parameters`, `layer_types`)."""

from __future__ import annotations

from typing import Any, Callable

from mlcc.errors import UnsupportedConfigError

from .blocks import DecoderConfig


def rope_theta_and_scaling(cfg: dict[str, Any], layer_type: str = "full_attention"
                           ) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the classic keys or transformers-5 `rope_parameters`, for the layers of
    `layer_type` where the parameters are given per layer type. A scaling of type "default" means none."""
    params = cfg.get("rope_parameters") or {}
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = params.get(layer_type) or params.get("full_attention") or next(iter(params.values()))
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or {k: v for k, v in params.items()
                                          if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling:
        scaling = dict(scaling)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling["rope_type"] = kind
        scaling.pop("type", None)
        if kind == "default":
            scaling = None
    return float(theta), scaling or None


def partial_rotary_factor(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)


def sliding_layers(cfg: dict[str, Any], context: int, default_pattern: Callable[[int], bool] | None
                   ) -> tuple[int, list[bool]]:
    """(window, which layers slide). From `layer_types` where the config has it, else `default_pattern(layer)` (the
    family's rule; None: no layer slides). A window as long as the context restricts nothing, so it is dropped."""
    window = int(cfg.get("sliding_window") or 0)
    n = int(cfg["num_hidden_layers"])
    if not window or cfg.get("use_sliding_window") is False or window >= context:
        return 0, []
    types = cfg.get("layer_types")
    if types:
        if len(types) != n:
            raise UnsupportedConfigError(f"layer_types lists {len(types)} layers, num_hidden_layers is {n}")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise UnsupportedConfigError(f"layer_types {sorted(unknown)} are not supported; supported: "
                                         "sliding_attention, full_attention")
        flags = [t == "sliding_attention" for t in types]
    elif default_pattern is not None:
        flags = [default_pattern(i) for i in range(n)]
    else:
        return 0, []
    return (window, flags) if any(flags) else (0, [])


def decoder_config(cfg: dict[str, Any], sliding_pattern: Callable[[int], bool] | None = None,
                   **switches: Any) -> DecoderConfig:
    """The fields every family reads the same way; `switches` set the block's family-specific ones."""
    theta, scaling = rope_theta_and_scaling(cfg)
    context = int(cfg.get("max_position_embeddings", 4096))
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    window, sliding = sliding_layers(cfg, context, sliding_pattern)
    fields = dict(
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        vocab_size=cfg["vocab_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        head_dim=head_dim,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        context_window_size=context,
        attention_bias=bool(cfg.get("attention_bias", False)),
        hidden_act=cfg.get("hidden_act", "silu"),
        sliding_window=window,
        layer_sliding=sliding,
        rotary_dim=int(head_dim * partial_rotary_factor(cfg)),
    )
    fields.update(switches)
    return DecoderConfig(**fields)


def gguf_rope_scaling(fields: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """HF's rope_scaling from llama.cpp's `rope.scaling.*` keys; None where the file scales nothing. YaRN only among
    the scalings these keys describe alone (linear and LongRoPE families read their own)."""
    g = lambda k: fields.get(f"{arch}.rope.scaling.{k}")  # noqa: E731
    kind = g("type")
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise UnsupportedConfigError(f"GGUF {arch}.rope.scaling.type {kind!r} is not supported for this architecture; "
                                     "supported: none, yarn")
    scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(g("factor"))}
    for key, ours in (("original_context_length", "original_max_position_embeddings"), ("yarn_beta_fast", "beta_fast"),
                      ("yarn_beta_slow", "beta_slow"), ("yarn_attn_factor", "attention_factor")):
        if g(key) is not None:
            scaling[ours] = int(g(key)) if ours.startswith("original") else float(g(key))
    return scaling


def gguf_single_value(fields: dict[str, Any], key: str) -> Any:
    """A GGUF key llama.cpp may write as one value or as one per layer: the value, which must be the same in every
    layer (mlcc's configs hold one)."""
    value = fields.get(key)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedConfigError(f"GGUF {key} differs between layers ({sorted(set(value))}); mlcc supports one "
                                         "value for every layer")
        value = value[0]
    return value
