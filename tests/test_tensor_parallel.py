"""Tensor parallelism, the parts that need no GPU: the shard plan reproduces the unsharded layer math, compile
writes one weight folder per rank, bad shard counts and mismatched builds are refused with the reason."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlcc.errors import TensorParallelError
from mlcc.relax_models.blocks import DecoderConfig
from mlcc.relax_models.weight_plans import check_tensor_parallel, shard_weight


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


@pytest.fixture(scope="module")
def cfg() -> DecoderConfig:
    return DecoderConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=8,
                       num_key_value_heads=4, vocab_size=100, head_dim=8)


@pytest.mark.parametrize("shards", [2, 4])
def test_sharded_projections_reproduce_the_full_layer(cfg, shards):
    rng = np.random.default_rng(0)
    hd, h, kvh, d, inter = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size, \
        cfg.intermediate_size
    x = rng.standard_normal((3, d))
    qkv = rng.standard_normal(((h + 2 * kvh) * hd, d))
    o = rng.standard_normal((d, h * hd))
    gate_up = rng.standard_normal((2 * inter, d))
    down = rng.standard_normal((d, inter))

    full_qkv = x @ qkv.T
    q, k, v = np.split(full_qkv, [h * hd, (h + kvh) * hd], axis=1)
    attn = rng.standard_normal((3, h * hd))  # stands in for attention's output, head-major like q
    full_o = attn @ o.T
    gate, up = np.split(x @ gate_up.T, 2, axis=1)
    full_mlp = (_silu(gate) * up) @ down.T

    o_sum, mlp_sum = np.zeros_like(full_o), np.zeros_like(full_mlp)
    for r in range(shards):
        hq, hk = h // shards, kvh // shards
        out = x @ shard_weight("l.self_attn.qkv_proj.weight", qkv, cfg, r, shards).T
        # each rank sees exactly its own heads of q, k and v, in that order
        np.testing.assert_allclose(out[:, : hq * hd], q[:, r * hq * hd:(r + 1) * hq * hd])
        np.testing.assert_allclose(out[:, hq * hd:(hq + hk) * hd], k[:, r * hk * hd:(r + 1) * hk * hd])
        np.testing.assert_allclose(out[:, (hq + hk) * hd:], v[:, r * hk * hd:(r + 1) * hk * hd])
        # o_proj and down_proj: partial sums that the all-reduce adds up
        o_sum += attn[:, r * hq * hd:(r + 1) * hq * hd] @ shard_weight("l.self_attn.o_proj.weight", o, cfg, r,
                                                                      shards).T
        g, u = np.split(x @ shard_weight("l.mlp.gate_up_proj.weight", gate_up, cfg, r, shards).T, 2, axis=1)
        mlp_sum += (_silu(g) * u) @ shard_weight("l.mlp.down_proj.weight", down, cfg, r, shards).T
    np.testing.assert_allclose(o_sum, full_o, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(mlp_sum, full_mlp, rtol=1e-10, atol=1e-10)
    norm = rng.standard_normal(d)
    assert shard_weight("l.input_layernorm.weight", norm, cfg, 1, shards) is norm  # replicated


def test_bad_shard_counts_are_refused(cfg):
    with pytest.raises(TensorParallelError, match=r"attention heads \(8\) do not split evenly"):
        check_tensor_parallel(cfg, 3, None)
    with pytest.raises(TensorParallelError, match=r"key/value heads \(4\)"):
        check_tensor_parallel(cfg, 8, None)
    with pytest.raises(TensorParallelError, match=r"MLP width \(48\) is not a multiple of the quantization group"):
        check_tensor_parallel(cfg, 2, 32)
    check_tensor_parallel(cfg, 2, None)  # unquantized: any even split is fine


def test_compile_writes_one_weight_folder_per_rank(compiled_tp2):
    out = compiled_tp2
    cfg = json.loads((out / "mlcc-config.json").read_text())
    assert cfg["tensor_parallel"] == 2
    from mlcc import artifact

    shapes = {p["name"]: p["shape"] for p in cfg["params"]}
    assert shapes["model.layers.0.self_attn.qkv_proj.q_weight"][0] == (4 + 2 * 2) * 16 // 2
    assert shapes["model.layers.0.mlp.down_proj.q_weight"][1] == 128 // 2 // 8
    for rank in range(2):
        folder = out / artifact.shard_dir(rank)
        artifact.verify_shards(folder)
        cache = json.loads((folder / artifact.TENSOR_CACHE_FILE).read_text())
        got = {r["name"]: r["shape"] for s in cache["records"] for r in s["records"]}
        assert got == shapes
    # the all-reduce is in the compiled graph
    assert b"runtime.disco.allreduce" in (out / cfg["library"]).read_bytes()


def test_runtime_refuses_mismatched_tensor_parallel(compiled_tp2, compiled):
    from mlcc.errors import ArtifactError
    from mlcc.runtime.engine import Engine

    with pytest.raises(ArtifactError, match="compiled for --tensor-parallel 1, not 2"):
        Engine(compiled("llama", "q4f32_1"), target="llvm", tensor_parallel=2)
    with pytest.raises(ArtifactError, match="tensor parallelism runs on CUDA GPUs"):
        Engine(compiled_tp2, target="llvm")


@pytest.fixture(scope="module")
def compiled_tp2(hf_models, tmp_path_factory):
    from mlcc.compiler.build import compile_model

    out = tmp_path_factory.mktemp("tp2") / "model"
    compile_model(hf_models("llama"), "llvm", "q4f32_1", out, tensor_parallel=2)
    return out


def test_disco_workers_get_their_functions_by_registration():
    """What the controller calls on every worker (the cuda arch is an argument, not an environment variable)."""
    import tvm

    from mlcc.runtime.device.disco_worker import register_worker_functions

    register_worker_functions()
    assert tvm.get_global_func("mlcc.tp.load_params", allow_missing=True) is not None
    assert tvm.get_global_func("mlcc.tp.register_cuda_jit", allow_missing=True) is not None
