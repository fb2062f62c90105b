"""LLaVA (LlavaForConditionalGeneration): a CLIP or SigLIP encoder (siglip.py) read at vision_feature_layer, a
two-layer projector, and a language model of one of the decoder families (Llama, Mistral, Qwen2), whose own module
parses its config and says where its weights live.

The image rows are the encoder's states at that layer (CLIP's class token dropped under the "default" selection
strategy) through linear_1, the activation and linear_2, as transformers' get_image_features computes them; the
language model reads them causally, as transformers does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor

from mlcc.errors import UnsupportedConfigError

from . import llama, qwen2, siglip
from .blocks import ACTIVATIONS, DecoderConfig, DecoderForCausalLM
from .hf_defaults import with_defaults
from .weight_plans import Plan

# text_config.model_type → the family module that parses it
_TEXT_FAMILIES = {"llama": llama, "mistral": llama, "qwen2": qwen2}
_PROJECTOR_ACTS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_pytorch_tanh", "silu": "silu"}


@dataclasses.dataclass
class LlavaConfig(DecoderConfig):
    vision: siglip.VisionConfig | None = None
    text_model_type: str = "llama"
    drop_class_token: bool = False      # vision_feature_select_strategy "default" on a CLIP encoder
    projector_act: str = "gelu"
    projector_bias: bool = True
    image_token_id: int = -1

    @property
    def tokens_per_image(self) -> int:
        return self.vision.num_patches + int(self.vision.clip) - int(self.drop_class_token)


def _text_module(cfg: dict[str, Any]) -> Any:
    kind = cfg.get("text_config", {}).get("model_type", "llama")
    if kind not in _TEXT_FAMILIES:
        raise UnsupportedConfigError(f"llava text_config.model_type {kind!r}: supported language models are "
                                     f"{', '.join(_TEXT_FAMILIES)}")
    return _TEXT_FAMILIES[kind]


def config_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    layer = cfg.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise UnsupportedConfigError(f"vision_feature_layer {layer}: several feature layers (concatenated) are not "
                                     "compiled; one layer is")
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise UnsupportedConfigError(f"vision_feature_select_strategy {strategy!r}: 'default' or 'full'")
    act = cfg.get("projector_hidden_act", "gelu")
    if act not in _PROJECTOR_ACTS:
        raise UnsupportedConfigError(f"projector_hidden_act {act!r}: supported {', '.join(_PROJECTOR_ACTS)}")
    # (the Hub's files keep only what differs from transformers' defaults in the nested configs)
    text_cfg = {"tie_word_embeddings": cfg.get("tie_word_embeddings", False),
                **with_defaults(cfg.get("text_config", {}), "llama")}
    text = _text_module(cfg).config_from_hf(text_cfg)
    vision = siglip.vision_config(with_defaults(cfg["vision_config"], "clip_vision_model"), layer)
    return LlavaConfig(
        **{f.name: getattr(text, f.name) for f in dataclasses.fields(DecoderConfig)}, vision=vision,
        text_model_type=text_cfg["model_type"],
        drop_class_token=strategy == "default" and vision.clip, projector_act=_PROJECTOR_ACTS[act],
        projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
        image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 32000))))


def hf_weight_plan(cfg: LlavaConfig) -> Plan:
    # transformers saves the language model under model.language_model (the Hub's language_model.model) and the
    # LM head at the top (the Hub's language_model.lm_head): compiler/weights.py resolves the Hub's names
    text = _TEXT_FAMILIES[cfg.text_model_type].hf_weight_plan(cfg)
    plan: Plan = {ours: ([("model.language_model." + n[len("model."):]) if n.startswith("model.") else n
                          for n in names], combine) for ours, (names, combine) in text.items()}
    plan.update(siglip.hf_weight_plan(cfg.vision, "vision_tower", "model.vision_tower"))
    for linear in ("linear_1", "linear_2"):
        for leaf in ("weight", "bias") if cfg.projector_bias else ("weight",):
            plan[f"multi_modal_projector.{linear}.{leaf}"] = ([f"model.multi_modal_projector.{linear}.{leaf}"], None)
    return plan


def hf_fixups(cfg: LlavaConfig) -> dict[str, Callable]:
    return {}


def gguf_config(fields: dict[str, Any], arch: str, vocab_size: int, has_output: bool) -> dict[str, Any]:
    raise UnsupportedConfigError("LLaVA from GGUF (llama.cpp's mmproj file) is not supported; compile the Hugging "
                                 "Face folder")


def image_prompt(cfg: LlavaConfig, token_text: Callable[[int], str]) -> dict[str, Any]:
    """LlavaProcessor's expansion: the template's <image> becomes one <image> per image row."""
    image = token_text(cfg.image_token_id)
    return {"placeholder": image, "expanded": image * cfg.tokens_per_image, "image_token_id": cfg.image_token_id,
            "tokens_per_image": cfg.tokens_per_image}


class _Projector(nn.Module):
    def __init__(self, cfg: LlavaConfig):
        self.linear_1 = siglip.Dense(cfg.vision.hidden_size, cfg.hidden_size, cfg.projector_bias)
        self.linear_2 = siglip.Dense(cfg.hidden_size, cfg.hidden_size, cfg.projector_bias)
        self.act = ACTIVATIONS[cfg.projector_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: LlavaConfig, target: Any, dtype: str = "float32"):
        super().__init__(cfg, target, dtype)
        self.vision_tower = siglip.VisionTransformer(cfg.vision)
        self.multi_modal_projector = _Projector(cfg)

    def image_embed(self, pixel_values: Tensor) -> Tensor:
        """[images, channels, size, size] preprocessed → [images, tokens_per_image, hidden]."""
        states = self.vision_tower(pixel_values)
        if self.cfg.drop_class_token:
            states = nn.op.split(states, [1], axis=1)[1]
        return self.multi_modal_projector(states).astype(self.dtype)

    def get_default_spec(self) -> dict:
        spec = super().get_default_spec()
        v = self.cfg.vision
        spec["image_embed"] = {
            "pixel_values": nn.spec.Tensor(["num_images", v.num_channels, v.image_size, v.image_size], self.dtype),
            "$": {"param_mode": "packed", "effect_mode": "none"}}
        return spec


MODEL_CLS = LlavaForCausalLM
