"""GGUF architectures `gpt-oss` and `deepseek2`, written the way llama.cpp's convert_hf_to_gguf.py writes them (its
GptOssModel and DeepseekV2Model: the metadata keys it sets, tensor names from gguf's table; gpt-oss's gate_up_proj
split into gate and up and every expert projection transposed to [E, out, in] as GGML MXFP4 blocks, the biases split
alike; DeepSeek's experts stacked, kv_b_proj split per head into attn_k_b (transposed) and attn_v_b, or kept whole as
conversions before llama.cpp absorbed it did), compiled for the CPU and compared with transformers carrying the
same weights (the MXFP4 experts dequantized): q0f32 logits rel. err ≤ 1e-4 through prefill and decode, and the
greedy ids transformers generates. Where LLAMA_CPP_DIR names a llama.cpp source tree (the llama-cpp-python sdist
ships one in vendor/llama.cpp), the same models also go through its own convert_hf_to_gguf.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PROMPT
from test_gguf import _write_tokenizer
from test_gpt_oss import assert_mxfp4_experts, write_mxfp4_checkpoint
from test_parity import hf_model, run_greedy

from mlcc.runtime.device.model import LoadedModel


def _hparams(hf_dir) -> dict:
    return json.loads((hf_dir / "config.json").read_text())


def _write_text_model_params(w, hp: dict) -> None:
    """convert_hf_to_gguf's TextModel.set_gguf_parameters, for the keys these configs have."""
    import gguf

    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    rope = hp["rope_parameters"]
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_expert_count(hp.get("num_local_experts") or hp["n_routed_experts"])
    w.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("n_group") is not None:
        w.add_expert_group_count(hp["n_group"])
    if hp.get("topk_group") is not None:
        w.add_expert_group_used_count(hp["topk_group"])
    if hp.get("scoring_func"):
        w.add_expert_gating_func(gguf.ExpertGatingFuncType[hp["scoring_func"].upper()])
    if hp.get("head_dim") is not None:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def _gguf_name(tmap, name: str) -> str:
    """convert_hf_to_gguf's map_tensor_name."""
    gname = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
    assert gname, f"gguf has no name for {name}"
    return gname


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _mxfp4(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(GGML MXFP4 blocks of float a [E, out, in], the values they hold)."""
    import gguf
    from gguf.quants import dequantize, quantize

    raw = quantize(np.ascontiguousarray(a, np.float32), gguf.GGMLQuantizationType.MXFP4)
    return raw, dequantize(raw, gguf.GGMLQuantizationType.MXFP4).reshape(a.shape)


def write_gpt_oss_gguf(hf_dir, path) -> dict[str, np.ndarray]:
    """GptOssModel's file with MXFP4 experts; returns the HF expert tensors holding the values the blocks dequantize
    to (transformers' layout: [E, in, out], gate and up interleaved)."""
    import gguf
    from safetensors.numpy import load_file

    hp = _hparams(hf_dir)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT_OSS])
    _write_text_model_params(w, hp)
    w.add_sliding_window(hp["sliding_window"])
    w.add_expert_feed_forward_length(hp["intermediate_size"])
    _write_tokenizer(w, hf_dir, hp["vocab_size"])
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, hp["num_hidden_layers"])
    replaced = {}
    for name, a in load_file(str(hf_dir / "model.safetensors")).items():
        if name.endswith("experts.gate_up_proj"):
            rows = a.swapaxes(1, 2)   # [E, 2I, in], gate and up rows interleaved
            gate, gate_f = _mxfp4(rows[:, 0::2])
            up, up_f = _mxfp4(rows[:, 1::2])
            w.add_tensor(_gguf_name(tmap, name.replace("gate_up_proj", "gate_proj.weight")), gate,
                         raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            w.add_tensor(_gguf_name(tmap, name.replace("gate_up_proj", "up_proj.weight")), up,
                         raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            both = np.empty_like(rows)
            both[:, 0::2], both[:, 1::2] = gate_f, up_f
            replaced[name] = both.swapaxes(1, 2)
            continue
        if name.endswith("experts.down_proj"):
            raw, values = _mxfp4(a.swapaxes(1, 2))
            w.add_tensor(_gguf_name(tmap, f"{name}.weight"), raw, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            replaced[name] = values.swapaxes(1, 2)
            continue
        if name.endswith("gate_up_proj_bias"):
            for part, cols in (("gate_proj.bias", a[:, 0::2]), ("up_proj.bias", a[:, 1::2])):
                w.add_tensor(_gguf_name(tmap, name.replace("gate_up_proj_bias", part)), np.ascontiguousarray(cols))
            continue
        name = name.replace("down_proj_bias", "down_proj.bias")
        if name.endswith("sinks"):
            name += ".weight"
        w.add_tensor(_gguf_name(tmap, name), np.ascontiguousarray(a))
    _finish(w)
    return replaced


def write_deepseek2_gguf(hf_dir, path, split_kv_b: bool = True, fuse_gate_up_exps: bool = False) -> None:
    """DeepseekV2Model's file (V2 and V3 alike). split_kv_b=False: as llama.cpp converted before it absorbed
    kv_b_proj (attn_kv_b whole, the MHA head sizes in key_length / value_length, no *_mla keys);
    fuse_gate_up_exps: the experts' gate and up stacked into one `ffn_gate_up_exps`, which llama.cpp also loads."""
    import gguf
    from safetensors.numpy import load_file

    hp = _hparams(hf_dir)
    heads, nope, rope_dim = hp["num_attention_heads"], hp["qk_nope_head_dim"], hp["qk_rope_head_dim"]
    latent, v_dim = hp["kv_lora_rank"], hp["v_head_dim"]
    arch = gguf.MODEL_ARCH.DEEPSEEK2
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _write_text_model_params(w, {**hp, "num_key_value_heads": 1 if split_kv_b else hp["num_key_value_heads"]})
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_vocab_size(hp["vocab_size"])
    if hp.get("q_lora_rank") is not None:
        w.add_q_lora_rank(hp["q_lora_rank"])
    w.add_kv_lora_rank(latent)
    if split_kv_b:
        w.add_key_length(latent + rope_dim)
        w.add_value_length(latent)
        w.add_key_length_mla(nope + rope_dim)
        w.add_value_length_mla(v_dim)
    else:
        w.add_key_length(nope + rope_dim)
        w.add_value_length(v_dim)
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_count(hp["n_routed_experts"])
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope_dim)
    if hp["rope_parameters"].get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * hp["rope_parameters"]["mscale_all_dim"])
    _write_tokenizer(w, hf_dir, hp["vocab_size"])
    tmap = gguf.get_tensor_name_map(arch, hp["num_hidden_layers"])
    tensors = load_file(str(hf_dir / "model.safetensors"))
    for name in sorted(tensors):
        a = tensors[name]
        if ".experts." in name:
            if ".experts.0." not in name:
                continue
            per = [tensors[name.replace(".experts.0.", f".experts.{e}.")] for e in range(hp["n_routed_experts"])]
            name, a = name.replace(".experts.0.", ".experts."), np.stack(per)
            if fuse_gate_up_exps and name.endswith(("gate_proj.weight", "up_proj.weight")):
                if name.endswith("gate_proj.weight"):
                    up = np.stack([tensors[n.replace("gate_proj", "up_proj")] for n in
                                   (name.replace(".experts.", f".experts.{e}.") for e in range(len(per)))])
                    gname = _gguf_name(tmap, name).replace("ffn_gate_exps", "ffn_gate_up_exps")
                    w.add_tensor(gname, np.ascontiguousarray(np.concatenate([a, up], axis=1)))
                continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if name.endswith("kv_b_proj.weight") and split_kv_b:
            kv_b = a.reshape(heads, nope + v_dim, latent)
            w.add_tensor(_gguf_name(tmap, name.replace("kv_b_proj", "k_b_proj")),
                         np.ascontiguousarray(kv_b[:, :nope].swapaxes(1, 2)))
            w.add_tensor(_gguf_name(tmap, name.replace("kv_b_proj", "v_b_proj")), np.ascontiguousarray(kv_b[:, nope:]))
            continue
        w.add_tensor(_gguf_name(tmap, name), np.ascontiguousarray(a))
    _finish(w)


def _compile(path, out) -> LoadedModel:
    from mlcc.compiler.build import compile_model

    compile_model(path, "llvm", "q0f32", out)
    m = LoadedModel(out)
    m.create_kv_cache(1, 256, 64)
    return m


def _check_greedy(m: LoadedModel, hf, steps: int) -> None:
    ours = run_greedy(m, hf, PROMPT, steps, 1e-4)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(PROMPT):].tolist()
    assert ours == ref


def test_gpt_oss_gguf_with_mxfp4_experts_matches_transformers(hf_models, tmp_path):
    hf_dir = hf_models("gpt_oss_limit7")
    path = tmp_path / "gpt-oss.gguf"
    replaced = write_gpt_oss_gguf(hf_dir, path)
    import gguf

    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    hf = hf_model(hf_dir)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in replaced:
                p.copy_(torch.from_numpy(replaced[name]))
    m = _compile(path, tmp_path / "art")
    assert_mxfp4_experts(tmp_path / "art", 8, 64, 64)   # kept as the file stores them
    _check_greedy(m, hf, 8)   # (the prompt is longer than the sliding window)


# (V3 covers the split kv_b in CI's time, the older whole one V2's router)
@pytest.mark.parametrize("kind,split", [("deepseek_v3", True),
                                        pytest.param("deepseek_v2", True, marks=pytest.mark.slow),
                                        ("deepseek_v2", False)], ids=["v3", "v2", "v2-kv_b-whole"])
def test_deepseek2_gguf_matches_transformers(kind, split, hf_models, tmp_path):
    path = tmp_path / "deepseek2.gguf"
    write_deepseek2_gguf(hf_models(kind), path, split_kv_b=split)
    m = _compile(path, tmp_path / "art")
    _check_greedy(m, hf_model(hf_models(kind)), 8)


@pytest.mark.parametrize("key,value,match", [
    ("expert_gating_func", 3, "expert_gating_func 3 is not supported"),
    ("attention.temperature_scale", 0.1, "temperature tuning .* is not supported"),
    ("expert_count", 0, "no routed experts"),
])
def test_unsupported_deepseek2_variants_are_refused_in_one_line(key, value, match, hf_models, tmp_path):
    import gguf

    from mlcc.errors import UnsupportedConfigError
    from mlcc.relax_models import family_for

    path = tmp_path / "deepseek2.gguf"
    write_deepseek2_gguf(hf_models("deepseek_v2"), path)
    fields = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("tokenizer.")}
    fields[f"deepseek2.{key}"] = value
    with pytest.raises(UnsupportedConfigError, match=match) as e:
        family_for("deepseek2", "gguf").gguf_config(fields, "deepseek2", 512, True)
    assert "\n" not in str(e.value)


def test_gate_up_fused_by_the_converter_is_refused_in_one_line(hf_models, tmp_path):
    from mlcc.compiler.weights import load_source
    from mlcc.errors import ModelSourceError

    path = tmp_path / "fused.gguf"
    write_deepseek2_gguf(hf_models("deepseek_v3"), path, fuse_gate_up_exps=True)
    with pytest.raises(ModelSourceError, match=r"'blk\.1\.ffn_gate_up_exps\.weight' is fused .* convert the model "
                                               r"without --fuse-gate-up-exps") as e:
        load_source(path)
    assert "\n" not in str(e.value)


# llama.cpp's converter as a script; the test models' byte-level tokenizer is not in its table of pre-tokenizers
# (a hash of how known tokenizers split a sample text), so that lookup answers "default"
_CONVERT = """
import os, runpy, sys
tree = sys.argv[1]
sys.path[:0] = [tree, os.path.join(tree, "gguf-py")]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(os.path.join(tree, "convert_hf_to_gguf.py"), run_name="__main__")
"""


@pytest.mark.skipif(not os.environ.get("LLAMA_CPP_DIR"), reason="LLAMA_CPP_DIR (a llama.cpp source tree) is not set")
@pytest.mark.parametrize("kind", ["gpt_oss_limit7", "deepseek_v3", "deepseek_v2"])
def test_llama_cpp_converter_output_matches_transformers(kind, hf_models, tmp_path):
    """The GGUF llama.cpp itself writes (gpt-oss from an MXFP4 checkpoint, its blocks repacked as GGML's)."""
    src, ref = hf_models(kind), hf_models(kind)
    if kind.startswith("gpt_oss"):
        ref, src = tmp_path / "float", tmp_path / "mxfp4"
        write_mxfp4_checkpoint(hf_models(kind), ref, src)
    path = tmp_path / "model.gguf"
    subprocess.run([sys.executable, "-c", _CONVERT, str(Path(os.environ["LLAMA_CPP_DIR"]).resolve()), str(src),
                    "--outtype", "f32", "--outfile", str(path)], check=True, capture_output=True)
    _check_greedy(_compile(path, tmp_path / "art"), hf_model(ref), 8)
