"""Every preset compiles a tiny model; the artifacts hold the expected device code (run on GPUs elsewhere)."""

import json
import shutil
import tarfile

import pytest

from mlcc.errors import ToolchainError
from mlcc.targets import TARGETS, get_target
from mlcc.targets.toolchains import rocm_toolchain

ROCM_READY = True
try:
    with rocm_toolchain():
        pass
except ToolchainError as e:
    ROCM_READY, ROCM_WHY = False, str(e)


def _compile(hf_models, tmp_path, target, quant: str = "q4f16_1"):
    from mlcc.compiler.build import compile_model

    out = tmp_path / target
    compile_model(hf_models("llama"), target, quant, out)
    cfg = json.loads((out / "mlcc-config.json").read_text())
    assert cfg["target"] == target and cfg["stamp"]["target"] == target
    return out, (out / cfg["library"]).read_bytes()


@pytest.mark.skipif(not ROCM_READY, reason="ROCm toolchain missing (.ci/run installs lld-19 rocm-device-libs)")
@pytest.mark.parametrize("target,arch", [("rocm-gfx942", b"gfx942"), ("rocm-gfx90a", b"gfx90a"),
                                         ("rocm-gfx1100", b"gfx1100")])
def test_rocm_library_holds_hsaco_kernels(target, arch, hf_models, tmp_path):
    _, lib = _compile(hf_models, tmp_path, target)
    assert b"amdgcn-amd-amdhsa" in lib and arch in lib
    kernels = {s for s in lib.split(b"\0") if s.endswith(b".kd")}
    assert any(b"dequantize" in k or b"matmul" in k for k in kernels), sorted(kernels)[:10]
    assert len(kernels) > 50


@pytest.mark.skipif(not ROCM_READY, reason="ROCm toolchain missing (.ci/run installs lld-19 rocm-device-libs)")
def test_rocm_library_of_int8_weights_holds_hsaco_kernels(hf_models, tmp_path):
    """q8f16_1 on ROCm: TVM's generic kernels over the same uint32 words as every target."""
    _, lib = _compile(hf_models, tmp_path, "rocm-gfx942", "q8f16_1")
    assert b"amdgcn-amd-amdhsa" in lib and b"gfx942" in lib
    assert len({s for s in lib.split(b"\0") if s.endswith(b".kd")}) > 50


def test_metal_tar_holds_msl_and_arm64_objects(hf_models, tmp_path):
    out, _ = _compile(hf_models, tmp_path, "metal")
    with tarfile.open(out / "model.tar") as t:
        names = t.getnames()
        dev = t.extractfile("devc.o").read()
        host = t.extractfile("lib0.o").read()
    assert sorted(names) == ["devc.o", "lib0.o"]
    assert b"#include <metal_stdlib>" in dev and dev.count(b"kernel void") > 20
    assert host[:4] == bytes.fromhex("cffaedfe")  # Mach-O 64-bit (arm64 host code for macOS)


def test_opencl_library_holds_opencl_c(hf_models, tmp_path):
    _, lib = _compile(hf_models, tmp_path, "opencl")
    assert lib.count(b"__kernel void") > 20


def test_every_preset_says_where_it_runs():
    for name, preset in TARGETS.items():
        assert preset.description
        if not preset.runs_with_wheel:
            assert preset.notes, f"{name} must say why it is compile-only"
    assert get_target("llvm").can_run_here()


@pytest.mark.parametrize("name", ["vulkan", "webgpu"])
def test_wasm_targets_without_emscripten_fail_fast(name, hf_models, tmp_path, monkeypatch):
    from mlcc.compiler.build import compile_model
    from mlcc.errors import ToolchainError

    monkeypatch.setattr("mlcc.compiler.wasm_runtime.shutil.which", lambda _name: None)
    with pytest.raises(ToolchainError, match="apt-get install emscripten"):
        compile_model(hf_models("llama"), name, "q4f32_1", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_rocm_linker_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    monkeypatch.setattr("mlcc.targets.toolchains.Path.exists", lambda self: False)
    with pytest.raises(ToolchainError, match="apt-get install lld-19"):
        with rocm_toolchain():
            pass


@pytest.mark.parametrize("target,marker", [("cuda-sm80", b"__global__"), ("llvm-generic", b"ELF")])
def test_remaining_presets_compile(target, marker, hf_models, tmp_path):
    """The presets no other test builds: CUDA for Ampere (kernels travel as CUDA source) and the portable CPU."""
    out, lib = _compile(hf_models, tmp_path, target)
    assert marker in lib
    if target == "cuda-sm80":
        assert json.loads((out / "mlcc-config.json").read_text())["cuda_arch"] == "sm_80"
