"""Tiny random vision-language models saved as transformers saves them, with their processor files (no downloads)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np

from mlcc.compiler.byte_tokenizer import SPECIALS, VOCAB, write_byte_tokenizer

IMAGE_SPECIALS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
BOI, IMAGE, EOI = (256 + len(SPECIALS) + i for i in range(3))
EOS = 256 + SPECIALS.index("<|im_end|>")
# Gemma 3's chat template, its image and text parts as google/gemma-3-4b-it's template writes them
GEMMA3_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}{% for item in m['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>{% elif item['type'] == 'text' %}{{ item['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def make_gemma3_vision(folder: Path, seed: int = 0, image_size: int = 64, patch_size: int = 16,
                       tokens_per_image: int = 4) -> Path:
    """Gemma3ForConditionalGeneration (2 text layers, one sliding; a 2-layer SigLIP) with Gemma3Processor's files."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    text = tf.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=VOCAB, max_position_embeddings=512, sliding_window=16, query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "full_attention"], eos_token_id=EOS, bos_token_id=None)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=image_size, patch_size=patch_size, vision_use_head=False)
    cfg = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=tokens_per_image, boi_token_index=BOI, eoi_token_index=EOI,
                          image_token_index=IMAGE)
    model = tf.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():   # random init leaves biases and norms at 0/1, and the projection at 0: perturb them
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mm_input_projection_weight"):
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    _write_tokenizer(folder)
    tokenizer = tf.AutoTokenizer.from_pretrained(folder)
    processor = tf.Gemma3Processor(
        image_processor=tf.Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}),
        tokenizer=tokenizer, chat_template=GEMMA3_TEMPLATE, image_seq_length=tokens_per_image)
    processor.save_pretrained(folder)
    _write_tokenizer(folder)   # (the processor saved its tokenizer over ours, in another form)
    return folder


def _write_tokenizer(folder: Path) -> None:
    """The byte tokenizer with the image tokens, as a plain fast tokenizer (not the GemmaTokenizer model_type gemma3
    would make AutoTokenizer build) that names them as Gemma3Processor reads them."""
    write_byte_tokenizer(folder, extra_specials=IMAGE_SPECIALS)
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tok_cfg.update(chat_template=GEMMA3_TEMPLATE, tokenizer_class="PreTrainedTokenizerFast", extra_special_tokens=dict(
        zip(("boi_token", "image_token", "eoi_token"), IMAGE_SPECIALS)))
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))


LLAVA_IMAGE = 256 + len(SPECIALS)   # "<image>", the one extra special token of the LLaVA test model
# llava-hf's template: it reads content as parts only (images first, then texts, selected by type)
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def make_llava(folder: Path, seed: int = 0, tower: str = "clip") -> Path:
    """LlavaForConditionalGeneration: a 3-layer CLIP (32x32, patch 8, read at layer -2 without its class token: 16
    image tokens), a Llama language model, LlavaProcessor's files (CLIP's short-side resize and center crop).
    tower="siglip": a SigLIP encoder instead (all 16 patches, read at layer -1: before its post_layernorm), with
    SigLIP's fixed-size resize, and a Qwen2 language model."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    text_cls = tf.LlamaConfig if tower == "clip" else tf.Qwen2Config
    text = text_cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, eos_token_id=EOS,
                    bos_token_id=None, tie_word_embeddings=False)
    vision_cls = tf.CLIPVisionConfig if tower == "clip" else tf.SiglipVisionConfig
    vision = vision_cls(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                        image_size=32, patch_size=8, **({"projection_dim": 32} if tower == "clip" else {}))
    model = tf.LlavaForConditionalGeneration(tf.LlavaConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=LLAVA_IMAGE,
        vision_feature_layer=-2 if tower == "clip" else -1,
        vision_feature_select_strategy="default" if tower == "clip" else "full")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)

    def write_tokenizer() -> None:
        write_byte_tokenizer(folder, extra_specials=("<image>",))
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
        tok_cfg.update(chat_template=LLAVA_TEMPLATE, tokenizer_class="PreTrainedTokenizerFast")
        (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))

    write_tokenizer()
    if tower == "clip":
        image_processor = tf.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    else:
        image_processor = tf.SiglipImageProcessorPil(size={"height": 32, "width": 32})
    processor = tf.LlavaProcessor(
        image_processor=image_processor, tokenizer=tf.AutoTokenizer.from_pretrained(folder),
        chat_template=LLAVA_TEMPLATE, patch_size=8,
        vision_feature_select_strategy=model.config.vision_feature_select_strategy,
        num_additional_image_tokens=int(tower == "clip"))
    processor.save_pretrained(folder)
    write_tokenizer()
    return folder


def png_data_url(pixels: np.ndarray) -> str:
    """uint8 [H, W, 3] → a data: URL of its PNG."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def random_image(seed: int, height: int = 50, width: int = 70) -> np.ndarray:
    """A smooth random RGB image (gradients plus noise): resizing it is not dominated by aliasing."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / width, y / height, (x + y) / (width + height)], -1) * 200
    return np.clip(base + rng.integers(0, 55, (height, width, 3)), 0, 255).astype(np.uint8)
