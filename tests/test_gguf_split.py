"""Split GGUF files (llama-gguf-split's `<name>-00001-of-0000N.gguf`, ...): compiled from any part, they give the
same weights and the same greedy tokens as the whole file; a missing part, a part of another split or a file named
unlike a part is one ModelSourceError saying which file and what to do."""

import shutil
import subprocess
import sys

import numpy as np
import pytest
from test_gguf import write_gguf

from mlcc.errors import ModelSourceError

PROMPT = [1, 5, 9, 2, 7]


def _parts(folder, stem: str) -> list:
    return sorted(folder.glob(f"{stem}-*-of-*.gguf"))


def _greedy_ids(artifacts, steps: int = 6) -> list[int]:
    from mlcc.runtime.device.model import LoadedModel

    m = LoadedModel(artifacts)
    m.create_kv_cache(1, 256, 64)
    m.add_sequence(0)
    ids = [int(np.argmax(m.prefill([0], [PROMPT]).numpy()[0]))]
    for _ in range(steps):
        ids.append(int(np.argmax(m.decode([0], [ids[-1]]).numpy()[0])))
    return ids


def _weights(artifacts) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(artifacts.iterdir())
            if p.name.startswith("params_shard_") or p.name in ("tensor-cache.json", "tokenizer.json")}


@pytest.mark.parametrize("per_part,metadata_only_first", [(8, False), (12, True)],
                         ids=["tensors-in-every-part", "no-tensor-first-split"])
def test_a_split_gguf_compiles_like_the_whole_file(per_part, metadata_only_first, hf_models, tmp_path, monkeypatch):
    from mlcc.compiler.build import compile_model
    from mlcc.compiler.weights import load_source

    monkeypatch.setenv("MLCC_CACHE_DIR", str(tmp_path / "cache"))
    write_gguf(hf_models("llama"), "llama", tmp_path / "whole.gguf")
    write_gguf(hf_models("llama"), "llama", tmp_path / "tiny.gguf", split_max_tensors=per_part,
               small_first_shard=metadata_only_first)
    parts = _parts(tmp_path, "tiny")
    assert [p.name for p in parts] == [f"tiny-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    # the big matrices of every part are read a few rows at a time, as the whole file's are
    assert set(load_source(parts[0]).rows) == set(load_source(tmp_path / "whole.gguf").rows) != set()
    compile_model(tmp_path / "whole.gguf", "llvm", "q0f32", tmp_path / "whole")
    compile_model(parts[-1], "llvm", "q0f32", tmp_path / "split")   # any part names the model
    assert _weights(tmp_path / "split") == _weights(tmp_path / "whole")
    assert _greedy_ids(tmp_path / "split") == _greedy_ids(tmp_path / "whole")


@pytest.fixture
def split(hf_models, tmp_path):
    """A 3-part split of the tiny llama in tmp_path, and the same model split 7 tensors a part (another download)."""
    write_gguf(hf_models("llama"), "llama", tmp_path / "tiny.gguf", split_max_tensors=8)
    other = tmp_path / "other"
    other.mkdir()
    write_gguf(hf_models("llama"), "llama", other / "tiny.gguf", split_max_tensors=7)
    return _parts(tmp_path, "tiny"), _parts(other, "tiny")


def test_a_missing_part_is_one_line_naming_it(split, tmp_path):
    from mlcc.compiler.weights import load_source

    parts, _ = split
    parts[1].unlink()
    with pytest.raises(ModelSourceError, match=r"split into 3 parts, and tiny-00002-of-00003.gguf is missing from "
                                               r".*download every part"):
        load_source(parts[0])
    r = subprocess.run([sys.executable, "-m", "mlcc", "compile", str(parts[2]), "-o", str(tmp_path / "out")],
                       check=False, capture_output=True, text=True, timeout=600)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "tiny-00002-of-00003.gguf is missing" in lines[0], r.stderr


def test_parts_of_another_split_are_refused(split):
    from mlcc.compiler.weights import load_source

    parts, others = split
    shutil.copyfile(others[2], parts[2])   # 8 + 8 + 7 tensors where the split lists 21
    with pytest.raises(ModelSourceError, match=r"lists 21 tensors \(split.tensors.count\) and its 3 parts hold 23"):
        load_source(parts[0])


def test_a_part_named_unlike_a_part_is_refused(split, tmp_path):
    from mlcc.compiler.weights import load_source

    parts, _ = split
    shutil.copyfile(parts[0], tmp_path / "renamed.gguf")
    with pytest.raises(ModelSourceError, match=r"part 1 of a GGUF split into 3 parts, but not named as llama.cpp"):
        load_source(tmp_path / "renamed.gguf")
    for i, part in enumerate(parts[:2]):
        shutil.copyfile(part, tmp_path / f"two-{i + 1:05d}-of-00002.gguf")
    with pytest.raises(ModelSourceError, match=r"says it is part 1 of 3, its name part 1 of 2"):
        load_source(tmp_path / "two-00001-of-00002.gguf")


def test_a_truncated_part_says_how_much_is_missing(split):
    from mlcc.compiler.weights import load_source

    parts, _ = split
    data = parts[1].read_bytes()
    parts[1].write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelSourceError, match=rf"tiny-00002-of-00003.gguf: truncated or incomplete file \(expected "
                                               rf"{len(data)} bytes, found {len(data) // 2}\)"):
        load_source(parts[0])


def test_a_folder_holding_one_split_model_loads_it(split):
    from mlcc.compiler.weights import load_source

    parts, _ = split
    assert load_source(parts[0].parent).path == parts[0]


def test_the_jit_cache_key_covers_every_part(split, tmp_path):
    """A later part replaced (a re-download of another revision) gives another build folder, not the old build."""
    from mlcc.options import CompileOptions
    from mlcc.runtime.jit import build_dir

    parts, _ = split
    before = build_dir(parts[0], "llvm", "q0f32", 1, CompileOptions())
    data = parts[-1].read_bytes()
    parts[-1].write_bytes(data + b"\0" * 32)
    assert build_dir(parts[0], "llvm", "q0f32", 1, CompileOptions()) != before
