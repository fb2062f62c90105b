"""Gemma 3 with its SigLIP encoder (Gemma3ForConditionalGeneration): the Gemma 3 language model of gemma3.py plus
`image_embed`, which turns preprocessed images into the rows that replace the image tokens' embeddings.

Transformers' projector: the encoder's patch grid average-pooled to mm_tokens_per_image tokens, Gemma's RMSNorm
(x̂·(1 + w)), then one matrix to the text width. The image rows are not multiplied by the √hidden the token
embeddings get, as in transformers, which scatters them into the already scaled embeddings.

A checkpoint without a `vision_config` (Gemma3ForCausalLM saved as model_type gemma3) compiles as the text model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from mlcc.errors import UnsupportedConfigError

from . import gemma3, siglip
from .blocks import DecoderConfig, DecoderForCausalLM
from .hf_defaults import with_defaults
from .weight_plans import Plan, norm_plus_one

# where transformers saves the multimodal parts (the Hub's original names are aliases, compiler/weights.py)
_VISION_PREFIX = "model.vision_tower"
_PROJECTOR_PREFIX = "model.multi_modal_projector"


@dataclasses.dataclass
class Gemma3VisionConfig(DecoderConfig):
    vision: siglip.VisionConfig | None = None
    mm_tokens_per_image: int = 256
    image_token_id: int = -1      # <image_soft_token>: the positions the image rows fill
    boi_token_id: int = -1        # <start_of_image>: where a chat template puts an image
    eoi_token_id: int = -1        # <end_of_image>


def config_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    if "text_config" in cfg:   # (the Hub's files keep only what differs from transformers' defaults)
        cfg = {**cfg, "text_config": with_defaults(cfg["text_config"], "gemma3_text")}
    text = gemma3.config_from_hf(cfg)
    if "vision_config" not in cfg:
        return text
    vision = siglip.vision_config(with_defaults(cfg["vision_config"], "siglip_vision_model"))
    tokens = int(cfg.get("mm_tokens_per_image", 256))
    side = math.isqrt(tokens)
    if side * side != tokens or vision.patches_per_side % side:
        raise UnsupportedConfigError(
            f"mm_tokens_per_image {tokens}: the projector pools the {vision.patches_per_side}x"
            f"{vision.patches_per_side} patch grid into a square grid, so it must be a square whose side divides "
            f"{vision.patches_per_side}")
    return Gemma3VisionConfig(
        **{f.name: getattr(text, f.name) for f in dataclasses.fields(DecoderConfig)}, vision=vision,
        mm_tokens_per_image=tokens,
        image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 262144))),
        boi_token_id=int(cfg.get("boi_token_index", 255999)), eoi_token_id=int(cfg.get("eoi_token_index", 256000)))


def hf_weight_plan(cfg: DecoderConfig) -> Plan:
    plan = gemma3.hf_weight_plan(cfg)
    if getattr(cfg, "vision", None) is not None:
        plan.update(siglip.hf_weight_plan(cfg.vision, "vision_tower", _VISION_PREFIX))
        for name in ("mm_soft_emb_norm.weight", "mm_input_projection_weight"):
            plan[f"multi_modal_projector.{name}"] = ([f"{_PROJECTOR_PREFIX}.{name}"], None)
    return plan


def hf_fixups(cfg: DecoderConfig) -> dict[str, Callable]:
    fixups = gemma3.hf_fixups(cfg)
    if getattr(cfg, "vision", None) is not None:
        fixups.update(norm_plus_one([f"{_PROJECTOR_PREFIX}.mm_soft_emb_norm.weight"]))
    return fixups


gguf_config = gemma3.gguf_config


def image_prompt(cfg: Gemma3VisionConfig, token_text: Callable[[int], str]) -> dict[str, Any]:
    """Where images go in a prompt, as Gemma3Processor writes them: a chat template puts <start_of_image> where an
    image is, and the processor replaces it with the image's whole token sequence, blank lines around it."""
    boi, image, eoi = (token_text(t) for t in (cfg.boi_token_id, cfg.image_token_id, cfg.eoi_token_id))
    return {"placeholder": boi, "expanded": f"\n\n{boi}{image * cfg.mm_tokens_per_image}{eoi}\n\n",
            "image_token_id": cfg.image_token_id, "tokens_per_image": cfg.mm_tokens_per_image}


class _Projector(nn.Module):
    def __init__(self, cfg: Gemma3VisionConfig):
        v = cfg.vision
        self.side = math.isqrt(cfg.mm_tokens_per_image)
        self.kernel = v.patches_per_side // self.side
        self.mm_soft_emb_norm = nn.RMSNorm(v.hidden_size, -1, v.layer_norm_eps, bias=False)
        self.mm_input_projection_weight = nn.Parameter((v.hidden_size, cfg.hidden_size))

    def forward(self, patches: Tensor) -> Tensor:
        n, _, hidden = patches.shape
        t, k = self.side, self.kernel
        # AvgPool2d(k, stride k) over the row-major patch grid
        grid = op.reshape(patches, (n, t, k, t, k, hidden))
        pooled = op.reshape(op.sum(grid, axis=[2, 4]), (n, t * t, hidden)) / float(k * k)
        return op.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


class Gemma3VisionForCausalLM(DecoderForCausalLM):
    """The language model's entry points, plus image_embed where the config has a vision tower."""

    def __init__(self, cfg: DecoderConfig, target: Any, dtype: str = "float32"):
        super().__init__(cfg, target, dtype)
        self.vision_tower = self.multi_modal_projector = None
        if getattr(cfg, "vision", None) is not None:
            self.vision_tower = siglip.VisionTransformer(cfg.vision)
            self.multi_modal_projector = _Projector(cfg)

    def image_embed(self, pixel_values: Tensor) -> Tensor:
        """[images, channels, size, size] preprocessed → [images, tokens_per_image, hidden] rows for image tokens."""
        return self.multi_modal_projector(self.vision_tower(pixel_values)).astype(self.dtype)

    def prefill_image(self, embeds: Tensor, kv_cache: Any):
        """prefill of one image's tokens, which attend to each other both ways (transformers' token_type_ids mask):
        the CPU attention kernels only (schedules/cpu_attention.py), so exported for the llvm target alone."""
        attentions = [layer.self_attn for layer in self.model.layers]
        for a in attentions:
            a.bidirectional = True
        try:
            return self.prefill(embeds, kv_cache)
        finally:
            for a in attentions:
                a.bidirectional = False

    def get_default_spec(self) -> dict:
        spec = super().get_default_spec()
        if self.vision_tower is not None:
            v = self.cfg.vision
            spec["image_embed"] = {
                "pixel_values": nn.spec.Tensor(["num_images", v.num_channels, v.image_size, v.image_size],
                                               self.dtype),
                "$": {"param_mode": "packed", "effect_mode": "none"}}
            if self.target.kind.name == "llvm":
                spec["prefill_image"] = {k: v for k, v in spec["prefill"].items()}
        return spec


MODEL_CLS = Gemma3VisionForCausalLM
