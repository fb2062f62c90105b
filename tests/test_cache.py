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
