"""The one description of each quantization scheme (mlcc.quantization): the quantizer tags every quantized
projection with its scheme, and the kernels take the layout from that scheme rather than assuming one."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from mlcc.errors import UnknownQuantizationError
from mlcc.quantization import QUANTIZATIONS, TAG, Quantization, get_quantization, weight_scheme


def test_each_scheme_describes_its_layout():
    for name, q in QUANTIZATIONS.items():
        assert q.name == name
        if q.kind == "group":
            assert q.scale_dtype == q.model_dtype
            assert q.per_word * q.bits == q.storage_bits and q.group_size % q.per_word == 0
            assert weight_scheme(name) is q
        elif q.kind == "float8":
            assert (q.per_word, q.storage_bits, q.scale_dtype) == (1, 8, "float32")
            assert q.scale_shape(96, 64) == (96,) and q.weight_shape(96, 64) == (96, 64)
            assert weight_scheme(name) is q
        else:
            assert weight_scheme(name) is None
    q4 = get_quantization("q4f16_1")
    assert (q4.bits, q4.group_size, q4.storage_dtype, q4.symmetric, q4.per_word, q4.max_int) == \
        (4, 32, "uint32", True, 8, 7)
    for name, dtype in (("q8f16_1", "float16"), ("q8f32_1", "float32")):
        q8 = get_quantization(name)   # int8 codes + 128, four a word, one scale per 32 codes, like Q8_0
        assert (q8.kind, q8.bits, q8.group_size, q8.storage_dtype, q8.symmetric, q8.per_word, q8.zero_code,
                q8.max_int, q8.scale_dtype) == ("group", 8, 32, "uint32", True, 4, 128, 127, dtype)
        assert q8.weight_shape(96, 64) == (96, 16) and q8.scale_shape(96, 64) == (96, 2)
        assert q8.quantize_embedding and q8.quantize_lm_head   # as q4f16_1
    e4m3 = get_quantization("e4m3_e4m3_f16")
    assert (e4m3.kind, e4m3.storage_dtype, e4m3.model_dtype, e4m3.activations, e4m3.float_max) == \
        ("float8", "float8_e4m3fn", "float16", "float8_e4m3fn", 448.0)
    assert not e4m3.quantize_embedding and not e4m3.quantize_lm_head
    assert weight_scheme("float16") is None
    with pytest.raises(UnknownQuantizationError, match="unknown quantization 'q3f7'; choose one of: q0f32"):
        get_quantization("q3f7")


def test_the_description_and_packers_import_without_tvm():
    code = "import sys, mlcc.quantization, mlcc.compiler.quant_schemes; assert 'tvm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def _quantized_kernels(kind: str, target: str, quant: str, hf_models) -> dict:
    """The model's PrimFuncs after TVM's fusion (the form the kernel passes see): name -> (func, dequantize block)."""
    import tvm
    from tvm import s_tir

    from mlcc.compiler.build import export_module
    from mlcc.compiler.pipeline import fusion_passes
    from mlcc.compiler.weights import load_source
    from mlcc.targets import get_target

    built = export_module(load_source(hf_models(kind)), get_target(target), get_quantization(quant))
    with built.target:
        mod = tvm.transform.Sequential(fusion_passes(built.target))(built.mod)
    found = {}
    for gv, f in mod.functions.items():
        if not isinstance(f, tvm.tirx.PrimFunc):
            continue
        try:
            sch = s_tir.Schedule(f)
            blocks = {sch.get(b).name_hint: sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))}
        except Exception:  # noqa: BLE001 - written already scheduled (the MoE kernels)
            blocks = {}
        found[gv.name_hint] = (f, blocks.get("dequantize"))
    return found


@pytest.mark.parametrize("kind,target,quant", [("llama", "cuda", "q4f16_1"), ("llama", "llvm", "q4f32_1"),
                                               ("mixtral", "cuda", "q4f16_1")])
def test_every_quantized_projection_carries_its_scheme(kind, target, quant, hf_models):
    from mlcc.schedules.gemv_match import tagged_scheme

    funcs = _quantized_kernels(kind, target, quant, hf_models)
    dense = {n: (f, b) for n, (f, b) in funcs.items() if b is not None}
    assert len(dense) >= 5, sorted(funcs)
    for name, (f, block) in dense.items():  # fused or not, the dequantize block keeps the tag
        assert str(block.annotations[TAG]) == quant, name
        assert tagged_scheme(f, block) is get_quantization(quant)
    experts = [f for n, (f, _) in funcs.items() if n.startswith(("moe_expert_gemv", "moe_grouped_gemm"))]
    assert len(experts) == (4 if kind == "mixtral" else 0), sorted(funcs)  # gate_up and down, decode and prefill
    for f in experts:
        assert str(f.attrs[TAG]) == quant


def _tagged_projection(n: int, k: int, q: Quantization, tokens: int | None = None):
    """A projection shaped as the quantizer writes it, in scheme `q`, over `tokens` (None: a symbolic count)."""
    from tvm import te, tirx

    m = tirx.Var("seq_len", "int64") if tokens is None else tokens
    x = te.placeholder((1, m, k), q.model_dtype, "x")
    w = te.placeholder((n, k // q.per_word), q.storage_dtype, "w")
    s = te.placeholder((n, k // q.group_size), q.scale_dtype, "s")
    r = te.reduce_axis((0, k), "k")

    def code(i, j):
        return (w[i, j // q.per_word] >> tirx.Cast(q.storage_dtype, j % q.per_word * q.bits)) & \
            tirx.const(q.code_mask, q.storage_dtype)

    deq = te.compute((n, k), lambda i, j: (code(i, j).astype(q.scale_dtype) - tirx.const(q.max_int, q.scale_dtype))
                     * s[i, j // q.group_size], name="dequantize", attrs={TAG: q.name})
    mm = te.compute((1, m, n), lambda a, b, c: te.sum(x[a, b, r] * deq[c, r], axis=r), name="matmul")
    return te.create_prim_func([x, w, s, mm])


def test_a_new_scheme_reaches_the_kernels_through_the_description(monkeypatch):
    """A scheme added to the table alone (groups of 64 here) is matched, and the CPU GEMM sizes its scales and
    unpacks its codes from it; the CUDA GEMV, which decodes only 32-code groups, leaves it alone."""
    import tvm

    from mlcc.compiler.quant_schemes import group_dequantize, group_quantize
    from mlcc.schedules.cpu_gemm import gemm_for, match_gemm
    from mlcc.schedules.cuda_source import decodes_q4
    from mlcc.schedules.gemv_match import GemvShape, match_gemv, match_many_token_projection

    q = dataclasses.replace(get_quantization("q4f32_1"), name="q4f32_g64", group_size=64)
    monkeypatch.setitem(QUANTIZATIONS, q.name, q)
    n, k, m = 64, 256, 5
    func = _tagged_projection(n, k, q)
    shape = match_gemm(func)
    assert shape is not None and (shape.n, shape.k, shape.weights) == (n, k, q.name)
    gemm = gemm_for(func)
    assert match_many_token_projection(func, "float16") is None  # (float32 scales: not a float16 projection)

    f16 = dataclasses.replace(q, name="q4f16_g64", model_dtype="float16")
    monkeypatch.setitem(QUANTIZATIONS, f16.name, f16)
    assert not decodes_q4(f16) and decodes_q4(get_quantization("q4f16_1"))
    assert match_gemv(_tagged_projection(n, k, f16, tokens=1)) is None
    assert match_gemv(_tagged_projection(n, k, get_quantization("q4f16_1"), tokens=1)) == \
        GemvShape(n, k, "none", weights="q4f16_1")

    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype("float32")
    packed, scale = group_quantize(w, q)
    assert scale.shape == (n, k // 64)
    x = rng.standard_normal((1, m, k)).astype("float32")
    lib = tvm.compile(tvm.IRModule({"main": gemm.with_attr("global_symbol", "main")}), "llvm")
    dev = tvm.cpu()
    y = tvm.runtime.tensor(np.zeros((1, m, n), "float32"), dev)
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in (x, packed, scale)], y)
    ref = x.astype("float64") @ group_dequantize(packed, scale, q).T.astype("float64")
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_float8_codes_decode_exactly_in_tir():
    """Every e4m3 code (zero and the subnormals included, which TVM's own float8 cast gets wrong on LLVM) through
    the quantizer's TIR decode, against ml_dtypes."""
    import ml_dtypes
    import tvm
    from tvm import te

    from mlcc.compiler.quantize import float8_value

    q = get_quantization("e4m3_e4m3_f16")
    codes = te.placeholder((256,), q.storage_dtype, "codes")
    out = te.compute((256,), lambda i: float8_value(codes[i], q), name="decode")
    lib = tvm.compile(te.create_prim_func([codes, out]), target="llvm")
    every = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    got = tvm.runtime.empty((256,), "float32", tvm.cpu())
    lib(tvm.runtime.tensor(every, tvm.cpu()), got)
    want = every.astype(np.float32)
    finite = ~np.isnan(want)  # (0x7f / 0xff: NaN, which the converter never writes)
    np.testing.assert_array_equal(got.numpy()[finite], want[finite])


@pytest.mark.parametrize("quant,why", [("e4m3_e4m3_f16", "no float8"), ("q8f32_1", "no q8f32_1 form")])
def test_float8_and_int8_refuse_expert_weights_in_one_line(quant, why, hf_models):
    from mlcc.compiler.build import export_module
    from mlcc.compiler.weights import load_source
    from mlcc.errors import UnsupportedQuantizationError
    from mlcc.targets import get_target

    with pytest.raises(UnsupportedQuantizationError, match=f"{quant}: mixture-of-experts weights have {why}"):
        export_module(load_source(hf_models("mixtral")), get_target("llvm"), get_quantization(quant))


@pytest.mark.parametrize("name", ["q8f16_1", "q8f32_1"])
def test_int8_codes_are_bytes_of_the_words_offset_by_128(name):
    """Code j of a row is byte j of its words (little-endian uint32), the int8 value + 128; the row's largest
    magnitude in a group becomes ±127, and dequantizing is within half a step of the weight."""
    from mlcc.compiler.quant_schemes import group_dequantize, group_quantize, unpack_codes

    q = get_quantization(name)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 96)).astype(np.float32)
    w[0, :32] = 0   # an all-zero group: scale 0, every code 128
    packed, scale = group_quantize(w, q)
    assert packed.dtype == np.uint32 and packed.shape == (6, 24) and scale.shape == (6, 3)
    assert scale.dtype == np.dtype(q.scale_dtype)
    codes = packed.view(np.uint8).reshape(6, 96)   # the bytes in memory order, one code each
    np.testing.assert_array_equal(codes, unpack_codes(packed, q))
    assert (codes[0, :32] == 128).all() and scale[0, 0] == 0
    values = codes.astype(np.int32) - 128
    assert values.min() >= -127 and values.max() <= 127
    assert (np.abs(values[1:].reshape(5, 3, 32)).max(axis=-1) == 127).all()
    step = np.repeat(scale.astype(np.float32), 32, axis=1)
    deq = group_dequantize(packed, scale, q)
    np.testing.assert_array_equal(deq, values.astype(np.float32) * step)
    # within half a step, plus float16 rounding of the scale (the quantizer rounds against the stored scale)
    assert (np.abs(deq - w) <= 0.5 * step + 1e-6).all()


@pytest.mark.parametrize("name", ["q8f16_1", "q8f32_1"])
def test_gguf_q8_0_blocks_requantize_to_the_same_codes_and_scales(name):
    """A Q8_0 block (an fp16 scale d, 32 int8 codes, what llama.cpp writes: d = absmax / 127) dequantized and
    quantized again gives back d and the codes: q8*_1's groups are Q8_0's blocks."""
    from mlcc.compiler.quant_schemes import group_quantize

    q = get_quantization(name)
    rng = np.random.default_rng(1)
    codes = rng.integers(-127, 128, (8, 64)).astype(np.int8)
    codes[:, ::32] = 127 * rng.choice([-1, 1], (8, 2))   # llama.cpp's rounding puts ±127 in every block
    d = (rng.random((8, 2)) * 0.01 + 1e-3).astype(np.float16)
    w = codes.astype(np.float32) * np.repeat(d.astype(np.float32), 32, axis=1)   # what the GGUF reader gives
    packed, scale = group_quantize(w, q)
    np.testing.assert_array_equal(packed.view(np.uint8).reshape(8, 64).astype(np.int32) - 128, codes)
    np.testing.assert_allclose(scale.astype(np.float32), d.astype(np.float32), rtol=2e-7)


@pytest.mark.parametrize("name", ["q8f16_1", "q8f32_1"])
@pytest.mark.parametrize("magic", [True, False])
def test_every_int8_code_decodes_exactly_in_tir(name, magic):
    """The quantizer's TIR decode of all 256 byte values in every position of a word, with the magic-number
    int-to-float (CPU, CUDA) and the plain convert (WebGPU), against numpy."""
    import tvm
    from tvm import te

    from mlcc.compiler.quant_schemes import group_dequantize
    from mlcc.compiler.quantize import dequant_value

    q = dataclasses.replace(get_quantization(name), magic_int_to_float=magic)
    # every byte value, at another position of its word in each row
    words = np.stack([np.roll(np.arange(256, dtype=np.uint8), 63 * i) for i in range(4)]).view(np.uint32)
    scale = np.array([[0.5] * 8] * 4, dtype=q.scale_dtype)   # [4 rows, 256 codes / 32]
    qw = te.placeholder(words.shape, q.storage_dtype, "qw")
    qs = te.placeholder(scale.shape, q.scale_dtype, "qs")
    out = te.compute((4, 256), lambda i, j: dequant_value(qw, qs, i, j, q), name="decode")
    lib = tvm.compile(te.create_prim_func([qw, qs, out]), target="llvm")
    got = tvm.runtime.empty((4, 256), q.model_dtype, tvm.cpu())
    lib(tvm.runtime.tensor(words, tvm.cpu()), tvm.runtime.tensor(scale, tvm.cpu()), got)
    np.testing.assert_array_equal(got.numpy().astype(np.float32), group_dequantize(words, scale, q))
