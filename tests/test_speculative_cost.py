"""The speculator's start-up cost probe (runtime.spec.speculative.speculative_step_cost): it times a decode step and a
verify on a scratch sequence that it removes again, and where a speculative step would cost more decode steps than
the tokens it can yield, speculation stays off and every request decodes plainly, with the same output."""

from __future__ import annotations

import logging

from mlcc import Engine
from mlcc.runtime.spec import speculative

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
PROMPT = [(7 * i) % 50 + 60 for i in range(12)] * 3


def _greedy(engine: Engine, n: int = 30) -> str:
    return engine.completions.create(prompt=PROMPT, max_tokens=n, temperature=0).choices[0].text


def test_the_probe_measures_and_leaves_no_trace(compiled):
    with Engine(compiled("llama", "q0f32"), target="llvm", max_batch=2, speculative_config=NGRAM) as e:
        core = e.core
        cost = core.speculator.step_cost
        assert cost is not None and cost > 0
        assert speculative.SCRATCH_SEQ not in core.model.seq_lens
        assert core.free_pages() == core.total_pages
        seconds = speculative.step_seconds(core.model, 6)
        assert all(s > 0 for s in seconds) and core.free_pages() == core.total_pages


def test_speculation_stays_off_where_it_cannot_pay(compiled, monkeypatch, caplog):
    target = compiled("llama", "q0f32")
    with Engine(target, target="llvm", max_batch=2, prefix_cache=False) as plain:
        want = _greedy(plain)
    # a verify of 6 tokens as slow as 100 decode steps
    monkeypatch.setattr(speculative, "step_seconds", lambda model, tokens, repeats=5: (0.001, 0.1))
    with caplog.at_level(logging.WARNING, logger="mlcc.runtime.spec.speculative"):
        with Engine(target, target="llvm", max_batch=2, speculative_config=NGRAM) as e:
            assert not e.core.speculator.enabled and e.core.speculator.step_cost == 100.0
            assert _greedy(e) == want
            assert e.core.stats["spec_drafts"] == 0
    assert "speculative decoding stays off" in caplog.text
