"""Multi-LoRA serving: PEFT adapters on builds with an adapter pool (CompileOptions.max_loras), against peft's own
greedy tokens (transformers with the adapter merged), alone and mixed in one batch with base requests; the prefix
cache keyed by adapter; adapters refused in one line; the server's adapter endpoints with the `openai` client."""

import queue

import httpx
import openai
import pytest
from conftest import PROMPT
from lora_support import ALL_MODULES, make_adapter, peft_greedy, peft_last_logits
from server_support import mlcc_serve

from mlcc.compiler.build import compile_model
from mlcc.errors import ArtifactError, LoraAdapterError
from mlcc.options import CompileOptions
from mlcc.runtime.core.request import Request
from mlcc.runtime.core.sampler import SamplingParams
from mlcc.runtime.device.lora import read_adapter
from mlcc.runtime.device.model import LoadedModel
from mlcc.runtime.engine import Engine

N = 8          # greedy tokens compared
SLOTS = 2      # the pool's adapters: three adapters take turns in it
RANK = 8


@pytest.fixture(scope="module")
def adapters(hf_models, tmp_path_factory):
    """name → folder: a rank-4 adapter of q/v/o/down, a rank-8 rsLoRA one of every projection, a rank-2 one of
    k/gate/up, all of the tiny llama."""
    base, root = hf_models("llama"), tmp_path_factory.mktemp("lora")
    return {"a1": make_adapter(base, root / "a1", 1, 4, ["q_proj", "v_proj", "o_proj", "down_proj"]),
            "a2": make_adapter(base, root / "a2", 2, RANK, ALL_MODULES, alpha=32, rslora=True),
            "a3": make_adapter(base, root / "a3", 3, 2, ["k_proj", "gate_proj", "up_proj"], alpha=4)}


@pytest.fixture(scope="module")
def lora_build(hf_models, tmp_path_factory):
    """build(kind, quant) → an artifacts folder with a pool of SLOTS adapters of rank up to RANK."""
    cache = {}

    def build(kind: str, quant: str = "q0f32"):
        if (kind, quant) not in cache:
            out = tmp_path_factory.mktemp(f"lora-{kind}-{quant}") / "model"
            compile_model(hf_models(kind), "llvm", quant, out,
                          options=CompileOptions(max_loras=SLOTS, max_lora_rank=RANK))
            cache[kind, quant] = out
        return cache[kind, quant]

    return build


@pytest.fixture(scope="module")
def engine(lora_build, adapters):
    with Engine(lora_build("llama"), target="llvm", max_batch=8,
                lora={name: str(path) for name, path in adapters.items()}) as e:
        yield e


def _hf(folder, quant: str = "q0f32"):
    from test_parity import hf_model

    return hf_model(folder, quant)   # (the float weights a scheme stores, dequantized)


def _greedy(engine, runs: list[tuple[list[int], str | None]], n: int = N) -> list[list[int]]:
    """Greedy ids of (prompt, adapter name) requests submitted together, so that they decode side by side."""
    queues = [queue.Queue() for _ in runs]
    for (prompt, name), q in zip(runs, queues):
        engine.core.submit(Request(prompt, SamplingParams(temperature=0, ignore_eos=True), n, q.put, None, set(),
                                   lora=engine.adapter_for(name)))
    out = []
    for q in queues:
        ids = []
        while (ev := q.get(timeout=120)).kind == "delta":
            ids.append(ev.token_id)
        assert ev.kind == "finish", ev.error
        out.append(ids)
    return out


def test_each_adapter_alone_and_all_mixed_match_peft(engine, adapters, hf_models):
    hf = _hf(hf_models("llama"))
    want = {name: peft_greedy(hf, PROMPT, path, N) for name, path in [(None, None), *adapters.items()]}
    assert len({tuple(v) for v in want.values()}) == 4   # the adapters change the answer
    for name, ids in want.items():
        assert _greedy(engine, [(PROMPT, name)]) == [ids], name
    # one batch of base and adapter requests: three adapters take turns in two slots, the third waits for one
    loads = engine.model.lora.loads
    names = [None, "a1", "a2", None, "a3", "a1"]
    assert _greedy(engine, [(PROMPT, m) for m in names]) == [want[m] for m in names]
    assert engine.model.lora.loads > loads


# (the other families' builds are slow-marked to keep CI's time: llama covers QLoRA and float16 there)
@pytest.mark.parametrize("kind, quant", [("llama", "q4f32_1"), ("llama", "q0f16"),
                                         pytest.param("qwen3", "q0f32", marks=pytest.mark.slow),
                                         pytest.param("granite", "q0f32", marks=pytest.mark.slow)])
def test_qlora_float16_and_other_families_match_peft(lora_build, hf_models, tmp_path, kind, quant):
    """q4 base weights with float adapters (QLoRA: the reference merges the adapter into the dequantized weights);
    a float16 model (its pool float16 too: logits within test_parity's float16 bound, 2e-2); Qwen3 (wider heads,
    q/k norms); Granite (its residual multiplier, folded into o_proj and down_proj, scales their adapters'
    products too)."""
    f32 = quant.endswith("f32") or quant.endswith("f32_1")
    base = hf_models(kind)
    adapters = {"x": make_adapter(base, tmp_path / "x", 4, RANK, ALL_MODULES),
                "y": make_adapter(base, tmp_path / "y", 5, 4, ["q_proj", "v_proj", "up_proj"], alpha=8)}
    hf = _hf(base, quant)
    names = ["x", None, "y"]
    want = {name: peft_greedy(hf, PROMPT, path, N) for name, path in [(None, None), *adapters.items()]}
    with Engine(lora_build(kind, quant), target="llvm", max_batch=4,
                lora={k: str(v) for k, v in adapters.items()}) as e:
        if f32:   # (float16 rounding may flip a near tie)
            assert _greedy(e, [(PROMPT, m) for m in names]) == [want[m] for m in names]
    # and the logits of one prefill of the three, within the model dtype's rounding of peft's
    from test_parity import rel_err

    model = LoadedModel(lora_build(kind, quant))
    model.create_kv_cache(4, 256, 64)
    for seq, name in enumerate(names):
        model.add_sequence(seq)
        adapter = read_adapter(name, adapters[name], model.lora.layout) if name else None
        model.lora.bind(seq, model.lora.acquire(adapter, set()) if adapter else None)
    got = model.prefill(list(range(3)), [PROMPT] * 3).numpy()
    ref = {name: peft_last_logits(hf, PROMPT, adapters.get(name)) for name in names}
    for row, name in enumerate(names):
        assert rel_err(got[row], ref[name]) < (1e-4 if f32 else 2e-2), name
        if name:   # the adapter matters
            assert rel_err(ref[name], ref[None]) > 1e-2


def test_prefix_cache_keys_include_the_adapter(engine):
    """A prompt cached under one adapter is reused by that adapter only: the base model recomputes it."""
    prompt = list(range(40, 90))   # three pages of 16
    kw = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = engine.completions.create(model="a2", **kw)
    base = engine.completions.create(**kw)
    again = engine.completions.create(model="a2", **kw)
    assert base.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 32
    assert again.choices[0].text == first.choices[0].text != base.choices[0].text
    assert first.model == "a2" and base.model == engine.model_name


def test_bad_adapters_are_refused_in_one_line(engine, hf_models, tmp_path):
    llama, wide = hf_models("llama"), hf_models("llama_g128")
    cases = [
        (make_adapter(wide, tmp_path / "wide", 6, 4, ["q_proj"]), "wrong base shapes"),
        (make_adapter(llama, tmp_path / "head", 7, 4, ["q_proj", "lm_head"]), "cannot adapt: lm_head"),
        (make_adapter(llama, tmp_path / "big", 8, 2 * RANK, ["q_proj"]), f"rank {2 * RANK}.*max_lora_rank {RANK}"),
        (tmp_path / "missing", "not a folder"),
    ]
    for path, why in cases:
        with pytest.raises(LoraAdapterError, match=why) as e:
            engine.load_lora("bad", path)
        assert "\n" not in str(e.value)
    assert "bad" not in engine.lora_adapters
    with pytest.raises(LoraAdapterError, match="already been loaded"):
        engine.load_lora("a1", tmp_path / "head")


def test_a_build_without_lora_refuses_adapters_naming_the_option(compiled, adapters):
    with pytest.raises(ArtifactError, match="compiled without LoRA.*--option max_loras="):
        Engine(compiled("llama", "q0f32"), target="llvm", lora={"a1": str(adapters["a1"])})


def test_the_pool_is_reused_least_recently_used_first(engine):
    pool = engine.model.lora
    a1, a2, a3 = (engine.lora_adapters[n] for n in ("a1", "a2", "a3"))
    first = pool.acquire(a1, set())
    pool.acquire(a2, set())
    assert pool.acquire(a1, set()) == first
    # a3 replaces the least recently used (a2), unless a running request uses it: then a1's slot goes
    assert pool.acquire(a3, {a1.key}) != first
    assert pool.acquire(a2, {a3.key}) == first
    assert set(pool.resident()) == {a2.key, a3.key}


def test_scheduler_admits_no_more_adapters_than_slots(engine):
    """Requests on a third adapter wait while two others run; base requests behind them wait in order too."""
    from mlcc.runtime.core.policy import make_policy
    from mlcc.runtime.core.scheduler import Scheduler

    sched = Scheduler(make_policy("no_evict", 16, 100, 512), max_batch=8, max_adapters=2)
    ads = [engine.lora_adapters[n] for n in ("a1", "a2", "a3")]
    reqs = [Request([1, 2, 3], SamplingParams(), 4, lambda e: None, None, set(), lora=a)
            for a in [ads[0], None, ads[1], ads[0], ads[2], None]]
    for r in reqs:
        sched.submit(r)
    plan, _ = sched.schedule(100)
    assert plan.admit == reqs[:4]


# -- the server --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(lora_build, adapters, tmp_path_factory):
    log = tmp_path_factory.mktemp("lora-srv") / "server.log"
    with mlcc_serve(lora_build("llama"), log, "--served-model-name", "tiny", "--lora", f"a1={adapters['a1']}",
                    "--allow-runtime-lora") as base:
        yield base


def test_openai_client_picks_adapters_by_model_and_the_endpoints_load_and_unload(server, engine, adapters):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "a1"} and cards["a1"].parent == "tiny" and cards["a1"].root == str(adapters["a1"])
    kw = {"prompt": PROMPT, "max_tokens": N, "temperature": 0}
    for name in ("tiny", "a1"):
        r = client.completions.create(model=name, **kw)
        local = engine.completions.create(model=None if name == "tiny" else name, **kw)
        assert r.model == name and r.choices[0].text == local.choices[0].text
    with pytest.raises(openai.NotFoundError, match="a2"):
        client.completions.create(model="a2", **kw)

    r = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(adapters["a2"])})
    assert r.status_code == 200 and "a2" in r.text
    assert client.completions.create(model="a2", **kw).choices[0].text == \
        engine.completions.create(model="a2", **kw).choices[0].text
    r = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(adapters["a2"])})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"})
    assert r.status_code == 400 and "not a folder" in r.json()["error"]["message"]

    r = httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "a2"})
    assert r.status_code == 200
    assert [m.id for m in client.models.list().data] == ["tiny", "a1"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a2", **kw)
    assert httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 404
    metrics = httpx.get(f"{server}/metrics").text
    assert "mlcc_lora_adapters 1.0" in metrics and f"mlcc_lora_slots {SLOTS}.0" in metrics


def test_runtime_adapter_endpoints_are_off_without_the_flag(engine, adapters):
    from fastapi.testclient import TestClient

    from mlcc.runtime.serve.server import create_app

    client = TestClient(create_app(engine))
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": str(adapters["a1"])})
    assert r.status_code == 403 and "--allow-runtime-lora" in r.json()["error"]["message"]
    assert "z" not in engine.lora_adapters


@pytest.mark.parametrize("target, tp, why", [("webgpu", 1, "web engine serves no LoRA"),
                                             ("cuda", 2, "not served with --tensor-parallel")])
def test_builds_that_cannot_serve_adapters_refuse_the_option(hf_models, target, tp, why):
    from mlcc.compiler.build import export_module
    from mlcc.compiler.quantize import get_quantization
    from mlcc.compiler.weights import load_source
    from mlcc.errors import UnsupportedConfigError
    from mlcc.targets import get_target

    with pytest.raises(UnsupportedConfigError, match=why):
        export_module(load_source(hf_models("llama")), get_target(target), get_quantization("q4f16_1"),
                      tensor_parallel=tp, options=CompileOptions(max_loras=2))


def test_lora_flags_parse_into_the_engine_config():
    import argparse

    from mlcc.errors import EngineConfigError
    from mlcc.options import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser, max_batch=8)
    cfg = EngineConfig.from_cli(parser.parse_args(["m", "--lora", "sql=/a/sql", "--lora", "chat=/a/chat",
                                                   "--max-loras", "3", "--max-lora-rank", "32"]))
    assert cfg.lora == {"sql": "/a/sql", "chat": "/a/chat"} and (cfg.max_loras, cfg.max_lora_rank) == (3, 32)
    assert EngineConfig.from_cli(parser.parse_args(["m"])).lora is None
    with pytest.raises(EngineConfigError, match="NAME=PATH"):
        EngineConfig.from_cli(parser.parse_args(["m", "--lora", "/a/sql"]))


def test_chat_answers_with_the_lora_adapter(lora_build, adapters, engine, capsys):
    from mlcc.options import EngineConfig
    from mlcc.runtime.serve.chat_cli import run_chat

    config = EngineConfig(target="llvm", max_batch=1, lora={"a2": str(adapters["a2"])})
    assert run_chat(str(lora_build("llama")), config, prompt="Hello", max_tokens=N,
                    sampling={"temperature": 0.0}) == 0
    out = capsys.readouterr()
    want = engine.chat.completions.create(model="a2", messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=N, temperature=0).choices[0].message.content
    assert "with LoRA adapter a2" in out.err and out.out == want + "\n"


@pytest.mark.parametrize("settings", [{"pipeline": True},
                                      {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                              "prompt_lookup_max": 2}}],
                         ids=["pipelined", "ngram"])
def test_pipelined_and_speculative_decoding_keep_the_adapter(lora_build, adapters, engine, settings):
    """A lone request decoded pipelined, and one verifying ngram proposals, give an adapter's greedy tokens."""
    prompt = [5, 77, 12, 5, 77, 12, 5, 77]   # repeats, so ngram proposes
    want = _greedy(engine, [(prompt, "a2"), (prompt, None)], n=12)
    with Engine(lora_build("llama"), target="llvm", max_batch=2, lora={"a2": str(adapters["a2"])}, **settings) as e:
        assert [_greedy(e, [(prompt, m)], n=12)[0] for m in ("a2", None)] == want
        assert e.core.stats["pipelined_tokens" if "pipeline" in settings else "spec_drafts"] > 0


# -- CUDA ------------------------------------------------------------------------------------------------------------

def _cuda_present() -> bool:
    from test_gpu_families import _cuda_present as present

    return present()


def _forced_logits(folder, adapters, names: list[str | None], steps: list[int]):
    """Logits [1 + steps, sequences, vocab] of one batch, sequence i on adapter names[i] (None: none): one batched
    prefill of a 39-token prompt each (rotated per row), then decode steps fed fixed tokens, so that two builds see
    the same inputs whatever their greedy ids."""
    import numpy as np

    model = LoadedModel(folder)
    n, seqs = len(names), list(range(len(names)))
    model.create_kv_cache(n, 512, 256)
    loaded = {name: read_adapter(name, adapters[name], model.lora.layout) for name in set(names) - {None}}
    in_use = {a.key for a in loaded.values()}
    for seq, name in zip(seqs, names):
        model.add_sequence(seq)
        model.lora.bind(seq, model.lora.acquire(loaded[name], in_use) if name else None)
    prompts = [(PROMPT * 3)[seq:] + (PROMPT * 3)[:seq] for seq in seqs]
    rows = [model.prefill(seqs, prompts).numpy().reshape(n, -1)]
    rows += [model.decode(seqs, [t + 3 * seq for seq in seqs]).numpy().reshape(n, -1) for t in steps]
    return np.stack(rows).astype(np.float64)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_present(), reason="no CUDA device")
@pytest.mark.parametrize("quant", ["q4f16_1", "q0f16"])
def test_mixed_adapters_on_cuda_match_the_cpu_build(hf_models, adapters, tmp_path, quant):
    """Two adapters and base rows in one batch on CUDA (the twins' gathered products through dlight's schedules,
    beside the q4 GEMM / cuBLASLt prefill and the batched and batch-1 decode kernels) against the CPU build of the
    same quantization and adapters: logits within test_gpu_families' float16 bound (2e-2 relative to the largest
    |logit|) at every step and row, and the same argmax wherever a row's top two logits are further apart than its
    difference; then one adapter alone at batch 1 (the decode GEMV path)."""
    import numpy as np

    options = CompileOptions(max_loras=SLOTS, max_lora_rank=RANK)
    for target, name in (("llvm", "cpu"), ("cuda", "cuda")):
        compile_model(hf_models("llama"), target, quant, tmp_path / name, options=options)
    steps = [(7 * i + 3) % 300 for i in range(24)]
    for names in (["a1", None, "a2", "a1"], ["a2"]):
        cpu = _forced_logits(tmp_path / "cpu", adapters, names, steps)
        cuda = _forced_logits(tmp_path / "cuda", adapters, names, steps)
        diff = np.abs(cuda - cpu).max(axis=-1)
        errs = diff / np.abs(cpu).max(axis=-1)
        assert errs.max() <= 2e-2, f"{names}: rel err per step and row: {np.round(errs, 4).tolist()}"
        top2 = np.sort(cpu, axis=-1)[..., -2:]
        decisive = top2[..., 1] - top2[..., 0] > 2 * diff
        assert ((cuda.argmax(-1) == cpu.argmax(-1)) | ~decisive).all(), names
