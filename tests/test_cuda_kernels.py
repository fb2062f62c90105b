"""mlcc's hand-written CUDA kernels: which functions they replace, the launch shapes they choose, and what
CompileOptions turn off (on the CPU); their numerics against numpy (marked gpu). Compiling the generated source with
NVRTC is test_cuda_nvrtc.py; the runtime on the GPU (decode graph, pipelined decode) is test_gpu_runtime.py."""

import pytest
import tvm

from mlcc.compiler.build import compile_library, export_module
from mlcc.compiler.gemv_fusion import fuse_decode_gemvs
from mlcc.compiler.pipeline import fusion_passes, kernel_passes
from mlcc.compiler.quantize import get_quantization
from mlcc.compiler.weights import load_source
from mlcc.options import CompileOptions
from mlcc.schedules import cuda_decode_attention as cda
from mlcc.schedules import cuda_pdl
from mlcc.schedules.cuda_gemv import E4M3_HELPER, F16_HELPER, Q4_HELPER, Q8_HELPER, decode_gemv_pass, launch_config
from mlcc.schedules.cuda_source import add_cuda_helpers
from mlcc.schedules.gemv_match import GemvShape, match_gemv
from mlcc.targets import get_target
from mlcc.tvm_compat import cuda_source_postproc

# tiny llama of conftest: hidden 64, intermediate 128, 4 heads of 16 (2 kv heads), vocab 320
DECODE_PROJECTIONS = {(128, 64, "none"), (64, 64, "add"), (256, 64, "none"), (64, 128, "add"), (320, 64, "cast")}
MAX_THREADS = 1024
H200_SMS = 132


def _fused(hf_models, kind: str = "llama", quant: str = "q4f16_1", options: CompileOptions | None = None):
    built = export_module(load_source(hf_models(kind)), get_target("cuda"), get_quantization(quant), options=options)
    with built.target:
        return built, tvm.transform.Sequential(fusion_passes(built.target))(built.mod)


def _prim_funcs(mod):
    return {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}


def _launches(func) -> list[dict]:
    """The kernels of a PrimFunc, in order, each as {thread tag: extent} of its thread-bound loops ("blockIdx.x",
    "threadIdx.y", ...; a symbolic extent as its expression)."""
    launches: list[dict] = []

    def visit(node, launch):
        if isinstance(node, tvm.tirx.For) and node.thread_binding is not None:
            if launch is None:  # the outermost thread loop starts a kernel
                launch = {}
                launches.append(launch)
            e = node.extent
            launch[node.thread_binding.thread_tag] = int(e) if isinstance(e, tvm.tirx.IntImm) else e
        for attr in ("body", "block", "then_case", "else_case", "init"):
            child = getattr(node, attr, None)
            if isinstance(child, tvm.tirx.Stmt):
                visit(child, launch)
        for child in getattr(node, "seq", None) or []:
            visit(child, launch)

    visit(func.body, None)
    return launches


def _threads(launch: dict) -> int:
    return launch.get("threadIdx.x", 1) * launch.get("threadIdx.y", 1) * launch.get("threadIdx.z", 1)


def test_every_decode_projection_and_only_those_get_the_q4_kernel(hf_models):
    _, mod = _fused(hf_models)
    matched = [s for s in map(match_gemv, _prim_funcs(mod).values()) if s is not None]
    assert {(s.n, s.k, s.epilogue) for s in matched} == DECODE_PROJECTIONS  # no prefill / batch functions
    assert {s.out_dtype for s in matched if s.epilogue == "cast"} == {"float32"}
    with get_target("cuda").tvm_target():
        after = decode_gemv_pass(pdl=True)(mod)
    ours = [f for f in _prim_funcs(after).values() if Q4_HELPER in f.script()]
    assert len(ours) == len(matched)
    assert all(f.attrs["tirx.is_scheduled"] for f in ours)


def test_e4m3_decode_projections_get_the_e4m3_kernel_and_the_lm_head_the_float16_one(hf_models):
    _, mod = _fused(hf_models, quant="e4m3_e4m3_f16")
    matched = [s for s in map(match_gemv, _prim_funcs(mod).values()) if s is not None]
    assert {(s.n, s.k, s.epilogue) for s in matched} == DECODE_PROJECTIONS
    assert {s.weights for s in matched if s.epilogue != "cast"} == {"e4m3_e4m3_f16"}
    assert {s.weights for s in matched if s.epilogue == "cast"} == {"float16"}
    with get_target("cuda").tvm_target():
        after = decode_gemv_pass(pdl=True)(mod)
    assert len([f for f in _prim_funcs(after).values() if E4M3_HELPER in f.script()]) == len(matched) - 1


def test_e4m3_helper_bit_moves_give_every_code_over_256():
    """e4m3_gemv.cuh's decode (byte_perm to bytes 1/3, then (t >> 1) & 0x3F803F80 | t & 0x80008000), replayed in
    numpy on every code: the fp16 it builds is the code's value / 256, zero and subnormals included."""
    import ml_dtypes
    import numpy as np

    b = np.arange(256, dtype=np.uint32)
    t = b << 8
    h = (((t >> 1) & 0x3F80) | (t & 0x8000)).astype(np.uint16).view(np.float16).astype(np.float32) * 256
    want = b.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(h[finite], want[finite])


def test_int8_decode_projections_and_the_lm_head_get_the_int8_kernel(hf_models):
    _, mod = _fused(hf_models, quant="q8f16_1")
    matched = [s for s in map(match_gemv, _prim_funcs(mod).values()) if s is not None]
    assert {(s.n, s.k, s.epilogue) for s in matched} == DECODE_PROJECTIONS
    assert {s.weights for s in matched} == {"q8f16_1"}   # the LM head is int8 too
    with get_target("cuda").tvm_target():
        after = decode_gemv_pass(pdl=True)(mod)
    ours = [f for f in _prim_funcs(after).values() if Q8_HELPER in f.script()]
    assert len(ours) == len(matched) and not [f for f in ours if Q4_HELPER in f.script()]


def test_int8_helper_decode_gives_every_code_over_128():
    """q8_gemv.cuh's decode, replayed in numpy on every byte in both positions of a half pair: PRMT under a 0x64
    byte (1024 + code in fp16), then x 1/128 - 9 in fp16, is (code - 128) / 128 exactly."""
    import numpy as np

    b = np.arange(256, dtype=np.uint16)
    h = (0x6400 | b).view(np.float16)
    assert (h.astype(np.float32) == 1024 + b).all()
    got = h * np.float16(1 / 128) + np.float16(-9)   # (both steps exact in fp16: no rounding to reorder)
    np.testing.assert_array_equal(got.astype(np.float32), (b.astype(np.float32) - 128) / 128)
    assert np.float16(1 / 128).view(np.uint16) == 0x2000 and np.float16(-9).view(np.uint16) == 0xC880


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
        after = decode_gemv_pass(pdl=True)(mod)
    assert len([f for f in _prim_funcs(after).values() if F16_HELPER in f.script()]) == len(matched)


@pytest.mark.parametrize("kind,quant,act", [("llama", "q4f16_1", "swiglu"), ("qwen2", "q0f16", "swiglu"),
                                            ("gemma", "q4f16_1", "geglu")])
def test_decode_norms_and_gated_mlp_fold_into_the_projections(hf_models, kind, quant, act):
    """SwiGLU (and Gemma's tanh GeGLU) folds into gate_up for both weight formats; every RMSNorm folds into the
    projection after it, in decode only."""
    built, mod = _fused(hf_models, kind, quant)
    with built.target:
        after = fuse_decode_gemvs(mod, pdl=True)
    decode, prefill = after["decode"].script(), after["prefill"].script()
    gate_up = f"fused_gemv_rms_{act}_128_64"
    assert gate_up in decode
    assert "rms_norm" not in decode and "rms_norm" in prefill
    assert "fused_gemv_rms_none_" in decode or "fused_gemv_rms_add_" in decode  # qkv (+bias)
    assert f"fused_gemv_rms_cast_{built.cfg.vocab_size}_64" in decode  # final norm + LM head
    # the split/activation/multiply kernel is gone from decode; prefill keeps its own
    word = "silu" if act == "swiglu" else "gelu"
    assert word not in decode and word in prefill
    assert after[after.get_global_var(gate_up)].attrs["tirx.is_scheduled"]


def test_pdl_launch_only_for_sm90_and_newer(hf_models, tmp_path):
    _, fused = _fused(hf_models)
    gemvs = {gv.name_hint: f for gv, f in fused.functions.items()
             if isinstance(f, tvm.tirx.PrimFunc) and match_gemv(f) is not None}
    options = CompileOptions()
    for preset, want in (("cuda", True), ("cuda-sm80", False)):
        # (a fresh module each time: TVM's pass infra updates the module a pass is called on in place)
        mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in gemvs.items()})
        target = get_target(preset).tvm_target()
        assert cuda_pdl.enabled(target, options) is want
        with target, cuda_source_postproc(add_cuda_helpers):
            ex = tvm.compile(decode_gemv_pass(pdl=want)(mod), target,
                             tir_pipeline=cuda_pdl.tir_pipeline_for(target, options))
        ex.export_library(str(tmp_path / f"{preset}.so"))
        data = (tmp_path / f"{preset}.so").read_bytes()
        assert (cuda_pdl.PDL_TAG.encode() in data) is want
        # each GEMV waits once, after its first weight loads (its own wait; the pass adds none)
        assert data.count(b"mlcc_pdl_wait();") == (len(gemvs) if want else 0)


@pytest.mark.parametrize("n,k,weights", [(4096, 4096, "q4f16_1"), (14336, 4096, "q4f16_1"), (4096, 14336, "q4f16_1"),
                                         (896, 896, "q4f16_1"), (320, 64, "q4f16_1"), (8, 4096, "q4f16_1"),
                                         (4096, 4096, "float16"), (28672, 4096, "float16"), (64, 128, "float16")])
def test_gemv_launch_config_covers_k_within_block_limits(n, k, weights):
    """Every unit of a row is read by exactly one lane of one K-split warp, lanes and splits are powers of two,
    and a block stays within the thread limit."""
    units = k // (32 if weights == "q4f16_1" else 8)
    lanes, rows, row_warps, ksplit = launch_config(n, units, weights)
    assert all(v & (v - 1) == 0 for v in (lanes, rows, row_warps, ksplit))
    # as many lanes as a row has units, up to a warp (at least 4)
    assert 4 <= lanes <= 32 and (lanes <= units or lanes == 4) and (lanes == 32 or units < 2 * lanes)
    assert 1 <= ksplit <= 8 and (ksplit == 1 or lanes * ksplit <= units)  # every K-split warp has units to read
    assert row_warps * ksplit * 32 <= MAX_THREADS


def test_decode_graph_captures_the_whole_step_attention_included(hf_models):
    from mlcc import artifact
    from mlcc.compiler.graph_decode import add_graph_decode
    from mlcc.compiler.pipeline import relax_passes

    built, _ = _fused(hf_models)
    passes = relax_passes(built.target, None, built.options)
    upto = [p.info.name for p in passes].index("mlcc_rewrite_cuda_graph") + 1  # the VM lowering after it hides it
    with built.target:
        mod = tvm.transform.Sequential(passes[:upto])(add_graph_decode(built.mod))
    graph = mod[artifact.GRAPH_DECODE_FUNCTION].script()
    # one graph per step: only the embedding lookup and its copy, the lm_head (into the returned tensor) and the
    # replay are launched from the VM
    assert graph.count("vm.builtin.cuda_graph.run_or_capture") == 1
    assert " = embed(input_ids, " in graph and "graph_input_copy(" in graph
    assert "attention_with_fused_qkv" not in graph
    captured = [f.script() for gv, f in mod.functions.items() if "cuda_graph_capture" in gv.name_hint]
    assert len(captured) == 1
    assert captured[0].count(artifact.GRAPH_ATTENTION) == built.cfg.num_hidden_layers
    assert "run_or_capture" not in mod["decode"].script()  # plain decode launches from the VM (forks, fallback)


# (KV heads, query heads, head dim): Llama-3-8B, Qwen2.5-0.5B, SmolLM2-135M, 8:1 GQA, MQA, MHA, 16:1 GQA
ATTENTION_SHAPES = [(8, 32, 128), (2, 14, 64), (3, 9, 64), (8, 64, 128), (1, 8, 64), (32, 32, 128), (8, 128, 128)]


@pytest.mark.parametrize("h_kv,h_qo,d", ATTENTION_SHAPES)
def test_decode_attention_launch_fills_the_gpu_within_block_limits(h_kv, h_qo, d):
    splits = cda.splits_for(h_kv)
    assert splits & (splits - 1) == 0 and 16 <= splits <= 64
    # enough blocks at batch 1 (or the most chunks), and no more chunks than that takes
    assert splits * h_kv >= cda.BLOCKS_WANTED or splits == 64
    assert splits == 16 or splits // 2 * h_kv < cda.BLOCKS_WANTED
    tp = cda.tokens_in_flight(h_kv, h_qo, d)
    threads = (d // cda.VEC) * (h_qo // h_kv) * tp
    assert tp & (tp - 1) == 0 and tp <= cda.MAX_TOKENS_IN_FLIGHT and threads <= MAX_THREADS
    assert tp == cda.MAX_TOKENS_IN_FLIGHT or threads * 2 > MAX_THREADS  # the most that fit
    assert cda.supported(h_kv, h_qo, d) is (tp >= 4)  # (all these head dims split over 8-32 lanes)
    if not cda.supported(h_kv, h_qo, d):
        return
    chunks, merge = _launches(cda.make_split_decode(h_kv, h_qo, d, "float16", 16))
    # every chunk at batch 1; fewer a sequence as the batch grows (active_splits)
    assert _at_batch(chunks["blockIdx.y"], 1) == h_kv * splits and _threads(chunks) == threads
    assert _at_batch(chunks["blockIdx.y"], 4096) == h_kv
    assert merge["blockIdx.y"] == h_qo and _threads(merge) <= 32  # one warp per query head


def _at_batch(extent, batch: int) -> int:
    """A launch extent that depends on the kernel's batch size, at that batch size."""
    from tvm.sym.analyzer import Analyzer

    if isinstance(extent, int):
        return extent
    analyzer = Analyzer()
    for var in tvm.tirx.analysis.undefined_vars(extent):
        analyzer.bind(var, batch)
    return int(analyzer.simplify(extent))


def _active_splits(batch: int, h_kv: int, splits: int) -> int:
    return _at_batch(cda.active_splits(tvm.tirx.Var("B", "int32"), h_kv, splits), batch)


@pytest.mark.parametrize("h_kv", [1, 2, 8, 32])
def test_decode_attention_chunks_shrink_as_the_batch_fills_the_gpu(h_kv):
    splits = cda.splits_for(h_kv)
    counts = [_active_splits(b, h_kv, splits) for b in (1, 2, 4, 16, 64, 256, 1024)]
    assert counts[0] == splits and counts[-1] == 1 and counts == sorted(counts, reverse=True)
    for b, s in zip((1, 2, 4, 16, 64, 256, 1024), counts):
        # enough blocks while chunks remain to be split, and no more than one step's worth past GRID_BLOCKS
        assert b * h_kv * s >= cda.GRID_BLOCKS or s == splits
        assert s == 1 or b * h_kv * (s - 1) < cda.GRID_BLOCKS


def test_decode_attention_splits_and_tokens_follow_the_options():
    assert cda.splits_for(2, 16) == 16 and cda.splits_for(8, 3) == 3
    assert cda.tokens_in_flight(8, 32, 128, 4) == 4 and cda.tokens_in_flight(2, 14, 64, 2) == 2
    assert not cda.supported(8, 32, 128, tokens=2)  # fewer than 4 in flight: TVM's kernel stays
    chunks, _ = _launches(cda.make_split_decode(8, 32, 128, "float16", 16, splits=24, tokens=4))
    assert chunks["blockIdx.y"] == 8 * 24 and chunks["threadIdx.z"] == 4


def test_graph_layout_moves_every_four_pages():
    from mlcc.artifact import graph_decode_layout

    assert [graph_decode_layout(n, 16) for n in (1, 64, 65, 128, 129)] == [1, 1, 2, 2, 3]


def test_sliding_layers_graph_layout_follows_both_page_tables():
    from mlcc.runtime.device.graph_decode import decode_layout

    # window 64, pages of 16: the window spans 4 pages when it starts on a page boundary, else 5 (TVM's
    # GetLayerSlidingWindowNumPages); the key is (page table in blocks of 4, window pages in blocks of 4)
    assert decode_layout(65, 16, 64) == 2 << 20 | 2    # 5 pages, the window starts 1 token into its first page
    assert decode_layout(80, 16, 64) == 2 << 20 | 1    # 5 pages, the window is pages 2-5 exactly
    assert decode_layout(81, 16, 64) == 2 << 20 | 2
    assert decode_layout(40, 16, 64) == 1 << 20 | 1    # shorter than the window: the same pages as the table
    assert decode_layout(1000, 16, 0) == decode_layout(1000, 16) == 16


def test_split_kv_decode_attention_replaces_tvms_kernel(hf_models):
    built, _ = _fused(hf_models)
    funcs = _prim_funcs(built.mod)
    assert cda._decode_kernel_shape(funcs["batch_decode_paged_kv"]) == (2, 4, 16, "float16", 16, False)
    assert cda._decode_kernel_shape(funcs["batch_decode_paged_kv_sliding_window"]) == (2, 4, 16, "float16", 16, True)
    after = _prim_funcs(cda.split_decode_attention_pass()(built.mod))
    for name in ("batch_decode_paged_kv", "batch_decode_paged_kv_sliding_window"):
        assert "part_md" in after[name].script()  # the split-KV kernel, same global symbol
        assert after[name].attrs["global_symbol"] == name


def test_wide_prefill_attention_is_tvms_kernel_with_a_bigger_grid(hf_models, monkeypatch):
    """Rebuilt with TVM's own grid size, each prefill kernel is structurally identical to TVM's (the shapes, dtype
    and flags read back from the original are the ones it was built with); the wide grid has several blocks per
    SM of an H200."""
    from mlcc.schedules import cuda_prefill_attention as cpa

    built, _ = _fused(hf_models)
    funcs = _prim_funcs(built.mod)
    target = get_target("cuda").tvm_target()
    (tvm_launch,) = _launches(funcs["batch_prefill_ragged_kv"])
    monkeypatch.setattr(cpa, "_num_blocks", lambda h_kv: tvm_launch["blockIdx.x"])
    for name, kind in cpa._KINDS.items():
        tvm.ir.assert_structural_equal(cpa._rebuild(kind, funcs[name], target), funcs[name])
    monkeypatch.undo()
    with target:
        wide = _prim_funcs(cpa.wide_prefill_attention_pass()(built.mod))
    h_kv = built.cfg.num_key_value_heads
    for name in cpa._KINDS:
        (launch,) = _launches(wide[name])
        assert launch["blockIdx.y"] == h_kv
        blocks = launch["blockIdx.x"] * h_kv
        assert blocks >= 4 * H200_SMS and blocks > tvm_launch["blockIdx.x"] * h_kv
        assert _threads(launch) <= MAX_THREADS
    # the sliding-window kernel is left as TVM built it
    tvm.ir.assert_structural_equal(wide["batch_prefill_paged_kv_sliding_window"],
                                   funcs["batch_prefill_paged_kv_sliding_window"])


def test_helpers_are_added_once_before_the_first_kernel():
    kernel = 'extern "C" __global__ void k(unsigned* p) { p[0] = mlcc_q4x8_hfma2_s1(p[0], 0, 0, 0, 0, 0); ' \
             'mlcc_pdl_wait(); }'
    code = add_cuda_helpers("// preamble\n" + kernel)
    q4, pdl, at = code.index("unsigned mlcc_q4x8_hfma2_s1("), code.index("void mlcc_pdl_wait("), code.index(kernel)
    assert code.index("// preamble") < q4 < pdl < at
    assert code.count("unsigned mlcc_q4x8_hfma2_s1(") == 1 and "mlcc_f16x2_fma" not in code
    assert add_cuda_helpers(code) == code  # a second pass adds nothing


def test_a_helper_group_brings_the_groups_it_calls(monkeypatch):
    from mlcc.schedules import cuda_source

    base = "__device__ __forceinline__ int base_fn(int x) { return x; }\n"
    user = "__device__ __forceinline__ int user_fn(int x) { return base_fn(x) + 1; }\n"
    unused = "__device__ __forceinline__ int unused_fn(int x) { return x; }\n"
    monkeypatch.setattr(cuda_source, "HELPER_GROUPS", (base, unused, user))
    kernel = 'extern "C" __global__ void k(int* p) { p[0] = user_fn(p[0]); }'
    code = add_cuda_helpers(kernel)
    assert code.index("int base_fn(") < code.index("int user_fn(") < code.index(kernel) and "unused_fn" not in code


# --- CompileOptions reach the kernels -------------------------------------------------------------------------------

def _pass_names(options: CompileOptions, preset: str = "cuda") -> list[str]:
    return [p.info.name for p in kernel_passes(get_target(preset).tvm_target(), options)]


def test_kernel_passes_follow_the_options():
    default = _pass_names(CompileOptions())
    assert default[-10:] == ["mlcc_cuda_fused_decode_gemv", "mlcc_cuda_decode_gemv", "mlcc_cuda_moe_expert_gemv",
                             "mlcc_cuda_split_decode_attention", "mlcc_cuda_wide_prefill_attention",
                             "mlcc_cuda_few_query_prefill", "mlcc_cuda_flash_prefill", "mlcc_cuda_few_token_gemv",
                             "mlcc_cuda_prefill_gemm", "mlcc_cuda_kv_append"]
    off = {"decode_gemv": ["mlcc_cuda_fused_decode_gemv", "mlcc_cuda_decode_gemv", "mlcc_cuda_moe_expert_gemv"],
           "few_query_attention": ["mlcc_cuda_few_query_prefill"],
           "few_token_gemv": ["mlcc_cuda_few_token_gemv"],
           "fuse_decode_gemv": ["mlcc_cuda_fused_decode_gemv"],
           "split_decode_attention": ["mlcc_cuda_split_decode_attention"],
           "wide_prefill_attention": ["mlcc_cuda_wide_prefill_attention"],
           "flash_prefill_attention": ["mlcc_cuda_flash_prefill"],
           "prefill_gemm": ["mlcc_cuda_prefill_gemm"]}
    for name, gone in off.items():
        assert _pass_names(CompileOptions(**{name: False})) == [p for p in default if p not in gone], name
    assert not [p for p in _pass_names(CompileOptions(), "llvm") if p.startswith("mlcc_cuda")]


def _cuda_library_source(built, path) -> str:
    def walk(m):
        yield m
        for i in m.imports:
            yield from walk(i)

    (cuda,) = [m for m in walk(compile_library(built, path).mod) if m.kind == "cuda"]
    return cuda.inspect_source()


def test_a_library_built_without_pdl_has_no_griddepcontrol(hf_models, tmp_path):
    """(test_cuda_nvrtc checks that the default library's kernels all wait)"""
    built, _ = _fused(hf_models, options=CompileOptions(pdl=False))
    src = _cuda_library_source(built, tmp_path / "model.so")
    assert "griddepcontrol" not in src and "mlcc_pdl" not in src
    assert f"{Q4_HELPER}(" in src and "fused_gemv_rms_swiglu" in src and "part_md" in src  # the same kernels


@pytest.fixture(scope="module")
def fused_llama(hf_models):
    return _fused(hf_models)


def _kernels_after(fused_llama, options: CompileOptions) -> dict:
    """{name: PrimFunc} of the tiny llama after the kernel passes of `options` (kernel_passes less the fusion
    passes, which the fixture ran)."""
    built, fused = fused_llama
    passes = kernel_passes(built.target, options)[len(fusion_passes(built.target)):]
    with built.target:  # (on a copy: the passes change the module they are given)
        mod = tvm.transform.Sequential(passes)(tvm.IRModule(dict(fused.functions.items()), attrs=fused.attrs))
    return _prim_funcs(mod)


@pytest.mark.parametrize("options,absent,present", [
    (CompileOptions(), [], [f'"{Q4_HELPER}"', "fused_gemv_rms_swiglu", '"mlcc_h2_rms_scale"', "part_md",
                            "batch_prefill_paged_kv_few", "_few_tokens"]),
    (CompileOptions(decode_gemv=False), [f'"{Q4_HELPER}"', "fused_gemv_", '"mlcc_h2_'], ["part_md"]),
    (CompileOptions(fuse_decode_gemv=False), ["fused_gemv_", '"mlcc_h2_rms_scale"'], [f'"{Q4_HELPER}"']),
    # (the few-query prefill is the split-KV kernel too)
    (CompileOptions(split_decode_attention=False, few_query_attention=False), ["part_md"], [f'"{Q4_HELPER}"']),
    (CompileOptions(few_query_attention=False), ["batch_prefill_paged_kv_few"], ["part_md"]),
    (CompileOptions(few_token_gemv=False), ["_few_tokens"], ["batch_prefill_paged_kv_few"]),
])
def test_options_turn_kernels_off(fused_llama, options, absent, present):
    src = "\n".join(f"{name}:\n{f.script()}" for name, f in _kernels_after(fused_llama, options).items())
    assert [s for s in absent if s in src] == [] and [s for s in present if s not in src] == []


def test_decode_attention_options_change_its_grid(fused_llama):
    def chunk_launch(**options) -> dict:
        options = CompileOptions(decode_gemv=False, wide_prefill_attention=False, **options)  # (only the attention)
        return _launches(_kernels_after(fused_llama, options)["batch_decode_paged_kv"])[0]

    h_kv = 2  # the tiny model's KV heads
    default, other = chunk_launch(), chunk_launch(decode_attention_splits=8, decode_attention_tokens=4)
    assert _at_batch(default["blockIdx.y"], 1) == h_kv * cda.splits_for(h_kv) and other["blockIdx.y"] == h_kv * 8
    assert other["threadIdx.z"] == 4 != default["threadIdx.z"]


# --- numerics on the GPU (bench/gpu.sh runs these on the H200) ------------------------------------------------------

def _cuda_device():
    from mlcc import tvm_compat

    tvm_compat.load_backend_runtimes("cuda")
    if not tvm.cuda(0).exist:
        pytest.skip("no CUDA device (the gpu marker)")
    return tvm.cuda(0)


GEMV_CASES = [
    (4096, 4096, "add", False), (1000, 896, "none", False), (320, 64, "cast", False), (4096, 14336, "add", False),
    (4864, 896, "swiglu", False), (128, 64, "swiglu", False),
    (6144, 4096, "none", True), (1000, 896, "add", True), (320, 64, "cast", True), (14336, 4096, "swiglu", True),
    (1536, 576, "swiglu", True), (1000, 4000, "add", False), (8, 4096, "cast", True),
    (14336, 3584, "geglu", True), (128, 64, "geglu", False)]


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("weights", ["q4f16_1", "q8f16_1", "e4m3_e4m3_f16", "float16"])
@pytest.mark.parametrize("n,k,epilogue,norm", GEMV_CASES)
def test_gemv_kernel_matches_numpy_on_the_gpu(n, k, epilogue, norm, weights, pdl):
    import numpy as np

    from mlcc.compiler.quantize import dequantize_weight, quantize_weight
    from mlcc.schedules.cuda_gemv import make_gemv

    dev = _cuda_device()
    rng = np.random.default_rng(0)
    n_w = 2 * n if epilogue in ("swiglu", "geglu") else n
    w = rng.standard_normal((n_w, k)).astype(np.float32) * 0.05
    if weights != "float16":
        q = get_quantization(weights)
        packed, scale = quantize_weight(w, q)
        weight_args, w = [packed, scale], dequantize_weight(packed, scale, q)
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
    options = CompileOptions(pdl=pdl)
    with target, cuda_source_postproc(add_cuda_helpers):
        kernel = make_gemv(shape, pdl=pdl).with_attr("global_symbol", "main")
        lib = tvm.compile(tvm.IRModule({"main": kernel}), target,
                          tir_pipeline=cuda_pdl.tir_pipeline_for(target, options))
    args = x_in + weight_args + ([res] if epilogue == "add" else []) + [np.zeros((1, 1, n), out_dtype)]
    args = [tvm.runtime.tensor(a, dev) for a in args]
    lib["main"](*args)
    want = w.astype(np.float32) @ x.reshape(-1).astype(np.float32)
    if epilogue == "add":
        want = want + res.reshape(-1)
    if epilogue in ("swiglu", "geglu"):
        gate, up = (want[:n].astype(np.float16).astype(np.float32), want[n:].astype(np.float16).astype(np.float32))
        act = gate / (1 + np.exp(-gate)) if epilogue == "swiglu" else \
            0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
        want = act * up
    got = args[-1].numpy().reshape(-1).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("h_kv,h_qo,d,splits,tokens", [(8, 32, 128, 0, 0), (3, 9, 64, 0, 0), (8, 32, 128, 24, 4)])
@pytest.mark.parametrize("lens", [[1], [17], [700], [5, 300, 1500]])
def test_split_kv_decode_attention_matches_numpy_on_the_gpu(h_kv, h_qo, d, splits, tokens, lens):
    import math

    import numpy as np

    dev = _cuda_device()
    rng = np.random.default_rng(0)
    page = 16
    n_pages = [-(-n // page) for n in lens]
    pages = (rng.standard_normal((sum(n_pages) + 2, 2, h_kv, page, d)) * 0.5).astype(np.float16)
    values = rng.permutation(sum(n_pages) + 2)[:sum(n_pages)].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    last = np.array([n - (p - 1) * page for n, p in zip(lens, n_pages)], np.int32)
    q = rng.standard_normal((len(lens), h_qo, d)).astype(np.float16)
    kernel = cda.make_split_decode(h_kv, h_qo, d, "float16", page, splits, tokens).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": kernel}), get_target("cuda").tvm_target())
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
