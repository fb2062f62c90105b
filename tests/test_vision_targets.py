"""The vision encoders built for the GPU targets without running them: the tiny Gemma 3 (SigLIP) and LLaVA (CLIP)
models of vision_support.py compiled for CUDA (the library's source compiled by NVRTC) and WebGPU (WGSL generated),
their `image_embed` and its kernels (the encoders' LayerNorms, which the language models lack) included. GPU builds
have no `prefill_image`: their attention kernels are TVM's, which read every prefill causally. CI builds LLaVA for
WebGPU only (its CUDA build, `-m slow`, adds 40 s)."""

from __future__ import annotations

import pytest
import tvm
from test_cuda_nvrtc import _assert_compiles, _cuda_source, nvrtc  # noqa: F401 (the fixture)
from test_family_targets import SOURCE_KIND, _device_source
from vision_support import make_gemma3_vision, make_llava

from mlcc.compiler.build import export_module
from mlcc.compiler.quantize import get_quantization
from mlcc.compiler.weights import load_source
from mlcc.targets import get_target

MAKERS = {"gemma3": make_gemma3_vision, "llava": make_llava}


@pytest.fixture(scope="module")
def vision_models(tmp_path_factory):
    cache = {}

    def get(kind: str):
        if kind not in cache:
            cache[kind] = MAKERS[kind](tmp_path_factory.mktemp(f"hf-{kind}"))
        return cache[kind]

    return get


def _built(folder, target: str):
    built = export_module(load_source(folder), get_target(target), get_quantization("q4f16_1"))
    names = {gv.name_hint for gv in built.mod.functions}
    assert "image_embed" in names and "prefill_image" not in names
    return built


@pytest.mark.parametrize("kind", ["gemma3", pytest.param("llava", marks=pytest.mark.slow)])
def test_cuda_source_with_the_encoder_compiles(kind, vision_models, tmp_path, nvrtc):  # noqa: F811
    from mlcc.compiler.build import compile_library

    src = _cuda_source(compile_library(_built(vision_models(kind), "cuda"), tmp_path / "model.so").mod)
    assert "layer_norm" in src
    _assert_compiles(nvrtc, src)


@pytest.mark.parametrize("kind", ["gemma3", "llava"])
def test_encoder_lowers_for_webgpu(kind, vision_models):
    from mlcc.compiler.pipeline import build_pipeline
    from mlcc.schedules.cuda_pdl import tir_pipeline_for
    from mlcc.tvm_compat import pass_config

    built = _built(vision_models(kind), "webgpu")
    with tvm.transform.PassContext(config=pass_config(built.target, built.cfg.rope_scaling)):
        lib = tvm.compile(built.mod, built.target, relax_pipeline=build_pipeline(built.target, None, built.options),
                          tir_pipeline=tir_pipeline_for(built.target, built.options))
    module_kind, marker = SOURCE_KIND["webgpu"]
    src = _device_source(lib, module_kind)
    assert src.count(marker) > 20 and "layer_norm" in src
