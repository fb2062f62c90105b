"""EngineConfig: one settings value for the engine, its checks, and the chat/serve flags declared from it once."""

from __future__ import annotations

import pytest

from mlcc.cli import build_parser
from mlcc.errors import EngineConfigError
from mlcc.options import CompileOptions, EngineConfig


def test_unknown_setting_names_the_known_ones():
    with pytest.raises(EngineConfigError, match="unknown engine setting.*max_batchh.*known: .*max_batch"):
        EngineConfig.of(max_batchh=4)


@pytest.mark.parametrize("bad", [{"max_batch": 0}, {"prefill_chunk": -1}, {"gpu_memory_utilization": 1.5},
                                 {"policy": "fifo"}, {"weights": "zeros"}, {"kv_cache_tokens": 1.5},
                                 {"options": {"pdl": False}}])
def test_bad_values_are_refused(bad):
    with pytest.raises(EngineConfigError, match=next(iter(bad))):
        EngineConfig(**bad)


def test_keywords_override_a_given_config():
    base = EngineConfig(max_batch=16, prefix_cache=False)
    cfg = EngineConfig.of(base, max_batch=2)
    assert (cfg.max_batch, cfg.prefix_cache) == (2, False) and base.max_batch == 16
    assert EngineConfig().describe() == "defaults" and '"max_batch": 2' in cfg.describe()


@pytest.mark.parametrize("command,max_batch", [("chat", 1), ("serve", 8)])
def test_chat_and_serve_share_the_engine_flags(command, max_batch):
    parser = build_parser()
    assert EngineConfig.from_cli(parser.parse_args([command])) == EngineConfig(max_batch=max_batch)
    args = parser.parse_args([command, "model.gguf", "--max-batch", "3", "--no-prefix-cache", "--policy", "max_util",
                              "--kv-cache-tokens", "4096", "--gpu-memory-utilization", "0.5", "--threads", "2",
                              "--option", "pdl=0", "--speculative-config", '{"method": "ngram"}'])
    cfg = EngineConfig.from_cli(args)
    assert args.model == "model.gguf"
    assert cfg == EngineConfig(max_batch=3, prefix_cache=False, policy="max_util", kv_cache_tokens=4096,
                               gpu_memory_utilization=0.5, num_threads=2, options=CompileOptions(pdl=False),
                               speculative_config='{"method": "ngram"}')


def test_every_flag_has_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in ("chat", "serve", "compile"):
        for action in sub.choices[name]._actions:
            assert action.help, f"mlcc {name} {action.option_strings or action.dest} has no help"


def _gpu_engine(free_gib: float, total_gib: float = 80.0):
    """The parts of an Engine its KV-cache sizing reads, for a Llama-3-8B-shaped model on a GPU."""
    from types import SimpleNamespace

    config = {"model_dtype": "float16",
              "model_config": {"num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128,
                               "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256}}
    dev = SimpleNamespace(total_global_memory=int(total_gib * 2**30), available_global_memory=int(free_gib * 2**30))
    return SimpleNamespace(model=SimpleNamespace(config=config, device_kind="cuda", dev=dev))


def test_gpu_kv_cache_is_sized_from_free_memory():
    from mlcc.runtime.engine import Engine

    cfg = EngineConfig(max_batch=256, context_window=8192)
    per_token = 2 * 32 * 8 * 128 * 2
    roomy, tight = (Engine._kv_budget_tokens(_gpu_engine(free), cfg) for free in (74.0, 20.0))
    # what is free, less 15% of the device kept back, less the activations estimate (about 1.4 GiB here)
    assert 74 * 2**30 - 12 * 2**30 - 2 * 2**30 < roomy * per_token < 74 * 2**30 - 12 * 2**30 - 2**30
    assert tight < roomy and Engine._kv_budget_tokens(_gpu_engine(74.0), EngineConfig.of(
        cfg, gpu_memory_utilization=0.5)) < roomy
    with pytest.raises(EngineConfigError, match="no room for a KV cache.*--gpu-memory-utilization"):
        Engine._kv_budget_tokens(_gpu_engine(12.5), cfg)


def test_version_flag():
    import subprocess
    import sys

    import mlcc

    r = subprocess.run([sys.executable, "-m", "mlcc", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"mlcc {mlcc.__version__}"


def test_serve_refuses_a_busy_port_before_loading_the_model():
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t = time.time()
        r = subprocess.run([sys.executable, "-m", "mlcc", "serve", "no-such-model.gguf", "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr and "--port" in r.stderr
    assert "Traceback" not in r.stderr and time.time() - t < 60


def test_a_target_this_machine_cannot_run_is_refused_before_compiling(tmp_path):
    import subprocess
    import sys

    from mlcc.errors import UnsupportedTargetError
    from mlcc.runtime.jit import resolve_model
    from mlcc.targets import get_target

    if get_target("cuda").can_run_here():
        pytest.skip("this machine runs CUDA: nothing to refuse")
    source = tmp_path / "model.gguf"
    source.write_bytes(b"not compiled: the refusal comes first")
    with pytest.raises(UnsupportedTargetError, match="--target cuda: this machine cannot run it.*mlcc compile"):
        resolve_model(source, "cuda", None)
    # compiling for it stays allowed (for another machine), with a warning before the work starts
    r = subprocess.run([sys.executable, "-m", "mlcc", "compile", str(tmp_path / "missing"), "--target", "cuda",
                        "--output", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert "no cuda device here" in r.stderr and "will run on another machine" in r.stderr
