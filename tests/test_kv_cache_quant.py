"""--kv-cache-dtype int8 / fp8_e4m3 on the CPU: the quantized cache against the float one on a tiny random llama,
its size, and the features around it (chunked prefill, batches, prefix cache, speculation, refusals)."""

import numpy as np
import pytest

from mlcc import artifact, kv_cache_format
from mlcc.errors import EngineConfigError, UnsupportedKVCacheDtypeError
from mlcc.options import CompileOptions, EngineConfig
from mlcc.runtime.device.model import LoadedModel
from mlcc.runtime.engine import Engine

# Llama-3-8B's attention: 32 layers, 8 KV heads of 128
LLAMA3_8B = {"layers": 32, "kv_heads": 8, "head_dim": 128}
# measured on the tiny llama (prefill in two chunks + 32 decode steps, teacher-forced): max |Δlogit| / max |logit|
# 1.5e-3 (int8) and 6.3e-3 (fp8_e4m3); the argmax agreed at 33 of 33 and 32 of 33 positions
TOLERANCE = {"int8": 0.01, "fp8_e4m3": 0.03}
AGREEMENT = {"int8": 0.95, "fp8_e4m3": 0.9}
PROMPT = [(3 + 7 * i) % 250 + 3 for i in range(37)]


@pytest.fixture(scope="module")
def builds(tmp_path_factory, hf_models):
    from mlcc.compiler.build import compile_model

    cache = {}

    def get(kv: str):
        if kv not in cache:
            out = tmp_path_factory.mktemp(f"kv-{kv}") / "model"
            compile_model(hf_models("llama"), "llvm", "q0f32", out, options=CompileOptions(kv_cache_dtype=kv))
            cache[kv] = out
        return cache[kv]

    return get


def _run(model_dir, feed: list[int] | None) -> tuple[np.ndarray, list[int]]:
    """Logits of the prompt (prefilled in two chunks: the second attends to the first through the cache and merges)
    and 32 decode steps fed `feed` (None: its own greedy choices); returns (logits rows, greedy ids)."""
    m = LoadedModel(model_dir)
    m.create_kv_cache(2, 256, 32)
    m.add_sequence(0)
    m.prefill([0], [PROMPT[:20]])
    rows = [m.prefill([0], [PROMPT[20:]]).numpy()[0]]
    ids = [int(rows[-1].argmax())]
    for step in range(32):
        rows.append(m.decode([0], [feed[step] if feed else ids[-1]]).numpy()[0])
        ids.append(int(rows[-1].argmax()))
    return np.array(rows), ids


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_quantized_cache_logits_follow_the_float_cache(builds, kv):
    ref, ref_ids = _run(builds("auto"), None)
    got, got_ids = _run(builds(kv), ref_ids)   # teacher-forced: both see the same tokens
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    agree = np.mean(np.array(got_ids) == np.array(ref_ids))
    assert 0 < rel < TOLERANCE[kv], rel   # (0: the cache did quantize)
    assert agree >= AGREEMENT[kv], agree


def test_batched_decode_matches_one_at_a_time(builds):
    m = LoadedModel(builds("int8"))
    m.create_kv_cache(4, 256, 64)
    for s in (0, 1):
        m.add_sequence(s)
    a, b = PROMPT[:11], PROMPT[5:30]
    together = m.prefill([0, 1], [a, b]).numpy()
    step = m.decode([0, 1], [7, 9]).numpy()
    alone = LoadedModel(builds("int8"))
    alone.create_kv_cache(4, 256, 64)
    alone.add_sequence(0)
    np.testing.assert_allclose(alone.prefill([0], [b]).numpy()[0], together[1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(alone.decode([0], [9]).numpy()[0], step[1], rtol=1e-4, atol=1e-4)


def test_kv_bytes_per_token_and_sequences_in_a_budget():
    f16 = kv_cache_format.bytes_per_token("auto", "float16", **LLAMA3_8B)
    f32 = kv_cache_format.bytes_per_token("auto", "float32", **LLAMA3_8B)
    i8 = kv_cache_format.bytes_per_token("int8", "float16", **LLAMA3_8B)
    assert (f16, f32, i8) == (131072, 262144, 67584)   # 128 codes + a 4-byte scale per row
    assert kv_cache_format.bytes_per_token("fp8_e4m3", "float32", **LLAMA3_8B) == i8
    budget = 16 << 30   # 16 GiB of KV cache
    assert (budget // (4096 * f16), budget // (4096 * i8)) == (32, 62)


def test_engine_prefix_cache_and_speculation(builds):
    model = builds("int8")
    with Engine(model, target="llvm", max_batch=2, prefix_cache=False) as plain:
        ref = plain.completions.create(prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    with Engine(model, target="llvm", max_batch=2, kv_cache_dtype="int8") as warm:
        first = warm.completions.create(prompt=PROMPT, max_tokens=24, temperature=0)
        again = warm.completions.create(prompt=PROMPT, max_tokens=24, temperature=0)
        assert first.choices[0].text == again.choices[0].text == ref
        assert again.usage.prompt_tokens_details.cached_tokens > 0   # the cached prefix's int8 pages were reused
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    with Engine(model, target="llvm", max_batch=2, speculative_config=spec) as e:
        assert e.completions.create(prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text == ref


def test_a_mismatched_kv_cache_dtype_is_refused(builds):
    with pytest.raises(artifact.ArtifactError, match="compiled with int8.*kv_cache_dtype=auto"):
        Engine(builds("int8"), target="llvm", kv_cache_dtype="auto")
    with pytest.raises(artifact.ArtifactError, match="asked for --kv-cache-dtype int8 but it was compiled with auto"):
        Engine(builds("auto"), target="llvm", kv_cache_dtype="int8")
    with pytest.raises(EngineConfigError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")


def test_unsupported_targets_and_shapes_are_refused(hf_models, tmp_path):
    from mlcc.compiler.build import compile_model

    with pytest.raises(UnsupportedKVCacheDtypeError, match="cannot run on target 'webgpu'"):
        compile_model(hf_models("llama"), "webgpu", "q4f16_1", tmp_path / "webgpu",
                      options=CompileOptions(kv_cache_dtype="int8"))
    with pytest.raises(UnsupportedKVCacheDtypeError, match="run on one GPU; use --tensor-parallel-shards 1"):
        compile_model(hf_models("llama"), "cuda", "q4f16_1", tmp_path / "tp", tensor_parallel=2,
                      options=CompileOptions(kv_cache_dtype="int8"))
    assert "multiple of 4" in kv_cache_format.unsupported_reason("int8", 66)
    assert kv_cache_format.unsupported_reason("auto", 66) is None


# --- CUDA (schedules/cuda_quantized_kv_attention.py) ---------------------------------------------------------------


def _cuda_present() -> bool:
    import tvm

    from mlcc import tvm_compat

    tvm_compat.load_backend_runtimes("cuda")
    return tvm.cuda(0).exist


# (fp8_e4m3 builds the same kernels with another decode of the codes: slow, to keep CI's time)
@pytest.mark.parametrize("kv", ["int8", pytest.param("fp8_e4m3", marks=pytest.mark.slow)])
def test_cuda_builds_read_the_codes_with_their_own_kernels(hf_models, tmp_path, kv):
    """Every attention kernel that reads the cache or its byte outputs is mlcc's (TVM's would read the codes as
    numbers), and the library compiles."""
    import tvm

    from mlcc.compiler.build import compile_library, export_module
    from mlcc.compiler.quantize import get_quantization
    from mlcc.compiler.weights import load_source
    from mlcc.targets import get_target

    built = export_module(load_source(hf_models("llama")), get_target("cuda"), get_quantization("q4f16_1"),
                          options=CompileOptions(kv_cache_dtype=kv))
    symbols = {str(f.attrs["global_symbol"]) for f in built.mod.functions.values()
               if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and "global_symbol" in f.attrs}
    assert {"batch_decode_paged_kv_quantized", "batch_prefill_paged_kv_quantized",
            "batch_prefill_ragged_kv_quantized", "merge_state_inplace_quantized"} <= symbols
    assert not symbols & {"batch_decode_paged_kv", "batch_prefill_paged_kv", "batch_prefill_ragged_kv",
                          "tir_attention_merge_state"}
    compile_library(built, tmp_path / "model.so")


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_present(), reason="no CUDA device")
@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_cuda_quantized_cache_follows_the_cpu_one(hf_models, tmp_path, kv):
    """The CUDA build with a quantized cache against the CPU build with the same cache and weights (q4f16_1 both):
    the same prompt in two chunks, then 32 teacher-forced decode steps; the difference is float16 arithmetic
    (the parity tests' 2e-2), not the codes, which both quantize alike. And against CUDA's float cache, within the
    CPU's tolerance for the codes."""
    from mlcc.compiler.build import compile_model

    dirs = {}
    for target, cache in (("llvm", kv), ("cuda", kv), ("cuda", "auto")):
        dirs[target, cache] = tmp_path / f"{target}-{cache}"
        compile_model(hf_models("llama"), target, "q4f16_1", dirs[target, cache],
                      options=CompileOptions(kv_cache_dtype=cache))
    ref, ref_ids = _run(dirs["llvm", kv], None)
    got, _ = _run(dirs["cuda", kv], ref_ids)
    float_cache, _ = _run(dirs["cuda", "auto"], ref_ids)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel <= 2e-2, rel
    rel_float = np.abs(got - float_cache).max() / np.abs(float_cache).max()
    assert 0 < rel_float < TOLERANCE[kv] + 2e-2, rel_float
