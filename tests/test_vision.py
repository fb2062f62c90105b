"""Vision-language models against transformers: a tiny random Gemma3ForConditionalGeneration (SigLIP 64x64, patch
16, 4 image tokens) compiled for the CPU in float32.

Tolerances: logits with images rel. err ≤ 1e-4 (relative to the largest |logit|, as tests/test_parity.py) and greedy
ids identical. The reference is transformers' processor (chat template, image processing) and model with everything
the processor returns: an image's tokens attend to each other both ways (token_type_ids), which the CPU build's
prefill_image does; the causal reading of the same prompt is measurably different (checked, so the test would see
the mask missing).
"""

import numpy as np
import pytest
import torch
from vision_support import EOS, make_gemma3_vision, png_data_url, random_image

from mlcc.runtime.device.interface import EmbedRows
from mlcc.runtime.device.model import LoadedModel


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from mlcc.compiler.build import compile_model

    hf_dir = make_gemma3_vision(tmp_path_factory.mktemp("hf-gemma3-vision"))
    art = tmp_path_factory.mktemp("art-gemma3-vision") / "model"
    compile_model(hf_dir, "llvm", "q0f32", art)
    return hf_dir, art


@pytest.fixture(scope="module")
def reference(gemma3):
    import transformers as tf

    hf_dir, _ = gemma3
    return (tf.AutoProcessor.from_pretrained(hf_dir),
            tf.Gemma3ForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval())


@pytest.fixture(scope="module")
def engine(gemma3):
    from mlcc.runtime.engine import Engine

    e = Engine(gemma3[1], target="llvm", max_batch=2)
    yield e
    e.shutdown()


def _ours(images, text):
    return [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": png_data_url(im)}}
                                           for im in images), {"type": "text", "text": text}]}]


def _theirs(images, text):
    from PIL import Image

    return [{"role": "user", "content": [*({"type": "image", "image": Image.fromarray(im)} for im in images),
                                         {"type": "text", "text": text}]}]


def _hf_inputs(processor, images, text):
    return processor.apply_chat_template(_theirs(images, text), add_generation_prompt=True, tokenize=True,
                                         return_dict=True, return_tensors="pt")


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.mark.parametrize("count", [1, 2])
def test_prompt_pixels_and_logits_with_images_match_transformers(gemma3, reference, engine, count):
    from mlcc.runtime.api.prepare import chat_call

    processor, hf = reference
    images = [random_image(i, 50 + 9 * i, 70 - 5 * i) for i in range(count)]
    call = chat_call(engine, {"messages": _ours(images, "What is in the picture?"), "max_tokens": 4})
    inputs = _hf_inputs(processor, images, "What is in the picture?")
    assert call.ids == inputs["input_ids"][0].tolist()   # template and image token expansion
    pixels = np.stack([img.pixels for img in call.spec.images])
    assert np.abs(pixels - inputs["pixel_values"].numpy()).max() <= 1e-6   # resize, rescale, normalise

    m = LoadedModel(gemma3[1])
    m.create_kv_cache(1, 256, 256)
    m.add_sequence(0)
    rows = m.embed_images(pixels)
    cuts = sorted({0, len(call.ids)} | {p for img in call.spec.images for p in (img.start, img.start + img.length)})
    for a, b in zip(cuts, cuts[1:]):   # text causally, each image on its own both ways (as the engine core does)
        image = next((i for i, img in enumerate(call.spec.images) if img.start == a), None)
        spliced = None if image is None else [EmbedRows(np.arange(b - a), rows[image])]
        ours = m.prefill([0], [call.ids[a:b]], spliced, bidirectional=image is not None).numpy()[0]
    with torch.no_grad():
        ref = hf(**inputs).logits[0, -1].double().numpy()
        causal = hf(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"]).logits[0, -1].double().numpy()
    assert rel_err(ours, ref) <= 1e-4, rel_err(ours, ref)
    assert rel_err(causal, ref) > 1e-3   # (the image tokens' two-way attention matters here)


def test_greedy_chat_with_images_then_a_text_turn_matches_transformers(reference, engine):
    processor, hf = reference
    images = [random_image(7), random_image(8, 64, 64)]
    messages = _ours(images, "Describe both.")
    reply = engine.chat.completions.create(messages=messages, max_tokens=12, temperature=0)
    inputs = _hf_inputs(processor, images, "Describe both.")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=12, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert reply.choices[0].message.content == expected and len(out[0]) > inputs["input_ids"].shape[1]
    assert reply.usage.prompt_tokens == inputs["input_ids"].shape[1]

    # a text-only turn after the image turn: the images stay in the conversation
    follow = [*messages, {"role": "assistant", "content": expected}, {"role": "user", "content": "And now?"}]
    reply2 = engine.chat.completions.create(messages=follow, max_tokens=8, temperature=0)
    theirs = [*_theirs(images, "Describe both."),
              {"role": "assistant", "content": [{"type": "text", "text": expected}]},
              {"role": "user", "content": [{"type": "text", "text": "And now?"}]}]
    inputs2 = processor.apply_chat_template(theirs, add_generation_prompt=True, tokenize=True, return_dict=True,
                                            return_tensors="pt")
    with torch.no_grad():
        out2 = hf.generate(**inputs2, max_new_tokens=8, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    assert reply2.choices[0].message.content == processor.tokenizer.decode(
        out2[0, inputs2["input_ids"].shape[1]:], skip_special_tokens=True)
    # the second turn's prompt starts with the first one's: its image tokens came from the prefix cache
    assert reply2.usage.prompt_tokens_details.cached_tokens > 0


def test_prefill_chunks_stop_before_an_image_they_would_cut(gemma3, reference, engine):
    """With 8-token prefill chunks the image (prompt tokens 23..26) would be cut at 24: the chunk stops at 23 and the
    image goes whole into the next forward, so the answer is transformers' all the same."""
    from mlcc.runtime.engine import Engine

    images = [random_image(9)]
    small = Engine(gemma3[1], target="llvm", max_batch=1, prefill_chunk=8)
    try:
        ours = small.chat.completions.create(messages=_ours(images, "Hm?"), max_tokens=6, temperature=0)
    finally:
        small.shutdown()
    assert ours.choices[0].message.content == engine.chat.completions.create(
        messages=_ours(images, "Hm?"), max_tokens=6, temperature=0).choices[0].message.content


def test_vision_models_refuse_tensor_parallel(gemma3):
    from mlcc.compiler.build import export_module
    from mlcc.compiler.quantize import get_quantization
    from mlcc.compiler.weights import load_source
    from mlcc.errors import UnsupportedConfigError
    from mlcc.targets import get_target

    with pytest.raises(UnsupportedConfigError, match="vision-language models run on one device"):
        export_module(load_source(gemma3[0]), get_target("cuda"), get_quantization("q4f16_1"), tensor_parallel=2)
