"""Mixture-of-experts families (Mixtral, Qwen2-MoE with its shared expert and a dense layer, Qwen3-MoE) compiled
for the CPU against transformers on small random configs: q0f32 logits rel. err ≤ 1e-4 and greedy tokens
identical, on a prompt whose tokens route to different experts; ragged batches (the grouped path); q4 against
transformers carrying the dequantized expert weights; GGUF files written as llama.cpp writes them (qwen2moe,
qwen3moe, and Mixtral as `llama` with stacked experts) against the HF model; tensor-parallel shards of the experts;
and the GPU decode kernels (warp GEMV, ranked top-k) with their thread loops run serially on the CPU against numpy."""

from __future__ import annotations

import inspect
import json
import re

import numpy as np
import pytest
import torch
from conftest import MOE_FAMILIES, PROMPT
from test_gguf import _permute_like_llama_cpp, _write_hparams, _write_tokenizer
from test_parity import hf_logits, rel_err, run_greedy

from mlcc.compiler.quantize import get_quantization, group_dequantize, group_quantize
from mlcc.runtime.device.model import LoadedModel

# (Mixtral: GGUF architecture llama, q/k permuted like every llama file)
GGUF_ARCH = {"mixtral": "LLAMA", "qwen2_moe_sparse": "QWEN2MOE", "qwen3_moe": "QWEN3MOE"}


def hf_moe(folder, quant: str = "q0f32"):
    """transformers' model; for a group quantization, with every weight mlcc quantizes replaced by its
    dequantized value: the linears, the embedding and the stacked [E, out, in] experts, not the routers nor
    Qwen2-MoE's shared-expert gate (mlcc keeps both in the model dtype)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    q = get_quantization(quant)
    if q.kind == "group":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim < 2 or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                    continue
                p.copy_(torch.from_numpy(group_dequantize(*group_quantize(p.numpy(), q), q)))
    return model


def expert_choices(hf, ids: list[int]) -> list[tuple[int, ...]]:
    """Per token of `ids`: the experts transformers' first sparse layer routes it to."""
    routers = [m for m in hf.modules() if type(m).__name__.endswith("TopKRouter")]
    seen = []
    handle = routers[0].register_forward_hook(lambda _m, _i, out: seen.append(out[2]))
    try:
        hf_logits(hf, ids)
    finally:
        handle.remove()
    return [tuple(sorted(r.tolist())) for r in seen[0]]


@pytest.mark.parametrize("kind", MOE_FAMILIES)
def test_q0f32_matches_transformers_with_tokens_on_different_experts(kind, compiled, hf_models):
    hf = hf_moe(hf_models(kind))
    choices = expert_choices(hf, PROMPT)
    assert len(set(choices)) >= len(PROMPT) // 3, f"too few distinct expert sets: {choices}"
    m = LoadedModel(compiled(kind, "q0f32"))
    m.create_kv_cache(2, 256, 64)
    ours = run_greedy(m, hf, PROMPT, 16, 1e-4)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(PROMPT):].tolist()
    assert ours == ref


def test_ragged_batch_prefill_and_batch_decode(compiled, hf_models):
    """Two sequences at once: tokens of both grouped by expert (prefill and the two-token decode)."""
    m = LoadedModel(compiled("qwen3_moe", "q0f32"))
    m.create_kv_cache(4, 256, 64)
    hf = hf_moe(hf_models("qwen3_moe"))
    a, b = PROMPT[:5], PROMPT[2:]
    m.add_sequence(0)
    m.add_sequence(1)
    lg = m.prefill([0, 1], [a, b]).numpy()
    assert rel_err(lg[0], hf_logits(hf, a)[-1]) <= 1e-4
    assert rel_err(lg[1], hf_logits(hf, b)[-1]) <= 1e-4
    lg = m.decode([0, 1], [11, 22]).numpy()
    assert rel_err(lg[0], hf_logits(hf, a + [11])[-1]) <= 1e-4
    assert rel_err(lg[1], hf_logits(hf, b + [22])[-1]) <= 1e-4


@pytest.mark.parametrize("kind,quant,tol", [("qwen2_moe", "q4f32_1", 1e-4), ("qwen3_moe", "q4f16_1", 2e-2)])
def test_q4_matches_dequantized_reference(kind, quant, tol, compiled, hf_models):
    out = compiled(kind, quant)
    m = LoadedModel(out)
    m.create_kv_cache(1, 256, 64)
    run_greedy(m, hf_moe(hf_models(kind), quant), PROMPT, 8, tol)
    params = {p["name"]: p for p in json.loads((out / "mlcc-config.json").read_text())["params"]}
    cfg = json.loads((hf_models(kind) / "config.json").read_text())
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    packed = params["model.layers.0.mlp.experts.gate_up_proj.q_weight"]
    assert packed["dtype"] == "uint32" and packed["shape"] == [experts, 2 * inter, cfg["hidden_size"] // 8]
    assert params["model.layers.0.mlp.gate.weight"]["dtype"] == quant[2:5].replace("f", "float")


def write_moe_gguf(hf_dir, kind: str, path) -> None:
    """`hf_dir`'s model as llama.cpp's converter writes it: experts stacked per projection ([E, out, in] under
    gguf's `ffn_*_exps` names), Qwen2-MoE's shared-expert gate as a vector."""
    import gguf
    import transformers as tf
    from safetensors.numpy import load_file

    cfg = tf.AutoConfig.from_pretrained(hf_dir)
    arch = GGUF_ARCH[kind]
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[arch]])
    _write_hparams(w, cfg, arch)
    w.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "LLAMA":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    _write_tokenizer(w, hf_dir, cfg.vocab_size)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch], cfg.num_hidden_layers)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, a in tensors.items():
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", hf_name)
        if m:
            experts.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = a
            continue
        if arch == "LLAMA" and hf_name.endswith("q_proj.weight"):
            a = _permute_like_llama_cpp(a, cfg.num_attention_heads)
        if arch == "LLAMA" and hf_name.endswith("k_proj.weight"):
            a = _permute_like_llama_cpp(a, cfg.num_key_value_heads)
        if hf_name.endswith("shared_expert_gate.weight"):
            a = a.reshape(-1)
        experts[hf_name] = {0: a}
    for hf_name, per_expert in experts.items():
        a = per_expert[0] if len(per_expert) == 1 else np.stack([per_expert[e] for e in sorted(per_expert)])
        name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name, f"gguf has no name for {hf_name}"
        w.add_tensor(name, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", list(GGUF_ARCH))
def test_gguf_model_matches_transformers(kind, hf_models, tmp_path):
    from mlcc.compiler.build import compile_model

    path = tmp_path / f"{kind}.gguf"
    write_moe_gguf(hf_models(kind), kind, path)
    compile_model(path, "llvm", "q0f32", tmp_path / "art")
    cfg = json.loads((tmp_path / "art" / "mlcc-config.json").read_text())
    assert cfg["model_type"] == kind.removesuffix("_sparse"), cfg["model_type"]
    m = LoadedModel(tmp_path / "art")
    m.create_kv_cache(1, 256, 64)
    m.add_sequence(0)
    hf = hf_moe(hf_models(kind))
    assert rel_err(m.prefill([0], [PROMPT]).numpy()[0], hf_logits(hf, PROMPT)[-1]) <= 1e-4
    ids = list(PROMPT)
    for t in (42, 7, 300):
        ids.append(t)
        assert rel_err(m.decode([0], [t]).numpy()[0], hf_logits(hf, ids)[-1]) <= 1e-4


# -- tensor parallelism ---------------------------------------------------------------------------------------

def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def test_sharded_experts_reproduce_every_expert():
    from mlcc.relax_models.moe import MoEConfig
    from mlcc.relax_models.weight_plans import shard_weight

    cfg = MoEConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=100, head_dim=8, num_experts=4, experts_per_token=2,
                    moe_intermediate_size=32)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 64))
    gate_up = rng.standard_normal((4, 64, 64))   # [E, 2I, H]
    down = rng.standard_normal((4, 64, 32))      # [E, H, I]
    router = rng.standard_normal((5, 64))
    for e in range(4):
        g, u = np.split(x @ gate_up[e].T, 2, axis=1)
        full = (_silu(g) * u) @ down[e].T
        total = np.zeros_like(full)
        for r in range(2):
            gu = shard_weight("l.mlp.experts.gate_up_proj.weight", gate_up, cfg, r, 2)
            dn = shard_weight("l.mlp.experts.down_proj.weight", down, cfg, r, 2)
            assert gu.shape == (4, 32, 64) and dn.shape == (4, 64, 16)
            g, u = np.split(x @ gu[e].T, 2, axis=1)
            total += (_silu(g) * u) @ dn[e].T
        np.testing.assert_allclose(total, full, rtol=1e-10, atol=1e-10)
    assert shard_weight("l.mlp.gate.weight", router, cfg, 1, 2) is router  # the router is replicated


def test_expert_width_that_does_not_split_is_refused():
    from mlcc.errors import TensorParallelError
    from mlcc.relax_models.moe import MoEConfig
    from mlcc.relax_models.weight_plans import check_tensor_parallel

    cfg = MoEConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=100, head_dim=8, num_experts=4, experts_per_token=2,
                    moe_intermediate_size=48)
    with pytest.raises(TensorParallelError, match=r"expert MLP width \(24\) is not a multiple"):
        check_tensor_parallel(cfg, 2, 32)



# -- the GPU decode kernels, their thread loops run one after another on the CPU ---------------------------------

def _run_on_cpu(forward, specs: dict, *args) -> list[np.ndarray]:
    import tvm
    from tvm import relax
    from tvm.relax.frontend import nn

    class Kernel(nn.Module):
        def forward(self, *xs):
            return forward(*xs)

    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ["self", *specs]]
    Kernel.forward.__signature__ = inspect.Signature(params)
    mod, _ = Kernel().export_tvm({"forward": {name: nn.spec.Tensor(*spec) for name, spec in specs.items()}})
    vm = relax.VirtualMachine(tvm.compile(mod, tvm.target.Target({"kind": "llvm"})), tvm.cpu())
    out = vm["forward"](*[tvm.runtime.tensor(a) for a in args])
    return [out.numpy()] if hasattr(out, "numpy") else [o.numpy() for o in out]


def _q4_experts(rng, e: int, n: int, kdim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random MLC q4 codes and scales for [e, n, kdim] and the weights they stand for."""
    words = rng.integers(0, 1 << 32, (e, n, kdim // 8), dtype=np.uint32)
    scale = rng.uniform(0.01, 0.03, (e, n, kdim // 32)).astype(np.float32)
    codes = (words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
    w = (codes.reshape(e, n, kdim).astype(np.float32) - 7) * np.repeat(scale, 32, axis=2)
    return words, scale, w


@pytest.mark.parametrize("swiglu,rows_x,kdim,n", [(True, 1, 1024, 48), (False, 4, 768, 40), (False, 4, 96, 24)])
def test_gpu_expert_gemv_index_math(swiglu, rows_x, kdim, n):
    from mlcc.relax_models.moe_kernels import ExpertFormat, expert_gemv_warp

    rng = np.random.default_rng(0)
    e, k = 16, 4
    words, scale, w = _q4_experts(rng, e, 2 * n if swiglu else n, kdim)
    x = rng.standard_normal((rows_x, kdim)).astype(np.float32)
    ids = np.array([11, 2, 15, 7], np.int32)
    fmt = ExpertFormat("float32", get_quantization("q4f32_1"))
    (got,) = _run_on_cpu(lambda xs, i, ws, ss: expert_gemv_warp(xs, i, [ws, ss], fmt, n, swiglu=swiglu, serial=True),
                         {"xs": (x.shape, "float32"), "i": ((k,), "int32"), "ws": (words.shape, "uint32"),
                          "ss": (scale.shape, "float32")}, x, ids, words, scale)
    full = np.stack([x[0 if rows_x == 1 else j] @ w[ids[j]].T for j in range(k)])
    want = full[:, :n] / (1 + np.exp(-full[:, :n])) * full[:, n:] if swiglu else full
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3 * np.abs(want).max())


@pytest.mark.parametrize("renormalize", [True, False])
def test_gpu_ranked_topk_index_math(renormalize):
    from mlcc.relax_models.moe_kernels import _topk_softmax_ranked

    rng = np.random.default_rng(1)
    experts, k = 40, 6
    logits = rng.standard_normal((5, experts + 1)).astype(np.float32)  # (a last column that is not an expert's)
    logits[1, [3, 9, 30]] = 5.0   # ties: the lower id first
    logits[2, experts] = 100.0
    w, ids = _run_on_cpu(lambda lg: _topk_softmax_ranked(lg, experts, k, renormalize, serial=True),
                         {"lg": (logits.shape, "float32")}, logits)
    for t in range(5):
        row = logits[t, :experts]
        order = sorted(range(experts), key=lambda e: (-row[e], e))[:k]
        p = np.exp(row - row.max())
        want = p[order] / (p[order].sum() if renormalize else p.sum())
        assert ids[t].tolist() == order
        np.testing.assert_allclose(w[t], want, rtol=1e-5)


def test_gpu_sort_by_expert_and_weighted_sum_index_math():
    import tvm

    from mlcc.relax_models.moe_kernels import sort_by_expert, weighted_sum

    rng = np.random.default_rng(2)
    experts, tokens, k, hidden = 12, 7, 3, 20
    ids = rng.integers(0, experts, tokens * k).astype(np.int32)
    llvm = tvm.target.Target({"kind": "llvm"})
    row_slot, slot_row, indptr = _run_on_cpu(lambda i: sort_by_expert(i, experts, llvm, serial=True),
                                             {"i": (ids.shape, "int32")}, ids)
    assert row_slot.tolist() == np.argsort(ids, kind="stable").tolist()
    assert slot_row[row_slot].tolist() == list(range(tokens * k))
    assert indptr.tolist() == [0] + np.cumsum(np.bincount(ids, minlength=experts)).tolist()
    y = rng.standard_normal((tokens * k, hidden)).astype(np.float32)
    w = rng.random((tokens, k)).astype(np.float32)
    (got,) = _run_on_cpu(lambda yy, ww, sr: weighted_sum(yy, ww, sr, llvm, serial=True),
                         {"yy": (y.shape, "float32"), "ww": (w.shape, "float32"), "sr": (slot_row.shape, "int32")},
                         y, w, slot_row)
    want = np.einsum("tj,tjh->th", w, y[slot_row].reshape(tokens, k, hidden))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
