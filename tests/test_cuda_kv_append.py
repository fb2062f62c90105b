"""The paged KV cache's append on CUDA (schedules/cuda_kv_append.py): one block a token, in place of TVM's kernel.

Without a GPU: the exported model's append is the scheduled kernel and compiles for float16 rows and the quantized
cache's int8 rows. With one: new keys and values land where the position map says (slots of -1 skipped), the same
as numpy's scatter, for every dtype."""

import numpy as np
import pytest
import tvm

from mlcc.schedules.cuda_kv_append import make_kv_append, vector_width
from mlcc.targets import get_target


def _cuda_present() -> bool:
    return tvm.cuda(0).exist


def test_vector_width_moves_16_bytes_where_the_row_allows():
    assert vector_width(128, "float16") == 8 and vector_width(128, "float32") == 4
    assert vector_width(132, "int8") == 4 and vector_width(64, "int8") == 16 and vector_width(6, "float16") == 2


@pytest.mark.parametrize("shape", [(8, 128, "float16"), (2, 132, "int8"), (4, 64, "float32")])
def test_append_compiles_for_cuda(shape):
    h_kv, d, dtype = shape
    func = make_kv_append(h_kv, d, dtype, 16).with_attr("global_symbol", "main")
    tvm.compile(tvm.IRModule({"main": func}), target=get_target("cuda").tvm_target())


def test_the_model_library_appends_with_it(hf_models):
    from mlcc.compiler.build import export_module
    from mlcc.compiler.pipeline import kernel_passes
    from mlcc.compiler.quantize import get_quantization
    from mlcc.compiler.weights import load_source
    from mlcc.options import CompileOptions

    preset = get_target("cuda")
    built = export_module(load_source(hf_models("llama")), preset, get_quantization("q0f16"))
    target = preset.tvm_target()
    with target:
        mod = tvm.transform.Sequential(kernel_passes(target, CompileOptions()))(built.mod)
    appends = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None
               and f.attrs.get("global_symbol") == "tir_kv_cache_transpose_append"]
    assert len(appends) == 1 and appends[0].attrs.get("tirx.is_scheduled")


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_present(), reason="no CUDA device")
@pytest.mark.parametrize("shape", [(8, 128, "float16"), (2, 132, "int8"), (4, 64, "float32")])
def test_append_scatters_rows_like_numpy(shape):
    h_kv, d, dtype = shape
    page_size, pages_n, ntok = 16, 6, 37
    rng = np.random.default_rng(0)
    mod = tvm.compile(tvm.IRModule({"main": make_kv_append(h_kv, d, dtype, page_size).with_attr(
        "global_symbol", "main")}), target=get_target("cuda").tvm_target())
    cast = (lambda a: rng.integers(-128, 128, a.shape).astype(np.int8)) if dtype == "int8" else (
        lambda a: a.astype(dtype))
    k, v = cast(rng.standard_normal((ntok, h_kv, d))), cast(rng.standard_normal((ntok, h_kv, d)))
    slots = rng.permutation(pages_n * page_size)[:ntok].astype(np.int32)
    slots[[3, 20]] = -1   # tokens the cache does not keep
    pages = cast(rng.standard_normal((pages_n, 2, h_kv, page_size, d)))
    want = pages.copy()
    for t, s in enumerate(slots):
        if s >= 0:
            want[s // page_size, 0, :, s % page_size] = k[t]
            want[s // page_size, 1, :, s % page_size] = v[t]
    dev = tvm.cuda(0)
    got = tvm.runtime.tensor(pages, dev)
    mod["main"](got, tvm.runtime.tensor(k, dev), tvm.runtime.tensor(v, dev), tvm.runtime.tensor(slots, dev))
    np.testing.assert_array_equal(got.numpy(), want)
