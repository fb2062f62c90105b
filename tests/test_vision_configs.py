"""The Hub's multimodal config.json files keep only what differs from transformers' defaults in their nested
text_config and vision_config: parsed by mlcc, such a file gives the same model as the whole config transformers
writes today. The partial configs are made here by dropping every nested value equal to the config class's default."""

import pytest
import transformers as tf

from mlcc.relax_models import family_for


def _partial(full: dict, classes: dict) -> dict:
    out = dict(full)
    for key, cls in classes.items():
        defaults = cls().to_dict()
        out[key] = {k: v for k, v in full[key].items() if k == "model_type" or k not in defaults or defaults[k] != v}
    return out


CASES = {
    # google/gemma-3-4b-it's shape: its text_config names 6 values, its vision_config 8
    "gemma3": lambda: tf.Gemma3Config(
        text_config=tf.Gemma3TextConfig(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                                        sliding_window=1024,
                                        rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0},
                                                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                            "rope_theta": 1000000.0}}).to_dict(),
        vision_config=tf.SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                            num_attention_heads=16, image_size=896, patch_size=14,
                                            vision_use_head=False).to_dict()),
    # llava-hf/llava-1.5-7b-hf's shape: CLIP ViT-L/14 at 336, a Llama-2-7B
    "llava": lambda: tf.LlavaConfig(
        text_config=tf.LlamaConfig(vocab_size=32064, max_position_embeddings=4096, rms_norm_eps=1e-5).to_dict(),
        vision_config=tf.CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                          num_attention_heads=16, image_size=336, patch_size=14).to_dict()),
    "llava_siglip_qwen2": lambda: tf.LlavaConfig(
        text_config=tf.Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2).to_dict(),
        vision_config=tf.SiglipVisionConfig(image_size=384, patch_size=14).to_dict(),
        vision_feature_layer=-1, vision_feature_select_strategy="full"),
}
SUB_CLASSES = {"gemma3": (tf.Gemma3TextConfig, tf.SiglipVisionConfig), "llava": (tf.LlamaConfig, tf.CLIPVisionConfig),
               "llava_siglip_qwen2": (tf.Qwen2Config, tf.SiglipVisionConfig)}


@pytest.mark.parametrize("case", CASES)
def test_partial_hub_configs_parse_as_the_whole_ones(case):
    full = CASES[case]().to_dict()
    text_cls, vision_cls = SUB_CLASSES.get(case, SUB_CLASSES["gemma3"])
    partial = _partial(full, {"text_config": text_cls, "vision_config": vision_cls})
    assert len(partial["text_config"]) < len(full["text_config"]) / 2   # (the defaults are really left out)
    family = family_for(full["model_type"])
    assert family.config_from_hf(partial) == family.config_from_hf(full)
