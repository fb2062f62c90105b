"""The host sampler against the definitions it implements, on known logits: HF's repetition penalty, OpenAI's
frequency/presence penalties, temperature, top-k and top-p; and the row mapping of forked choices."""

from __future__ import annotations

import numpy as np
import pytest

from mlcc.runtime.core.sampler import Sampler, SamplingParams, apply_penalties, sample_row

LOGITS = np.array([2.0, -1.0, 0.5, 3.0, -0.5, 1.0])
PROMPT = [5, 0]
GENERATED = [3, 3, 1]


def test_repetition_penalty_is_hfs_on_prompt_and_output():
    p = SamplingParams(repetition_penalty=2.0)
    got = apply_penalties(LOGITS, p, (PROMPT, GENERATED))
    # seen: 0, 1, 3, 5 — positive logits halved, negative ones doubled; 2 and 4 untouched
    np.testing.assert_allclose(got, [1.0, -2.0, 0.5, 1.5, -0.5, 0.5])


def test_frequency_and_presence_penalties_are_openais_on_generated_tokens():
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = apply_penalties(LOGITS, p, (PROMPT, GENERATED))
    # token 3 generated twice: 3 - 2 * 0.5 - 0.25; token 1 once: -1 - 0.5 - 0.25; prompt tokens 0 and 5 untouched
    np.testing.assert_allclose(got, [2.0, -1.75, 0.5, 1.75, -0.5, 1.0])
    np.testing.assert_array_equal(apply_penalties(LOGITS, p, (PROMPT, [])), LOGITS)   # nothing generated yet


def test_penalties_combine_repetition_first():
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    np.testing.assert_allclose(apply_penalties(LOGITS, p, (PROMPT, GENERATED)), [1.0, -2.75, 0.5, 0.25, -0.5, 0.5])
    # greedy picks the argmax of the penalised row: 0 (1.0) over 3 (0.25)
    assert sample_row(LOGITS, SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5,
                                             presence_penalty=0.25), (PROMPT, GENERATED), np.random.default_rng()) == 0
    assert sample_row(LOGITS, SamplingParams(temperature=0), (PROMPT, GENERATED), np.random.default_rng()) == 3


@pytest.mark.parametrize("kw,support", [
    (dict(temperature=0.7), [0, 1, 2, 3, 4, 5]),
    (dict(temperature=1.3, top_k=3), [0, 3, 5]),
    (dict(temperature=1.0, top_p=0.8), [0, 3]),           # mass of 3, then 0: 0.61, 0.84 ≥ 0.8
    (dict(temperature=1.0, presence_penalty=2.0), [0, 1, 2, 3, 4, 5]),
])
def test_sample_row_draws_from_softmax_of_the_scaled_penalised_logits(kw, support):
    p = SamplingParams(**kw)
    z = apply_penalties(LOGITS, p, (PROMPT, GENERATED)) / p.temperature
    want = np.zeros_like(z)
    want[support] = np.exp(z[support] - z[support].max())
    want /= want.sum()
    rng = np.random.default_rng(0)
    n = 6000
    freq = np.bincount([sample_row(LOGITS, p, (PROMPT, GENERATED), rng) for _ in range(n)], minlength=6) / n
    assert set(np.flatnonzero(freq)) <= set(support)
    assert np.abs(freq - want).max() < 4 * np.sqrt(0.25 / n), (freq, want)


class _Host:
    def __init__(self, a):
        self.a = np.asarray(a, np.float32)
        self.shape = self.a.shape

    def numpy(self):
        return self.a


def test_sampler_rows_map_choices_to_logits_rows():
    logits = _Host([[0.0, 5.0, 1.0], [9.0, 0.0, 1.0]])
    greedy = SamplingParams(temperature=0)
    calls = []

    def argmax(x):
        calls.append(x.shape)
        return _Host(np.argmax(x.numpy(), axis=-1))

    s = Sampler(3, device_argmax=argmax)
    assert s.sample(logits, [greedy] * 3, [([], [])] * 3, [None] * 3, rows=[1, 1, 0]) == [0, 0, 1]
    assert calls == [(2, 3)]   # one argmax over the rows, then picked
    host = Sampler(3, device_argmax=argmax, host_greedy=True)
    assert host.sample(logits, [greedy] * 2, [([], [])] * 2, [None] * 2, rows=[0, 0]) == [1, 1] and len(calls) == 1
    # the compiled sampler draws one sample per row: repeated rows are gathered first
    seen = []

    def device_sample(lg, t, top_p, top_k, u, rows):
        seen.append((lg.numpy().copy(), rows.numpy().tolist()))
        return _Host(np.argmax(lg.numpy(), axis=-1).astype(np.int32))

    s = Sampler(3, argmax, device_sample, to_device=_Host)
    ids = s.sample(logits, [SamplingParams()] * 3, [([], [])] * 3, [np.random.default_rng(i) for i in range(3)],
                   rows=[1, 1, 0])
    assert ids == [0, 0, 1]
    np.testing.assert_array_equal(seen[0][0], logits.a[[1, 1, 0]])
    assert seen[0][1] == [0, 1, 2]
