"""The few-token q4 GEMV (schedules/cuda_few_token_gemv.py): every many-token q4 projection of a library goes
through a dispatch to it and to the projection as it was (which the tensor-core GEMM pass or dlight still
schedules), the whole source compiles through NVRTC, the dispatch picks by token count (on the CPU, through llvm),
and the kernel's numerics against numpy on the GPU (marked gpu)."""

import re

import numpy as np
import pytest
import tvm
from test_cuda_gemm import WIDE_LLAMA
from test_cuda_nvrtc import _assert_compiles, _cuda_source, nvrtc  # noqa: F401 (the fixture)

from mlcc.compiler.build import compile_library, export_module
from mlcc.compiler.quantize import get_quantization
from mlcc.compiler.weights import ModelSource, load_source
from mlcc.options import CompileOptions
from mlcc.schedules import cuda_few_token_gemv as ftg
from mlcc.targets import get_target


def _modules(lib):
    yield lib
    for m in lib.imports:
        yield from _modules(m)


def _host_symbols(lib) -> set[str]:
    (host,) = [m for m in _modules(lib) if m.kind == "llvm"]
    return set(re.findall(r"define[^@]*@(?:__tvm_ffi_)?(\w+)\(", host.inspect_source("ll")))


def test_wide_model_projections_dispatch_to_the_gemv_and_the_tensor_core_gemm(tmp_path, nvrtc):  # noqa: F811
    source = ModelSource("config", tmp_path, "llama", WIDE_LLAMA, {})
    built = export_module(source, get_target("cuda"), get_quantization("q4f16_1"))
    lib = compile_library(built, tmp_path / "model.so").mod
    src = _cuda_source(lib)
    calls = set(re.findall(r"mlcc_q4_gemv_tokens<(\d+), 8, (\d), (\d)>\(", src))
    # qkv / gate_up / the LM head (K 2048) and down (K 4096); none, + residual and the LM head's float32 cast
    assert {c[0] for c in calls} == {"2048", "4096"} and {c[2] for c in calls} == {"0", "2", "3"}
    assert "mlcc_tc_gemm<" in src  # more tokens: the tensor-core GEMM, as before
    symbols = _host_symbols(lib)
    few = {s for s in symbols if s.endswith("_few_tokens")}
    assert few and {s.replace("_few_tokens", "_many_tokens") for s in few} <= symbols
    assert {s.replace("_few_tokens", "") for s in few} <= symbols  # the dispatch under the projection's own name
    _assert_compiles(nvrtc, src)


def test_narrow_models_dispatch_too_and_the_option_turns_it_off(hf_models, tmp_path):
    src = load_source(hf_models("llama"))
    on = compile_library(export_module(src, get_target("cuda"), get_quantization("q4f16_1")), tmp_path / "a.so")
    assert "mlcc_q4_gemv_tokens<64, 8, 1, " in _cuda_source(on.mod)
    off = compile_library(export_module(src, get_target("cuda"), get_quantization("q4f16_1"),
                                        options=CompileOptions(few_token_gemv=False)), tmp_path / "b.so")
    assert "mlcc_q4_gemv_tokens" not in _cuda_source(off.mod)
    assert not any(s.endswith("_few_tokens") for s in _host_symbols(off.mod))


def test_float16_weights_keep_their_kernels(hf_models, tmp_path):
    built = export_module(load_source(hf_models("llama")), get_target("cuda"), get_quantization("q0f16"))
    assert "mlcc_q4_gemv_tokens" not in _cuda_source(compile_library(built, tmp_path / "model.so").mod)


def _marker(x_shape, n: int, k: int, value: float):
    """A CPU function with a q4 projection's parameters (no epilogue) that fills y with `value`."""
    from tvm.script import tirx as T

    (xs, _), (ws, _), (ss, _), (ys, _) = ftg._signature(x_shape, n, k, "none")

    @T.prim_func(s_tir=True)
    def func(var_x: T.handle, var_w: T.handle, var_s: T.handle, var_y: T.handle):
        T.match_buffer(var_x, xs, "float16")
        T.match_buffer(var_w, ws, "uint32")
        T.match_buffer(var_s, ss, "float16")
        y = T.match_buffer(var_y, ys, "float16")
        for i, j in T.grid(ys[1], n):
            with T.sblock("fill"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[0, vi, vj] = T.float16(value)

    return func


@pytest.mark.parametrize("m,expect", [(1, 1.0), (ftg.FEW_TOKENS, 1.0), (ftg.FEW_TOKENS + 1, 2.0), (64, 2.0)])
def test_dispatch_picks_by_token_count(m, expect):
    from tvm.script import tirx as T

    from mlcc.schedules.host_dispatch import host_dispatch

    n, k = 4, 32
    tokens = tvm.tirx.Var("m", "int64")
    x_shape = (T.int64(1), tokens, T.int64(k))
    many = _marker(x_shape, n, k, 2.0)
    # (as the pass does: the dispatch shares the parameters of the function it stands for, kept beside it)
    disp = host_dispatch(many, tokens, ftg.FEW_TOKENS, "few", "many")
    mod = tvm.IRModule({"main": disp.with_attr("global_symbol", "main"),
                        "few": _marker(x_shape, n, k, 1.0).with_attr("global_symbol", "few"),
                        "many": many.with_attr("global_symbol", "many")})
    lib = tvm.compile(mod, "llvm")
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in (
        np.zeros((1, m, k), np.float16), np.zeros((n, k // 8), np.uint32), np.zeros((n, k // 32), np.float16),
        np.zeros((1, m, n), np.float16))]
    lib["main"](*args)
    np.testing.assert_array_equal(args[-1].numpy(), np.full((1, m, n), expect, np.float16))


def test_launch_fits_the_gpu():
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (2048, 1536), (1536, 8960)]:
        rows = ftg.rows_per_warp(n, k)
        assert ftg.blocks(n, k) * ftg.WARPS * rows >= n
        assert rows == 1 or -(-(k // 32) // 32) <= 4  # a lane's weight loads held in registers


# --- numerics on the GPU (bench/gpu.sh runs these on the H200) ------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 14336), (2048, 1536), (28672, 4096), (8, 64)])
@pytest.mark.parametrize("epilogue", ["none", "bias", "add", "cast"])
def test_few_token_gemv_matches_numpy_on_the_gpu(n, k, epilogue):
    from tvm.script import tirx as T

    from mlcc import tvm_compat
    from mlcc.schedules.cuda_source import add_cuda_helpers

    tvm_compat.load_backend_runtimes("cuda")
    if not tvm.cuda(0).exist:
        pytest.skip("no CUDA device (the gpu marker)")
    dev = tvm.cuda(0)
    x_shape = (T.int64(1), tvm.tirx.Var("m", "int64"), T.int64(k))
    func = ftg.make_few_token_gemv(x_shape, n, k, epilogue).with_attr("global_symbol", "main")
    target = get_target("cuda").tvm_target()
    with target, tvm_compat.cuda_source_postproc(add_cuda_helpers):
        lib = tvm.compile(tvm.IRModule({"main": func}), target)
    rng = np.random.default_rng(0)
    w = rng.integers(0, 1 << 32, size=(n, k // 8), dtype=np.uint32)
    s = (rng.random((n, k // 32)) * 0.02 + 0.001).astype(np.float16)
    codes = ((w[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15).reshape(n, k).astype(np.float32) - 7
    dense = codes * np.repeat(s.astype(np.float32), 32, axis=1)
    for m in (1, 3, 5, 8):
        x = rng.standard_normal((1, m, k)).astype(np.float16)
        want = x[0].astype(np.float32) @ dense.T
        extra = []
        if epilogue == "bias":
            e = rng.standard_normal(n).astype(np.float16)
            want, extra = want + e.astype(np.float32), [e]
        elif epilogue == "add":
            e = rng.standard_normal((1, m, n)).astype(np.float16)
            want, extra = want + e[0].astype(np.float32), [e]
        out = np.zeros((1, m, n), np.float32 if epilogue == "cast" else np.float16)
        args = [tvm.runtime.tensor(a, dev) for a in [x, w, s, *extra, out]]
        lib["main"](*args)
        got = args[-1].numpy()[0].astype(np.float32)
        scale = np.abs(want).max()
        assert np.abs(got - want).max() / scale < 5e-3, (m, np.abs(got - want).max(), scale)
