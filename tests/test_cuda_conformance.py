"""Every model family through the CUDA build takes the fast decode path: each batch-1 projection (fused q/k/v,
o, fused gate/up, down, the LM head) is one of mlcc's GEMV kernels, none left to the generic rules, and the decode
attention (plain and sliding-window layers) is the split-KV kernel, soft-capped where the family caps its scores.
The CUDA source of the family with the most switches (Gemma 2: sliding windows, both soft-caps, sandwich norms,
RoPE in the model) is compiled with NVRTC, as on a GPU."""

import pytest
import tvm
from conftest import FAMILIES
from test_cuda_nvrtc import _assert_compiles, _cuda_source, nvrtc  # noqa: F401 (the fixture)
from tvm import relax

from mlcc.compiler.build import export_module
from mlcc.compiler.pipeline import kernel_passes
from mlcc.compiler.quantize import get_quantization
from mlcc.compiler.weights import load_source
from mlcc.options import CompileOptions
from mlcc.schedules.attention_softcap import softcap_of
from mlcc.schedules.gemv_match import is_unscheduled_prim_func, match_gemv
from mlcc.targets import get_target

SOFTCAP = {"gemma2": 2.0}  # conftest's Gemma 2 config: attn_logit_softcapping


def _decode_callees(mod: tvm.IRModule) -> list[tvm.tirx.PrimFunc]:
    calls = []

    def visit(e):
        if isinstance(e, relax.Call) and e.op == tvm.ir.Op.get("relax.call_tir"):
            calls.append(mod[e.args[0]])

    relax.analysis.post_order_visit(mod["decode"].body, visit)
    return calls


@pytest.mark.parametrize("kind", FAMILIES)
def test_family_takes_the_fast_cuda_decode_path(kind, hf_models):
    built = export_module(load_source(hf_models(kind)), get_target("cuda"), get_quantization("q4f16_1"))
    with built.target:
        mod = tvm.transform.Sequential(kernel_passes(built.target, CompileOptions()))(built.mod)
    callees = _decode_callees(mod)
    generic = [f.attrs["global_symbol"] for f in callees if is_unscheduled_prim_func(f) and match_gemv(f)]
    ours = [f for f in callees if not is_unscheduled_prim_func(f)]
    assert not generic, f"decode projections left to the generic schedule: {generic}"
    assert len(ours) == 4 * built.cfg.num_hidden_layers + 1, [f.attrs.get("global_symbol") for f in ours]
    decode_attention = {str(f.attrs["global_symbol"]): f for f in mod.functions.values()
                        if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None
                        and str(f.attrs.get("global_symbol", "")).startswith("batch_decode_paged_kv")}
    assert set(decode_attention) == {"batch_decode_paged_kv", "batch_decode_paged_kv_sliding_window"}
    for name, f in decode_attention.items():
        assert "part_md" in f.script(), f"{name} is TVM's one-block-per-head kernel, not the split-KV one"
        assert softcap_of(f) == SOFTCAP.get(kind, 0.0)
    if kind in SOFTCAP:  # TVM's prefill kernels store capped scores
        prefill = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None
                   and str(f.attrs.get("global_symbol", "")).startswith("batch_prefill_")]
        # (the paged one: a dispatch to its few-rows and tiled kernels, cuda_few_query_attention)
        assert {str(f.attrs["global_symbol"]) for f in prefill} == {
            "batch_prefill_ragged_kv", "batch_prefill_paged_kv", "batch_prefill_paged_kv_few",
            "batch_prefill_paged_kv_tiled", "batch_prefill_paged_kv_sliding_window"}
        assert all(softcap_of(f) == SOFTCAP[kind] for f in prefill)
        kernels = [f for f in prefill if str(f.attrs["global_symbol"]) != "batch_prefill_paged_kv"]  # (the host one)
        assert all("tanh" in f.script() for f in kernels)


def test_gemma2_cuda_source_compiles(hf_models, tmp_path, nvrtc):  # noqa: F811
    from mlcc.compiler.build import compile_library

    built = export_module(load_source(hf_models("gemma2")), get_target("cuda"), get_quantization("q4f16_1"))
    src = _cuda_source(compile_library(built, tmp_path / "model.so").mod)
    assert "batch_decode_paged_kv_sliding_window_kernel" in src and "tanhf(" in src
    _assert_compiles(nvrtc, src)
