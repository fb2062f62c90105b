"""Compiled models (llvm) against transformers on small random configs of each family.

Tolerances: q0f32 logits rel. err ≤ 1e-4 (relative to the largest |logit|) at prefill and every decode step, and
32 greedy tokens identical. q4f32_1 / q4f16_1 are compared with transformers carrying the *dequantized* weights,
so only kernel arithmetic differs: ≤ 1e-4 for f32 activations, ≤ 2e-2 for f16 activations. e4m3_e4m3_f16 likewise
(its projections dequantized, embedding and LM head as they are) ≤ 2e-2, and against the q0f32 build of the same
weights ≤ 6e-2 (measured 2.5e-2 to 3.9e-2 on the tiny llama; q4f16_1 is 0.15 to 0.27 there, q0f16 1e-3 to 3e-3).
q8f32_1 / q8f16_1 (int8 weight-only) as q4 against the dequantized weights; against the q0f32 build, q8f32_1 is
within 2e-2 (the weights' rounding alone) and gives q0f32's greedy ids.
"""

import numpy as np
import pytest
import torch
from conftest import FAMILIES, PROMPT

from mlcc.compiler.quantize import dequantize_weight, get_quantization, quantize_weight
from mlcc.runtime.device.model import LoadedModel


def hf_model(folder, quant: str = "q0f32"):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    q = get_quantization(quant)
    if q.kind != "none":
        # what mlcc stores, dequantized: every Linear and the embedding where the scheme quantizes them (rows are
        # quantized independently, so quantizing q/k/v separately equals quantizing our fused qkv)
        with torch.no_grad():
            for name, mod in model.named_modules():
                if (isinstance(mod, torch.nn.Linear) and (q.quantize_lm_head or name != "lm_head")) or \
                        (isinstance(mod, torch.nn.Embedding) and q.quantize_embedding):
                    w = mod.weight.numpy()
                    mod.weight.copy_(torch.from_numpy(dequantize_weight(*quantize_weight(w, q), q)))
    return model


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def run_greedy(m: LoadedModel, hf, prompt, steps, tol):
    m.add_sequence(0)
    ours = m.prefill([0], [prompt]).numpy()[0]
    ids = list(prompt)
    errs = [rel_err(ours, hf_logits(hf, ids)[-1])]
    for _ in range(steps):
        ids.append(int(np.argmax(ours)))
        ours = m.decode([0], [ids[-1]]).numpy()[0]
        errs.append(rel_err(ours, hf_logits(hf, ids)[-1]))
    assert max(errs) <= tol, f"max rel err {max(errs):.2e} (per step: {[f'{e:.1e}' for e in errs[:5]]}...)"
    return ids[len(prompt):]


@pytest.mark.parametrize("kind", FAMILIES)
def test_q0f32_prefill_decode_and_32_greedy_tokens(kind, compiled, hf_models):
    m = LoadedModel(compiled(kind, "q0f32"))
    m.create_kv_cache(2, 256, 64)
    hf = hf_model(hf_models(kind))
    ours = run_greedy(m, hf, PROMPT, 32, 1e-4)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(PROMPT):].tolist()
    assert ours == ref


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_ragged_batch_prefill_and_batch_decode(kind, compiled, hf_models):
    m = LoadedModel(compiled(kind, "q0f32"))
    m.create_kv_cache(4, 256, 64)
    hf = hf_model(hf_models(kind))
    a, b = PROMPT[:7], PROMPT[3:]
    m.add_sequence(0)
    m.add_sequence(1)
    lg = m.prefill([0, 1], [a, b]).numpy()
    assert rel_err(lg[0], hf_logits(hf, a)[-1]) <= 1e-4
    assert rel_err(lg[1], hf_logits(hf, b)[-1]) <= 1e-4
    lg = m.decode([0, 1], [11, 22]).numpy()
    assert rel_err(lg[0], hf_logits(hf, a + [11])[-1]) <= 1e-4
    assert rel_err(lg[1], hf_logits(hf, b + [22])[-1]) <= 1e-4
    # fork + popn: a child that shares seq 0's prefix and then diverges
    m.fork_sequence(0, 2)
    m.popn(2, 1)
    lg = m.decode([2], [33]).numpy()
    assert rel_err(lg[0], hf_logits(hf, a + [33])[-1]) <= 1e-4


@pytest.mark.parametrize("kind,quant,tol", [
    ("llama", "q4f32_1", 1e-4), ("llama", "q4f16_1", 2e-2),
    ("qwen2", "q4f32_1", 1e-4), ("gemma", "q4f32_1", 1e-4), ("llama_tied_llama3", "q4f16_1", 2e-2),
    ("llama", "e4m3_e4m3_f16", 2e-2), ("llama_tied_llama3", "e4m3_e4m3_f16", 2e-2),
    ("llama", "q8f32_1", 1e-4), ("qwen2", "q8f32_1", 1e-4), ("llama", "q8f16_1", 2e-2),
    ("llama_tied_llama3", "q8f16_1", 2e-2),
])
def test_q4_matches_dequantized_reference(kind, quant, tol, compiled, hf_models):
    m = LoadedModel(compiled(kind, quant))
    m.create_kv_cache(1, 256, 64)
    hf = hf_model(hf_models(kind), quant)
    run_greedy(m, hf, PROMPT, 8, tol)


def test_e4m3_logits_stay_near_the_q0f32_build(compiled):
    """The same random weights through e4m3 (prefill and three decode steps) against float32: the whole cost of
    the scheme (weight rounding and float16 activations)."""
    logits = {}
    for quant in ("q0f32", "e4m3_e4m3_f16"):
        m = LoadedModel(compiled("llama", quant))
        m.create_kv_cache(1, 256, 64)
        m.add_sequence(0)
        rows = [m.prefill([0], [PROMPT]).numpy()[0]] + [m.decode([0], [t]).numpy()[0] for t in (5, 17, 33)]
        logits[quant] = np.stack(rows).astype(np.float64)
    ref = logits["q0f32"]
    err = np.abs(logits["e4m3_e4m3_f16"] - ref).max(axis=1) / np.abs(ref).max(axis=1)
    assert err.max() <= 6e-2, err


def test_q8f32_1_stays_near_the_q0f32_build_and_gives_its_greedy_ids(compiled):
    """The same random weights in int8 and in float32: prefill and 16 greedy decode steps, the logits within 2e-2
    of float32's (the whole cost of the scheme: int8 rounding of every weight) and the same 16 ids."""
    runs = {}
    for quant in ("q0f32", "q8f32_1"):
        m = LoadedModel(compiled("llama", quant))
        m.create_kv_cache(1, 256, 64)
        m.add_sequence(0)
        rows, ids = [m.prefill([0], [PROMPT]).numpy()[0]], []
        for _ in range(16):
            ids.append(int(np.argmax(rows[-1])))
            rows.append(m.decode([0], [ids[-1]]).numpy()[0])
        runs[quant] = np.stack(rows).astype(np.float64), ids
    (ref, ref_ids), (got, got_ids) = runs["q0f32"], runs["q8f32_1"]
    err = np.abs(got - ref).max(axis=1) / np.abs(ref).max(axis=1)
    assert err.max() <= 2e-2, err
    assert got_ids == ref_ids


def test_q8_weights_are_stored_as_int8_bytes_in_words(compiled):
    import json

    import tvm

    from mlcc.compiler.quant_schemes import unpack_codes
    from mlcc.runtime.device.model import load_params

    folder = compiled("llama", "q8f16_1")
    specs = json.loads((folder / "mlcc-config.json").read_text())["params"]
    params = {p["name"]: p for p in specs}
    qkv = "model.layers.0.self_attn.qkv_proj"
    assert params[f"{qkv}.q_weight"]["dtype"] == "uint32" and params[f"{qkv}.q_weight"]["shape"] == [128, 64 // 4]
    assert params[f"{qkv}.q_scale"]["dtype"] == "float16" and params[f"{qkv}.q_scale"]["shape"] == [128, 64 // 32]
    assert "model.embed_tokens.q_weight" in params and "lm_head.q_weight" in params   # as q4f16_1
    loaded = load_params(folder, specs, tvm.cpu())
    words = loaded[[p["name"] for p in specs].index(f"{qkv}.q_weight")].numpy()
    codes = unpack_codes(words, get_quantization("q8f16_1")).astype(np.int32) - 128
    assert codes.min() >= -127 and codes.max() <= 127 and (np.abs(codes).reshape(128, 2, 32).max(-1) == 127).all()


def test_e4m3_weights_are_stored_as_float8_with_row_scales(compiled):
    import json

    cfg = json.loads((compiled("llama", "e4m3_e4m3_f16") / "mlcc-config.json").read_text())
    params = {p["name"]: p for p in cfg["params"]}
    qkv = "model.layers.0.self_attn.qkv_proj"
    assert params[f"{qkv}.q_weight"]["dtype"] == "float8_e4m3fn" and params[f"{qkv}.q_weight"]["shape"] == [128, 64]
    assert params[f"{qkv}.q_scale"]["dtype"] == "float32" and params[f"{qkv}.q_scale"]["shape"] == [128]
    # the embedding and the LM head stay float16
    assert params["model.embed_tokens.weight"]["dtype"] == params["lm_head.weight"]["dtype"] == "float16"


def test_q4_weights_are_stored_packed(compiled):
    import json

    cfg = json.loads((compiled("llama", "q4f16_1") / "mlcc-config.json").read_text())
    params = {p["name"]: p for p in cfg["params"]}
    qkv = params["model.layers.0.self_attn.qkv_proj.q_weight"]
    assert qkv["dtype"] == "uint32" and qkv["shape"] == [(4 + 2 * 2) * 16, 64 // 8]
    assert params["model.layers.0.self_attn.qkv_proj.q_scale"]["dtype"] == "float16"
    assert "model.embed_tokens.q_weight" in params and "lm_head.q_weight" in params


def test_e4m3_builds_load_random_weights_for_speed_runs(compiled):
    """The benchmarks' `weights="random"` gives float8 parameters codes of the format (numpy has no float8 name of
    its own) and finite logits."""
    m = LoadedModel(compiled("llama", "e4m3_e4m3_f16"), weights="random")
    m.create_kv_cache(1, 256, 64)
    m.add_sequence(0)
    logits = m.prefill([0], [PROMPT]).numpy()
    assert np.isfinite(logits).all() and np.abs(logits).max() > 0
