"""mlcc's hand-written CUDA kernels (issue 4): which functions they replace, and that a CUDA library carries
complete source. Numerics need a GPU (marked `gpu`; bench/gemv_kernels.py and bench/decode.py check them on the
H200 against numpy and the CPU build)."""

import shutil
import subprocess

import numpy as np
import pytest
import tvm

from mlcc.compiler.build import compile_library, export_module
from mlcc.compiler.pipeline import fusion_passes
from mlcc.compiler.quantize import get_quantization, group_dequantize, group_quantize
from mlcc.compiler.weights import load_source
from mlcc.schedules import cuda_pdl
from mlcc.schedules.cuda_decode_attention import _decode_kernel_shape, make_split_decode, split_decode_attention_pass
from mlcc.schedules.cuda_gemv import (F16_HELPER_NAME, HELPER_NAME, ONE_SHIFT_HELPER_NAME, GemvShape, q4_helper_name,
                                      decode_gemv_pass, fuse_decode_gemvs, make_gemv, match_gemv)
from mlcc.schedules.cuda_gemv_tc import STEP_HELPERS
from mlcc.targets import get_target

# tiny llama of conftest: hidden 64, intermediate 128, 4 heads of 16 (2 kv heads), vocab 320
DECODE_PROJECTIONS = {(128, 64, "none"), (64, 64, "add"), (256, 64, "none"), (64, 128, "add"), (320, 64, "cast")}


def _fused(hf_models, kind: str = "llama", quant: str = "q4f16_1"):
    built = export_module(load_source(hf_models(kind)), get_target("cuda"), get_quantization(quant))
    with built.target:
        return built, tvm.transform.Sequential(fusion_passes(built.target))(built.mod)


def _prim_funcs(mod):
    return {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}


def test_every_decode_projection_and_only_those_get_the_q4_kernel(hf_models):
    _, mod = _fused(hf_models)
    matched = [s for s in map(match_gemv, _prim_funcs(mod).values()) if s is not None]
    assert {(s.n, s.k, s.epilogue) for s in matched} == DECODE_PROJECTIONS  # no prefill / batch functions
    assert {s.out_dtype for s in matched if s.epilogue == "cast"} == {"float32"}
    with get_target("cuda").tvm_target():
        after = decode_gemv_pass(mod)
    ours = [f for f in _prim_funcs(after).values() if HELPER_NAME in f.script()]
    assert len(ours) == len(matched)
    assert all(f.attrs["tirx.is_scheduled"] for f in ours)


def test_qwen2_qkv_bias_is_fused_as_an_add_epilogue(hf_models):
    _, mod = _fused(hf_models, "qwen2")
    matched = [s for s in map(match_gemv, _prim_funcs(mod).values()) if s is not None]
    assert GemvShape(128, 64, "add", (128,), "float16") in matched


def test_float32_models_keep_the_default_schedule(hf_models):
    _, mod = _fused(hf_models, quant="q4f32_1")
    assert not [f for f in _prim_funcs(mod).values() if match_gemv(f) is not None]


def test_q0f16_decode_projections_get_the_float16_kernel(hf_models):
    _, mod = _fused(hf_models, quant="q0f16")
    matched = [s for s in map(match_gemv, _prim_funcs(mod).values()) if s is not None]
    assert {(s.n, s.k, s.epilogue) for s in matched} == DECODE_PROJECTIONS
    assert {s.weights for s in matched} == {"float16"}
    with get_target("cuda").tvm_target():
        after = decode_gemv_pass(mod)
    assert len([f for f in _prim_funcs(after).values() if F16_HELPER_NAME in f.script()]) == len(matched)


@pytest.mark.parametrize("kind,quant,swiglu", [("llama", "q4f16_1", True), ("qwen2", "q0f16", True),
                                               ("gemma", "q4f16_1", False)])
def test_decode_norms_and_swiglu_fold_into_the_projections(hf_models, kind, quant, swiglu):
    """SwiGLU folds into gate_up for both weight formats (gemma's GeGLU does not); RMSNorm folds into the next
    projection."""
    built, mod = _fused(hf_models, kind, quant)
    with built.target:
        after = fuse_decode_gemvs(mod)
    decode = after["decode"].script()
    norm = True
    rms = "rms_" if norm else ""
    gate_up = f"fused_gemv_{rms}swiglu_128_64"
    assert (gate_up in decode) is swiglu
    assert ("rms_norm" not in decode) is norm
    if swiglu:
        # the split/silu/multiply kernel is gone from decode; prefill keeps its own
        assert "silu" not in decode and "silu" in after["prefill"].script()
        assert "rms_norm" in after["prefill"].script()
        assert after[after.get_global_var(gate_up)].attrs["tirx.is_scheduled"]
    if norm:
        assert "fused_gemv_rms_none_" in decode or "fused_gemv_rms_add_" in decode  # qkv (+bias)
        assert f"fused_gemv_rms_cast_{built.cfg.vocab_size}_64" in decode  # final norm + LM head


def test_pdl_launch_only_for_sm90_and_newer(hf_models, tmp_path):
    from mlcc.targets.toolchains import toolchain_for

    _, fused = _fused(hf_models)
    gemvs = {gv.name_hint: f for gv, f in fused.functions.items()
             if isinstance(f, tvm.tirx.PrimFunc) and match_gemv(f) is not None}
    for preset, want in (("cuda", True), ("cuda-sm80", False)):
        # (a fresh module each time: TVM's pass infra updates the module a pass is called on in place)
        mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in gemvs.items()})
        target = get_target(preset).tvm_target()
        assert cuda_pdl.supported(target) is want
        with target, toolchain_for("cuda"):  # as compile_library builds them: the pass picks the kernel variant
            ex = tvm.compile(decode_gemv_pass(mod), target, tir_pipeline=cuda_pdl.tir_pipeline_for(target))
        ex.export_library(str(tmp_path / f"{preset}.so"))
        data = (tmp_path / f"{preset}.so").read_bytes()
        assert (cuda_pdl.PDL_TAG.encode() in data) is want
        # each GEMV waits once, after its first weight loads (its own wait; the pass adds none)
        assert data.count(b"mlcc_pdl_wait();") == (len(gemvs) if want else 0)


def _lowered_for_graphs(built):
    """The build's Relax passes up to the CUDA-graph rewrite (the VM lowering after it hides the structure)."""
    from mlcc.compiler.graph_decode import add_graph_decode
    from mlcc.compiler.pipeline import relax_passes

    passes = relax_passes(built.target)
    upto = [p.info.name for p in passes].index("mlcc_rewrite_cuda_graph") + 1
    with built.target:
        return tvm.transform.Sequential(passes[:upto])(add_graph_decode(built.mod))


def test_decode_graph_captures_the_whole_step_attention_included(hf_models):
    from mlcc import artifact

    built, _ = _fused(hf_models)
    mod = _lowered_for_graphs(built)
    graph = mod[artifact.GRAPH_DECODE_FUNCTION].script()
    # one graph per step: only the embedding lookup and its copy, the lm_head (into the returned tensor) and the
    # replay are launched from the VM
    assert graph.count("vm.builtin.cuda_graph.run_or_capture") == 1
    assert " = embed(input_ids, " in graph and "graph_input_copy(" in graph
    assert "attention_with_fused_qkv" not in graph
    captured = [f.script() for gv, f in mod.functions.items() if "cuda_graph_capture" in gv.name_hint]
    assert len(captured) == 1
    assert captured[0].count(artifact.GRAPH_ATTENTION) == built.cfg.num_hidden_layers
    # graphs keyed by the cache and its metadata layout
    assert "R.shape([kv_cache_id, kv_layout])), 0, R.shape([kv_cache_id, kv_layout]))" in graph
    assert "run_or_capture" not in mod["decode"].script()  # plain decode launches from the VM (forks, fallback)


def test_decode_attention_splits_fill_the_gpu_for_few_kv_heads(monkeypatch):
    from mlcc.schedules.cuda_decode_attention import splits_for, supported, tokens_in_flight

    assert [splits_for(h) for h in (2, 3, 4, 8, 32)] == [64, 64, 32, 16, 16]
    # 1024 threads: head-dim lanes x query heads per KV head x tokens (Llama-3-8B, Qwen2.5-0.5B, SmolLM2, 8:1 GQA)
    assert [tokens_in_flight(*s) for s in ((8, 32, 128), (2, 14, 64), (3, 9, 64), (8, 64, 128))] == [8, 8, 16, 4]
    assert not supported(8, 128, 128)  # 16 query heads per KV head leave 2 tokens per step: TVM's kernel stays
    monkeypatch.setenv("MLCC_DECODE_SPLITS", "16")
    assert splits_for(2) == 16


def test_graph_layout_moves_every_four_pages():
    from mlcc.artifact import graph_decode_layout

    assert [graph_decode_layout(n, 16) for n in (1, 64, 65, 128, 129)] == [1, 1, 2, 2, 3]


def test_split_kv_decode_attention_replaces_tvms_kernel(hf_models):
    built, _ = _fused(hf_models)
    funcs = _prim_funcs(built.mod)
    assert _decode_kernel_shape(funcs["batch_decode_paged_kv"]) == (2, 4, 16, "float16", 16)
    assert _decode_kernel_shape(funcs["batch_decode_paged_kv_sliding_window"]) is None  # different signature
    after = _prim_funcs(split_decode_attention_pass(built.mod))
    assert "part_md" in after["batch_decode_paged_kv"].script()  # the split-KV kernel, same global symbol
    assert after["batch_decode_paged_kv"].attrs["global_symbol"] == "batch_decode_paged_kv"
    assert "part_md" not in after["batch_decode_paged_kv_sliding_window"].script()


@pytest.mark.parametrize("quant", ["q4f16_1", "q0f16"])
def test_cuda_library_source_carries_the_helpers_and_compiles(hf_models, tmp_path, quant):
    import re

    built, _ = _fused(hf_models, quant=quant)
    ex = compile_library(built, tmp_path / "model.so")

    def walk(m):
        yield m
        for i in m.imports:
            yield from walk(i)

    (cuda,) = [m for m in walk(ex.mod) if m.kind == "cuda"]
    src = cuda.inspect_source()
    # every mlcc helper a kernel calls is defined, once (a missing one fails only in NVRTC, at load on the GPU)
    called = set(re.findall(r"\b(mlcc_\w+)\(", src))
    defined = re.findall(r"__device__ __forceinline__ [\w ]+?\b(mlcc_\w+)\(", src)
    assert called <= set(defined) and len(defined) == len(set(defined)), called - set(defined)
    helper = q4_helper_name() if quant == "q4f16_1" else F16_HELPER_NAME
    assert src.count(f"{helper}(") > 10                                 # the decode GEMVs call it
    assert "argmax_partial_kernel" in src and "argmax_merge_kernel" in src
    assert "part_md" in src  # split-KV decode attention
    assert src.count("void mlcc_pdl_wait()") == 1 and src.count("mlcc_pdl_wait();") > 10  # every kernel waits
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return  # the source checks above still ran; NVRTC compiles it at load on a GPU machine
    (tmp_path / "k.cu").write_text(src)
    r = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-o", str(tmp_path / "k.cubin"), str(tmp_path / "k.cu")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.gpu
def test_decode_graph_matches_plain_decode_on_the_gpu(hf_models, tmp_path):
    """Two sequences of one cache fed the same tokens, one through decode_graph and one through decode, across
    four metadata layouts; then a new sequence on other pages replays the cached graphs."""
    from mlcc.compiler.build import compile_model
    from mlcc.runtime.model import LoadedModel

    compile_model(hf_models("llama"), "cuda", "q4f16_1", tmp_path / "m")
    m = LoadedModel(tmp_path / "m")
    assert m._decode_graph is not None
    m.create_kv_cache(4, 2048, 256)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, m.vocab, 240).tolist()

    def run(seq: int, graph: bool) -> list[np.ndarray]:
        keep, m._decode_graph = m._decode_graph, (m._decode_graph if graph else None)
        try:
            m.add_sequence(seq)
            out = [m.prefill([seq], [tokens[:7]]).numpy()]
            out += [m.decode([seq], [t]).numpy() for t in tokens[7:]]
        finally:
            m._decode_graph = keep
        return out

    plain, graph = run(1, False), run(2, True)
    m.remove_sequence(2)
    again = run(3, True)
    m.create_kv_cache(1, 1024, 256)  # other buffers: the graphs of the first cache must not be replayed
    other_cache = run(1, True)
    for step, (p, g, a, o) in enumerate(zip(plain, graph, again, other_cache)):
        np.testing.assert_array_equal(g, p, err_msg=f"step {step}")
        np.testing.assert_array_equal(a, p, err_msg=f"step {step}")
        np.testing.assert_array_equal(o, p, err_msg=f"step {step}")


@pytest.mark.gpu
@pytest.mark.parametrize("graph,tail", [(True, False), (True, True), (False, False)])
def test_pipelined_decode_matches_the_synchronous_loop_on_the_gpu(hf_models, tmp_path, monkeypatch, graph, tail):
    """Greedy ids of the engine's pipelined loop (ids fed back on the device, read one step late through pinned
    memory and a CUDA event) against decode + argmax + read per step; then a stop mid-way and a fresh sequence;
    then seeded sampling both ways. tail: the next step's KV metadata queued once the previous step has passed its
    last KV-cache read (MLCC_STEP_TAIL=1), not its end."""
    from mlcc.compiler.build import compile_model
    from mlcc.runtime.decode_pipeline import decode_pipelined
    from mlcc.runtime.model import LoadedModel
    from mlcc.runtime.sampler import DeviceDraw
    from mlcc.runtime.token_fetch import TokenFetcher

    compile_model(hf_models("llama"), "cuda", "q4f16_1", tmp_path / "m")
    monkeypatch.setenv("MLCC_STEP_TAIL", "1" if tail else "0")
    m = LoadedModel(tmp_path / "m")
    assert (m._tail_event is not None) is tail
    if not graph:
        m._decode_graph = None
    fetcher = TokenFetcher(m.dev)
    assert fetcher.overlaps
    argmax = m.vm["argmax_logits"]
    m.create_kv_cache(4, 2048, 256)
    prompt, steps = [7, 1, 99, 300, 42], 120

    def first(seq: int) -> int:
        m.add_sequence(seq)
        return int(argmax(m.prefill([seq], [prompt])).numpy()[0])

    want = [first(0)]
    for _ in range(steps):
        want.append(int(argmax(m.decode([0], [want[-1]])).numpy()[0]))

    def pipelined(seq: int, stop_after: int | None = None) -> list[int]:
        got = [first(seq)]
        decode_pipelined(m, seq, got[0], DeviceDraw(argmax), fetcher,
                         lambda in_flight: len(got) + in_flight <= steps,
                         lambda t: got.append(t) or len(got) != stop_after)
        return got

    assert pipelined(1) == want
    assert pipelined(2, stop_after=30) == want[:30]   # the step queued behind the stop is dropped
    m.remove_sequence(2)
    assert pipelined(3) == want
    # the KV cache holds what was decoded: one more synchronous step on each sequence agrees
    nxt = [int(argmax(m.decode([s], [want[-1]])).numpy()[0]) for s in (0, 1, 3)]
    assert nxt[0] == nxt[1] == nxt[2]

    # seeded sampling on the device: the synchronous sampler and the pipelined draw take the same uniforms
    from mlcc.runtime.sampler import Sampler, SamplingParams

    sampler = Sampler(m.vocab, argmax, m.vm["sample_top_p_top_k"], m._to_dev)
    p = SamplingParams(temperature=0.8, top_p=0.9)
    m.create_kv_cache(2, 2048, 256)
    runs = []
    for seq, pipe in ((0, False), (1, True)):
        rng = np.random.default_rng(3)
        m.add_sequence(seq)
        got = sampler.sample(m.prefill([seq], [prompt]), [p], [[]], [rng])
        if pipe:
            decode_pipelined(m, seq, got[0], sampler.device_draw(p, rng), fetcher,
                             lambda in_flight: len(got) + in_flight <= 40, lambda t: got.append(t) or True)
        else:
            while len(got) <= 40:
                got += sampler.sample(m.decode([seq], [got[-1]]), [p], [[]], [rng])
        runs.append(got)
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


GEMV_CASES = [
    (4096, 4096, "add", False), (1000, 896, "none", False), (320, 64, "cast", False), (4096, 14336, "add", False),
    (4864, 896, "swiglu", False), (128, 64, "swiglu", False),
    (6144, 4096, "none", True), (1000, 896, "add", True), (320, 64, "cast", True), (14336, 4096, "swiglu", True),
    (1536, 576, "swiglu", True), (1000, 4000, "add", False), (8, 4096, "cast", True)]


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("weights", ["q4f16_1", "float16"])
@pytest.mark.parametrize("n,k,epilogue,norm", GEMV_CASES)
def test_gemv_kernel_matches_numpy_on_the_gpu(n, k, epilogue, norm, weights, pdl, max_blocks=None, contiguous=False):
    from mlcc.targets.toolchains import toolchain_for

    if not tvm.cuda(0).exist:
        pytest.fail("marked gpu but no CUDA device")
    rng = np.random.default_rng(0)
    n_w = 2 * n if epilogue == "swiglu" else n
    w = rng.standard_normal((n_w, k)).astype(np.float32) * 0.05
    if weights == "q4f16_1":
        q = get_quantization("q4f16_1")
        packed, scale = group_quantize(w, q)
        weight_args, w = [packed, scale], group_dequantize(packed, scale, q)
    else:
        w = w.astype(np.float16)
        weight_args = [w]
    x = rng.standard_normal((1, 1, k)).astype(np.float16)
    res = rng.standard_normal((1, 1, n)).astype(np.float16)
    out_dtype = "float32" if epilogue == "cast" else "float16"
    shape = GemvShape(n, k, epilogue, (1, 1, n) if epilogue == "add" else (), out_dtype, weights,
                      1e-5 if norm else None)
    x_in = [x]
    if norm:  # the un-normalized residual stream (larger values) and the norm weight; x becomes rms_norm's output
        h = (x.astype(np.float32) * 7).astype(np.float16)
        g = (1 + 0.3 * rng.standard_normal(k)).astype(np.float16)
        hf = h.astype(np.float32)
        x = (hf / np.sqrt((hf * hf).mean() + 1e-5) * g.astype(np.float32)).astype(np.float16)
        x_in = [h, g]
    target = get_target("cuda").tvm_target()
    with target, toolchain_for("cuda"):
        kernel = make_gemv(shape, pdl=pdl, max_blocks=max_blocks, contiguous=contiguous) \
            .with_attr("global_symbol", "main")
        lib = tvm.compile(tvm.IRModule({"main": kernel}), target,
                          tir_pipeline=cuda_pdl.tir_pipeline_for(target) if pdl else "default")
    dev = tvm.cuda(0)
    args = x_in + weight_args + ([res] if epilogue == "add" else []) + [np.zeros((1, 1, n), out_dtype)]
    args = [tvm.runtime.tensor(a, dev) for a in args]
    lib["main"](*args)
    want = w.astype(np.float32) @ x.reshape(-1).astype(np.float32)
    if epilogue == "add":
        want = want + res.reshape(-1)
    if epilogue == "swiglu":
        gate, up = (want[:n].astype(np.float16).astype(np.float32), want[n:].astype(np.float16).astype(np.float32))
        want = gate / (1 + np.exp(-gate)) * up
    got = args[-1].numpy().reshape(-1).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("weights", ["q4f16_1", "float16"])
@pytest.mark.parametrize("n,k,epilogue,norm", [(4096, 14336, "add", False), (14336, 4096, "swiglu", True),
                                               (1000, 896, "add", True), (320, 64, "cast", False)])
def test_grid_capped_gemv_matches_numpy_on_the_gpu(n, k, epilogue, norm, weights, contiguous):
    """max_blocks=7: every block loops over several row blocks (interleaved bx, bx + grid, ... or one contiguous
    run), the last round partly idle (the staged RMSNorm input, the K-split reduction buffer and the float16 sum
    of squares reused across rounds)."""
    test_gemv_kernel_matches_numpy_on_the_gpu(n, k, epilogue, norm, weights, True, max_blocks=7,
                                              contiguous=contiguous)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,epilogue,norm", [(4096, 14336, "add", False), (14336, 4096, "swiglu", True),
                                               (320, 64, "cast", False)])
def test_one_shift_q4_unpacking_matches_numpy_on_the_gpu(monkeypatch, n, k, epilogue, norm):
    """The two-shift unpacking (MLCC_Q4_ONE_SHIFT=0; one shift per word is the default) computes the same GEMV."""
    monkeypatch.setenv("MLCC_Q4_ONE_SHIFT", "0")
    monkeypatch.setenv("MLCC_Q4_KERNEL", "cuda-core")
    test_gemv_kernel_matches_numpy_on_the_gpu(n, k, epilogue, norm, "q4f16_1", True)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["sub", "bias"])
@pytest.mark.parametrize("n,k,epilogue,norm", GEMV_CASES)
def test_tensor_core_q4_gemv_matches_numpy_on_the_gpu(monkeypatch, n, k, epilogue, norm, variant):
    """The tensor-core q4 kernel (MLCC_Q4_KERNEL=tc; codes as fp16 subnormals or 1024 + code) on every shape the
    CUDA-core kernel is tested on: row tails, partial chunks of four groups, K split unevenly, every epilogue."""
    monkeypatch.setenv("MLCC_Q4_KERNEL", "tc")
    monkeypatch.setenv("MLCC_Q4_TC_VARIANT", variant)
    test_gemv_kernel_matches_numpy_on_the_gpu(n, k, epilogue, norm, "q4f16_1", True)


def test_q4_kernel_choice_follows_mlcc_q4_kernel(monkeypatch):
    from mlcc.schedules.cuda_gemv import q4_kernel

    short, long_ = GemvShape(4096, 4096, "add", (1, 1, 4096)), GemvShape(14336, 4096, "swiglu")
    monkeypatch.delenv("MLCC_Q4_KERNEL", raising=False)
    assert q4_kernel(short) == q4_kernel(long_) == "cuda-core"
    monkeypatch.setenv("MLCC_Q4_KERNEL", "auto")
    assert (q4_kernel(short), q4_kernel(long_)) == ("tc", "cuda-core")  # 8 MiB vs 56 MiB of codes
    monkeypatch.setenv("MLCC_Q4_KERNEL", "tensor")
    with pytest.raises(ValueError, match="MLCC_Q4_KERNEL='tensor'"):
        q4_kernel(short)


def _assert_kernel_calls_and_compiles(shape: GemvShape, helper: str, tmp_path) -> None:
    """The kernel make_gemv builds for `shape` calls `helper`, and nvcc (where present) compiles its source."""
    from mlcc.targets.toolchains import toolchain_for

    target = get_target("cuda").tvm_target()
    with target, toolchain_for("cuda"):
        kernel = make_gemv(shape).with_attr("global_symbol", "main")
        lib = tvm.compile(tvm.IRModule({"main": kernel}), target)
    (cuda,) = [m for m in lib.mod.imports if m.kind == "cuda"]
    src = cuda.inspect_source()
    assert f"{helper}(" in src.split("extern \"C\" __global__", 1)[1]  # the kernel calls it
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return
    (tmp_path / "k.cu").write_text(src)
    r = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-o", str(tmp_path / "k.cubin"), str(tmp_path / "k.cu")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_tensor_core_q4_gemv_is_used_and_compiles(monkeypatch, tmp_path):
    monkeypatch.setenv("MLCC_Q4_KERNEL", "tc")
    _assert_kernel_calls_and_compiles(GemvShape(1536, 576, "swiglu", norm_eps=1e-5), STEP_HELPERS["sub"], tmp_path)


def test_tensor_core_bias_variant_is_used_and_compiles(monkeypatch, tmp_path):
    """Its step helper calls cuda_gemv's mlcc_lop3_and_or: cuda_source adds that group too, ahead of its caller."""
    monkeypatch.setenv("MLCC_Q4_KERNEL", "tc")
    monkeypatch.setenv("MLCC_Q4_TC_VARIANT", "bias")
    _assert_kernel_calls_and_compiles(GemvShape(1536, 576, "swiglu", norm_eps=1e-5), STEP_HELPERS["bias"], tmp_path)


def test_helpers_called_by_helpers_are_added_once_before_their_callers():
    from mlcc.schedules.cuda_source import add_cuda_helpers

    kernel = 'extern "C" __global__ void k(unsigned* p) { mlcc_q4tc_step_bias(0, p, p, p); }'
    code = add_cuda_helpers(kernel)
    lop3, step = code.index("unsigned mlcc_lop3_and_or("), code.index("void mlcc_q4tc_step_bias(")
    assert lop3 < step < code.index(kernel)
    assert code.count("unsigned mlcc_lop3_and_or(") == 1 and "mlcc_pdl_wait" not in code
    assert add_cuda_helpers(code) == code  # a second pass adds nothing


def test_one_shift_q4_unpacking_is_called_and_compiles(monkeypatch, tmp_path):
    monkeypatch.setenv("MLCC_Q4_ONE_SHIFT", "1")
    monkeypatch.setenv("MLCC_Q4_KERNEL", "cuda-core")
    _assert_kernel_calls_and_compiles(GemvShape(4096, 14336, "add", (1, 1, 4096)), ONE_SHIFT_HELPER_NAME, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("h_kv,h_qo,d", [(8, 32, 128), (3, 9, 64)])
@pytest.mark.parametrize("lens", [[1], [17], [700], [5, 300, 1500]])
def test_split_kv_decode_attention_matches_numpy_on_the_gpu(h_kv, h_qo, d, lens):
    import math

    if not tvm.cuda(0).exist:
        pytest.fail("marked gpu but no CUDA device")
    rng = np.random.default_rng(0)
    page = 16
    n_pages = [-(-n // page) for n in lens]
    pages = (rng.standard_normal((sum(n_pages) + 2, 2, h_kv, page, d)) * 0.5).astype(np.float16)
    values = rng.permutation(sum(n_pages) + 2)[:sum(n_pages)].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    last = np.array([n - (p - 1) * page for n, p in zip(lens, n_pages)], np.int32)
    q = rng.standard_normal((len(lens), h_qo, d)).astype(np.float16)
    lib = tvm.compile(tvm.IRModule({"main": make_split_decode(h_kv, h_qo, d, "float16", page)
                                    .with_attr("global_symbol", "main")}), get_target("cuda").tvm_target())
    dev = tvm.cuda(0)
    zeros = np.zeros(len(lens), np.int32)
    args = [tvm.runtime.tensor(x, dev) for x in (q, pages, indptr, values, last, zeros, zeros, np.zeros_like(q),
                                                  np.zeros((len(lens), h_qo), np.float32))]
    sm = 1 / math.sqrt(d)
    lib["main"](*args, 0, 1.0, 10000.0, sm)
    for i, n in enumerate(lens):
        pg = values[indptr[i]:indptr[i + 1]]
        k = pages[pg, 0].transpose(1, 0, 2, 3).reshape(h_kv, -1, d)[:, :n].astype(np.float32)
        v = pages[pg, 1].transpose(1, 0, 2, 3).reshape(h_kv, -1, d)[:, :n].astype(np.float32)
        for h in range(h_qo):
            s = k[h // (h_qo // h_kv)] @ q[i, h].astype(np.float32) * sm
            p = np.exp(s - s.max())
            np.testing.assert_allclose(args[7].numpy()[i, h].astype(np.float32), p @ v[h // (h_qo // h_kv)] / p.sum(),
                                       atol=2e-2)
            assert abs(args[8].numpy()[i, h] - (s.max() + np.log(p.sum())) * math.log2(math.e)) < 1e-2


def test_wide_prefill_attention_is_tvms_kernel_with_a_bigger_grid(hf_models, monkeypatch):
    """Rebuilt with TVM's own grid size, each prefill kernel is structurally identical to TVM's: the shapes,
    dtype and flags we read back from the original are the ones it was built with."""
    from mlcc.schedules import cuda_prefill_attention as cpa

    built, _ = _fused(hf_models)
    funcs = _prim_funcs(built.mod)
    target = get_target("cuda").tvm_target()
    monkeypatch.setattr(cpa, "_num_blocks", lambda h_kv: 16)
    for name, kind in (("batch_prefill_ragged_kv", "ragged"), ("batch_prefill_paged_kv", "paged")):
        tvm.ir.assert_structural_equal(cpa._rebuild(kind, funcs[name], target), funcs[name])
    monkeypatch.undo()
    with target:
        wide = _prim_funcs(cpa.wide_prefill_attention_pass(built.mod))
    assert 'thread_binding(528, thread="blockIdx.x")' in wide["batch_prefill_ragged_kv"].script()
    assert 'thread_binding(16, thread="blockIdx.x")' in wide["batch_prefill_paged_kv_sliding_window"].script()
