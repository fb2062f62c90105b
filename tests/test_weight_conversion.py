"""The weight conversion (GGUF read, sliced and parallel re-quantization) gives exactly what the plain one-tensor-at-a-
time conversion gives: same parameters, same order, same bytes; the fast GGUF reader reads what gguf's does."""

import numpy as np
import pytest
from test_gguf import write_gguf

from mlcc.quantization import QUANTIZATIONS, Quantization


def _reference_group_quantize(w: np.ndarray, q: Quantization) -> tuple[np.ndarray, np.ndarray]:
    """The packer as first written (whole-array numpy, one code at a time into the words): the reference."""
    if w.ndim > 2:
        packed, scale = _reference_group_quantize(w.reshape(-1, w.shape[-1]), q)
        return packed.reshape(*w.shape[:-1], -1), scale.reshape(*w.shape[:-1], -1)
    n, k = w.shape
    w32 = w.astype(np.float32).reshape(n, k // q.group_size, q.group_size)
    scale = np.abs(w32).max(axis=-1, keepdims=True) / q.max_int
    scale = scale.astype(q.scale_dtype).astype(np.float32)
    safe = np.where(scale == 0, 1.0, scale)
    word = np.dtype(q.storage_dtype)
    codes = np.clip(np.round(w32 / safe) + q.max_int, 0, 2 * q.max_int).astype(word).reshape(n, k)
    codes = codes.reshape(n, k // q.per_word, q.per_word)
    packed = np.bitwise_or.reduce(codes << (np.arange(q.per_word, dtype=word) * q.bits), axis=-1).astype(word)
    return packed, scale.reshape(n, k // q.group_size).astype(q.scale_dtype)


def _reference_params(source, built):
    from mlcc.compiler.weights import iter_float_params

    wanted = {p["name"] for p in built.params}
    for name, w in iter_float_params(source, built.family, built.cfg):
        base = name.removesuffix(".weight")
        if f"{base}.q_weight" in wanted:
            qw, qs = _reference_group_quantize(w, built.quant)
            yield f"{base}.q_weight", qw
            yield f"{base}.q_scale", qs
        else:
            yield name, w.astype(next(p["dtype"] for p in built.params if p["name"] == name))


@pytest.mark.parametrize("quant", ["q4f32_1", "q4f16_1"])
def test_packer_matches_the_reference(quant):
    q = QUANTIZATIONS[quant]
    from mlcc.compiler.quant_schemes import group_quantize

    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 256), dtype=np.float32)
    w[0, :32] = 0.0
    w[1, :32] = -0.0
    w[2, 5] = 1e4
    w[3] *= 1e-30
    for x in (w, w.astype(np.float16), w.reshape(4, 16, 256)):
        got, ref = group_quantize(x, q), _reference_group_quantize(x, q)
        for a, b in zip(got, ref):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("kind,k_quants,quant", [("qwen3_256", True, "q4f32_1"), ("llama", False, "q4f32_1"),
                                                 ("gemma3", False, "q4f16_1"), ("qwen2", False, "q0f32")])
def test_conversion_matches_the_plain_one(kind, k_quants, quant, hf_models, tmp_path, monkeypatch):
    from mlcc.compiler import weight_conversion
    from mlcc.compiler.build import export_module
    from mlcc.compiler.weights import load_source
    from mlcc.targets import get_target

    path = tmp_path / f"{kind}.gguf"
    write_gguf(hf_models(kind), kind, path, k_quants=k_quants)
    source = load_source(path)
    assert source.rows, "no tensor is read in slices"
    built = export_module(source, get_target("llvm"), QUANTIZATIONS[quant])
    # slices of a few rows and a small window: every matrix is split, and jobs wait for the window
    monkeypatch.setattr(weight_conversion, "SLICE_ELEMENTS", 1000)
    monkeypatch.setattr(weight_conversion, "IN_FLIGHT_ELEMENTS", 20000)
    done = []
    got = list(weight_conversion.converted_params(source, built, workers=3, progress=done.append))
    ref = list(_reference_params(load_source(path), built))
    assert [n for n, _ in got] == [n for n, _ in ref]
    for (name, a), (_, b) in zip(got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
    assert sum(done) == weight_conversion.total_elements(built)


def test_fast_gguf_reader_reads_what_gguf_reads(hf_models, tmp_path):
    import gguf

    from mlcc.compiler.weights import open_gguf

    path = tmp_path / "q.gguf"
    write_gguf(hf_models("qwen3_256"), "qwen3_256", path, k_quants=True)
    fast, slow = open_gguf(path), gguf.GGUFReader(str(path))
    assert list(fast.fields) == list(slow.fields)
    for key, f in slow.fields.items():
        g = fast.fields[key]
        assert (g.types, g.data, g.offset, g.contents()) == (f.types, f.data, f.offset, f.contents()), key
        assert [(p.dtype, p.tobytes()) for p in g.parts] == [(p.dtype, p.tobytes()) for p in f.parts], key
    assert [(t.name, t.tensor_type, t.data.tobytes()) for t in fast.tensors] == \
        [(t.name, t.tensor_type, t.data.tobytes()) for t in slow.tensors]


def test_a_second_model_of_the_same_shape_reuses_the_compiled_library(hf_models, tmp_path, monkeypatch, caplog):
    import logging
    import shutil

    from mlcc.compiler.build import compile_model

    monkeypatch.setenv("MLCC_CACHE_DIR", str(tmp_path / "cache"))
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_gguf(hf_models("qwen2"), "qwen2", first)
    shutil.copyfile(first, second)
    compile_model(first, "llvm", "q4f32_1", tmp_path / "a")
    with caplog.at_level(logging.INFO, logger="mlcc.compiler.build"):
        compile_model(second, "llvm", "q4f32_1", tmp_path / "b")
    assert "same shape is in the cache" in caplog.text
    assert (tmp_path / "a" / "model.so").read_bytes() == (tmp_path / "b" / "model.so").read_bytes()
    assert (tmp_path / "a" / "tensor-cache.json").read_text() == (tmp_path / "b" / "tensor-cache.json").read_text()
    compile_model(second, "llvm", "q4f16_1", tmp_path / "c")  # another quantization: another library
    assert len(list((tmp_path / "cache" / "libraries").iterdir())) == 2
