"""The logit functions every library carries (apply_bitmask, apply_logit_bias, logprobs) against numpy: built alone
for the CPU (fast, also with the GPUs' two-stage top-K), and through a compiled tiny model's LoadedModel methods."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm

from mlcc.errors import RequestError

K = 20


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))


def _top(x: np.ndarray) -> np.ndarray:
    """Descending, ties in index order."""
    return np.argsort(-x, axis=1, kind="stable")[:, :K]


def _mask_bits(allowed: np.ndarray) -> np.ndarray:
    """bool [b, V] -> llguidance's int32 words: bit v % 32 of word v // 32."""
    b, v = allowed.shape
    words = -(-v // 32)
    padded = np.zeros((b, words * 32), dtype=bool)
    padded[:, :v] = allowed
    bits = (padded.reshape(b, words, 32) * (1 << np.arange(32, dtype=np.uint64))).sum(axis=2)
    return bits.astype(np.uint32).view(np.int32)


@pytest.fixture(scope="module", params=[None, 64], ids=["whole-row", "chunked"])
def funcs(request):
    """The three functions alone for a vocabulary that is no multiple of 32 (partial mask word); `chunked` runs
    the GPUs' two-stage top-K (pieces of 64, a partial last one) on the CPU."""
    from mlcc.compiler.pipeline import build_pipeline
    from mlcc.compiler.sampler import attach_logit_functions
    from mlcc.options import CompileOptions

    vocab = 333
    target = tvm.target.Target("llvm")
    mod = attach_logit_functions(tvm.IRModule(), vocab, target, chunk=request.param)
    ex = tvm.compile(mod, target, relax_pipeline=build_pipeline(target, None, CompileOptions()))
    vm = tvm.relax.VirtualMachine(ex, tvm.cpu())
    return vocab, vm


def _t(a):
    return tvm.runtime.tensor(np.ascontiguousarray(a))


def test_bitmask_matches_numpy(funcs):
    vocab, vm = funcs
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, vocab)).astype(np.float32)
    allowed = rng.random((4, vocab)) < 0.5
    allowed[1] = False
    allowed[1, [3, 31, 32, vocab - 1]] = True   # all but a few masked, at word edges and the partial last word
    allowed[2] = True
    out = vm["apply_bitmask"](_t(x), _t(_mask_bits(allowed))).numpy()
    np.testing.assert_array_equal(out, np.where(allowed, x, -np.inf))
    assert np.isneginf(out[1]).sum() == vocab - 4
    # what samplers do with such a row stays finite
    p = np.exp(out[1] - out[1].max())
    assert np.isfinite(p).all() and set(np.flatnonzero(p)) == {3, 31, 32, vocab - 1}


def test_logit_bias_adds_at_the_pairs(funcs):
    vocab, vm = funcs
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, vocab)).astype(np.float32)
    rows = np.array([0, 0, 2, 1], np.int32)
    ids = np.array([5, vocab - 1, 7, 5], np.int32)
    bias = np.array([100.0, -100.0, 2.5, -0.5], np.float32)
    logits = _t(x)
    out = vm["apply_logit_bias"](logits, _t(rows), _t(ids), _t(bias)).numpy()
    ref = x.copy()
    ref[rows, ids] += bias
    np.testing.assert_array_equal(out, ref)
    assert out[0].argmax() == 5 and out[0].argmin() == vocab - 1
    np.testing.assert_array_equal(logits.numpy(), x)  # the input is not modified (logprobs read it after)


def test_logprobs_match_log_softmax_and_order(funcs):
    vocab, vm = funcs
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((5, vocab)) * 4).astype(np.float32)
    x[1, ::3] = x[1].max() + 1.0          # many ties at the top: index order
    x[2] = np.round(x[2])                 # ties everywhere
    x[3] = -np.inf
    x[3, [10, 200, 300]] = [1.0, 3.0, 2.0]   # a masked row: three tokens allowed
    x[4, 0] = 80.0                        # one token dominates
    ids = np.array([0, 3, 7, 200, 5], np.int32)
    lp, top_ids, top_lp = (o.numpy() for o in vm["logprobs"](_t(x), _t(ids)))
    assert lp.shape == (5,) and top_ids.shape == (5, K) and top_lp.shape == (5, K) and top_ids.dtype == np.int32
    ref = _log_softmax(x)
    np.testing.assert_allclose(lp, ref[np.arange(5), ids], atol=1e-5)
    np.testing.assert_array_equal(top_ids, _top(x))
    np.testing.assert_allclose(top_lp, np.take_along_axis(ref, _top(x), axis=1), atol=1e-5)
    # the masked row: its three tokens, then -inf ones in index order
    assert list(top_ids[3, :3]) == [200, 300, 10]
    assert list(top_ids[3, 3:]) == [i for i in range(vocab) if i not in (10, 200, 300)][:K - 3]
    assert np.isneginf(top_lp[3, 3:]).all() and np.isfinite(top_lp[3, :3]).all()
    assert np.all(np.diff(top_lp[:3], axis=1) <= 0)


@pytest.fixture(scope="module")
def model(compiled):
    from mlcc.runtime.device.model import LoadedModel

    m = LoadedModel(compiled("llama", "q0f32"))
    m.create_kv_cache(2, 512, 64)
    return m


def test_model_methods_on_prefill_logits(model):
    assert model.has_logit_functions
    model.add_sequence(0)
    model.add_sequence(1)
    try:
        logits = model.prefill([0, 1], [[1, 2, 3, 4], [5, 6]])
        x = logits.numpy()
        allowed = np.zeros_like(x, dtype=bool)
        allowed[0, [7, 9]] = True
        allowed[1] = True
        masked = model.mask_logits(logits, _mask_bits(allowed))
        np.testing.assert_array_equal(masked.numpy(), np.where(allowed, x, -np.inf))
        assert int(model.argmax(masked).numpy()[0]) in (7, 9)
        # logit_bias: force one token in row 1, ban row 1's best; a repeated pair adds up
        best = int(x[1].argmax())
        biased = model.bias_logits(masked, np.array([1, 1, 0, 0]), np.array([11, best, 7, 7]),
                                   np.array([100.0, -100.0, 1.0, 2.0]))
        b = biased.numpy()
        assert b[1].argmax() == 11 and b[1, best] == pytest.approx(x[1, best] - 100, abs=1e-4)
        assert b[0, 7] == pytest.approx(x[0, 7] + 3.0, abs=1e-5)
        ids = np.array([7, best], np.int32)
        lp, top_ids, top_lp = model.logprobs(biased, ids)
        ref = _log_softmax(b)
        np.testing.assert_allclose(lp, ref[[0, 1], ids], atol=1e-5)
        np.testing.assert_array_equal(top_ids, _top(b))
        np.testing.assert_allclose(top_lp, np.take_along_axis(ref, _top(b), axis=1), atol=1e-5)
        # decode steps reuse the uploaded buffers
        sizes = []
        for _ in range(3):
            out = model.decode([0, 1], [int(top_ids[0, 0]), int(top_ids[1, 0])])
            out = model.bias_logits(model.mask_logits(out, _mask_bits(allowed)), np.array([0, 1, 0, 1]),
                                    np.array([1, 2, 3, 4]), np.zeros(4))
            model.logprobs(out, np.array([7, 1], np.int32))
            sizes.append(len(model._buffers))
        assert sizes[0] == sizes[-1]
    finally:
        model.remove_sequence(0)
        model.remove_sequence(1)


def test_prefill_all_matches_prefill_at_every_position(model):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    model.add_sequence(0)
    try:
        all_rows = model.prefill_all(0, prompt).numpy()
    finally:
        model.remove_sequence(0)
    assert all_rows.shape == (len(prompt), model.vocab)
    for n in (1, 5, len(prompt)):
        model.add_sequence(0)
        try:
            last = model.prefill([0], [prompt[:n]]).numpy()[0]
        finally:
            model.remove_sequence(0)
        np.testing.assert_allclose(all_rows[n - 1], last, atol=1e-4, rtol=1e-4)


def test_bad_inputs_and_missing_functions_are_clear(model):
    from mlcc.runtime.device.tensor_parallel import TensorParallelModel

    model.add_sequence(0)
    try:
        logits = model.prefill([0], [[1, 2]])
    finally:
        model.remove_sequence(0)
    with pytest.raises(ValueError, match="bitmask of shape"):
        model.mask_logits(logits, np.zeros((1, 3), np.int32))
    with pytest.raises(ValueError, match="out of range"):
        model.bias_logits(logits, np.array([0]), np.array([model.vocab]), np.array([1.0]))
    with pytest.raises(ValueError, match="out of range"):
        model.logprobs(logits, np.array([-1]))
    fns = model.fns
    try:
        model.fns = dataclasses.replace(fns, apply_bitmask=None, apply_logit_bias=None, logprobs=None)
        assert not model.has_logit_functions
        for call, param in [(lambda: model.mask_logits(logits, np.zeros((1, 10), np.int32)), "response_format"),
                            (lambda: model.bias_logits(logits, [0], [1], [1.0]), "logit_bias"),
                            (lambda: model.logprobs(logits, np.array([1])), "logprobs")]:
            with pytest.raises(RequestError, match="recompile") as e:
                call()
            assert e.value.param == param
    finally:
        model.fns = fns
    with pytest.raises(RequestError, match="tensor parallelism") as e:
        TensorParallelModel._logit_function(None, "logprobs", "logprobs")
    assert e.value.param == "logprobs"


def test_webgpu_library_carries_the_logit_kernels(hf_models):
    """The tiny model's WebGPU module (TVM's compile only: linking the .wasm needs emscripten) has the three
    functions, and its WGSL spells -inf as a bit pattern (WGSL has no infinity literal)."""
    from mlcc.compiler.build import export_module
    from mlcc.compiler.pipeline import build_pipeline
    from mlcc.compiler.quantize import get_quantization
    from mlcc.compiler.weights import load_source
    from mlcc.schedules.cuda_pdl import tir_pipeline_for
    from mlcc.targets import get_target
    from mlcc.tvm_compat import pass_config

    built = export_module(load_source(hf_models("llama")), get_target("webgpu"), get_quantization("q4f32_1"))
    with tvm.transform.PassContext(config=pass_config(built.target, built.cfg.rope_scaling)):
        ex = tvm.compile(built.mod, built.target, relax_pipeline=build_pipeline(built.target, None, built.options),
                         tir_pipeline=tir_pipeline_for(built.target, built.options))

    def walk(m):
        yield m
        for i in m.imports:
            yield from walk(i)

    (wgsl,) = [m.inspect_source() for m in walk(ex.mod) if m.kind == "webgpu"]
    for kernel in ("apply_bitmask_tir_kernel", "logit_bias_scatter_kernel", "topk_chunk_next_kernel",
                   "logprobs_finish_kernel"):
        assert f"fn {kernel}(" in wgsl
    assert "inff" not in wgsl and "bitcast<f32>(4286578688u)" in wgsl
    assert {"apply_bitmask", "apply_logit_bias", "logprobs"} <= {gv.name_hint for gv in built.mod.get_global_vars()}
