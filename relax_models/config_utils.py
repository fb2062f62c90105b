"""Config parsing shared by the families: the HF keys that moved between transformers versions."""

from __future__ import annotations

from typing import Any


def rope_theta_and_scaling(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the classic keys or transformers-5 `rope_parameters`.

    A scaling of type "default" means none; TVM's KV cache RoPE takes the rest (llama3, yarn, longrope) as is.
    """
    params = cfg.get("rope_parameters") or {}
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # per-layer-type parameters (e.g. {"full_attention": {...}}): the families here use one kind
        params = params.get("full_attention") or next(iter(params.values()))
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling:
        scaling = dict(scaling)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling["rope_type"] = kind
        scaling.pop("type", None)
        if kind == "default":
            scaling = None
    return float(theta), scaling or None
