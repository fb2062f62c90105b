"""`mlcc chat`: one --prompt and exit, and the interactive loop (/reset, /exit), on the tiny compiled model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlcc import Engine

QUESTION = "Hello there"


@pytest.fixture(scope="module")
def model(compiled):
    return compiled("llama", "q0f32")


@pytest.fixture(scope="module")
def answers(model):
    """What the engine answers, greedily, to the question asked once and then again after that answer."""
    with Engine(model, target="llvm", max_batch=1) as e:
        history = [{"role": "user", "content": QUESTION}]
        first = e.chat.completions.create(messages=history, max_tokens=12, temperature=0).choices[0].message.content
        history += [{"role": "assistant", "content": first}, {"role": "user", "content": QUESTION}]
        second = e.chat.completions.create(messages=history, max_tokens=12, temperature=0).choices[0].message.content
    assert first != second   # the history matters, so /reset is visible
    return first, second


def _chat(model, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlcc", "chat", str(model), "--target", "llvm", "--max-tokens", "12",
                           *args], input=stdin, capture_output=True, text=True, timeout=300)


def test_prompt_answers_once_and_exits(model, answers):
    r = _chat(model, "--prompt", QUESTION)
    assert r.returncode == 0, r.stderr
    assert r.stdout == answers[0] + "\n"
    assert "tokens," in r.stderr and "tok/s" in r.stderr and "ready in" in r.stderr


def test_interactive_keeps_history_until_reset(model, answers):
    r = _chat(model, stdin=f"{QUESTION}\n{QUESTION}\n/reset\n{QUESTION}\n/exit\n{QUESTION}\n")
    assert r.returncode == 0, r.stderr
    turns = r.stdout.split(">>> ")
    first, second = answers
    # the prompt is written before each read: after the answers, after /reset, before /exit
    assert turns == ["", first + "\n", second + "\n", "", first + "\n", ""]


def test_a_missing_model_is_one_line_error(tmp_path):
    r = _chat(tmp_path / "nothing", "--prompt", "hi")
    assert r.returncode == 2 and r.stderr.strip().startswith("mlcc: error:") and len(r.stderr.strip().splitlines()) == 1
