"""cuBLASLt projections (CompileOptions.vendor_gemm): the shim builds with g++ against pip's CUDA packages and
registers its global functions (loading libcublasLt needs no GPU); a CUDA build of the tiny llama calls it for its
float16 projections over many tokens and keeps the old kernels for few tokens; q4f16_1 projections over more tokens
(and q8f16_1 ones over more than 16) decode their weights into a scratch first; e4m3_e4m3_f16 projections quantize their activations per token and take
the FP8 GEMM (sm_90 only); with the option off or the shim unavailable the build is what it was. The shim's numerics
on a GPU are marked gpu."""

import numpy as np
import pytest
import tvm

from mlcc.cache import cache_root
from mlcc.compiler.build import export_module
from mlcc.compiler.pipeline import kernel_passes
from mlcc.compiler.quantize import get_quantization
from mlcc.compiler.vendor_gemm import MIN_TOKENS, WORKSPACE_BYTES
from mlcc.compiler.weights import load_source
from mlcc.native import cublaslt_shim as cublaslt
from mlcc.options import CompileOptions
from mlcc.targets import get_target


def _shim():
    """The shim, built here: the test dependencies bring g++'s inputs (pip's CUDA 13 packages), so a shim that
    does not build is a failure, not a skip."""
    try:
        return cublaslt.load(cache_root())
    except cublaslt.CublasLtUnavailable as e:
        pytest.fail(f"the shim does not build here ({str(e).splitlines()[0]}); pip install -e '.[test]'")


def test_the_shim_builds_and_registers_its_functions():
    import tvm_ffi

    lib = _shim()
    assert lib.exists() and cublaslt.available(cache_root())
    for name in (*cublaslt.MATMUL.values(), *cublaslt.MATMUL_FP8.values(), "mlcc.cublaslt.init",
                 "mlcc.cublaslt.cache_size"):
        assert tvm_ffi.get_global_func(name, allow_missing=True) is not None, name
    assert cublaslt.library_path(cache_root()) == lib   # cached: built once


def _kernels(hf_models, quant: str, options: CompileOptions, target: str = "cuda") -> tvm.IRModule:
    built = export_module(load_source(hf_models("llama")), get_target(target), get_quantization(quant),
                          options=options)
    with built.target:
        return tvm.transform.Sequential(kernel_passes(built.target, options))(built.mod)


def _script_less_stamp(mod: tvm.IRModule) -> str:
    """The module's text without `_metadata` (the ABI stamp, which records the options)."""
    return "\n".join(f.script() for gv, f in sorted(mod.functions.items(), key=lambda kv: kv[0].name_hint)
                     if gv.name_hint != "_metadata")


def _calls(mod: tvm.IRModule, fn: str) -> list:
    found = []
    tvm.relax.analysis.post_order_visit(
        mod[fn], lambda e: found.append(e) if isinstance(e, tvm.relax.Call) and e.op.name == "relax.call_tir" else None)
    return [(c.args[0].name_hint, c.ty_args[0]) for c in found]


def test_float16_projections_over_many_tokens_call_cublaslt(hf_models):
    _shim()
    mod = _kernels(hf_models, "q0f16", CompileOptions())
    names = {gv.name_hint for gv in mod.functions}
    # the tiny llama's four projections a layer (qkv, o + residual, gate_up, down + residual), for every function
    # with a symbolic token count (prefill, batch_prefill, batch_decode, batch_verify ...)
    calls = [(n, t) for n, t in _calls(mod, "prefill") if n.endswith("_cublaslt")]
    assert len(calls) == 8   # 2 layers
    for _, ty in calls:   # (y, the workspace TVM allocates)
        assert isinstance(ty, tvm.relax.TupleType) and [int(d) for d in ty.fields[1].shape] == [WORKSPACE_BYTES]
    for name, _ in calls:
        host = mod[name]
        assert {f"{name[:-len('_cublaslt')]}_kernel"} <= names and name[:-len("_cublaslt")] not in names
        text = host.script()
        assert "mlcc.cublaslt.matmul" in text and f"<= T.int64({MIN_TOKENS})" in text and "call_cpacked" in text
    assert any("mlcc.cublaslt.matmul_add" in mod[n].script() for n, _ in calls)   # the residual epilogue
    # batch-1 decode (a static (1, 1, K)) keeps its GEMV kernels
    assert not [n for n, _ in _calls(mod, "decode") if n.endswith("_cublaslt")]


def test_q4_projections_over_many_tokens_decode_into_a_scratch_then_call_cublaslt(hf_models):
    _shim()
    mod = _kernels(hf_models, "q4f16_1", CompileOptions(vendor_gemm_q4_tokens=64))
    calls = [(n, t) for n, t in _calls(mod, "prefill") if n.endswith("_cublaslt")]
    assert len(calls) == 8
    decoders = {gv.name_hint for gv in mod.functions if gv.name_hint.startswith("mlcc_dequantize_q4f16_1_")}
    assert decoders   # one per weight shape, shared by the layers
    for name, ty in calls:   # (y, workspace, the decoded float16 weights [n, k])
        assert len(ty.fields) == 3 and ty.fields[2].dtype == "float16" and len(ty.fields[2].shape) == 2
        text = mod[name].script()
        assert "<= T.int64(64)" in text and "mlcc.cublaslt.matmul" in text
        assert any(d in text for d in decoders)   # decoded before the packed call
    # off: the q4 tensor-core GEMM at every size, as before
    off = _kernels(hf_models, "q4f16_1", CompileOptions(vendor_gemm_q4_tokens=0))
    assert not [gv for gv in off.functions if "cublaslt" in gv.name_hint or "dequantize_q4" in gv.name_hint]


def test_int8_projections_over_16_tokens_decode_into_a_scratch_then_call_cublaslt(hf_models):
    """q8f16_1 has no GEMM of mlcc's own: over MIN_TOKENS tokens its weights are decoded for cuBLASLt, whatever
    the q4 threshold says."""
    _shim()
    mod = _kernels(hf_models, "q8f16_1", CompileOptions(vendor_gemm_q4_tokens=0))
    calls = [(n, t) for n, t in _calls(mod, "prefill") if n.endswith("_cublaslt")]
    assert len(calls) == 8   # the four projections of both layers
    decoders = {gv.name_hint for gv in mod.functions if gv.name_hint.startswith("mlcc_dequantize_q8f16_1_")}
    assert decoders
    for name, ty in calls:
        assert len(ty.fields) == 3 and ty.fields[2].dtype == "float16"
        text = mod[name].script()
        assert f"<= T.int64({MIN_TOKENS})" in text and any(d in text for d in decoders)


def test_e4m3_projections_over_many_tokens_quantize_their_activations_then_call_the_fp8_gemm(hf_models, monkeypatch):
    from mlcc.compiler import vendor_gemm

    _shim()
    plain = _kernels(hf_models, "e4m3_e4m3_f16", CompileOptions())
    assert not [gv for gv in plain.functions if gv.name_hint.startswith("quantize_swiglu_tokens_")]
    assert len([n for n, _ in _calls(plain, "prefill") if n.endswith("_cublaslt")]) == 8
    monkeypatch.setattr(vendor_gemm, "FUSE_PRODUCERS", True)
    mod = _kernels(hf_models, "e4m3_e4m3_f16", CompileOptions())
    calls = [(n, t) for n, t in _calls(mod, "prefill") if n.endswith("_cublaslt")]
    assert len(calls) == 8   # the LM head stays float16 and over one position: not among them
    quantizers = {gv.name_hint for gv in mod.functions if gv.name_hint.startswith("quantize_tokens_")}
    assert len(quantizers) == 1   # o_proj's (K 64): the others quantize what their producer computes
    fused = {gv.name_hint for gv in mod.functions if gv.name_hint.startswith(("quantize_swiglu_tokens_",
                                                                               "quantize_rms_norm_tokens_"))}
    assert len(fused) == 2   # the norms' (K 64) and SwiGLU's (K 128)
    produced = 0
    for name, ty in calls:   # (y, workspace[, x: the few-token path's], e4m3 activations shaped like x, their scales)
        codes, scales = ty.fields[-2], ty.fields[-1]
        assert codes.dtype == "float8_e4m3fn" and len(codes.shape) == 3 and scales.dtype == "float32"
        text = mod[name].script()
        assert f"<= T.int64({MIN_TOKENS})" in text and "mlcc.cublaslt.matmul_fp8" in text
        if len(ty.fields) == 5:   # the norm or SwiGLU before it computed and quantized in one kernel
            assert ty.fields[2].dtype == "float16" and any(q in text for q in fused)
            produced += 1
        else:
            assert any(q in text for q in quantizers)
    # per layer: qkv after the input norm, gate_up after the post-attention norm, down after SwiGLU; o_proj reads
    # attention's output
    assert produced == 6
    # what prefill still calls of them: the final norm before the (float16) LM head
    assert len([n for n, _ in _calls(mod, "prefill")
                if ("rms_norm" in n or "silu" in n) and not n.endswith("_cublaslt")]) == 1
    assert any("mlcc.cublaslt.matmul_fp8_add" in mod[n].script() for n, _ in calls)
    # sm_80: no FP8 GEMM there; the projections keep their kernels at every size
    sm80 = _kernels(hf_models, "e4m3_e4m3_f16", CompileOptions(), target="cuda-sm80")
    assert not [gv for gv in sm80.functions if "cublaslt" in gv.name_hint or "quantize_tokens" in gv.name_hint]


def test_the_q4_decoding_kernel_matches_numpy():
    """The scratch decoder, built for the CPU from the same TE expression: codes and scales as the quantizer packs
    them decode to the numpy reference's weights exactly."""
    from mlcc.compiler.quant_schemes import group_dequantize, group_quantize
    from mlcc.compiler.vendor_gemm import dequantize_func

    q = get_quantization("q4f16_1")
    n, k = 24, 64
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    packed, scale = group_quantize(w, q)
    func = dequantize_func(n, k, q, threads=None)
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    out = tvm.runtime.empty((n, k), "float16", tvm.cpu())
    lib["main"](tvm.runtime.tensor(packed), tvm.runtime.tensor(scale), out)
    np.testing.assert_array_equal(out.numpy(), group_dequantize(packed, scale, q).astype(np.float16))


def test_option_off_or_shim_unavailable_keeps_the_build(hf_models, monkeypatch):
    options_off = CompileOptions(vendor_gemm=False)
    target = get_target("cuda").tvm_target()
    names = [p.info.name for p in kernel_passes(target, options_off)]
    assert "mlcc_cuda_vendor_gemm" not in names
    off = _script_less_stamp(_kernels(hf_models, "q0f16", options_off))
    monkeypatch.setattr(cublaslt, "available", lambda _cache_dir: False)
    assert "mlcc_cuda_vendor_gemm" not in [p.info.name for p in kernel_passes(target, CompileOptions())]
    unavailable = _script_less_stamp(_kernels(hf_models, "q0f16", CompileOptions()))
    assert "cublaslt" not in off and off == unavailable


def _cuda_present() -> bool:
    return tvm.cuda(0).exist


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_present(), reason="no CUDA device")
@pytest.mark.parametrize("epilogue,dtype", [("none", "float16"), ("bias", "float16"), ("add", "float16"),
                                            ("none", "bfloat16")])
def test_shim_matches_float32(epilogue, dtype):
    import ml_dtypes  # noqa: F401 - numpy's bfloat16
    import tvm_ffi

    _shim()
    dev = tvm.cuda(0)
    cublaslt.prepare_device(0)
    rng = np.random.default_rng(0)
    m, n, k = 300, 512, 1024
    x = rng.standard_normal((1, m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / k ** 0.5).astype(np.float32)
    extra = {"none": None, "bias": rng.standard_normal(n), "add": rng.standard_normal((1, m, n))}[epilogue]
    np_dtype = "bfloat16" if dtype == "bfloat16" else np.float16
    cast = [a.astype(np_dtype) for a in (x, w) + ((extra,) if extra is not None else ())]
    args = [tvm.runtime.tensor(a, dev) for a in cast]
    ws = tvm.runtime.empty((WORKSPACE_BYTES,), "uint8", dev)
    out = tvm.runtime.empty((1, m, n), dtype, dev)
    tvm_ffi.get_global_func(cublaslt.MATMUL[epilogue])(*args[:2], *args[2:], ws, out)
    ref = cast[0].astype(np.float32) @ cast[1].astype(np.float32).T
    if extra is not None:
        ref = ref + cast[2].astype(np.float32)
    got = out.numpy().astype(np.float32)
    assert np.abs(got - ref).max() / np.abs(ref).max() < (2e-2 if dtype == "bfloat16" else 3e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_present(), reason="no CUDA device")
@pytest.mark.parametrize("epilogue", ["none", "bias", "add"])
def test_fp8_gemm_with_per_token_activations_matches_float32(epilogue):
    """The token quantizer and the shim's FP8 GEMM together against float32 on the dequantized weights and the
    float16 activations: within e4m3's rounding of the activations (3 mantissa bits, relative 2^-4 at worst,
    averaging out over K)."""
    import tvm_ffi

    from mlcc.compiler.quant_schemes import dequantize_weight, quantize_weight
    from mlcc.schedules.cuda_token_quantize import quantize_tokens_func

    _shim()
    dev = tvm.cuda(0)
    cublaslt.prepare_device(0)
    q = get_quantization("e4m3_e4m3_f16")
    rng = np.random.default_rng(0)
    m, n, k = 300, 512, 1024
    x = rng.standard_normal((1, m, k)).astype(np.float16)
    x[0, 7] = 0   # an all-zero token
    w, w_scale = quantize_weight((rng.standard_normal((n, k)) / k ** 0.5).astype(np.float32), q)
    extra = {"none": None, "bias": rng.standard_normal(n), "add": rng.standard_normal((1, m, n))}[epilogue]
    target = get_target("cuda").tvm_target()
    quantize = tvm.compile(tvm.IRModule({"main": quantize_tokens_func(k, q).with_attr("global_symbol", "main")}),
                           target)
    xq = tvm.runtime.empty((1, m, k), "float8_e4m3fn", dev)
    xs = tvm.runtime.empty((1, m), "float32", dev)
    quantize["main"](tvm.runtime.tensor(x, dev), xq, xs)
    want_xs = np.maximum(np.abs(x.astype(np.float32)).max(-1) / 448, 1e-12)
    np.testing.assert_allclose(xs.numpy(), want_xs, rtol=1e-6)
    ws = tvm.runtime.empty((WORKSPACE_BYTES,), "uint8", dev)
    out = tvm.runtime.empty((1, m, n), "float16", dev)
    args = [xq, xs, tvm.runtime.tensor(w, dev), tvm.runtime.tensor(w_scale, dev)]
    if extra is not None:
        args.append(tvm.runtime.tensor(extra.astype(np.float16), dev))
    tvm_ffi.get_global_func(cublaslt.MATMUL_FP8[epilogue])(*args, ws, out)
    ref = x.astype(np.float32) @ dequantize_weight(w, w_scale, q).T
    if extra is not None:
        ref = ref + extra.astype(np.float16).astype(np.float32)
    got = out.numpy().astype(np.float32)
    assert np.abs(got[0, 7] - (ref[0, 7] if extra is not None else 0)).max() < 1e-2
    assert np.abs(got - ref).max() / np.abs(ref).max() < 3e-2


def test_a_library_calling_cublaslt_is_refused_in_one_line_where_the_shim_cannot_build(tmp_path, monkeypatch):
    from mlcc.artifact import ArtifactError
    from mlcc.native import cublaslt_shim
    from mlcc.runtime.device import cublaslt

    monkeypatch.setattr(cublaslt_shim, "available", lambda _cache: False)
    plain, calling = tmp_path / "plain.so", tmp_path / "calling.so"
    plain.write_bytes(b"\x7fELF host code without vendor calls")
    calling.write_bytes(b"\x7fELF ... mlcc.cublaslt.matmul_bias ...")
    cublaslt.prepare_for(plain, 0)   # nothing to prepare, nothing refused
    with pytest.raises(ArtifactError, match="calls cuBLASLt.*vendor_gemm=0"):
        cublaslt.prepare_for(calling, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_present(), reason="no CUDA device")
@pytest.mark.parametrize("producer", ["swiglu", "geglu", "rms_norm"])
def test_fused_producer_quantizers_match_numpy(producer):
    """The SwiGLU/GeGLU/RMSNorm computed inside the token quantizer: scales and codes against numpy's float16
    activations quantized the same way (codes within one e4m3 step where float16 rounding moves a tie)."""
    import ml_dtypes

    from mlcc.schedules.cuda_token_quantize import quantize_produced_tokens_func

    dev = tvm.cuda(0)
    q = get_quantization("e4m3_e4m3_f16")
    rng = np.random.default_rng(1)
    m, k = 37, 1000
    target = get_target("cuda").tvm_target()
    f = tvm.compile(tvm.IRModule({"main": quantize_produced_tokens_func(k, q, producer, 1e-5).with_attr(
        "global_symbol", "main")}), target)
    if producer == "rms_norm":
        h = rng.standard_normal((1, m, k)).astype(np.float16)
        w = rng.standard_normal(k).astype(np.float16)
        h32 = h.astype(np.float32)
        x = (h32 / np.sqrt((h32 ** 2).mean(-1, keepdims=True) + 1e-5) * w.astype(np.float32)).astype(np.float16)
        inputs = [h, w]
    else:
        gu = rng.standard_normal((1, m, 2 * k)).astype(np.float16)
        g, u = gu[..., :k].astype(np.float32), gu[..., k:].astype(np.float32)
        act = g / (1 + np.exp(-g)) if producer == "swiglu" else \
            0.5 * g * (1 + np.tanh(0.7978845608028654 * (g + 0.044715 * g ** 3)))
        x = (act * u).astype(np.float16)
        inputs = [gu]
    xq = tvm.runtime.empty((1, m, k), "float8_e4m3fn", dev)
    xs = tvm.runtime.empty((1, m), "float32", dev)
    f["main"](*[tvm.runtime.tensor(a, dev) for a in inputs], xq, xs)
    want_xs = np.abs(x.astype(np.float32)).max(-1) / 448
    np.testing.assert_allclose(xs.numpy(), want_xs, rtol=2e-3)
    got = xq.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32) * xs.numpy()[..., None]
    assert np.abs(got - x.astype(np.float32)).max() <= np.abs(x.astype(np.float32)).max() * 2 ** -3
