"""Mixture-of-experts models built for the GPU targets without running them: the CUDA library's source compiled
by NVRTC, WGSL (WebGPU) and MSL (Metal) generated, ROCm's HSACO linked, each holding the expert kernels; and a
tensor-parallel build whose ranks get their slices of every expert. Qwen2-MoE is the test model: the shared
expert (its sigmoid gate is the router's last row), a dense layer and q/k/v biases."""

from __future__ import annotations

import json

import pytest
import tvm
from test_cuda_nvrtc import _assert_compiles, _cuda_source, nvrtc  # noqa: F401 (the fixture)
from test_family_targets import SOURCE_KIND, _device_source
from test_targets import ROCM_READY

from mlcc.compiler.build import export_module
from mlcc.compiler.quantize import get_quantization
from mlcc.compiler.weights import load_source
from mlcc.targets import get_target

MOE_KERNELS = ("moe_topk_softmax", "moe_count_by_expert", "moe_place_by_expert", "moe_expert_gemv",
               "moe_grouped_gemm", "moe_weighted_sum")


def _built(hf_models, target: str):
    return export_module(load_source(hf_models("qwen2_moe")), get_target(target), get_quantization("q4f16_1"))


def test_cuda_source_compiles(hf_models, tmp_path, nvrtc):  # noqa: F811
    from mlcc.compiler.build import compile_library

    src = _cuda_source(compile_library(_built(hf_models, "cuda"), tmp_path / "model.so").mod)
    missing = [k for k in MOE_KERNELS if f"{k}_kernel" not in src]
    assert not missing, missing
    _assert_compiles(nvrtc, src)


@pytest.mark.parametrize("target", ["webgpu", "metal"])
def test_lowers_for_the_target(target, hf_models):
    from mlcc.compiler.pipeline import build_pipeline
    from mlcc.schedules.cuda_pdl import tir_pipeline_for
    from mlcc.tvm_compat import pass_config

    built = _built(hf_models, target)
    with tvm.transform.PassContext(config=pass_config(built.target, built.cfg.rope_scaling)):
        lib = tvm.compile(built.mod, built.target, relax_pipeline=build_pipeline(built.target, None, built.options),
                          tir_pipeline=tir_pipeline_for(built.target, built.options))
    module_kind, marker = SOURCE_KIND[target]
    src = _device_source(lib, module_kind)
    assert src.count(marker) > 20
    missing = [k for k in MOE_KERNELS if k not in src]
    assert not missing, missing


@pytest.mark.skipif(not ROCM_READY, reason="ROCm toolchain missing (.ci/run installs lld-19 rocm-device-libs)")
def test_rocm_library_holds_the_expert_kernels(hf_models, tmp_path):
    from mlcc.compiler.build import compile_model

    out = tmp_path / "rocm"
    compile_model(hf_models("qwen2_moe"), "rocm-gfx942", "q4f16_1", out)
    lib = (out / json.loads((out / "mlcc-config.json").read_text())["library"]).read_bytes()
    assert b"amdgcn-amd-amdhsa" in lib and b"gfx942" in lib
    kernels = {s for s in lib.split(b"\0") if s.endswith(b".kd")}
    missing = [k for k in MOE_KERNELS if not any(k.encode() in s for s in kernels)]
    assert not missing, missing


# -- tensor parallelism ---------------------------------------------------------------------------------------

def test_tensor_parallel_compile_shards_experts_and_the_shared_expert(hf_models, tmp_path):
    from mlcc import artifact
    from mlcc.compiler.build import compile_model

    out = tmp_path / "tp2"
    compile_model(hf_models("qwen2_moe"), "llvm", "q0f32", out, tensor_parallel=2)  # (16-wide expert shards)
    cfg = json.loads((out / "mlcc-config.json").read_text())
    shapes = {p["name"]: p["shape"] for p in cfg["params"]}
    mlp = "model.layers.0.mlp"
    assert shapes[f"{mlp}.experts.gate_up_proj.weight"] == [8, 2 * 32 // 2, 64]
    assert shapes[f"{mlp}.experts.down_proj.weight"] == [8, 64, 32 // 2]
    assert shapes[f"{mlp}.shared_expert.gate_up_proj.weight"] == [2 * 64 // 2, 64]
    assert shapes[f"{mlp}.shared_expert.down_proj.weight"] == [64, 64 // 2]
    assert shapes[f"{mlp}.gate.weight"] == [8 + 1, 64]  # the router and the shared expert's gate, whole
    for rank in range(2):
        folder = out / artifact.shard_dir(rank)
        artifact.verify_shards(folder)
        cache = json.loads((folder / artifact.TENSOR_CACHE_FILE).read_text())
        assert {r["name"]: r["shape"] for s in cache["records"] for r in s["records"]} == shapes
    assert b"runtime.disco.allreduce" in (out / cfg["library"]).read_bytes()
