"""The logit functions on CUDA (grammar bitmask, logit_bias, logprobs; tiny random Llama, q0f32): exact against
numpy, and a constrained, biased chat with logprobs on the CUDA build gives the CPU build's text and values."""

import json

import numpy as np
import pytest


def _cuda_present() -> bool:
    import tvm

    return tvm.cuda(0).exist


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_present(), reason="no CUDA device")]

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def builds(hf_models, tmp_path_factory):
    from mlcc.compiler.build import compile_model

    out = tmp_path_factory.mktemp("logits")
    for target in ("llvm", "cuda"):
        compile_model(hf_models("llama"), target, "q0f32", out / target)
    return out


def test_logit_functions_match_numpy_on_cuda(builds):
    from mlcc.runtime.device.model import LoadedModel

    m = LoadedModel(builds / "cuda")
    rng = np.random.default_rng(0)
    host = rng.normal(0, 4, (3, m.vocab)).astype(np.float32)
    logits = m.to_device(host)
    mask = rng.integers(-(2 ** 31), 2 ** 31, (3, (m.vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    allowed = np.unpackbits(mask.view(np.uint8), bitorder="little").reshape(3, -1)[:, :m.vocab].astype(bool)
    np.testing.assert_array_equal(m.mask_logits(logits, mask).numpy(), np.where(allowed, host, -np.inf))
    rows, toks, bias = np.array([0, 2], np.int32), np.array([5, m.vocab - 1], np.int32), np.array([9, -3], np.float32)
    want = host.copy()
    want[rows, toks] += bias
    np.testing.assert_array_equal(m.bias_logits(logits, rows, toks, bias).numpy(), want)
    np.testing.assert_array_equal(logits.numpy(), host)   # the input is left as it was
    ids = np.array([1, 2, 3], np.int32)
    lp, top_ids, top_lp = m.logprobs(logits, ids)
    x = host.astype(np.float64)
    ref = x - x.max(1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(1, keepdims=True))
    order = np.argsort(-ref, axis=1, kind="stable")[:, :20]
    np.testing.assert_allclose(lp, ref[np.arange(3), ids], atol=1e-5)
    np.testing.assert_array_equal(top_ids, order)
    np.testing.assert_allclose(top_lp, np.take_along_axis(ref, order, 1), atol=1e-5)


def test_constrained_biased_chat_with_logprobs_on_cuda_equals_the_cpu_build(builds):
    pytest.importorskip("openai", reason="the Engine returns the openai package's types")
    from mlcc.runtime.engine import Engine

    kw = dict(messages=[{"role": "user", "content": "Hello there"}], max_tokens=200, temperature=0,
              logit_bias={"65": 3.0}, logprobs=True, top_logprobs=3,
              response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    out = {}
    for target in ("llvm", "cuda"):
        with Engine(builds / target, target=target, max_batch=2) as e:
            r = e.chat.completions.create(**kw)
            lone = e.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
            out[target] = (r.choices[0].message.content, [t.logprob for t in r.choices[0].logprobs.content],
                           lone.choices[0].message.content)
    assert out["cuda"][0] == out["llvm"][0] == out["cuda"][2]   # the pipelined lone request too
    json.loads(out["cuda"][0])
    np.testing.assert_allclose(out["cuda"][1], out["llvm"][1], atol=1e-3)
