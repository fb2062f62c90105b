"""GGUF tokenizer metadata → HF tokenizer.json + tokenizer_config.json, with the `tokenizers` library only.

transformers can do this too, but its GGUF path needs torch, which the install must not. The byte-level BPE
("gpt2": Llama 3, Qwen2, SmolLM2) is rebuilt the way transformers does; the result is tested against it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from mlcc.errors import UnsupportedTokenizerError

log = logging.getLogger(__name__)

_CONTROL, _USER_DEFINED = 3, 4

# How a byte-level vocabulary splits text before its merges (`tokenizer.ggml.pre`): the regexes of the models' own
# tokenizer.json files, as llama.cpp's llama-vocab.cpp and transformers' GGUF loader map them. Splitting otherwise
# gives other tokens for the same text (Qwen2's "(x" or "):\n" become two tokens under GPT-2's regex).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), _LLAMA3),
           **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2), "qwen35": _QWEN35,
           "tekken": _TEKKEN, **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O)}
# GPT-2's regex after every digit split off alone (SmolLM's, StarCoder's)
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2 = {None, "default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}


def byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of a byte-level BPE vocabulary whose GGUF names its splitting `pre`."""
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre not in _GPT2:
        log.warning("GGUF pre-tokenizer '%s' is not known here: splitting text as GPT-2 does, so some texts may "
                    "tokenize differently from the model's own tokenizer", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def write_gguf_tokenizer(gguf_path: Path, out: Path) -> None:
    from .weights import gguf_parts, open_gguf

    reader = open_gguf(gguf_parts(gguf_path)[0])   # a split GGUF's tokenizer is in its first part

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    kind = field("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise UnsupportedTokenizerError(
            f"{gguf_path}: GGUF tokenizer type '{kind}' is not supported yet (byte-level BPE 'gpt2' and "
            "SentencePiece BPE 'llama' are); compile from the Hugging Face folder instead, which ships tokenizer.json")
    tokens: list[str] = field("tokenizer.ggml.tokens")
    types: list[int] = field("tokenizer.ggml.token_type", [1] * len(tokens))
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                                   byte_fallback=False))
        tok.pre_tokenizer = byte_level_pre_tokenizer(field("tokenizer.ggml.pre"))
        tok.decoder = decoders.ByteLevel()
    else:
        tok = _sentencepiece_bpe(tokens, field("tokenizer.ggml.scores"), bool(field("tokenizer.ggml.add_space_prefix",
                                                                                     True)))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
                            if k == _CONTROL])
    # USER_DEFINED tokens (Qwen's <tool_call>, </tool_call>, <think>; Gemma's runs of spaces) are text that is
    # matched whole, as llama.cpp, transformers' GGUF loader and the models' own tokenizer.json treat them: decoded
    # even where special tokens are skipped, and to a grammar the same bytes as their spelling, so a model writing
    # `</tool_call>` as its one token satisfies a grammar that asks for that text.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
                    if k == _USER_DEFINED])

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


def _sentencepiece_bpe(tokens: list[str], scores: list[float], add_space_prefix: bool) -> Tokenizer:
    """llama.cpp's 'llama' vocabulary (SentencePiece BPE: "▁" for spaces, byte fallback) as a `tokenizers` BPE.
    SentencePiece merges the adjacent pair whose merged piece scores highest, so the merges are every split of a
    piece into two pieces of the vocabulary, ranked by the merged piece's score."""
    from tokenizers import normalizers

    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for piece, score in zip(tokens, scores):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True,
                               unk_token=tokens[0] if tokens else None))
    steps = ([normalizers.Prepend("▁")] if add_space_prefix else []) + [normalizers.Replace(" ", "▁")]
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return tok
