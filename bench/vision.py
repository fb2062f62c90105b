"""Time to first token with an image: one 896x896 PNG and a 64-token question to a Gemma-3-shaped vision-language
model with random weights, mlcc against transformers on the same weights in one run.

    python bench/vision.py make --shape gemma3-4b --out .dev/g3v4b               # random HF folder + processor files
    mlcc compile .dev/g3v4b --target cuda --quant q0f16 --output .dev/g3v4b-cuda
    python bench/vision.py run --model .dev/g3v4b --art .dev/g3v4b-cuda --out OUT   # the CUDA machine
    # the same on a CPU, small: --shape tiny, --target llvm --quant q0f32, run --device cpu

make: transformers' Gemma3ForConditionalGeneration of the shape with its own random initialisation (seeded), saved in
bfloat16, with a byte-level tokenizer that has Gemma 3's image tokens, Gemma 3's chat template and image processor.
run: TTFT = from the request to its first streamed token (mlcc: Engine.chat.completions.create(stream=True) with
the image as a data: URL, prefix cache off so every repeat encodes the image; transformers: the processor's chat
template and image processing, then the forward of the whole prompt on --device, synchronised), median of
--repeats after one warm-up, alternating the two. Rows of OUT/vision_ttft.json: {"engine", "shape", "image",
"prompt_tokens", "ttft_ms", "ttft_ms_all"}. (That both answer the same is tests/test_vision.py's business, on a
tiny model in float32; random weights of this size say nothing more.)
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import time
from pathlib import Path

import numpy as np

SHAPES = {
    # google/gemma-3-4b-it's config: SigLIP-so400m at 896 (4,096 patches pooled to 256 tokens), 34 text layers
    "gemma3-4b": {
        "text": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8,
                 "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 262208, "sliding_window": 1024,
                 "query_pre_attn_scalar": 256},
        "vision": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
                   "image_size": 896, "patch_size": 14},
        "tokens": 256},
    "tiny": {
        "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 320, "sliding_window": 64,
                 "query_pre_attn_scalar": 32},
        "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "image_size": 896, "patch_size": 112},
        "tokens": 16},
}
SPECIALS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}{% for item in m['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>{% elif item['type'] == 'text' %}{{ item['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
QUESTION = "Describe the picture in one sentence, then name the main colours it has, from most to least."[:64]


def make(args: argparse.Namespace) -> None:
    import torch
    import transformers as tf

    from mlcc.compiler.byte_tokenizer import SPECIALS as BASE
    from mlcc.compiler.byte_tokenizer import write_byte_tokenizer

    shape, out = SHAPES[args.shape], Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    boi, image, eoi = (256 + len(BASE) + i for i in range(3))
    torch.manual_seed(0)
    text = tf.Gemma3TextConfig(**shape["text"], max_position_embeddings=8192, bos_token_id=None,
                               eos_token_id=256 + BASE.index("<|im_end|>"))
    cfg = tf.Gemma3Config(text_config=text.to_dict(),
                          vision_config=tf.SiglipVisionConfig(**shape["vision"], vision_use_head=False).to_dict(),
                          mm_tokens_per_image=shape["tokens"], boi_token_index=boi, eoi_token_index=eoi,
                          image_token_index=image)
    with torch.device("cpu"):
        model = tf.Gemma3ForConditionalGeneration(cfg).to(torch.bfloat16 if args.shape != "tiny" else torch.float32)
    model.save_pretrained(out)

    def tokenizer() -> None:
        write_byte_tokenizer(out, extra_specials=SPECIALS)
        tok = json.loads((out / "tokenizer_config.json").read_text())
        tok.update(chat_template=TEMPLATE, tokenizer_class="PreTrainedTokenizerFast",
                   extra_special_tokens=dict(zip(("boi_token", "image_token", "eoi_token"), SPECIALS)))
        (out / "tokenizer_config.json").write_text(json.dumps(tok))

    tokenizer()
    size = shape["vision"]["image_size"]
    tf.Gemma3Processor(image_processor=tf.Gemma3ImageProcessorPil(size={"height": size, "width": size}),
                       tokenizer=tf.AutoTokenizer.from_pretrained(out), chat_template=TEMPLATE,
                       image_seq_length=shape["tokens"]).save_pretrained(out)
    tokenizer()   # (the processor wrote its tokenizer over ours)
    print(f"wrote {out}")


def _image(seed: int, side: int = 896) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side, 0:side]
    base = np.stack([x / side, y / side, (x + y) / (2 * side)], -1) * 200
    return np.clip(base + rng.integers(0, 55, (side, side, 3)), 0, 255).astype(np.uint8)


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def run(args: argparse.Namespace) -> None:
    import torch
    import transformers as tf
    from PIL import Image

    from mlcc.runtime.engine import Engine

    pixels = _image(1)
    png = _png(pixels)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    engine = Engine(args.art, prefix_cache=False, max_batch=1)
    processor = tf.AutoProcessor.from_pretrained(args.model)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    hf = tf.Gemma3ForConditionalGeneration.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    ours_msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                              {"type": "text", "text": QUESTION}]}]

    def mlcc_once() -> float:
        t0 = time.perf_counter()
        for chunk in engine.chat.completions.create(messages=ours_msgs, max_tokens=1, temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content is not None:
                break
        return time.perf_counter() - t0

    def hf_once() -> tuple[float, int]:
        t0 = time.perf_counter()
        image = Image.open(io.BytesIO(png))   # decoded per request, as the engine does
        theirs = [{"role": "user", "content": [{"type": "image", "image": image},
                                               {"type": "text", "text": QUESTION}]}]
        inputs = processor.apply_chat_template(theirs, add_generation_prompt=True, tokenize=True, return_dict=True,
                                               return_tensors="pt").to(args.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        with torch.no_grad():
            hf(**inputs).logits[0, -1].argmax().item()   # (.item(): waits for the device)
        return time.perf_counter() - t0, int(inputs["input_ids"].shape[1])

    mlcc_once(), hf_once()   # warm-up
    ours, theirs, prompt = [], [], 0
    for _ in range(args.repeats):
        ours.append(mlcc_once() * 1e3)
        t, prompt = hf_once()
        theirs.append(t * 1e3)
    engine.shutdown()
    rows = [{"engine": "mlcc", "shape": args.model, "image": "896x896 png", "prompt_tokens": prompt,
             "ttft_ms": statistics.median(ours), "ttft_ms_all": ours},
            {"engine": "transformers", "device": args.device, "dtype": str(dtype), "shape": args.model,
             "image": "896x896 png", "prompt_tokens": prompt, "ttft_ms": statistics.median(theirs),
             "ttft_ms_all": theirs}]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vision_ttft.json").write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(f"{r['engine']:>12}: TTFT {r['ttft_ms']:.1f} ms ({r['prompt_tokens']} prompt tokens)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(required=True)
    m = sub.add_parser("make")
    m.add_argument("--shape", choices=SHAPES, default="gemma3-4b")
    m.add_argument("--out", required=True)
    m.set_defaults(func=make)
    r = sub.add_parser("run")
    r.add_argument("--model", required=True, help="the HF folder `make` wrote")
    r.add_argument("--art", required=True, help="its mlcc artifacts folder")
    r.add_argument("--device", default="cuda", help="transformers' device (default: %(default)s)")
    r.add_argument("--repeats", type=int, default=5)
    r.add_argument("--out", required=True)
    r.set_defaults(func=run)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
