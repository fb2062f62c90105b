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


# -- the tiled prefill kernels at the edges of their tiles (16 query rows, 32-key blocks, 3-vector row tiles) ----

def _host_target():
    from mlcc.targets import get_target

    return get_target("llvm").tvm_target()  # what models are built with: AVX-512 here where the CPU has it


def _reference(q, k, v, visible, scale, softcap=0.0):
    """out [n, h_q, d] and log2-domain lse [n, h_q] of q against k/v [kv_len, h_kv, d] where visible(i, j);
    a row that sees no key keeps TVM's empty state (output 0, lse -5e4)."""
    n, h_q, d = q.shape
    group = h_q // k.shape[1]
    out, lse = np.zeros((n, h_q, d), "float64"), np.full((n, h_q), -5e4)
    for i in range(n):
        cols = [j for j in range(k.shape[0]) if visible(i, j)]
        if not cols:
            continue
        for h in range(h_q):
            s = k[cols, h // group].astype("float64") @ q[i, h] * scale
            if softcap:
                s = np.tanh(s / softcap) * softcap
            p = np.exp(s - s.max())
            out[i, h] = p @ v[cols, h // group] / p.sum()
            lse[i, h] = (np.log(p.sum()) + s.max()) / np.log(2)
    return out, lse


def _check(out, lse, ref_out, ref_lse):
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("h_kv,h_q,d,causal,softcap", [(3, 9, 64, 1, 0.0), (2, 14, 64, 1, 0.0), (1, 1, 8, 0, 0.0),
                                                       (2, 4, 32, 1, 3.0)])
def test_tiled_ragged_two_sequences(h_kv, h_q, d, causal, softcap):
    lens = [37, 5]  # 37: two query blocks and two key blocks, neither full; 5: one partial block of each
    rng = np.random.default_rng(3)
    n, scale = sum(lens), d**-0.5
    q, k, v = (rng.standard_normal((n, h, d)).astype("float32") for h in (h_q, h_kv, h_kv))
    out, lse = _t(np.zeros((n, h_q, d), "float32")), _t(np.zeros((n, h_q), "float32"))
    f = tvm.compile(ragged_prefill(h_kv, h_q, d, d, "float32", softcap), target=_host_target())
    indptr = _t(np.array([0, lens[0], n], "int32"))
    f(_t(q), indptr, _t(k), _t(v), indptr, _t(np.zeros(n, "int32")), _t(np.zeros(2, "int32")), out, lse,
      causal, 0, 1.0, 1e4, scale)
    refs = [_reference(q[a:b], k[a:b], v[a:b], lambda i, j: not causal or j <= i, scale, softcap)
            for a, b in ((0, lens[0]), (lens[0], n))]
    _check(out, lse, np.concatenate([r[0] for r in refs]), np.concatenate([r[1] for r in refs]))


def _paged(rng, kv, h_kv, d, sink_pages=1):
    """kv [2, kv_len, h_kv, d] scattered over shuffled pages (unused slots NaN) -> pages, page table."""
    kv_len = kv.shape[1]
    n_pages = (kv_len + PAGE - 1) // PAGE
    table = rng.permutation(n_pages + sink_pages).astype("int32")[:n_pages]
    pages = np.full((n_pages + sink_pages, 2, h_kv, PAGE, d), np.nan, "float32")
    for p in range(n_pages):
        chunk = kv[:, p * PAGE:(p + 1) * PAGE]
        pages[table[p], :, :, : chunk.shape[1]] = chunk.transpose(0, 2, 1, 3)
    return pages, table


@pytest.mark.parametrize("causal", [0, 1])
def test_tiled_paged_chunk_after_a_prefix(causal):
    # a prompt's later chunk: 19 new rows against 45 cached keys (3 pages, the last partly filled, shuffled);
    # causal: row i sees keys up to kv_len - qo_len + i (TVM's mask), else all of them
    h_kv, h_q, d, kv_len, n = 3, 9, 64, 45, 19
    rng = np.random.default_rng(4)
    kv = rng.standard_normal((2, kv_len, h_kv, d)).astype("float32")
    pages, table = _paged(rng, kv, h_kv, d)
    q = rng.standard_normal((n, h_q, d)).astype("float32")
    out, lse = _t(np.zeros((n, h_q, d), "float32")), _t(np.zeros((n, h_q), "float32"))
    f = tvm.compile(paged_prefill(h_kv, h_q, d, "float32", False), target=_host_target())
    last = kv_len - (len(table) - 1) * PAGE
    f(_t(q), _t(np.array([0, n], "int32")), _t(pages), _t(np.array([0, len(table)], "int32")), _t(table),
      _t(np.array([last], "int32")), _t(np.zeros(1, "int32")), _t(np.zeros(n, "int32")), out, lse,
      causal, 0, 1.0, 1e4, d**-0.5)
    ref = _reference(q, kv[0], kv[1], lambda i, j: not causal or j < kv_len - n + i + 1, d**-0.5)
    _check(out, lse, *ref)


def test_tiled_paged_sliding_window_with_offset_and_empty_sequence():
    # sequence 0: the window's pages start 5 slots into the first page (length_info offset), 40 keys in view,
    # 20 new rows with a window of 24: row i sees the last 24 - i - 1 cached keys. Sequence 1 has no pages yet.
    h_kv, h_q, d, window, offset, kv_len, n = 2, 14, 64, 24, 5, 40, 20
    rng = np.random.default_rng(5)
    kv = rng.standard_normal((2, offset + kv_len, h_kv, d)).astype("float32")
    kv[:, :offset] = np.nan  # slid out of the window: never read
    pages, table = _paged(rng, kv, h_kv, d)
    q = rng.standard_normal((n + 3, h_q, d)).astype("float32")
    out, lse = _t(np.zeros((n + 3, h_q, d), "float32")), _t(np.zeros((n + 3, h_q), "float32"))
    f = tvm.compile(paged_prefill(h_kv, h_q, d, "float32", True, window), target=_host_target())
    last = offset + kv_len - (len(table) - 1) * PAGE
    length_info = np.array([[last, 0], [offset, 0], [0, 0]], "int32")
    f(_t(q), _t(np.array([0, n, n + 3], "int32")), _t(pages), _t(np.array([0, len(table), len(table)], "int32")),
      _t(table), _t(length_info), _t(np.zeros(2, "int32")), _t(np.zeros(n + 3, "int32")), out, lse,
      1, 0, 1.0, 1e4, d**-0.5)
    ref_out, ref_lse = _reference(q[:n], kv[0, offset:], kv[1, offset:],
                                  lambda i, j: j >= kv_len - max(window - i - 1, 0), d**-0.5)
    ref_out = np.concatenate([ref_out, np.zeros((3, h_q, d))])
    ref_lse = np.concatenate([ref_lse, np.full((3, h_q), -5e4)])
    _check(out, lse, ref_out, ref_lse)
