"""Prefill on CUDA, whose GEMMs dlight schedules on the tensor cores, against the CPU build: the SmolLM2-135M shape
at q4f16_1 (every dimension over 64, so the tensorized path is taken), the same seeded random weights in both
builds, a 300-token prefill and one decode step; with the projections on the q4 tensor-core GEMM and on cuBLASLt
over weights decoded into a scratch."""

import numpy as np
import pytest

from mlcc.relax_models.presets import PRESETS


def _cuda_present() -> bool:
    import tvm

    return tvm.cuda(0).exist


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_present(), reason="no CUDA device")]

IDS = [1 + (i * 37) % 49000 for i in range(300)]


def _logits(model_dir) -> np.ndarray:
    from mlcc.runtime.device.model import LoadedModel

    m = LoadedModel(model_dir, weights="random")
    m.create_kv_cache(1, 1024, 512)
    m.add_sequence(0)
    rows = [m.prefill([0], [IDS]).numpy().reshape(-1), m.decode([0], [5]).numpy().reshape(-1)]
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("options", [{"vendor_gemm_q4_tokens": 0}, {"vendor_gemm_q4_tokens": 64}],
                         ids=["q4-tensor-core-gemm", "decoded-scratch-cublaslt"])
def test_tensor_core_prefill_matches_the_cpu_build(tmp_path, options):
    from mlcc.compiler.build import compile_shape_only
    from mlcc.options import CompileOptions

    p = PRESETS["smollm2-135m"]
    compile_shape_only(p.family, p.hf_config(), "llvm", "q4f16_1", tmp_path / "llvm")
    compile_shape_only(p.family, p.hf_config(), "cuda", "q4f16_1", tmp_path / "cuda",
                       options=CompileOptions(**options))
    ref, got = _logits(tmp_path / "llvm"), _logits(tmp_path / "cuda")
    err = np.abs(got - ref).max(axis=1) / np.abs(ref).max(axis=1)  # per row: after the prefill, after the step
    assert err.max() <= 3e-2, f"max rel. logit error per row {err}"
