"""Family chat templates for models whose files carry none, recognised by their tokenizers' turn markers and
rendered by the runtime's template engine."""

from __future__ import annotations

import json
import logging

import pytest
from tokenizers import Tokenizer, models

from mlcc.compiler.chat_templates import FAMILY_TEMPLATES, fallback_chat_template, family_of
from mlcc.runtime.core.tokenizer import Tokenizer as RuntimeTokenizer

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Capital of France?"}]

EXPECTED = {
    "llama3": "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user"
              "<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nCapital of France?<|eot_id|><|start_header_id|>assistant"
              "<|end_header_id|>\n\n",
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
              "Hello.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n",
    "gemma": "<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
             "<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\n",
    "phi3": "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello.<|end|>\n<|user|>\n"
            "Capital of France?<|end|>\n<|assistant|>\n",
    "mistral": "<s>[INST] Be brief.\n\nHi [/INST]Hello.</s>[INST] Capital of France? [/INST]",
}


def _tokenizer(folder, marker: str | None) -> str:
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3}
    if marker is not None:
        vocab[marker] = 4
    path = folder / "tokenizer.json"
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(path))
    return str(path)


@pytest.mark.parametrize("family", sorted(FAMILY_TEMPLATES))
def test_each_family_is_recognised_and_renders_its_format(family, tmp_path, caplog):
    marker = FAMILY_TEMPLATES[family][0]
    with caplog.at_level(logging.INFO, logger="mlcc.compiler.chat_templates"):
        template = fallback_chat_template(_tokenizer(tmp_path, marker), "model.gguf")
    assert template == FAMILY_TEMPLATES[family][1] and family in caplog.text and "model.gguf" in caplog.text
    tok = RuntimeTokenizer(tmp_path, {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"})
    assert tok.apply_chat_template(MSGS, add_generation_prompt=True) == EXPECTED[family]


def test_no_known_markers_no_template(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="mlcc.compiler.chat_templates"):
        assert fallback_chat_template(_tokenizer(tmp_path, None), "odd.gguf") is None
    assert "odd.gguf" in caplog.text and "no chat template" in caplog.text
    assert family_of({"<|im_start|>": 5}) == "chatml" and family_of(set()) is None


def test_a_compiled_model_without_a_template_gets_its_family_one(hf_models, tmp_path):
    import shutil

    from mlcc.compiler.build import compile_model

    src = tmp_path / "src"
    shutil.copytree(hf_models("llama"), src)
    cfg_path = src / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    (src / "chat_template.jinja").unlink(missing_ok=True)
    compile_model(src, "llvm", "q0f32", tmp_path / "out")
    info = json.loads((tmp_path / "out" / "mlcc-config.json").read_text())["tokenizer"]
    assert info["chat_template"] == FAMILY_TEMPLATES[family_of(
        Tokenizer.from_file(str(src / "tokenizer.json")).get_vocab(with_added_tokens=True))][1]
