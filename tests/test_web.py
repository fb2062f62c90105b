"""WebGPU target end to end: compile to model.wasm, build the site, run it in headless Chromium and in Node.js
(Dawn), and compare greedy output with the CPU target's output for the same prompt (the tiny model here, the bundled
SmolLM2 in test_web_smollm2.py: separate files so two test processes take one each).

Needs emscripten, node/npm and chromium (CI's web stage installs them; there MLCC_REQUIRE_WEB=1 turns a missing
tool into a failure instead of a skip)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from web_support import JS, PROMPT, cpu_answer, in_browser, in_node, node_path, run_node, serve  # noqa: F401

pytestmark = pytest.mark.web


@pytest.fixture(scope="module")
def tiny_site(node_path, hf_models, tmp_path_factory):
    from mlcc.compiler.build import compile_model
    from mlcc.web.site import build_site

    root = tmp_path_factory.mktemp("web-tiny")
    src = hf_models("llama")
    compile_model(src, "webgpu", "q4f32_1", root / "tiny-q4f32")
    compile_model(src, "llvm", "q4f32_1", root / "cpu")
    site = build_site([root / "tiny-q4f32"], root / "site")
    return site, root / "cpu"


def test_tiny_node_matches_cpu(tiny_site, node_path):
    site, cpu = tiny_site
    want_text, want_n = cpu_answer(cpu, 16)
    got = in_node(site, "tiny-q4f32", node_path, 16)
    assert got["usage"]["completion_tokens"] == want_n
    assert got["content"] == want_text


def test_tiny_browser_matches_cpu(tiny_site, node_path):
    site, cpu = tiny_site
    want_text, want_n = cpu_answer(cpu, 16)
    got = in_browser(site, node_path, 16, reload=True)
    assert got["state"] == "ready"
    assert len(got["token_ids"]) == want_n
    assert got["content"] == want_text
    # the second visit takes every weight shard from the browser's Cache API
    shards = len(json.loads((site / "models" / "tiny-q4f32" / "tensor-cache.json").read_text())["records"])
    assert got["reload"] == {"state": "ready", "shards_from_cache": shards}


def test_sampling_runs_in_the_wasm(tiny_site, node_path):
    """temperature/top-p sampling goes through TVM's sampler inside the wasm: a nucleus of ~one token is greedy,
    and a seed fixes the draw."""
    site, cpu = tiny_site
    want_text, _ = cpu_answer(cpu, 16)
    narrow = in_node(site, "tiny-q4f32", node_path, 16, extra=("--temperature", "1.0", "--top-p", "1e-6"))
    assert narrow["content"] == want_text
    hot = [in_node(site, "tiny-q4f32", node_path, 16, extra=("--temperature", "1.5", "--seed", "7"))
           for _ in range(2)]
    assert hot[0]["token_ids"] == hot[1]["token_ids"]
    assert hot[0]["token_ids"] != narrow["token_ids"]


ASK = [{"role": "user", "content": PROMPT}]
OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}


def run_requests(site, node_path, tmp_path, requests: list[dict]) -> list[dict]:
    """engine.chat.completions.create for each request in one Node.js process (one engine load)."""
    path = tmp_path / "requests.json"
    path.write_text(json.dumps(requests))
    proc = run_node(["node_chat.mjs", "models/tiny-q4f32", "--requests", str(path)], node_path, cwd=site)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # grammar masks and logit_bias run on the device (logprobs' kernel may exceed a device's storage-buffer limit)
    host = json.loads(proc.stderr.split("[logit functions on the host] ", 1)[1].splitlines()[0])
    assert "apply_bitmask" not in host and "apply_logit_bias" not in host, host
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_requests_in_node_logit_bias_logprobs_grammars_and_refusals(tiny_site, node_path, tmp_path):
    """The OpenAI fields in the web engine, against the Python engine on the CPU build where both answer."""
    from mlcc.runtime.engine import Engine

    site, cpu = tiny_site
    lp, bias, bias_sampled, choice, schema, stream, *refused, again = run_requests(site, node_path, tmp_path, [
        {"messages": ASK, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3},
        {"messages": ASK, "max_tokens": 4, "temperature": 0, "logit_bias": {"65": 100}},
        {"messages": ASK, "max_tokens": 4, "temperature": 1.0, "seed": 3, "logit_bias": {"66": 100}},
        {"messages": ASK, "max_tokens": 8, "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}},
        {"messages": ASK, "max_tokens": 30, "temperature": 0,
         "response_format": {"type": "json_schema", "json_schema": {"name": "ok", "schema": OK_SCHEMA}}},
        {"messages": ASK, "max_tokens": 5, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
         "logprobs": True, "top_logprobs": 2},
        {"messages": ASK, "frobnicate": 1},
        {"messages": ASK, "temperature": "warm"},
        {"messages": ASK, "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"messages": ASK, "n": 2},
        {"messages": ASK, "logit_bias": {"320": 1}},
        {"messages": ASK, "structured_outputs": {"grammar": 'root ::= ("a"'}},
        {"messages": ASK, "max_tokens": 6, "temperature": 0},
    ])
    with Engine(cpu) as engine:
        want = engine.chat.completions.create(messages=ASK, max_tokens=6, temperature=0, logprobs=True,
                                              top_logprobs=3).choices[0]
    got = lp["reply"]["choices"][0]
    assert got["message"]["content"] == want.message.content
    assert len(got["logprobs"]["content"]) == len(want.logprobs.content) == 6
    for g, w in zip(got["logprobs"]["content"], want.logprobs.content):
        assert (g["token"], g["bytes"]) == (w.token, w.bytes)
        assert g["logprob"] == pytest.approx(w.logprob, abs=2e-3)
        assert [(a["token"], a["bytes"]) for a in g["top_logprobs"]] == [(a.token, a.bytes) for a in w.top_logprobs]
        assert [a["logprob"] for a in g["top_logprobs"]] == pytest.approx([a.logprob for a in w.top_logprobs],
                                                                          abs=2e-3)
    assert again["token_ids"] == lp["token_ids"]    # refusals leave the engine as it was
    assert bias["token_ids"] == [65] * 4 and bias_sampled["token_ids"] == [66] * 4
    assert choice["reply"]["choices"][0]["message"]["content"] in ("yes", "no")
    assert choice["reply"]["choices"][0]["finish_reason"] == "stop"
    assert schema["reply"]["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(schema["reply"]["choices"][0]["message"]["content"])["ok"], bool)

    chunks = stream["chunks"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in got["logprobs"]["content"][:5]]
    assert all(len(e["top_logprobs"]) == 2 for e in streamed)

    params = [r["error"]["param"] for r in refused]
    assert params == ["frobnicate", "temperature", "tools", "n", "logit_bias", "structured_outputs.grammar"]
    assert all(r["error"]["name"] == "EngineError" for r in refused)
    unknown, wrong_type, tools = (r["error"] for r in refused[:3])
    assert unknown["code"] == "unknown_parameter" and "'frobnicate'" in unknown["message"]
    assert wrong_type["code"] == "invalid_type" and "a string" in wrong_type["message"]
    assert tools["code"] == "unsupported_parameter" and "not supported by the web engine" in tools["message"]


def test_next_chat_turn_reuses_the_previous_turns_kv(tiny_site, node_path, tmp_path):
    """The web engine keeps its KV sequence between requests: a chat's next turn prefills only what is new (the
    previous prompt at least), and every answer is what a cold engine gives."""
    from mlcc.runtime.engine import Engine

    site, cpu = tiny_site
    turn2 = ASK + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Spain?"}]
    first, second, again, other = run_requests(site, node_path, tmp_path, [
        {"messages": m, "max_tokens": 6, "temperature": 0} for m in (ASK, turn2, turn2, ASK)])
    with Engine(cpu, prefix_cache=False) as engine:
        n_ask, n_turn2 = len(engine.encode_chat(ASK)), len(engine.encode_chat(turn2))
        want = engine.chat.completions.create(messages=turn2, max_tokens=6, temperature=0).choices[0].message.content
    cached = [r["reply"]["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, second, again, other)]
    assert cached[0] == 0 and cached[1] >= n_ask and cached[2] == n_turn2 - 1 and cached[3] == n_ask - 1
    assert [r["reply"]["choices"][0]["message"]["content"] for r in (second, again)] == [want, want]
    assert other["token_ids"] == first["token_ids"]


def test_grammar_and_logprobs_in_the_browser(tiny_site, node_path):
    """web-xgrammar loads in Chromium next to the bundle: a JSON schema constrains the answer there too."""
    site, _ = tiny_site
    req = {"messages": ASK, "max_tokens": 30, "temperature": 0, "logprobs": True, "top_logprobs": 1,
           "response_format": {"type": "json_schema", "json_schema": {"name": "ok", "schema": OK_SCHEMA}}}
    with serve(site) as url:
        proc = run_node([str(JS / "browser_run.mjs"), url, "--prompt", PROMPT, "--max-tokens", "1", "--request",
                         json.dumps(req)], node_path)
    out = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {"error": proc.stderr}
    assert proc.returncode == 0 and out["ok"], out
    assert out["request"]["xgrammar"], out["request"]
    reply = out["request"]["reply"]["choices"][0]
    assert isinstance(json.loads(reply["message"]["content"])["ok"], bool)
    assert len(reply["logprobs"]["content"]) == out["request"]["reply"]["usage"]["completion_tokens"]


def test_web_rejects_corrupted_shard_and_foreign_library(tiny_site, node_path, tmp_path):
    site, _ = tiny_site
    bad = tmp_path / "site"
    shutil.copytree(site, bad)
    shard = bad / "models" / "tiny-q4f32" / "params_shard_0.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = run_node(["node_chat.mjs", "models/tiny-q4f32", "--prompt", "hi"], node_path, cwd=bad)
    assert proc.returncode == 1
    assert "checksum mismatch" in proc.stderr and "params_shard_0.bin" in proc.stderr

    shard.write_bytes((site / "models" / "tiny-q4f32" / "params_shard_0.bin").read_bytes())
    cfg_path = bad / "models" / "tiny-q4f32" / "mlcc-config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["stamp"]["param_hash"] = "0" * 16
    cfg_path.write_text(json.dumps(cfg))
    proc = run_node(["node_chat.mjs", "models/tiny-q4f32", "--prompt", "hi"], node_path, cwd=bad)
    assert proc.returncode == 1
    assert "param_hash" in proc.stderr and "recompile" in proc.stderr


def test_model_choice_falls_back_to_f32(node_path):
    script = ("import { chooseModel } from './engine.js';"
              "const ms=[{id:'a',dtype:'float16'},{id:'b',dtype:'float32'}];"
              "console.log(chooseModel(ms,new Set(['shader-f16'])).id, chooseModel(ms,new Set()).id);"
              "try { chooseModel([ms[0]], new Set()); } catch (e) { console.log(e.message.includes('q4f32_1')); }")
    proc = run_node(["--input-type=module", "-e", script], node_path, cwd=JS)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["a", "b", "true"]


# --- Vulkan (issue: targets): the WebGPU build driven by Dawn's Vulkan backend on Mesa's lavapipe ------------------
LAVAPIPE_ICD = "/usr/share/vulkan/icd.d/lvp_icd.json"
ADAPTER_PROBE = ("const {create, globals} = require('webgpu'); Object.assign(globalThis, globals);"
                 "create(['backend=vulkan']).requestAdapter().then(a => { console.log(a ? a.info.description : 'none');"
                 " process.exit(0); });")


@pytest.fixture(scope="module")
def lavapipe(node_path):
    proc = run_node(["-e", ADAPTER_PROBE], node_path, env={"VK_ICD_FILENAMES": LAVAPIPE_ICD}, timeout=120)
    desc = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if "llvmpipe" not in desc:
        msg = (f"Dawn cannot use lavapipe ({desc or proc.stderr[-300:]}); it needs Mesa >= 24 "
               "(Debian 12: apt-get install -t bookworm-backports mesa-vulkan-drivers)")
        if os.environ.get("MLCC_REQUIRE_WEB") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return {"VK_ICD_FILENAMES": LAVAPIPE_ICD}


@pytest.fixture(scope="module")
def vulkan_site(tiny_site, node_path, hf_models, tmp_path_factory):
    """A site with the vulkan preset's q4f16_1 build next to the webgpu q4f32_1 one (both WGSL in a .wasm)."""
    from mlcc.compiler.build import compile_model
    from mlcc.web.site import build_site

    site, _ = tiny_site
    root = tmp_path_factory.mktemp("vulkan")
    compile_model(hf_models("llama"), "vulkan", "q4f16_1", root / "vk-q4f16_1")
    compile_model(hf_models("llama"), "llvm", "q4f16_1", root / "cpu-q4f16_1")
    mixed = build_site([site.parent / "tiny-q4f32", root / "vk-q4f16_1"], root / "site")
    return mixed, root


def test_vulkan_on_lavapipe_matches_cpu(vulkan_site, tiny_site, lavapipe, node_path):
    """Dawn's Vulkan backend on Mesa's lavapipe, f16 (vulkan preset) and f32 builds, against the CPU target."""
    site, root = vulkan_site
    _, cpu_f32 = tiny_site
    for build, cpu in (("vk-q4f16_1", root / "cpu-q4f16_1"), ("tiny-q4f32", cpu_f32)):
        want_text, want_n = cpu_answer(cpu, 16)
        got = in_node(site, build, node_path, 16, env=lavapipe, extra=("--backend", "vulkan"))
        assert got["adapter"]["description"].startswith("llvmpipe"), got["adapter"]
        assert got["usage"]["completion_tokens"] == want_n, build
        assert got["content"] == want_text, build


def test_site_picks_f16_where_supported_and_f32_in_chromium(vulkan_site, lavapipe, node_path):
    site, _ = vulkan_site
    on_lavapipe = in_node(site, "", node_path, 4, env=lavapipe)     # lavapipe has shader-f16
    assert on_lavapipe["model"] == "vk-q4f16_1"
    in_chromium = in_browser(site, node_path, 4)                       # SwiftShader has no shader-f16
    assert "tiny-q4f32" in in_chromium["status"]


BENCH = JS.parents[1] / "bench" / "vulkan_bench.mjs"


def test_decode_step_reuses_bind_groups_on_lavapipe(tiny_site, lavapipe, node_path, tmp_path):  # noqa: F811
    """The host's side of a decode step, counted on the CI adapter by the benchmark that times it on real GPUs
    (bench/vulkan_bench.mjs): after the first steps a step creates (almost) no bind groups, where tvmjs asks for one
    per dispatch, which on the H200 was half the step's time; one submit batch per forward and one read-back per
    token. The same ids with the cache off."""
    site, _ = tiny_site
    ids = [1 + (7 * i) % 90 for i in range(12)]
    job = {"prompt": ids, "decode": 12, "prefill": ids[:8], "prefill_repeats": 1, "check_prompt": ids[:6],
           "check_forced": [3, 5], "sample_idx": list(range(16)), "profile_tokens": 0,
           "variants": ["no_bind_group_cache"]}
    (tmp_path / "job.json").write_text(json.dumps(job))
    proc = run_node([str(BENCH), str(site), "tiny-q4f32", str(tmp_path / "job.json"), "--backend", "vulkan"],
                    node_path, env=lavapipe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["engine_caches_bind_groups"]
    per = out["per_token"]
    assert per["dispatch"] >= 10, per
    # new buffers (a step's token ids, the KV cache's page tables as the sequence grows) make a few; the rest is reused
    assert per["bindGroup"] < per["dispatch"] / 4, per
    assert per["submit"] <= 3 and per["mapAsync"] <= 1, per
    off = out["variants"]["no_bind_group_cache"]
    assert off["ids_equal"], off
    assert off["per_token"]["bindGroup"] == per["dispatch"], off


def test_python_engine_points_wasm_builds_to_the_web_runtime(tiny_site):
    from mlcc.errors import ArtifactError
    from mlcc.runtime.engine import Engine

    site, _ = tiny_site
    with pytest.raises(ArtifactError, match="runs in a browser or Node.js"):
        Engine(site.parent / "tiny-q4f32", target="llvm")
