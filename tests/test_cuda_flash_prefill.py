"""The tensor-core prefill attention (schedules/cuda_flash_prefill.py, cuda/flash_prefill.cuh) without a GPU: the
kernel compiles through NVRTC for sm_90 and sm_80 with both head sizes, and a model built with the option has it in
place of TVM's ragged prefill kernel (same parameters, so the KV cache calls it). Its numerics run on the GPU:
bench/prefill.py checks a model's logits against a float32 build of the same weights before timing."""

from __future__ import annotations

import pytest
import tvm
from test_cuda_nvrtc import _assert_compiles, _cuda_source, nvrtc  # noqa: F401 (the fixture)

from mlcc.compiler.build import compile_library, export_module
from mlcc.compiler.quantize import get_quantization
from mlcc.compiler.weights import load_source
from mlcc.options import CompileOptions
from mlcc.schedules.cuda_flash_prefill import make_flash_prefill
from mlcc.schedules.cuda_source import add_cuda_helpers
from mlcc.targets import get_target
from mlcc.tvm_compat import cuda_source_postproc


@pytest.mark.parametrize("preset", ["cuda", "cuda-sm80"])
def test_flash_prefill_kernels_compile(nvrtc, preset):  # noqa: F811
    target = get_target(preset).tvm_target()
    funcs = {f"flash_{h_kv}_{h_q}_{d}": make_flash_prefill(h_kv, h_q, d)
             for h_kv, h_q, d in [(8, 32, 128), (2, 14, 64), (1, 4, 64), (4, 4, 128)]}
    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    with target, cuda_source_postproc(add_cuda_helpers):
        lib = tvm.compile(mod, target)
    src = _cuda_source(lib.mod)
    assert src.count("mlcc_flash_prefill<") >= len(funcs) and "extern __shared__" in src
    _assert_compiles(nvrtc, src, str(target.attrs["arch"]))


def test_model_prefill_takes_the_flash_kernel(hf_models, tmp_path, nvrtc):  # noqa: F811
    # (the test Gemma: head size 64, one KV head for four query heads)
    built = export_module(load_source(hf_models("gemma")), get_target("cuda"), get_quantization("q4f16_1"),
                          options=CompileOptions(flash_prefill_attention=True))
    src = _cuda_source(compile_library(built, tmp_path / "model.so").mod)
    assert "mlcc_flash_prefill<64>(" in src
    # cross-attention over cached pages stays TVM's (beside the split-KV kernel for a verify's few rows)
    assert "batch_prefill_paged_kv_tiled_kernel" in src and "batch_prefill_paged_kv_few_kernel" in src
    _assert_compiles(nvrtc, src)
