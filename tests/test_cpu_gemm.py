"""The CPU GEMM kernel (schedules/cpu_gemm.py) built for llvm against numpy, on the projection shapes of SmolLM2-135M
and Qwen2.5-0.5B, token counts that are and are not multiples of the register block, and M = 1."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from mlcc.quantization import TAG
from mlcc.schedules.cpu import ApplyCPUMatmulSchedule
from mlcc.schedules.cpu_gemm import GemmTiles, gemm_for, match_gemm


def _projection(n: int, k: int, weights: str, add: bool | str, lead: int) -> tirx.PrimFunc:
    """A PrimFunc shaped like TVM's legalized (dequantize→)matmul[→add] over a symbolic token count."""
    m = tirx.Var("seq_len", "int64")
    shape = (1, m) if lead == 1 else (m, 1)
    x = te.placeholder((*shape, k), "float32", "x")
    r = te.reduce_axis((0, k), "k")
    if weights == "q4f32_1":
        w = te.placeholder((n, k // 8), "uint32", "w")
        s = te.placeholder((n, k // 32), "float32", "s")
        deq = te.compute((n, k), lambda i, j: ((w[i, j // 8] >> tirx.Cast("uint32", j % 8 * 4)) & tirx.const(
            15, "uint32")).astype("float32") * s[i, j // 32] - s[i, j // 32] * 7.0, name="dequantize",
            attrs={TAG: weights})  # (as the quantizer tags it)
        mm = te.compute((*shape, n), lambda a, b, c: te.sum(x[a, b, r] * deq[c, r], axis=r), name="matmul")
        args = [x, w, s]
    else:
        w = te.placeholder((n, k), "float32", "w")
        mm = te.compute((*shape, n), lambda a, b, c: te.sum(x[a, b, r] * w[c, r], axis=r), name="NT_matmul")
        args = [x, w]
    out = mm
    if add == "bias":
        res = te.placeholder((n,), "float32", "bias")
        out = te.compute((*shape, n), lambda a, b, c: mm[a, b, c] + res[c], name="T_add")
        args.append(res)
    elif add:
        res = te.placeholder((*shape, n), "float32", "res")
        out = te.compute((*shape, n), lambda a, b, c: mm[a, b, c] + res[a, b, c], name="T_add")
        args.append(res)
    return te.create_prim_func(args + [out])


def _run(func: tirx.PrimFunc, n: int, k: int, m: int, weights: str, add: bool | str, lead: int) -> None:
    rng = np.random.default_rng(n + k + m)
    shape = (1, m) if lead == 1 else (m, 1)
    x = rng.standard_normal((*shape, k)).astype("float32")
    res = rng.standard_normal((n,) if add == "bias" else (*shape, n)).astype("float32")
    if weights == "q4f32_1":
        qw = rng.integers(0, 2**32, (n, k // 8), dtype=np.uint32)
        qs = (rng.random((n, k // 32)) * 0.1).astype("float32")
        codes = (qw[:, :, None] >> (np.arange(8, dtype=np.uint32) * 4)) & 15
        w = (codes.reshape(n, k).astype("float32") - 7) * np.repeat(qs, 32, axis=1)
        inputs = [x, qw, qs]
    else:
        w = rng.standard_normal((n, k)).astype("float32")
        inputs = [x, w]
    inputs += [res] if add else []
    ref = x.astype("float64") @ w.T.astype("float64") + (res if add else 0)
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), "llvm")
    dev = tvm.cpu()
    y = tvm.runtime.tensor(np.zeros((*shape, n), "float32"), dev)
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in inputs], y)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


CASES = [  # n, k, m, weights, add, lead
    (960, 576, 37, "q4f32_1", False, 1),     # SmolLM2 qkv, M not a multiple of the block
    (3072, 576, 16, "q4f32_1", False, 0),    # SmolLM2 gate_up, batched decode layout
    (576, 1536, 1, "q4f32_1", True, 1),      # SmolLM2 down + residual, one token
    (1152, 896, 13, "q4f32_1", "bias", 1),   # Qwen2.5-0.5B qkv (14x64 + 2x2x64) + its bias
    (896, 4864, 9, "q4f32_1", True, 1),      # Qwen2.5-0.5B down + residual
    (49152, 576, 3, "q4f32_1", False, 0),    # SmolLM2 lm_head, batched decode
    (576, 576, 11, "float32", True, 1),      # float32 weights
    (128, 896, 8, "float32", False, 0),      # Qwen2.5 k/v-sized, exactly one block
    (128, 896, 5, "float32", "bias", 0),     # float32 weights + bias
]


@pytest.mark.parametrize("n,k,m,weights,add,lead", CASES)
def test_gemm_matches_numpy(n, k, m, weights, add, lead):
    func = _projection(n, k, weights, add, lead)
    shape = match_gemm(func)
    assert shape is not None and (shape.n, shape.k, shape.weights) == (n, k, weights)
    assert shape.epilogue == ("bias" if add == "bias" else "add" if add else "none")
    _run(gemm_for(func), n, k, m, weights, add, lead)


def test_other_tiles():
    func = _projection(576, 576, "q4f32_1", True, 1)
    for tiles in (GemmTiles(mr=4, nc=64), GemmTiles(mr=12, nc=16)):
        _run(gemm_for(func, tiles), 576, 576, 29, "q4f32_1", True, 1)


def test_batch_one_keeps_the_gemv_path():
    """Static M = 1 (decode) is not a GEMM: the pass leaves it to the vectorised-reduction rule."""
    m = 1
    x = te.placeholder((1, m, 576), "float32", "x")
    w = te.placeholder((960, 576), "float32", "w")
    r = te.reduce_axis((0, 576), "k")
    mm = te.compute((1, m, 960), lambda a, b, c: te.sum(x[a, b, r] * w[c, r], axis=r), name="NT_matmul")
    func = te.create_prim_func([x, w, mm])
    assert match_gemm(func) is None
    mod = ApplyCPUMatmulSchedule(tvm.IRModule({"main": func}))
    assert "tile" not in mod["main"].script()
