"""Sampling compiled into the library, on CUDA: the device sampler's draws follow the softmax, and a seeded
temperature/top-p chat on the CUDA build gives exactly the CPU build's text (tiny random Llama, q0f32)."""

import numpy as np
import pytest


def _cuda_present() -> bool:
    import tvm

    return tvm.cuda(0).exist


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_present(), reason="no CUDA device")]

CHAT = dict(messages=[{"role": "user", "content": "Hello there"}], max_tokens=24, temperature=0.8, top_p=0.9, seed=11)
DRAWS = 3000


@pytest.fixture(scope="module")
def builds(hf_models, tmp_path_factory):
    from mlcc.compiler.build import compile_model

    out = tmp_path_factory.mktemp("sampling")
    for target in ("llvm", "cuda"):
        compile_model(hf_models("llama"), target, "q0f32", out / target)
    return out


def test_device_sampler_draws_follow_the_softmax(builds):
    """3000 draws over softmax([0, 1, 2, 3]) on four tokens (every other logit -30): each token's frequency within
    four standard deviations of its probability."""
    import tvm

    from mlcc.runtime.device.model import LoadedModel

    m = LoadedModel(builds / "cuda")
    sample = m.sample

    def dev(a: np.ndarray):
        return tvm.runtime.tensor(a, m.dev)

    logits = np.full((1, m.vocab), -30.0, np.float32)
    picked = [3, 7, 11, 19]
    logits[0, picked] = [0.0, 1.0, 2.0, 3.0]
    one, top_k, row = dev(np.array([1.0], np.float32)), dev(np.array([m.vocab], np.int32)), dev(np.zeros(1, np.int32))
    x = dev(logits)
    us = np.random.default_rng(0).random(DRAWS)
    ids = [int(sample(x, one, one, top_k, dev(np.array([u], np.float32)), row).numpy()[0]) for u in us]
    counts = np.bincount(ids, minlength=m.vocab)
    assert counts[picked].sum() == DRAWS, "drew a token whose probability is ~e-30"
    p = np.exp(logits[0, picked] - 3.0)
    p /= p.sum()
    freq = counts[picked] / DRAWS
    assert np.abs(freq - p).max() < 4 * np.sqrt(0.25 / DRAWS), (freq, p)


def test_seeded_sampled_chat_on_cuda_equals_the_cpu_build(builds):
    pytest.importorskip("openai", reason="the Engine returns the openai package's types")
    from mlcc.runtime.engine import Engine

    text = {}
    for target in ("llvm", "cuda"):
        with Engine(builds / target, target=target) as e:
            text[target] = e.chat.completions.create(**CHAT).choices[0].message.content
    assert text["cuda"] == text["llvm"]
    assert text["cuda"]
