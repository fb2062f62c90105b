"""Put the tokenizer and chat template next to the compiled model, in HF's file format (tokenizer.json)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
             "generation_config.json", "chat_template.json")


def write_tokenizer(source_kind: str, source_path: Path, out: Path) -> dict[str, Any]:
    """Copy (HF) or convert (GGUF metadata) the tokenizer; return what the runtime needs."""
    if source_kind == "gguf":
        from .gguf_tokenizer import write_gguf_tokenizer

        write_gguf_tokenizer(source_path, out)
    else:
        for name in _HF_FILES:
            if (source_path / name).exists():
                shutil.copy(source_path / name, out / name)
        if not (out / "tokenizer.json").exists():
            log.warning("%s has no tokenizer.json: the artifacts can run token ids but not text", source_path)
    return tokenizer_info(out)


def write_placeholder_tokenizer(out: Path, vocab_size: int) -> dict[str, Any]:
    """A shape-only build's tokenizer: one word per id ("w0", "w1", ...), no special tokens, no chat template.
    Benchmarks on random weights feed token ids and read ids back; this lets the engine stream and detokenize them
    as it would a real model's."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    return {"eos_token_ids": [], "placeholder": True}


def tokenizer_info(out: Path) -> dict[str, Any]:
    cfg = json.loads((out / "tokenizer_config.json").read_text()) if (out / "tokenizer_config.json").exists() else {}
    template = cfg.get("chat_template")
    if not template and (out / "chat_template.json").exists():   # (where multimodal processors saved it)
        template = json.loads((out / "chat_template.json").read_text()).get("chat_template")
    if (out / "chat_template.jinja").exists():
        template = (out / "chat_template.jinja").read_text()
    gen = json.loads((out / "generation_config.json").read_text()) if (out / "generation_config.json").exists() else {}

    def tok_str(v: Any) -> str | None:
        return v.get("content") if isinstance(v, dict) else v

    return {
        "files": sorted(p.name for p in out.iterdir() if p.name in _HF_FILES),
        "chat_template": template,
        "bos_token": tok_str(cfg.get("bos_token")),
        "eos_token": tok_str(cfg.get("eos_token")),
        "eos_token_ids": _as_list(gen.get("eos_token_id")),
        "add_bos_token": bool(cfg.get("add_bos_token", False)),
        "generation_defaults": generation_defaults(gen),
    }


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


def generation_defaults(gen: dict[str, Any]) -> dict[str, float] | None:
    """The sampling a model's generation_config.json asks for (what `mlcc chat` uses when no flag says otherwise,
    as vLLM does): its temperature / top_p / top_k / repetition_penalty, greedy where do_sample is false; None where
    it says nothing."""
    found = {k: gen[k] for k in SAMPLING_KEYS if isinstance(gen.get(k), (int, float)) and not isinstance(gen[k], bool)}
    if gen.get("do_sample") is False:
        found = {"temperature": 0.0, **({"repetition_penalty": found["repetition_penalty"]}
                                        if "repetition_penalty" in found else {})}
    return found or None


def _as_list(v: Any) -> list[int]:
    if v is None:
        return []
    return list(v) if isinstance(v, (list, tuple)) else [int(v)]
