"""DeepSeek-V3 and -V2 compiled for the CPU against transformers on small random configs: latent attention with the
up-projections absorbed (q through its own low rank on V3, straight on V2; interleaved rotary channels; YaRN with
mscale on V3), a dense first layer on V3, shared experts, routing among the best expert groups (V3: sigmoid scores
chosen with the correction bias, renormalised; V2: softmax, not), routed_scaling_factor; q0f32 logits rel. err ≤
1e-4 and 32 greedy ids identical on a prompt whose tokens route to different experts; ragged batches and a forked
sequence; GPU targets refused in one line."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPT
from test_gpt_oss import check_ragged_batch_and_fork
from test_parity import hf_logits, hf_model, run_greedy

from mlcc.runtime.device.model import LoadedModel

KINDS = ["deepseek_v3", "deepseek_v2"]


def expert_sets(hf, ids: list[int]) -> set[tuple[int, ...]]:
    """The expert sets transformers' last layer routes the tokens of `ids` to."""
    seen = []
    handle = hf.model.layers[-1].mlp.gate.register_forward_hook(lambda _m, _i, out: seen.append(out[2]))
    try:
        hf_logits(hf, ids)
    finally:
        handle.remove()
    return {tuple(sorted(r.tolist())) for r in seen[0]}


@pytest.mark.parametrize("kind", KINDS)
def test_q0f32_prefill_decode_and_32_greedy_tokens(kind, compiled, hf_models):
    hf = hf_model(hf_models(kind))
    assert len(expert_sets(hf, PROMPT)) >= len(PROMPT) // 3
    m = LoadedModel(compiled(kind))
    m.create_kv_cache(2, 256, 64)
    ours = run_greedy(m, hf, PROMPT, 32, 1e-4)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(PROMPT):].tolist()
    assert ours == ref


def test_ragged_batch_and_a_forked_sequence(compiled, hf_models):
    check_ragged_batch_and_fork(compiled("deepseek_v3"), hf_model(hf_models("deepseek_v3")), [33])


def test_the_cache_holds_the_latent(compiled):
    """One KV head of kv_lora_rank + qk_rope_head_dim channels (the conftest config: 32 + 8)."""
    import json

    cfg = json.loads((compiled("deepseek_v3") / "mlcc-config.json").read_text())["model_config"]
    assert (cfg["num_key_value_heads"], cfg["head_dim"]) == (1, 40)


def test_gpu_targets_refused_in_one_line(hf_models):
    from mlcc.compiler.build import export_module
    from mlcc.compiler.quantize import get_quantization
    from mlcc.compiler.weights import load_source
    from mlcc.errors import UnsupportedConfigError
    from mlcc.targets import get_target

    for target in ("cuda", "webgpu"):
        with pytest.raises(UnsupportedConfigError, match="--target llvm") as e:
            export_module(load_source(hf_models("deepseek_v3")), get_target(target), get_quantization("q4f16_1"))
        assert "\n" not in str(e.value)
