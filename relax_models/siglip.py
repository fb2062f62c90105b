"""The vision transformer of SigLIP (HF's SiglipVisionModel; its pooling head, whose output no vision-language model
reads, is left out) and of CLIP (CLIPVisionModel: a class token, a LayerNorm before the layers), the image encoders
of Gemma 3 and of LLaVA models, in TVM's relax.frontend.nn. `VisionConfig.layers` may stop the encoder early: LLaVA reads a layer's output below the top
(vision_feature_layer), and the layers above it are neither compiled nor loaded.

The patch convolution (kernel = stride = patch) is a reshape into patches and one projection: the checkpoint's
[hidden, 3, p, p] kernel is stored as a [hidden, 3·p·p] matrix (`hf_weight_plan`). Attention is dense and
bidirectional over an image's patches, so it needs no KV cache. The projections are plain matmuls of their own
(`Dense`) rather than nn.Linear, so weight quantization (which swaps every nn.Linear) leaves the encoder in the
model's float dtype, as transformers runs it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from mlcc.errors import UnsupportedConfigError

from .weight_plans import Plan

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu_pytorch_tanh": lambda x: op.gelu(x, approximate="tanh"),
    "gelu": op.gelu,
    "quick_gelu": lambda x: x * op.sigmoid(x * 1.702),
}


@dataclasses.dataclass
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    num_channels: int = 3
    clip: bool = False        # CLIP: a class token before the patches, pre_layrnorm, no bias on the patch projection
    layers: int | None = None  # encoder layers run (None: all)
    post_norm: bool = True    # post_layernorm on the last layer's output

    def __post_init__(self) -> None:
        if self.layers is None:
            self.layers = self.num_hidden_layers

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2


def vision_config(cfg: dict[str, Any], feature_layer: int | None = None) -> VisionConfig:
    """A transformers `vision_config` (siglip_vision_model, clip_vision_model) as a VisionConfig; what the encoder
    cannot run refused. feature_layer: the index into the encoder's hidden states whose value is read (LLaVA's
    vision_feature_layer: 0 the embeddings, -1 the last layer's output, both before post_layernorm); None: the
    encoder's output, post_layernorm included."""
    kind = cfg.get("model_type", "siglip_vision_model")
    if kind not in ("siglip_vision_model", "clip_vision_model"):
        raise UnsupportedConfigError(f"vision_config.model_type {kind!r}: the vision encoders compiled are "
                                     "siglip_vision_model and clip_vision_model")
    if cfg.get("hidden_act", "gelu_pytorch_tanh") not in _ACTIVATIONS:
        raise UnsupportedConfigError(f"vision_config.hidden_act {cfg['hidden_act']!r} is not supported; supported: "
                                     f"{', '.join(_ACTIVATIONS)}")
    total = int(cfg["num_hidden_layers"])
    layers = total
    if feature_layer is not None:
        layers = feature_layer if feature_layer >= 0 else total + 1 + feature_layer
        if not 0 <= layers <= total:
            raise UnsupportedConfigError(f"vision_feature_layer {feature_layer}: the encoder has {total} layers")
    clip = kind == "clip_vision_model"
    return VisionConfig(
        hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=total, num_attention_heads=int(cfg["num_attention_heads"]),
        image_size=int(cfg["image_size"]), patch_size=int(cfg["patch_size"]),
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5 if clip else 1e-6)),
        hidden_act=cfg.get("hidden_act", "quick_gelu" if clip else "gelu_pytorch_tanh"),
        num_channels=int(cfg.get("num_channels", 3)), clip=clip, layers=layers,
        post_norm=feature_layer is None)


class Dense(nn.Module):
    """y = x·Wᵀ + b with W [out, in] as HF stores it; kept in float by quantization (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        self.weight = nn.Parameter((out_features, in_features))
        self.bias = nn.Parameter((out_features,)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = op.matmul(x, op.permute_dims(self.weight))
        return y + self.bias if self.bias is not None else y


class _Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (Dense(cfg.hidden_size, cfg.hidden_size)
                                                               for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        n, s, hidden = x.shape

        def heads(t: Tensor) -> Tensor:
            return op.permute_dims(op.reshape(t, (n, s, self.heads, self.head_dim)), (0, 2, 1, 3))

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        scale = np.array(self.head_dim ** -0.5, dtype=x.dtype).item()
        scores = op.matmul(q * scale, op.permute_dims(k, (0, 1, 3, 2)))
        probs = op.softmax(scores.astype("float32"), axis=-1).astype(x.dtype)
        out = op.permute_dims(op.matmul(probs, v), (0, 2, 1, 3))
        return self.out_proj(op.reshape(out, (n, s, hidden)))


class _MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        self.fc1 = Dense(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = Dense(cfg.intermediate_size, cfg.hidden_size)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.self_attn = _Attention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.mlp = _MLP(cfg)

    def forward(self, h: Tensor) -> Tensor:
        h = h + self.self_attn(self.layer_norm1(h))
        return h + self.mlp(self.layer_norm2(h))


class VisionTransformer(nn.Module):
    """pixel_values [n, channels, image_size, image_size] (preprocessed) → states [n, positions, hidden]: the
    patches, after CLIP's class token."""

    def __init__(self, cfg: VisionConfig):
        self.cfg = cfg
        self.patch_embedding = Dense(cfg.num_channels * cfg.patch_size ** 2, cfg.hidden_size, bias=not cfg.clip)
        self.position_embedding = nn.Parameter((cfg.num_patches + int(cfg.clip), cfg.hidden_size))
        if cfg.clip:
            self.class_embedding = nn.Parameter((cfg.hidden_size,))
            self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.layers = nn.ModuleList([_EncoderLayer(cfg) for _ in range(cfg.layers)])
        if cfg.post_norm:
            self.post_layernorm = nn.LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, pixel_values: Tensor) -> Tensor:
        cfg, n = self.cfg, pixel_values.shape[0]
        g, p, c = cfg.patches_per_side, cfg.patch_size, cfg.num_channels
        if g * p != cfg.image_size:   # (the strided conv leaves the pixels past the last whole patch unread)
            pixel_values = op.split(op.split(pixel_values, [g * p], axis=2)[0], [g * p], axis=3)[0]
        # [n, c, g·p, g·p] → [n, g·g, c·p·p]: patches in row-major order, each flattened as the conv kernel is
        x = op.reshape(pixel_values, (n, c, g, p, g, p))
        x = op.reshape(op.permute_dims(x, (0, 2, 4, 1, 3, 5)), (n, g * g, c * p * p))
        h = self.patch_embedding(x)
        if cfg.clip:
            cls = op.broadcast_to(op.reshape(self.class_embedding, (1, 1, cfg.hidden_size)), (n, 1, cfg.hidden_size))
            h = self.pre_layrnorm(op.concat([cls, h], dim=1) + self.position_embedding)
        else:
            h = h + self.position_embedding
        for layer in self.layers:
            h = layer(h)
        return self.post_layernorm(h) if cfg.post_norm else h


def hf_weight_plan(cfg: VisionConfig, ours: str, theirs: str) -> Plan:
    """Our encoder's parameters under `ours` from HF's vision transformer (SigLIP's or CLIP's) under `theirs`."""
    def patch_matrix(ts: list[np.ndarray]) -> np.ndarray:
        return ts[0].reshape(ts[0].shape[0], -1)

    plan: Plan = {f"{ours}.patch_embedding.weight": ([f"{theirs}.embeddings.patch_embedding.weight"], patch_matrix),
                  f"{ours}.position_embedding": ([f"{theirs}.embeddings.position_embedding.weight"], None)}
    if cfg.clip:
        plan[f"{ours}.class_embedding"] = ([f"{theirs}.embeddings.class_embedding"], None)
        norms = ["pre_layrnorm"]
    else:
        plan[f"{ours}.patch_embedding.bias"] = ([f"{theirs}.embeddings.patch_embedding.bias"], None)
        norms = []
    for norm in norms + (["post_layernorm"] if cfg.post_norm else []):
        for leaf in ("weight", "bias"):
            plan[f"{ours}.{norm}.{leaf}"] = ([f"{theirs}.{norm}.{leaf}"], None)
    for i in range(cfg.layers):
        mine, hf = f"{ours}.layers.{i}", f"{theirs}.encoder.layers.{i}"
        for sub in ("layer_norm1", "layer_norm2", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                    "self_attn.out_proj", "mlp.fc1", "mlp.fc2"):
            for leaf in ("weight", "bias"):
                plan[f"{mine}.{sub}.{leaf}"] = ([f"{hf}.{sub}.{leaf}"], None)
    return plan
