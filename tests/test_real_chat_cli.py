"""The real `mlcc chat` command on a real base model (marked slow: the Gemma-3-270m GGUF of
tests/test_real_weights.py, ~0.25 GB, and half a minute of CPU compile).

Gemma-3-270m is a base model: its GGUF carries no chat template, so the compile gives it the Gemma family's,
recognised by the `<start_of_turn>` token of its tokenizer, and says so in the log.

    python -m pytest -m slow -s tests/test_real_chat_cli.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_real_weights import gemma3_270m_gguf, weights_dir  # noqa: F401 - weights_dir: the fixture, by name

pytestmark = pytest.mark.slow

FALLBACK_LOG = "has no chat template: using the gemma family's, recognised by its tokenizer's '<start_of_turn>' token"


def _chat(gguf: Path, cache: Path, prompt: str, max_tokens: int) -> subprocess.CompletedProcess:
    # an empty cache of its own: the template fallback is logged only when the model is compiled
    env = {**os.environ, "MLCC_CACHE_DIR": str(cache)}
    cmd = [sys.executable, "-m", "mlcc", "chat", str(gguf), "--prompt", prompt, "--max-tokens", str(max_tokens),
           "--temperature", "0"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)


@pytest.mark.usefixtures("weights_dir")
def test_gemma3_270m_chats_through_the_cli_with_the_fallback_template(tmp_path):
    r = _chat(gemma3_270m_gguf(), tmp_path / "cache", "What is the capital of France?", 16)
    print("stdout:", r.stdout, "\nstderr:", r.stderr[-3000:])
    assert r.returncode == 0, r.stderr[-3000:]
    answer = r.stdout.strip()
    assert answer
    assert "<start_of_turn>" not in answer and "<end_of_turn>" not in answer
    assert f"gemma-3-270m-q4_k_m.gguf {FALLBACK_LOG}" in r.stderr
