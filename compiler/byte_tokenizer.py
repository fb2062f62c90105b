"""A byte-level tokenizer with a ChatML template, for models with random weights (a shape-only or freshly
initialized transformers model has no tokenizer of its own): every byte is a token, so any text round-trips, and the
chat template makes the folder usable by `mlcc chat`, `mlcc serve` and the Engine. The tests' tiny models and the
benchmarks' random ones both take it."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# 256 byte tokens + the specials, below the 320-row vocabulary these models are given (padded, as real ones are)
VOCAB = 320


def write_byte_tokenizer(folder: Path, bos_token: str | None = None, extra_specials: tuple[str, ...] = ()) -> None:
    """tokenizer.json (byte-level BPE without merges, built with `tokenizers`) and tokenizer_config.json (ChatML,
    EOS <|im_end|>) into `folder`. bos_token: a special token the config asks to start every prompt with
    (add_bos_token), which the template writes first. extra_specials: more special tokens, after the others (a
    vision-language model's image tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS + ([bos_token] if bos_token else []) + list(extra_specials))
    tok.save(str(Path(folder) / "tokenizer.json"))
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": bos_token}
    if bos_token:
        config.update(chat_template="{{ bos_token }}" + CHATML, add_bos_token=True)
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config))
