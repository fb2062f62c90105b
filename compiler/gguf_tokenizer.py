"""GGUF tokenizer metadata → HF tokenizer.json + tokenizer_config.json, with the `tokenizers` library only.

transformers can do this too, but its GGUF path needs torch, which the install must not. The byte-level BPE
("gpt2": Llama 3, Qwen2, SmolLM2) is rebuilt the way transformers does; the result is tested against it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from mlcc.errors import UnsupportedTokenizerError

_CONTROL, _USER_DEFINED = 3, 4


def write_gguf_tokenizer(gguf_path: Path, out: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    kind = field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedTokenizerError(
            f"{gguf_path}: GGUF tokenizer type '{kind}' is not supported yet (only byte-level BPE 'gpt2'); "
            "compile from the Hugging Face folder instead, which ships tokenizer.json")
    tokens: list[str] = field("tokenizer.ggml.tokens")
    types: list[int] = field("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                               byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
                if k in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens(specials)

    def name(key: str) -> str | None:
        i = field(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos, unk, pad = (name(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding"))
    add_bos = bool(field("tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                          special_tokens=[(bos, tokens.index(bos))])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad, "add_bos_token": add_bos,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    template = field("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
