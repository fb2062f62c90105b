"""The CPU batch-1 GEMV for 8-bit codes (schedules/cpu_gemv.py): which fused functions it replaces, its numerics
against numpy for every epilogue, and that it reads the codes as bytes (vector loads, no per-lane word gather)."""

import numpy as np
import pytest
import tvm
from tvm import te

from mlcc.compiler.quant_schemes import dequantize_weight, quantize_weight
from mlcc.compiler.quantize import dequant_value, get_quantization
from mlcc.quantization import TAG
from mlcc.schedules.cpu_gemv import Int8GemvShape, int8_gemv_for, int8_gemv_pass, match_int8_gemv
from mlcc.targets import get_target


def _projection(n: int, k: int, quant: str, epilogue: str = "none"):
    """A batch-1 projection shaped as TVM fuses the quantizer's output, with its epilogue."""
    q = get_quantization(quant)
    d = q.model_dtype
    x = te.placeholder((1, 1, k), d, "x")
    qw = te.placeholder(q.weight_shape(n, k), q.storage_dtype, "qw")
    qs = te.placeholder(q.scale_shape(n, k), q.scale_dtype, "qs")
    deq = te.compute((n, k), lambda i, j: dequant_value(qw, qs, i, j, q), name="dequantize", attrs={TAG: quant})
    r = te.reduce_axis((0, k), "k")
    mm = te.compute((1, 1, n), lambda a, b, c: te.sum(x[a, b, r] * deq[c, r], axis=r), name="matmul")
    if epilogue == "none":
        return te.create_prim_func([x, qw, qs, mm])
    if epilogue == "cast":
        out = te.compute((1, 1, n), lambda a, b, c: mm[a, b, c].astype("float32"), name="compute")
        return te.create_prim_func([x, qw, qs, out])
    res = te.placeholder((n,) if epilogue == "bias" else (1, 1, n), d, "res")
    out = te.compute((1, 1, n), lambda a, b, c: mm[a, b, c] + (res[c] if epilogue == "bias" else res[a, b, c]),
                     name="T_add")
    return te.create_prim_func([x, qw, qs, res, out])


@pytest.mark.parametrize("quant,epilogue", [("q8f32_1", "none"), ("q8f32_1", "add"), ("q8f32_1", "bias"),
                                            ("q8f16_1", "none"), ("q8f16_1", "add"), ("q8f16_1", "cast")])
def test_int8_gemv_matches_numpy(quant, epilogue):
    q = get_quantization(quant)
    n, k = 96, 320
    func = _projection(n, k, quant, epilogue)
    assert match_int8_gemv(func) == Int8GemvShape(n, k, quant, epilogue)
    kernel = int8_gemv_for(func)
    lib = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), get_target("llvm").tvm_target())
    asm = lib.mod.inspect_source("asm")
    assert "vpmovzxbd" in asm or "pmovzxbd" in asm or "vpmovzxbw" in asm   # the codes as bytes, vector loads
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype(np.float32)
    packed, scale = quantize_weight(w, q)
    x = rng.standard_normal((1, 1, k)).astype(q.model_dtype)
    res = rng.standard_normal((n,) if epilogue == "bias" else (1, 1, n)).astype(q.model_dtype)
    out = np.zeros((1, 1, n), "float32" if epilogue == "cast" or q.model_dtype == "float32" else "float16")
    args = [x, packed, scale] + ([res] if epilogue in ("add", "bias") else []) + [out]
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in args]
    lib["main"](*args)
    want = dequantize_weight(packed, scale, q).astype(np.float64) @ x.reshape(-1).astype(np.float64)
    if epilogue in ("add", "bias"):
        want = want + res.reshape(-1)
    tol = 1e-5 if q.model_dtype == "float32" else 2e-3
    np.testing.assert_allclose(args[-1].numpy().reshape(-1), want, rtol=0, atol=tol * np.abs(want).max())


def test_q4_and_many_token_projections_are_left_alone():
    assert match_int8_gemv(_projection(96, 320, "q4f32_1")) is None
    assert int8_gemv_for(_projection(96, 320, "q4f16_1", "add")) is None


def test_every_decode_projection_of_a_q8_build_gets_the_kernel(hf_models):
    from mlcc.compiler.build import export_module
    from mlcc.compiler.pipeline import fusion_passes
    from mlcc.compiler.weights import load_source

    built = export_module(load_source(hf_models("llama")), get_target("llvm"), get_quantization("q8f32_1"))
    with built.target:
        mod = tvm.transform.Sequential(fusion_passes(built.target))(built.mod)
        matched = {gv.name_hint: match_int8_gemv(f) for gv, f in mod.functions.items()
                   if isinstance(f, tvm.tirx.PrimFunc)}
        after = int8_gemv_pass(mod)
    shapes = {(s.n, s.k, s.epilogue) for s in matched.values() if s is not None}
    # tiny llama: qkv, o + residual, gate_up, down + residual, and the LM head (int8 too)
    assert shapes == {(128, 64, "none"), (64, 64, "add"), (256, 64, "none"), (64, 128, "add"), (320, 64, "none")}
    for name, s in matched.items():
        if s is not None:
            assert after[name].attrs["tirx.is_scheduled"]
