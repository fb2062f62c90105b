"""The tensor-core prefill GEMM (schedules/cuda_gemm.py, cuda/tc_gemm.cuh) without a GPU: every parameter set the
benchmark searches compiles through NVRTC for sm_90 (and the 48 KB ones for sm_80), the pass finds a model's
many-token projections (and leaves batch-1 decode to the GEMVs), and the whole library's source compiles. The
numerics run on the GPU: `bench/prefill.py gemm-run` checks every kernel and epilogue against torch before timing
it, and `bench/prefill.py mlcc` a model's logits against a float32 build of the same weights."""

from __future__ import annotations

import re

import pytest
from test_cuda_nvrtc import _assert_compiles, _cuda_source, nvrtc  # noqa: F401 (the fixture)

from mlcc.compiler.build import compile_library, export_module
from mlcc.compiler.quantize import get_quantization
from mlcc.compiler.weights import load_source
from mlcc.options import CompileOptions
from mlcc.schedules.cuda_gemm import EPILOGUES, GemmParams, default_params, kernel_source, supported
from mlcc.targets import get_target

SEARCHED = [(128, 128, 2, 4, 3, 32), (128, 256, 2, 4, 4, 64), (256, 128, 4, 2, 3, 64), (64, 128, 2, 2, 4, 32),
            (128, 64, 2, 2, 4, 64)]


def test_shared_memory_budget_follows_the_architecture():
    big = GemmParams(128, 256, 2, 4, 4, 64)
    assert big.smem_bytes(False) == 4 * (128 + 256) * 64 * 2
    assert big.valid(False, 90) and not big.valid(False, 89) and not big.valid(False, 75)
    assert GemmParams(128, 128, 2, 4, 3).valid(True, 80)
    assert not GemmParams(128, 128, 2, 4, 3, 48).valid(False)       # BK is 32 or 64
    assert not GemmParams(256, 256, 2, 2, 3).valid(False)           # 128 x 128 warp tiles: no
    assert supported(4096, 14336, default_params("q4f16_1")) and not supported(4000, 4096, default_params("float16"))


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_every_searched_kernel_compiles(nvrtc, arch):  # noqa: F811
    sm = int(arch[3:])
    src, n = None, 0
    for weights in ("float16", "q4f16_1"):
        for p in map(lambda c: GemmParams(*c), SEARCHED):
            if not p.valid(weights == "q4f16_1", sm):
                continue
            for epi in EPILOGUES:
                src = (src or "") + kernel_source(weights, epi, p, with_header=src is None)
                n += 1
    assert n >= 16
    _assert_compiles(nvrtc, src, arch)


# one layer of a model wide enough for the kernel (every side >= MIN_SIDE), head size 128
WIDE_LLAMA = dict(hidden_size=2048, intermediate_size=4096, num_hidden_layers=1, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=1024, max_position_embeddings=512, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")


@pytest.mark.parametrize("quant", ["q4f16_1", "q0f16"])
def test_prefill_projections_take_the_tensor_core_kernel(tmp_path, nvrtc, quant):  # noqa: F811
    from mlcc.compiler.weights import ModelSource

    source = ModelSource("config", tmp_path, "llama", WIDE_LLAMA, {})
    built = export_module(source, get_target("cuda"), get_quantization(quant))
    src = _cuda_source(compile_library(built, tmp_path / "model.so").mod)
    calls = re.findall(r"mlcc_tc_gemm<(\d+), (\d+), (\d+), \d+, \d+, \d+, (true|false), (\d)(, \d+)?>\(", src)
    # qkv, o (+ residual), gate_up, down (+ residual) in prefill and in the batched forwards, tiled and split-K
    assert len(calls) >= 8 and {c[3] for c in calls} == {"true" if quant == "q4f16_1" else "false"}
    assert {c[4] for c in calls} >= {"0"} and any(c[5] for c in calls) and "mlcc_tc_gemm_reduce<" in src
    assert "extern __shared__" in src and "mlcc_flash_prefill<128>(" in src
    helper = "mlcc_q4x8_hfma2_s1" if quant == "q4f16_1" else "mlcc_f16x2_fma"
    assert helper in src  # batch-1 decode keeps its GEMV kernels
    _assert_compiles(nvrtc, src)


def test_narrow_models_keep_dlight_gemms(hf_models, tmp_path):
    built = export_module(load_source(hf_models("llama")), get_target("cuda"), get_quantization("q4f16_1"))
    assert "mlcc_tc_gemm<" not in _cuda_source(compile_library(built, tmp_path / "model.so").mod)


def test_the_pass_runs_only_when_asked_on_cuda():
    from mlcc.schedules import handwritten_kernel_passes

    def names(preset: str, options: CompileOptions) -> list[str]:
        return [p.info.name for p in handwritten_kernel_passes(get_target(preset).tvm_target(), options)]

    assert "mlcc_cuda_prefill_gemm" in names("cuda", CompileOptions())
    assert "mlcc_cuda_prefill_gemm" not in names("cuda", CompileOptions(prefill_gemm=False))
    assert "mlcc_cuda_prefill_gemm" in names("cuda-sm80", CompileOptions(prefill_gemm=True))
    assert names("llvm", CompileOptions(prefill_gemm=True)) == []


@pytest.mark.parametrize("weights", ["q4f16_1", "float16"])
def test_few_tokens_take_the_split_k_kernel(nvrtc, weights):  # noqa: F811
    """Up to SMALL_M tokens (batched decode, a speculative verify) the projection runs K-split into a workspace the
    host allocates, then the reduction with the epilogue; more tokens take the tiled kernel."""
    import tvm
    from tvm.script import tirx as T

    from mlcc.schedules.cuda_gemm import few_token_params
    from mlcc.schedules.cuda_gemm_tir import PrefillGemm, make_prefill_gemm, params_for
    from mlcc.schedules.cuda_source import add_cuda_helpers
    from mlcc.tvm_compat import cuda_source_postproc

    m = tvm.tirx.Var("m", "int64")
    funcs = {}
    for epi in ("none", "bias", "add"):
        shape = PrefillGemm(4096, 14336, (T.int64(1), m, T.int64(14336)), weights, epi)
        few = few_token_params(4096, 14336, weights)
        assert few.split == 8 and supported(4096, 14336, few, epi)
        funcs[f"gemm_{epi}"] = make_prefill_gemm(shape, params_for(shape, 90), few)
    target = get_target("cuda").tvm_target()
    with target, cuda_source_postproc(add_cuda_helpers):
        lib = tvm.compile(tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in funcs.items()}), target)
    src = _cuda_source(lib.mod)
    assert len(re.findall(r"mlcc_tc_gemm<32, 128, 64, 2, 4, 4, \w+, 0, 8>\(", src)) == 3
    assert {e for e in re.findall(r"mlcc_tc_gemm_reduce<8, (\d)>\(", src)} == {"0", "1", "2"}
    assert lib.mod.inspect_source("ll").count("TVMBackendAllocWorkspace") >= 3
    _assert_compiles(nvrtc, src)
