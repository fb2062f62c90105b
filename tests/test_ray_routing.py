"""The pieces of `mlcc serve --ray` that need no cluster: the prompt-prefix index the router routes by, the
deployment options the flags become (autoscaling passed through), and the flag checks."""

import pytest

from mlcc.runtime.serve.rayserve.prefix_index import PrefixIndex, block_keys, prompt_text

SYSTEM = "You are a terse assistant. Answer in one word only. " * 6


def chat(user: str) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}


def test_prompt_text_of_chat_and_completions_bodies():
    assert prompt_text(chat("Hi")) == f"<system>{SYSTEM}<user>Hi"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
    assert prompt_text(parts) == '<user>[{"text": "a", "type": "text"}]'
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"prompt": [1, 2, 3]}) == "1 2 3"
    assert prompt_text({"model": "x"}) == ""


def test_block_keys_chain_over_the_whole_prefix():
    a, b = block_keys("x" * 64 + "y" * 64, 64), block_keys("z" * 64 + "y" * 64, 64)
    assert len(a) == 2 and len(block_keys("x" * 63, 64)) == 0
    assert a[1] != b[1]   # same second block, different prefix before it


def test_the_longest_cached_prefix_names_its_replica():
    index = PrefixIndex(block_chars=32)
    index.insert(prompt_text(chat("first question")), "r1")
    owner, matched = index.match(prompt_text(chat("another one")))
    assert owner == "r1" and matched >= len(SYSTEM) - 32
    assert index.match("unrelated text " * 10) == (None, 0)
    assert index.match(prompt_text(chat("x")), replicas={"r2"}) == (None, 0)   # r1 is not a candidate
    index.insert(prompt_text(chat("first question")) + " and a longer tail " * 4, "r2")
    assert index.match(prompt_text(chat("first question")) + " and a longer tail " * 4)[0] == "r2"


def test_dead_replicas_are_forgotten_and_capacity_is_kept():
    index = PrefixIndex(block_chars=16, capacity=8)
    index.insert("a" * 160, "r1")
    assert len(index) == 8   # least recently used blocks dropped
    index.forget({"r2"})
    assert len(index) == 0 and index.match("a" * 160) == (None, 0)


def test_flags_become_deployment_options_with_autoscaling():
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'mlcc[ray]'")
    from mlcc.cli import build_parser
    from mlcc.options import EngineConfig
    from mlcc.runtime.serve.rayserve.launch import settings_from_cli

    args = build_parser().parse_args(["serve", "--ray", "--replicas", "2", "--max-replicas", "6",
                                      "--target-ongoing-requests", "3", "--num-cpus-per-replica", "2",
                                      "--target", "llvm", "--max-batch", "8"])
    config = EngineConfig.from_cli(args)
    opts = settings_from_cli(args, config).deployment_options(config)
    scaling = opts["autoscaling_config"]
    assert (scaling.min_replicas, scaling.initial_replicas, scaling.max_replicas) == (2, 2, 6)
    assert scaling.target_ongoing_requests == 3
    assert opts["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 0.0}
    assert opts["max_ongoing_requests"] == 32 and "num_replicas" not in opts
    gpu_args = build_parser().parse_args(["serve", "--ray", "--replicas", "3", "--target", "cuda"])
    fixed = settings_from_cli(gpu_args, EngineConfig.from_cli(gpu_args))   # one GPU a replica
    assert fixed.deployment_options(config)["num_replicas"] == 3 and fixed.num_gpus == 1.0
    tp_args = build_parser().parse_args(["serve", "--ray", "--target", "cuda", "--tensor-parallel", "2"])
    assert settings_from_cli(tp_args, EngineConfig.from_cli(tp_args)).num_gpus == 2.0   # the GPUs it shards over


@pytest.mark.parametrize("flags,message", [
    (["--replicas", "0"], "--replicas must be at least 1"),
    (["--replicas", "4", "--max-replicas", "2"], "--max-replicas 2 is below"),
    (["--min-replicas", "1"], "give --max-replicas too"),
])
def test_bad_ray_flags_are_refused_in_one_line(flags, message):
    from mlcc.cli import build_parser
    from mlcc.errors import EngineConfigError
    from mlcc.options import EngineConfig
    from mlcc.runtime.serve.rayserve.launch import settings_from_cli

    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'mlcc[ray]'")
    args = build_parser().parse_args(["serve", "--ray", "--target", "llvm", *flags])
    with pytest.raises(EngineConfigError, match=message):
        settings_from_cli(args, EngineConfig.from_cli(args))


def test_the_rayservice_manifest_builds_the_application():
    """deploy/ray/rayservice.yaml's Serve config is valid and its arguments build the application."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'mlcc[ray]'")
    from pathlib import Path

    import yaml
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema

    from mlcc.runtime.serve.rayserve.launch import app_builder

    manifest = yaml.safe_load((Path(__file__).parent.parent / "deploy" / "ray" / "rayservice.yaml").read_text())
    config = ServeDeploySchema.model_validate(yaml.safe_load(manifest["spec"]["serveConfigV2"]))
    (app,) = config.applications
    assert app.import_path == "mlcc.runtime.serve.rayserve.launch:app_builder"
    assert call_user_app_builder_with_args_if_necessary(app_builder, app.args) is not None
