"""The tensor-core prefill GEMM (schedules/cuda_gemm.py, cuda/tc_gemm.cuh) without a GPU: every parameter set the
benchmark searches compiles through NVRTC for sm_90 (and the 48 KB ones for sm_80), the pass finds a model's
many-token projections (and leaves batch-1 decode to the GEMVs), and the whole library's source compiles. The
numerics run on the GPU: bench/gemm.py checks every kernel and epilogue against torch before timing it, and
bench/prefill.py a model's logits against a float32 build of the same weights."""

from __future__ import annotations

import re

import pytest

from mlcc.compiler.build import compile_library, export_module
from mlcc.compiler.quantize import get_quantization
from mlcc.compiler.weights import load_source
from mlcc.options import CompileOptions
from mlcc.schedules.cuda_gemm import EPILOGUES, GemmParams, default_params, kernel_source, supported
from mlcc.targets import get_target
from test_cuda_nvrtc import _assert_compiles, _cuda_source, nvrtc  # noqa: F401 (the fixture)

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


@pytest.mark.parametrize("quant", ["q4f16_1", "q0f16"])
def test_prefill_projections_take_the_tensor_core_kernel(hf_models, tmp_path, nvrtc, quant):  # noqa: F811
    built = export_module(load_source(hf_models("llama")), get_target("cuda"), get_quantization(quant),
                          options=CompileOptions(prefill_gemm=True))
    src = _cuda_source(compile_library(built, tmp_path / "model.so").mod)
    calls = re.findall(r"mlcc_tc_gemm<(\d+), (\d+), (\d+), \d+, \d+, \d+, (true|false), (\d)>\(", src)
    # per layer qkv, o (+ residual), gate_up, down (+ residual), in prefill and in the batched forwards
    assert len(calls) >= 4 and {c[3] for c in calls} == {"true" if quant == "q4f16_1" else "false"}
    assert {c[4] for c in calls} >= {"0", "2"}
    assert "extern __shared__" in src
    helper = "mlcc_q4x8_hfma2_s1" if quant == "q4f16_1" else "mlcc_f16x2_fma"
    assert helper in src  # batch-1 decode keeps its GEMV kernels
    _assert_compiles(nvrtc, src)


def test_the_pass_runs_only_when_asked_on_cuda():
    from mlcc.schedules import handwritten_kernel_passes

    def names(preset: str, options: CompileOptions) -> list[str]:
        return [p.info.name for p in handwritten_kernel_passes(get_target(preset).tvm_target(), options)]

    assert "mlcc_cuda_prefill_gemm" not in names("cuda", CompileOptions())
    assert "mlcc_cuda_prefill_gemm" in names("cuda", CompileOptions(prefill_gemm=True))
    assert "mlcc_cuda_prefill_gemm" in names("cuda-sm80", CompileOptions(prefill_gemm=True))
    assert names("llvm", CompileOptions(prefill_gemm=True)) == []
