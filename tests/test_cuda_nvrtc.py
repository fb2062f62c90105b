"""The CUDA source mlcc generates, compiled here without a GPU or nvcc: NVRTC from pip (the `nvidia-cuda-nvrtc`
wheel, whose bundled headers give cuda_fp16.h and libcu++), called through ctypes with the flags TVM's NVRTC path
uses when a library is loaded on a GPU (tvm.support.nvcc._compile_cuda_nvrtc). A break in TVM's CUDA codegen or in
mlcc's kernels and device helpers fails these tests instead of failing at load on the GPU."""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import itertools
import re

import pytest
import tvm

from mlcc.schedules.cuda_decode_attention import make_split_decode
from mlcc.schedules.cuda_gemv import E4M3_HELPER, F16_HELPER, Q4_HELPER, Q8_HELPER, make_gemv
from mlcc.schedules.cuda_source import add_cuda_helpers
from mlcc.schedules.gemv_match import GemvShape
from mlcc.targets import get_target
from mlcc.tvm_compat import cuda_source_postproc

NVRTC_PACKAGE = "nvidia-cuda-nvrtc"
NVRTC_MIN = (13, 5)  # the first with bundled headers (--use-bundled-headers)
# TVM's NVRTC flags less its include paths (-w: only errors in the log)
TVM_FLAGS = ["-default-device", "--device-int128", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
             "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
             "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__", "--use_fast_math", "-w"]


@functools.cache
def _libnvrtc() -> ctypes.CDLL:
    try:
        dist = importlib.metadata.distribution(NVRTC_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{NVRTC_PACKAGE} is a test dependency (pip install -e '.[test]'): it compiles mlcc's CUDA "
                    "source on machines without a GPU")
    path = next((f for f in dist.files or [] if f.name.startswith("libnvrtc.so")), None)
    assert path is not None, f"{NVRTC_PACKAGE} {dist.version} ships no libnvrtc.so"
    lib = ctypes.CDLL(str(dist.locate_file(path)))
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    assert (major.value, minor.value) >= NVRTC_MIN, \
        f"NVRTC {major.value}.{minor.value}: need {NVRTC_PACKAGE}>={'.'.join(map(str, NVRTC_MIN))}"
    return lib


@pytest.fixture(scope="module")
def nvrtc(tmp_path_factory):
    """nvrtc(source, arch) -> cubin bytes; fails the test with NVRTC's log on an error."""
    lib = _libnvrtc()
    headers = tmp_path_factory.mktemp("nvrtc-headers")  # NVRTC writes its bundled headers here on first use

    def compile_cuda(src: str, arch: str = "sm_90") -> bytes:
        prog = ctypes.c_void_p()
        assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"mlcc.cu", 0, None, None) == 0
        try:
            opts = [f"--gpu-architecture={arch}", f"--use-bundled-headers={headers}"] + TVM_FLAGS
            rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts]))
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            assert rc == 0, f"NVRTC error {rc}:\n{log.value.decode(errors='replace')[:6000]}"
            lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            cubin = ctypes.create_string_buffer(size.value)
            assert lib.nvrtcGetCUBIN(prog, cubin) == 0
            return cubin.raw
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))

    return compile_cuda


def _kernels(src: str) -> list[str]:
    return re.findall(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(', src)


def _assert_compiles(nvrtc, src: str, arch: str = "sm_90") -> None:
    cubin = nvrtc(src, arch)
    assert cubin[:4] == b"\x7fELF"
    missing = [k for k in set(_kernels(src)) if k.encode() not in cubin]
    assert not missing, missing


def _cuda_source(lib) -> str:
    def walk(m):
        yield m
        for i in m.imports:
            yield from walk(i)

    (cuda,) = [m for m in walk(lib) if m.kind == "cuda"]
    return cuda.inspect_source()


def test_nvrtc_reports_a_broken_kernel(nvrtc):
    """The compiler really runs: a type error in a kernel fails."""
    with pytest.raises(AssertionError, match="NVRTC error"):
        nvrtc('extern "C" __global__ void k(float* p) { p[0] = undefined_name; }')


@pytest.mark.parametrize("quant", ["q4f16_1", "q0f16", "e4m3_e4m3_f16", "q8f16_1"])
def test_cuda_library_source_carries_the_helpers_and_compiles(hf_models, tmp_path, nvrtc, quant):
    """The whole CUDA source of a tiny model's default library (every kernel of every function) compiles for
    sm_90."""
    from mlcc.compiler.build import compile_library, export_module
    from mlcc.compiler.quantize import get_quantization
    from mlcc.compiler.weights import load_source

    built = export_module(load_source(hf_models("llama")), get_target("cuda"), get_quantization(quant))
    src = _cuda_source(compile_library(built, tmp_path / "model.so").mod)
    # every mlcc helper a kernel calls is defined, once
    called = set(re.findall(r"\b(mlcc_\w+)\(", src)) - set(_kernels(src))   # (kernels named mlcc_*: launched)
    defined = re.findall(r"__device__ __forceinline__ [\w ]+?\b(mlcc_\w+)\(", src)
    assert called <= set(defined) and len(defined) == len(set(defined)), called - set(defined)
    helper = {"q4f16_1": Q4_HELPER, "q0f16": F16_HELPER, "e4m3_e4m3_f16": E4M3_HELPER, "q8f16_1": Q8_HELPER}[quant]
    assert src.count(f"{helper}(") > 10                                 # the decode GEMVs call it
    assert "argmax_partial_kernel" in src and "part_md" in src          # GPU argmax, split-KV decode attention
    assert "apply_bitmask_tir_kernel" in src and "topk_chunk_next_kernel" in src  # the logit functions
    assert src.count("void mlcc_pdl_wait()") == 1 and src.count("mlcc_pdl_wait();") > 10  # every kernel waits
    _assert_compiles(nvrtc, src)


# K split over warps, partial row blocks, fewer units than lanes, both swiglu layouts, one row block
GEMV_SHAPES = [(4096, 4096, "add"), (1000, 896, "none"), (320, 64, "cast"), (4864, 896, "swiglu"),
               (128, 64, "swiglu"), (8, 4096, "cast"), (14336, 3584, "geglu")]


@pytest.mark.parametrize("preset", ["cuda", "cuda-sm80"])
def test_every_gemv_and_decode_attention_variant_compiles(nvrtc, preset):
    """make_gemv for every weight format, every epilogue, with and without the RMSNorm prologue, with the PDL wait
    on sm_90 and without it on sm_80; the split-KV decode attention with the automatic and explicit splits / tokens
    in flight. One module, one NVRTC run per GPU generation."""
    target = get_target(preset).tvm_target()
    pdl = preset == "cuda"  # griddepcontrol needs sm_90
    funcs = {}
    for (n, k, epi), weights, norm in itertools.product(GEMV_SHAPES, ["q4f16_1", "q8f16_1", "e4m3_e4m3_f16",
                                                                       "float16"], [False, True]):
        shape = GemvShape(n, k, epi, (1, 1, n) if epi == "add" else (), "float32" if epi == "cast" else "float16",
                          weights, 1e-5 if norm else None)
        funcs[f"gemv_{n}_{k}_{epi}_{weights[:4]}_{int(norm)}"] = make_gemv(shape, pdl=pdl)
    # (Gemma's head dim 256 with its sliding window and score cap)
    for h_kv, h_qo, d, splits, tokens, sliding, cap in [
            (8, 32, 128, 0, 0, False, 0.0), (3, 9, 64, 0, 0, False, 0.0), (2, 14, 64, 0, 0, False, 0.0),
            (8, 32, 128, 24, 4, False, 0.0), (1, 4, 16, 1, 0, False, 0.0), (8, 16, 256, 0, 0, True, 50.0),
            (1, 4, 256, 0, 0, False, 0.0)]:
        funcs[f"attn_{h_kv}_{h_qo}_{d}_{splits}_{tokens}_{int(sliding)}"] = make_split_decode(
            h_kv, h_qo, d, "float16", 16, splits, tokens, sliding, cap)
    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    with target, cuda_source_postproc(add_cuda_helpers):
        lib = tvm.compile(mod, target)
    src = _cuda_source(lib.mod)
    assert len(_kernels(src)) >= len(funcs)  # (the attention is two kernels)
    _assert_compiles(nvrtc, src, str(target.attrs["arch"]))


def test_logit_functions_compile_for_a_real_vocabulary(nvrtc):
    """apply_bitmask, apply_logit_bias and logprobs for Qwen2.5's 151936-token vocabulary: the top-K rounds over
    2048-token pieces and the merge of their picks (the tiny model's vocabulary fits one piece)."""
    from mlcc.compiler.pipeline import build_pipeline
    from mlcc.compiler.sampler import attach_logit_functions
    from mlcc.options import CompileOptions

    target = get_target("cuda").tvm_target()
    mod = attach_logit_functions(tvm.IRModule(), 151936, target)
    lib = tvm.compile(mod, target, relax_pipeline=build_pipeline(target, None, CompileOptions()))
    src = _cuda_source(lib.mod)
    assert {"logit_bias_scatter_kernel", "topk_chunk_first_kernel", "topk_merge_next_kernel",
            "logprobs_sum_exp_kernel"} <= set(_kernels(src))
    _assert_compiles(nvrtc, src)
