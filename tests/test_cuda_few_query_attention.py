"""The paged prefill for few query rows (schedules/cuda_few_query_attention.py): what the pass puts in place of TVM's
kernel, that the host dispatcher calls the right function of its own library (on the CPU, through llvm), and the
kernel's numerics against numpy, causal or not, ragged batches, through the dispatcher (marked gpu)."""

import math

import numpy as np
import pytest
import tvm

from mlcc.compiler.build import export_module
from mlcc.compiler.quantize import get_quantization
from mlcc.compiler.weights import load_source
from mlcc.schedules import cuda_few_query_attention as fqa
from mlcc.targets import get_target

PAGE = 16


def _prim_funcs(mod):
    return {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}


def test_paged_prefill_becomes_a_dispatch_over_both_kernels(hf_models):
    built = export_module(load_source(hf_models("llama")), get_target("cuda"), get_quantization("q4f16_1"))
    before = _prim_funcs(built.mod)
    after = _prim_funcs(fqa.few_query_prefill_pass()(built.mod))
    disp = after["batch_prefill_paged_kv"]
    assert disp.attrs["global_symbol"] == "batch_prefill_paged_kv"
    assert "thread_binding" not in disp.script()  # a host function
    assert "batch_prefill_paged_kv_few" in disp.script() and "batch_prefill_paged_kv_tiled" in disp.script()
    assert "part_md" in after["batch_prefill_paged_kv_few"].script()
    tvm.ir.assert_structural_equal(after["batch_prefill_paged_kv_tiled"].without_attr("global_symbol"),
                                   before["batch_prefill_paged_kv"].without_attr("global_symbol"))
    # the sliding-window kernel and the ragged one are left alone
    for name in ("batch_prefill_paged_kv_sliding_window", "batch_prefill_ragged_kv"):
        tvm.ir.assert_structural_equal(after[name], before[name])


def _marker(value: float, h_kv: int, h_qo: int, d: int):
    """A CPU function with the paged prefill's signature that fills lse with `value`."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def func(var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
             var_page_values: T.handle, var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
             var_q_rope_position: T.handle, var_output: T.handle, var_lse: T.handle, causal: T.int32,
             rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32):
        total_len = T.int32()
        lse = T.match_buffer(var_lse, (total_len, h_qo), "float32")
        for i, h in T.grid(total_len, h_qo):
            with T.sblock("fill"):
                vi, vh = T.axis.remap("SS", [i, h])
                lse[vi, vh] = T.float32(value) + T.Cast("float32", causal)

    return func


@pytest.mark.parametrize("rows,expect", [(1, 1.0), (fqa.FEW_QUERY_ROWS, 1.0), (fqa.FEW_QUERY_ROWS + 1, 2.0)])
def test_dispatch_calls_the_few_rows_function_up_to_the_limit(rows, expect):
    from mlcc.schedules.host_dispatch import host_dispatch

    h_kv, h_qo, d = 1, 2, 16
    sig = fqa.make_few_query_paged_prefill(h_kv, h_qo, d, "float32", PAGE)  # (TVM's kernel's parameters)
    disp = host_dispatch(sig, sig.params[0].shape[0], fqa.FEW_QUERY_ROWS, "few_rows", "many_rows")
    mod = tvm.IRModule({"main": disp.with_attr("global_symbol", "main"),
                        "few_rows": _marker(1.0, h_kv, h_qo, d).with_attr("global_symbol", "few_rows"),
                        "many_rows": _marker(2.0, h_kv, h_qo, d).with_attr("global_symbol", "many_rows")})
    lib = tvm.compile(mod, "llvm")
    dev = tvm.cpu()
    i32 = np.int32
    args = [np.zeros((rows, h_qo, d), np.float32), np.array([0, rows], i32),
            np.zeros((1, 2, h_kv, PAGE, d), np.float32), np.array([0, 1], i32), np.zeros(1, i32), np.ones(1, i32),
            np.zeros(1, i32), np.zeros(rows, i32),
            np.zeros((rows, h_qo, d), np.float32), np.zeros((rows, h_qo), np.float32)]
    args = [tvm.runtime.tensor(a, dev) for a in args]
    lib["main"](*args, 1, 0, 1.0, 10000.0, 1.0)  # (causal 1: passed through to the callee)
    np.testing.assert_array_equal(args[-1].numpy(), np.full((rows, h_qo), expect + 1.0, np.float32))


# --- numerics on the GPU (bench/gpu.sh runs these on the H200) ------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("h_kv,h_qo,d", [(8, 32, 128), (2, 14, 64)])
@pytest.mark.parametrize("qo_lens,kv_lens", [([5], [1029]), ([1, 6, 3], [17, 300, 2]), ([40], [700])])
@pytest.mark.parametrize("causal", [0, 1])
def test_paged_prefill_matches_numpy_on_the_gpu(h_kv, h_qo, d, qo_lens, kv_lens, causal):
    """Cross attention of each sequence's new rows to its paged KV (what the KV cache asks of the paged prefill):
    up to FEW_QUERY_ROWS rows through the split-KV kernel, more ([40]) through TVM's, one dispatcher."""
    from mlcc import tvm_compat

    tvm_compat.load_backend_runtimes("cuda")
    if not tvm.cuda(0).exist:
        pytest.skip("no CUDA device (the gpu marker)")
    dev = tvm.cuda(0)
    target = get_target("cuda").tvm_target()
    rng = np.random.default_rng(1)
    n_pages = [-(-n // PAGE) for n in kv_lens]
    pages = (rng.standard_normal((sum(n_pages) + 3, 2, h_kv, PAGE, d)) * 0.5).astype(np.float16)
    values = rng.permutation(sum(n_pages) + 3)[:sum(n_pages)].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    last = np.array([n - (p - 1) * PAGE for n, p in zip(kv_lens, n_pages)], np.int32)
    q_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    rows = int(q_indptr[-1])
    q = rng.standard_normal((rows, h_qo, d)).astype(np.float16)

    from tvm.relax.frontend.nn.llm import _prefill_kernels as pk

    tiled = pk._attention_prefill(h_kv, h_qo, d, "float16", False, {}, target)
    mod = tvm.IRModule({"batch_prefill_paged_kv": tiled})
    with target:
        mod = fqa.few_query_prefill_pass()(mod)
    lib = tvm.compile(mod, target)
    zeros_b, zeros_r = np.zeros(len(kv_lens), np.int32), np.zeros(rows, np.int32)
    args = [tvm.runtime.tensor(x, dev) for x in (q, q_indptr, pages, indptr, values, last, zeros_b, zeros_r,
                                                  np.zeros_like(q), np.zeros((rows, h_qo), np.float32))]
    sm = 1 / math.sqrt(d)
    lib["batch_prefill_paged_kv"](*args, causal, 0, 1.0, 10000.0, sm)
    out, lse = args[8].numpy().astype(np.float32), args[9].numpy()
    group = h_qo // h_kv
    for b, n in enumerate(kv_lens):
        pg = values[indptr[b]:indptr[b + 1]]
        k = pages[pg, 0].transpose(1, 0, 2, 3).reshape(h_kv, -1, d)[:, :n].astype(np.float32)
        v = pages[pg, 1].transpose(1, 0, 2, 3).reshape(h_kv, -1, d)[:, :n].astype(np.float32)
        qo = qo_lens[b]
        for i in range(qo):
            r = q_indptr[b] + i
            visible = n - (qo - 1 - i) if causal else n
            for h in range(h_qo):
                if visible <= 0:
                    np.testing.assert_allclose(out[r, h], 0, atol=1e-3)
                    continue
                s = k[h // group, :visible] @ q[r, h].astype(np.float32) * sm
                p = np.exp(s - s.max())
                np.testing.assert_allclose(out[r, h], p @ v[h // group, :visible] / p.sum(), atol=2e-2)
                assert abs(lse[r, h] - (s.max() + np.log(p.sum())) * math.log2(math.e)) < 1e-2
