"""LLaVA against transformers: a tiny random LlavaForConditionalGeneration (CLIP 32x32 read at layer -2 without its
class token, a Llama language model) compiled for the CPU in float32, through the Engine. Tolerances as
test_vision.py: logits rel. err ≤ 1e-4, greedy ids identical; LLaVA's language model reads images causally, as
transformers does. `-m slow` adds a SigLIP-tower LLaVA with a Qwen2 language model."""

import numpy as np
import pytest
import torch
from vision_support import EOS, make_llava, png_data_url, random_image

from mlcc.runtime.device.interface import EmbedRows
from mlcc.runtime.device.model import LoadedModel


@pytest.fixture(scope="module", params=["clip", pytest.param("siglip", marks=pytest.mark.slow)])
def llava(request, tmp_path_factory):
    import transformers as tf

    from mlcc.compiler.build import compile_model

    hf_dir = make_llava(tmp_path_factory.mktemp("hf-llava"), tower=request.param)
    art = tmp_path_factory.mktemp("art-llava") / "model"
    compile_model(hf_dir, "llvm", "q0f32", art)
    return (art, tf.AutoProcessor.from_pretrained(hf_dir),
            tf.LlavaForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval())


def _messages(images, text, pil: bool):
    from PIL import Image

    parts = [{"type": "image", "image": Image.fromarray(im)} if pil else
             {"type": "image_url", "image_url": {"url": png_data_url(im)}} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def test_llava_logits_and_greedy_chat_match_transformers(llava):
    from mlcc.runtime.api.prepare import chat_call
    from mlcc.runtime.engine import Engine

    art, processor, hf = llava
    images = [random_image(4, 45, 60), random_image(5, 70, 40)]   # (wide and tall: both resized and cropped)
    inputs = processor.apply_chat_template(_messages(images, "Compare them.", True), add_generation_prompt=True,
                                           tokenize=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        ref = hf(**inputs).logits[0, -1].double().numpy()
        out = hf.generate(**inputs, max_new_tokens=10, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    engine = Engine(art, target="llvm", max_batch=2)
    try:
        call = chat_call(engine, {"messages": _messages(images, "Compare them.", False), "max_tokens": 10})
        assert call.ids == inputs["input_ids"][0].tolist()
        pixels = np.stack([img.pixels for img in call.spec.images])
        assert np.abs(pixels - inputs["pixel_values"].numpy()).max() <= 1e-5
        reply = engine.chat.completions.create(messages=_messages(images, "Compare them.", False), max_tokens=10,
                                               temperature=0)
        # a next turn with plain-string messages: a template that reads parts only gets them as parts
        follow = [*_messages(images, "Compare them.", False), {"role": "assistant", "content": "Fine."},
                  {"role": "user", "content": "Why?"}]
        ids2 = chat_call(engine, {"messages": follow, "max_tokens": 4}).ids
    finally:
        engine.shutdown()
    assert reply.choices[0].message.content == processor.tokenizer.decode(
        out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    theirs = [*_messages(images, "Compare them.", True), {"role": "assistant", "content": [{"type": "text",
                                                                                            "text": "Fine."}]},
              {"role": "user", "content": [{"type": "text", "text": "Why?"}]}]
    assert ids2 == processor.apply_chat_template(theirs, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                 return_tensors="pt")["input_ids"][0].tolist()

    m = LoadedModel(art)
    m.create_kv_cache(1, 256, 256)
    m.add_sequence(0)
    rows = m.embed_images(pixels)
    offsets = np.concatenate([np.arange(img.start, img.start + img.length) for img in call.spec.images])
    ours = m.prefill([0], [call.ids], [EmbedRows(offsets, rows.reshape(-1, rows.shape[-1]))]).numpy()[0]
    err = float(np.abs(ours - ref).max() / np.abs(ref).max())
    assert err <= 1e-4, err
