"""Models named by their Hugging Face repo (mlcc/hub.py): `mlcc chat org/name` and `org/name-GGUF:QUANT` download
through huggingface_hub from a stand-in Hub on loopback (tests/hub_support.py, reached through HF_ENDPOINT: never
the internet), then compile as a local path would; offline, unreachable, missing and gated repos are one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from hub_support import fake_hub
from test_gguf import write_gguf

from mlcc.errors import ModelDownloadError
from mlcc.hub import HubModel, parse_name, pick_files, source_name

ARGS = ["--target", "llvm", "--quant", "q0f32", "--max-tokens", "6", "--temperature", "0", "--prompt", "Hello"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory, hf_models):
    """org/tiny: the tiny llama with the copies a real repo carries beside its safetensors; org/tiny-GGUF: the same
    model as one GGUF and as a GGUF split in 3 parts (F16), among other quantizations (those are not GGUF files:
    picking one fails the chat)."""
    root = tmp_path_factory.mktemp("hub-repos")
    tiny = root / "tiny"
    shutil.copytree(hf_models("llama"), tiny)
    (tiny / "pytorch_model.bin").write_bytes(b"not needed")
    (tiny / "onnx").mkdir()
    (tiny / "onnx" / "model.onnx").write_bytes(b"not needed")
    (tiny / "README.md").write_text("a tiny model")
    gguf = root / "tiny-GGUF"
    gguf.mkdir()
    write_gguf(hf_models("llama"), "llama", gguf / "tiny-Q4_K_M.gguf")
    write_gguf(hf_models("llama"), "llama", gguf / "tiny-F16.gguf", split_max_tensors=8)
    for other in ("tiny-Q4_K_S.gguf", "tiny-Q8_0.gguf"):
        (gguf / other).write_bytes(b"some other quantization")
    with fake_hub({"org/tiny": tiny, "org/tiny-GGUF": gguf}, gated=frozenset({"org/gated"})) as h:
        h.env = {**os.environ, "HF_ENDPOINT": h.url, "HF_HOME": str(root / "hf-home"), "HF_HUB_OFFLINE": "0",
                 "MLCC_CACHE_DIR": str(root / "mlcc-cache")}
        yield h


def _mlcc(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlcc", *args], check=False, env=env, capture_output=True, text=True, timeout=600)


def _one_line_error(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("mlcc: error:"), r.stderr
    return lines[0]


def test_a_repo_name_downloads_what_mlcc_reads_and_chats(hub):
    r = _mlcc(hub.env, "chat", "org/tiny", *ARGS)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "[org/tiny on llvm" in r.stderr
    got = sorted(f for repo, f in hub.downloads if repo == "org/tiny")
    assert got == ["config.json", "generation_config.json", "model.safetensors",
                   "tokenizer.json", "tokenizer_config.json"]

    # offline, the Hugging Face cache and the JIT cache answer the same, with nothing fetched
    before = len(hub.downloads)
    offline = _mlcc({**hub.env, "HF_HUB_OFFLINE": "1"}, "chat", "org/tiny", *ARGS)
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout == r.stdout and len(hub.downloads) == before

    # the Engine resolves names the same way
    code = ("from mlcc import Engine\n"
            "with Engine('org/tiny', target='llvm', quant='q0f32') as e: print(e.model_name)")
    e = subprocess.run([sys.executable, "-c", code], check=False, env=hub.env, capture_output=True, text=True, timeout=600)
    assert e.returncode == 0 and e.stdout.strip() == "org/tiny", e.stderr


def test_a_gguf_tag_picks_its_file_among_the_quantizations(hub):
    r = _mlcc(hub.env, "chat", "org/tiny-GGUF:q4_k_m", *ARGS)   # the tag is case-insensitive
    assert r.returncode == 0, r.stderr
    assert [f for repo, f in hub.downloads if repo == "org/tiny-GGUF"] == ["tiny-Q4_K_M.gguf"]


def test_a_split_gguf_downloads_every_part_and_chats_as_the_whole_file(hub):
    whole = _mlcc(hub.env, "chat", "org/tiny-GGUF:Q4_K_M", *ARGS)
    split = _mlcc(hub.env, "chat", "org/tiny-GGUF:F16", *ARGS)
    assert split.returncode == 0, split.stderr
    assert sorted(f for repo, f in hub.downloads if repo == "org/tiny-GGUF" and "F16" in f) == \
        [f"tiny-F16-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    assert split.stdout.strip() and split.stdout == whole.stdout and "[tiny-F16 on llvm" in split.stderr


def test_offline_without_the_files_is_one_line(hub):
    line = _one_line_error(_mlcc({**hub.env, "HF_HUB_OFFLINE": "1"}, "chat", "org/never-downloaded", "--prompt",
                                 "hi"))
    assert "HF_HUB_OFFLINE" in line and "path/to/model-folder-or.gguf" in line


def test_an_unreachable_hub_is_one_line(hub):
    from server_support import free_port

    line = _one_line_error(_mlcc({**hub.env, "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}, "chat",
                                 "org/never-downloaded", "--prompt", "hi"))
    assert "cannot be reached" in line and "path/to/model-folder-or.gguf" in line


def test_missing_and_gated_repos_are_one_line(hub):
    assert "no Hugging Face repo" in _one_line_error(_mlcc(hub.env, "chat", "org/missing", "--prompt", "hi"))
    from server_support import free_port

    assert "is gated" in _one_line_error(_mlcc(hub.env, "serve", "org/gated", "--port", str(free_port())))
    assert "no GGUF file of org/tiny-GGUF is tagged Q2_K" in _one_line_error(
        _mlcc(hub.env, "compile", "org/tiny-GGUF:Q2_K", "-o", "unused"))


def test_names_and_paths(tmp_path, monkeypatch):
    assert parse_name("Qwen/Qwen2.5-0.5B-Instruct") == HubModel("Qwen/Qwen2.5-0.5B-Instruct")
    assert parse_name("hf.co/user/repo-GGUF:Q4_K_M") == HubModel("user/repo-GGUF", "Q4_K_M")
    assert parse_name("https://huggingface.co/user/repo") == HubModel("user/repo")
    for path in ("./a/b", "/a/b", "a/b/c", "dir/model.gguf", "model", "../a"):
        assert parse_name(path) is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert parse_name("org/name") is None   # a local path that exists wins
    assert source_name(tmp_path / "hub" / "models--org--name" / "snapshots" / ("0" * 40)) == "org/name"
    assert source_name(tmp_path / "m-Q4_K_M.gguf") == "m-Q4_K_M"
    assert source_name(tmp_path / "m-Q8_0-00002-of-00003.gguf") == "m-Q8_0"   # every part: the model's name


def test_which_files_of_a_repo():
    ggufs = ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "mmproj-m-f16.gguf", "Q8_0/m-Q8_0-00002-of-00002.gguf",
             "Q8_0/m-Q8_0-00001-of-00002.gguf", "README.md"]
    assert pick_files(HubModel("u/r"), ggufs) == ["m-Q4_K_M.gguf"]   # no tag: Q4_K_M
    assert pick_files(HubModel("u/r", "Q8_0"), ggufs) == ["Q8_0/m-Q8_0-00001-of-00002.gguf",
                                                         "Q8_0/m-Q8_0-00002-of-00002.gguf"]   # every part
    assert pick_files(HubModel("u/r", "q4_k_s"), ggufs) == ["m-Q4_K_S.gguf"]
    assert pick_files(HubModel("u/r"), ["only-Q8_0.gguf"]) == ["only-Q8_0.gguf"]
    with pytest.raises(ModelDownloadError, match="m-Q4_K_M.gguf, m-Q4_K_S.gguf"):
        pick_files(HubModel("u/r", "Q4"), ggufs)
    with pytest.raises(ModelDownloadError, match="u/r:QUANT"):
        pick_files(HubModel("u/r"), ["m-Q8_0.gguf", "m-F16.gguf"])
    hf = ["config.json", "tokenizer.json", "tokenizer_config.json", "consolidated.safetensors",
          "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
          "pytorch_model.bin", "original/consolidated.00.pth", "onnx/model.onnx", "model-Q4_K_M.gguf"]
    assert pick_files(HubModel("u/r"), hf) == ["config.json", "tokenizer.json", "tokenizer_config.json",
                                               "model-00001-of-00002.safetensors",
                                               "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    assert pick_files(HubModel("u/r"), ["config.json", "pytorch_model.bin"]) == ["config.json", "pytorch_model.bin"]
    with pytest.raises(ModelDownloadError, match="no .gguf"):
        pick_files(HubModel("u/r", "Q4_K_M"), ["config.json", "model.safetensors"])
