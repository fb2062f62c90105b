"""The cache's build locks: they exclude each other and leave nothing in the cache."""

import filelock
import pytest

from mlcc.cache import cache_lock


def test_a_build_lock_excludes_a_second_builder_and_leaves_no_file_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLCC_CACHE_DIR", str(tmp_path / "cache"))
    entry = tmp_path / "cache" / "model-q4f32_1-llvm-abc"
    with cache_lock(entry):
        with pytest.raises(filelock.Timeout):
            cache_lock(entry).acquire(timeout=0.1)
        entry.mkdir()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [entry.name]
    with cache_lock(entry).acquire(timeout=0.1):  # free again once released
        pass


def test_the_compile_estimate_is_the_last_build_of_the_shape_else_the_targets_mean(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from mlcc.compiler.build import _compile_estimate, _record_compile_seconds

    monkeypatch.setenv("MLCC_CACHE_DIR", str(tmp_path))

    def built(family: str, hidden: int, target: str = "llvm"):
        cfg = SimpleNamespace(hidden_size=hidden, intermediate_size=4 * hidden, vocab_size=1000,
                              tensor_parallel_shards=1)
        return SimpleNamespace(preset=SimpleNamespace(name=target), family=SimpleNamespace(name=family), cfg=cfg,
                               quant=SimpleNamespace(name="q4f32_1"))

    assert _compile_estimate(built("qwen2", 64)) is None
    _record_compile_seconds(built("qwen2", 64), 10.0)
    _record_compile_seconds(built("llama", 32), 6.0)
    assert _compile_estimate(built("qwen2", 64))[0] == 10.0
    assert _compile_estimate(built("gemma3", 128))[0] == 8.0
    assert _compile_estimate(built("qwen2", 64, target="cuda")) is None
