"""Each family's whole model lowered for the GPU targets besides CUDA (WGSL for WebGPU, MSL for Metal): TVM's
kernels with the family's switches (soft-capped attention, sliding windows, RoPE in the model) generate for each.
CI compiles the two families with the most switches; `-m slow` runs every family."""

import pytest
import tvm
from conftest import FAMILIES

from mlcc.compiler.build import export_module
from mlcc.compiler.pipeline import build_pipeline
from mlcc.compiler.quantize import get_quantization
from mlcc.compiler.weights import load_source
from mlcc.schedules.cuda_pdl import tir_pipeline_for
from mlcc.targets import get_target
from mlcc.tvm_compat import pass_config

IN_CI = {"gemma2", "phi3"}
SOURCE_KIND = {"webgpu": ("webgpu", "@compute"), "metal": ("metal", "kernel void")}


def _device_source(lib, kind: str) -> str:
    def walk(m):
        yield m
        for i in m.imports:
            yield from walk(i)

    return "".join(m.inspect_source() for m in walk(lib.mod) if m.kind == kind)


@pytest.mark.parametrize("target", ["webgpu", "metal"])
@pytest.mark.parametrize("kind", [k if k in IN_CI else pytest.param(k, marks=pytest.mark.slow) for k in FAMILIES])
def test_family_lowers_for_the_target(kind, target, hf_models):
    built = export_module(load_source(hf_models(kind)), get_target(target), get_quantization("q4f16_1"))
    with tvm.transform.PassContext(config=pass_config(built.target, built.cfg.rope_scaling)):
        lib = tvm.compile(built.mod, built.target, relax_pipeline=build_pipeline(built.target, None, built.options),
                          tir_pipeline=tir_pipeline_for(built.target, built.options))
    module_kind, marker = SOURCE_KIND[target]
    src = _device_source(lib, module_kind)
    assert src.count(marker) > 20
    assert "batch_prefill_paged_kv_sliding_window" in src and "batch_decode_paged_kv" in src
    if built.cfg.attn_softcap:
        assert "tanh" in src


@pytest.mark.parametrize("target,quant,decode", [
    ("webgpu", "q8f16_1", " & 255u)) - 1.280000e+02h"),   # (WGSL: no 16-bit integers, a plain convert)
    ("webgpu", "q8f32_1", " & 255u)) - 1.280000e+02f"),
    ("metal", "q8f16_1", " & (uint)255)) | (ushort)25600)")])   # (1024 + code as fp16 bits)
def test_int8_weights_lower_for_the_target(target, quant, decode, hf_models):
    """int8 weights are uint32 words on every target: each kernel takes its bytes apart with shifts and masks."""
    built = export_module(load_source(hf_models("llama")), get_target(target), get_quantization(quant))
    with tvm.transform.PassContext(config=pass_config(built.target, built.cfg.rope_scaling)):
        lib = tvm.compile(built.mod, built.target, relax_pipeline=build_pipeline(built.target, None, built.options),
                          tir_pipeline=tir_pipeline_for(built.target, built.options))
    module_kind, marker = SOURCE_KIND[target]
    src = _device_source(lib, module_kind)
    assert src.count(marker) > 20 and src.count(decode) > 10
