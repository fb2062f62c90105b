"""mlcc's CPU paged-KV attention kernels against numpy: sliding-window cross attention, soft-capping, and no read
of a KV slot outside the window (those slots hold NaN here)."""

import numpy as np
import pytest
import tvm

from mlcc.schedules.cpu_attention import paged_decode, paged_prefill, ragged_prefill

H_KV, H_Q, D, PAGE = 2, 4, 32, 16
SCALE = D**-0.5


def _t(a):
    return tvm.runtime.tensor(a)


def _attend(q, k, v, softcap):
    s = q @ k.T * SCALE
    if softcap:
        s = np.tanh(s / softcap) * softcap
    p = np.exp(s - s.max())
    return p @ v / p.sum(), (np.log(p.sum()) + s.max()) / np.log(2)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_sliding_cross_attention_reads_only_the_window(softcap):
    window, cached, new = 8, 8, 3
    rng = np.random.default_rng(0)
    pages = np.full((4, 2, H_KV, PAGE, D), np.nan, "float32")
    pages[2, :, :, :cached] = rng.standard_normal((2, H_KV, cached, D))
    q = rng.standard_normal((new, H_Q, D)).astype("float32")
    out, lse = _t(np.zeros((new, H_Q, D), "float32")), _t(np.zeros((new, H_Q), "float32"))
    f = tvm.compile(paged_prefill(H_KV, H_Q, D, "float32", True, window, softcap), target="llvm")
    length_info = np.array([[cached], [0], [0]], "int32")  # last page length, window offset, sink size
    f(_t(q), _t(np.array([0, new], "int32")), _t(pages), _t(np.array([0, 1], "int32")), _t(np.array([2], "int32")),
      _t(length_info), _t(np.zeros(1, "int32")), _t(np.arange(cached, cached + new, dtype="int32")), out, lse,
      1, 0, 1.0, 1e4, SCALE)
    for r in range(new):
        # row r sits at position cached + r; its window (self included) reaches back to cached + r - window + 1,
        # and the self/new part comes from the ragged kernel, so the cache part is [r + 1, cached)
        cols = slice(r + 1, cached)
        for h in range(H_Q):
            ref, ref_lse = _attend(q[r, h], pages[2, 0, h // 2, cols], pages[2, 1, h // 2, cols], softcap)
            np.testing.assert_allclose(out.numpy()[r, h], ref, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(lse.numpy()[r, h], ref_lse, rtol=1e-5)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_ragged_causal_prefill(softcap):
    n = 5
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((n, h, D)).astype("float32") for h in (H_Q, H_KV, H_KV))
    out, lse = _t(np.zeros((n, H_Q, D), "float32")), _t(np.zeros((n, H_Q), "float32"))
    f = tvm.compile(ragged_prefill(H_KV, H_Q, D, D, "float32", softcap), target="llvm")
    indptr = _t(np.array([0, n], "int32"))
    f(_t(q), indptr, _t(k), _t(v), indptr, _t(np.arange(n, dtype="int32")), _t(np.zeros(1, "int32")), out, lse,
      1, 0, 1.0, 1e4, SCALE)
    for r in range(n):
        for h in range(H_Q):
            ref, _ = _attend(q[r, h], k[: r + 1, h // 2], v[: r + 1, h // 2], softcap)
            np.testing.assert_allclose(out.numpy()[r, h], ref, rtol=1e-5, atol=1e-5)


def test_decode_over_two_pages():
    kv_len = 20
    rng = np.random.default_rng(2)
    pages = np.full((3, 2, H_KV, PAGE, D), np.nan, "float32")
    kv = rng.standard_normal((2, H_KV, kv_len, D)).astype("float32")
    pages[1, :, :, :PAGE], pages[0, :, :, : kv_len - PAGE] = kv[:, :, :PAGE], kv[:, :, PAGE:]
    q = rng.standard_normal((1, H_Q, D)).astype("float32")
    out, lse = _t(np.zeros((1, H_Q, D), "float32")), _t(np.zeros((1, H_Q), "float32"))
    f = tvm.compile(paged_decode(H_KV, H_Q, D, "float32", False), target="llvm")
    f(_t(q), _t(pages), _t(np.array([0, 2], "int32")), _t(np.array([1, 0], "int32")),
      _t(np.array([kv_len - PAGE], "int32")), _t(np.zeros(1, "int32")), _t(np.array([kv_len], "int32")), out, lse,
      0, 1.0, 1e4, SCALE)
    for h in range(H_Q):
        ref, _ = _attend(q[0, h], kv[0, h // 2], kv[1, h // 2], 0.0)
        np.testing.assert_allclose(out.numpy()[0, h], ref, rtol=1e-5, atol=1e-5)
