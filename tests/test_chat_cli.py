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
                           "--temperature", "0", *args], input=stdin, capture_output=True, text=True, timeout=300)


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


def test_an_answer_cut_by_the_token_limit_says_so(model):
    r = _chat(model, "--prompt", QUESTION, "--max-tokens", "3")
    assert r.returncode == 0, r.stderr
    assert "cut at the token limit (3)" in r.stderr and "--max-tokens" in r.stderr


def test_sampling_defaults_come_from_the_model_else_interactive_ones(model):
    from types import SimpleNamespace

    from mlcc.compiler.tokenizer_files import generation_defaults
    from mlcc.runtime.serve.chat_cli import INTERACTIVE_SAMPLING, sampling_for

    def engine(defaults):
        return SimpleNamespace(tokenizer=SimpleNamespace(info={"generation_defaults": defaults}))

    none = dict.fromkeys(("temperature", "top_p", "top_k", "repetition_penalty"))
    assert sampling_for(engine(None), none) == INTERACTIVE_SAMPLING
    assert sampling_for(engine({"temperature": 0.6, "top_p": 0.95}), none) == {"temperature": 0.6, "top_p": 0.95}
    assert sampling_for(engine({"temperature": 0.6}), {**none, "temperature": 0.0}) == {"temperature": 0.0}
    assert generation_defaults({"do_sample": False, "temperature": 0.7, "repetition_penalty": 1.05}) == \
        {"temperature": 0.0, "repetition_penalty": 1.05}
    assert generation_defaults({"eos_token_id": 2}) is None
    r = subprocess.run([sys.executable, "-m", "mlcc", "chat", str(model), "--target", "llvm", "--max-tokens", "4",
                        "--prompt", QUESTION], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "sampling temperature 0.8, top_p 0.9, top_k 40, repetition_penalty 1.1" in r.stderr
