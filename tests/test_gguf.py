"""GGUF loading on small random models written the way llama.cpp's converter writes them (names from gguf's own
table, Q/K RoPE-permuted for Llama and Granite, Gemma's norms stored with their +1, LongRoPE factors as tensors,
byte-level BPE tokenizer metadata), compared with transformers; K-quant tensors against the same model carrying
the dequantized weights."""

import numpy as np
import pytest
import torch
from test_parity import PROMPT, hf_logits, hf_model, rel_err

from mlcc.runtime.device.model import LoadedModel

# test model kind → GGUF architecture
GGUF_ARCH = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gemma2_head_dim_scale": "GEMMA2",
             "gemma3": "GEMMA3", "phi3": "PHI3", "olmo2": "OLMO2", "granite": "GRANITE", "qwen3_256": "QWEN3"}
PERMUTED_QK = {"LLAMA", "GRANITE"}   # convert_hf_to_gguf's LlamaModel and its subclasses
PLUS_ONE_NORMS = {"GEMMA2", "GEMMA3"}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")


def _permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py: reshape(n_head, 2, dim/n_head/2, ...).swapaxes(1, 2)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_hparams(w, cfg, arch: str) -> None:
    import gguf

    rope = cfg.rope_parameters if "rope_theta" in cfg.rope_parameters else cfg.rope_parameters["full_attention"]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "GEMMA2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "GEMMA3":
        w.add_sliding_window_pattern(cfg.layer_types.index("full_attention") + 1)
        w.add_rope_freq_base_swa(float(cfg.rope_parameters["sliding_attention"]["rope_theta"]))
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    if arch == "PHI3":
        w.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    if arch == "GRANITE":
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_logit_scale(cfg.logits_scaling)


def _write_tokenizer(w, hf_dir, vocab_size: int) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + [f"[PAD{i}]" for i in range(vocab_size - len(vocab))]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges([])
    w.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _random_k_quant(shape, qtype, rng) -> np.ndarray:
    """Valid blocks of `qtype` for a (rows, cols) tensor: random quants, small positive f16 scales."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.004).tobytes(), np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q6_K:   # ql, qh, int8 scales, then d
        raw[..., -2:] = scale
    elif qtype == gguf.GGMLQuantizationType.Q8_0:  # d, then int8 quants
        raw[..., :2] = scale
    else:                                          # Q4_K / Q5_K: d, dmin, ...
        raw[..., :2] = scale
        raw[..., 2:4] = scale
    return raw.reshape(shape[0], -1)


def write_gguf(hf_dir, kind: str, path, k_quants: bool = False, split_max_tensors: int = 0,
               small_first_shard: bool = False, quantize_to: str | None = None) -> dict[str, np.ndarray]:
    """`hf_dir`'s model as llama.cpp would write it. k_quants: its matrices as random K-quant blocks instead;
    quantize_to: its matrices quantized to that type (gguf's own quantizer, e.g. "Q8_0"); both return those
    matrices dequantized, under their HF names, for the reference model. split_max_tensors: as a
    split GGUF of at most that many tensors a part (`<path stem>-00001-of-0000N.gguf`, ...; the split.* keys as
    llama-gguf-split writes them); small_first_shard: its first part the metadata alone (`--no-tensor-first-split`)."""
    import gguf
    import transformers as tf
    from gguf.quants import dequantize, quantize

    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    cfg = model.config
    arch = GGUF_ARCH[kind]
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[arch]], split_max_tensors=split_max_tensors,
                        small_first_shard=small_first_shard)
    _write_hparams(w, cfg, arch)
    _write_tokenizer(w, hf_dir, cfg.vocab_size)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch], cfg.num_hidden_layers)
    rng = np.random.default_rng(0)
    replaced = {}
    for i, (hf_name, t) in enumerate(model.state_dict().items()):
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        a = t.numpy()
        if arch in PERMUTED_QK and hf_name.endswith("q_proj.weight"):
            a = _permute_like_llama_cpp(a, cfg.num_attention_heads)
        if arch in PERMUTED_QK and hf_name.endswith("k_proj.weight"):
            a = _permute_like_llama_cpp(a, cfg.num_key_value_heads)
        if arch in PLUS_ONE_NORMS and hf_name.endswith("norm.weight"):
            a = a + 1
        name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name, f"gguf has no name for {hf_name}"
        if k_quants and a.ndim == 2:
            qtype = gguf.GGMLQuantizationType[K_QUANTS[i % len(K_QUANTS)]]
            raw = _random_k_quant(a.shape, qtype, rng)
            w.add_tensor(name, raw, raw_dtype=qtype)
            replaced[hf_name] = dequantize(raw, qtype).reshape(a.shape)
        elif quantize_to and a.ndim == 2:
            assert arch not in PERMUTED_QK, "the reference would need the Q/K permutation undone"
            qtype = gguf.GGMLQuantizationType[quantize_to]
            raw = quantize(np.ascontiguousarray(a), qtype)
            w.add_tensor(name, raw, raw_dtype=qtype)
            replaced[hf_name] = dequantize(raw, qtype).reshape(a.shape)
        else:
            w.add_tensor(name, np.ascontiguousarray(a))
    if arch == "PHI3":
        for which in ("long", "short"):
            w.add_tensor(f"rope_factors_{which}.weight", np.asarray(cfg.rope_parameters[f"{which}_factor"],
                                                                     np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return replaced


def _compile_gguf(path, out, quant: str = "q0f32"):
    from mlcc.compiler.build import compile_model

    compile_model(path, "llvm", quant, out)
    m = LoadedModel(out)
    m.create_kv_cache(1, 256, 64)
    m.add_sequence(0)
    return m


@pytest.mark.parametrize("kind", [k for k in GGUF_ARCH if k != "qwen3_256"])
def test_gguf_model_matches_transformers(kind, hf_models, tmp_path):
    path = tmp_path / f"{kind}.gguf"
    write_gguf(hf_models(kind), kind, path)
    m = _compile_gguf(path, tmp_path / "art")
    hf = hf_model(hf_models(kind))
    assert rel_err(m.prefill([0], [PROMPT]).numpy()[0], hf_logits(hf, PROMPT)[-1]) <= 1e-4
    ids = list(PROMPT)
    for t in (42, 7, 300):   # decode past the sliding windows
        ids.append(t)
        assert rel_err(m.decode([0], [t]).numpy()[0], hf_logits(hf, ids)[-1]) <= 1e-4


def test_gguf_k_quants_are_dequantized_exactly(hf_models, tmp_path):
    path = tmp_path / "kq.gguf"
    replaced = write_gguf(hf_models("qwen3_256"), "qwen3_256", path, k_quants=True)
    assert len(replaced) >= 4
    _assert_matches_dequantized(_compile_gguf(path, tmp_path / "art"), hf_models("qwen3_256"), replaced)


def _assert_matches_dequantized(m: LoadedModel, hf_dir, replaced: dict[str, np.ndarray]) -> None:
    """Prefill and one decode step within 1e-4 of transformers carrying the GGUF's quantized matrices dequantized."""
    hf = hf_model(hf_dir)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in replaced:
                p.copy_(torch.from_numpy(replaced[name]))
    assert rel_err(m.prefill([0], [PROMPT]).numpy()[0], hf_logits(hf, PROMPT)[-1]) <= 1e-4
    assert rel_err(m.decode([0], [42]).numpy()[0], hf_logits(hf, PROMPT + [42])[-1]) <= 1e-4


def test_gguf_q8_0_keeps_its_codes_and_scales_in_q8f32_1(hf_models, tmp_path):
    """Q8_0 matrices (llama.cpp's rounding, through gguf's quantizer) compiled to q8f32_1: its groups are Q8_0's
    blocks, so the embedding stores the file's codes and scales exactly and the logits are those of transformers
    carrying the Q8_0 weights dequantized, within float32 arithmetic (no second rounding)."""
    import json

    import gguf
    import tvm

    from mlcc.runtime.device.model import load_params

    path = tmp_path / "q8.gguf"
    replaced = write_gguf(hf_models("qwen2"), "qwen2", path, quantize_to="Q8_0")
    out = tmp_path / "art"
    m = _compile_gguf(path, out, "q8f32_1")
    specs = json.loads((out / "mlcc-config.json").read_text())["params"]
    names = [p["name"] for p in specs]
    params = load_params(out, specs, tvm.cpu())
    codes = params[names.index("model.embed_tokens.q_weight")].numpy().view(np.uint8).astype(np.int32) - 128
    scales = params[names.index("model.embed_tokens.q_scale")].numpy()
    reader = gguf.GGUFReader(path)
    (emb,) = [t for t in reader.tensors if t.name == "token_embd.weight"]
    blocks = np.asarray(emb.data).reshape(-1, 34)   # Q8_0: an fp16 d, then 32 int8 codes
    np.testing.assert_array_equal(codes.reshape(-1, 32), blocks[:, 2:].view(np.int8))
    np.testing.assert_array_equal(scales.reshape(-1), blocks[:, :2].copy().view(np.float16).reshape(-1))
    assert len(replaced) >= 8
    _assert_matches_dequantized(m, hf_models("qwen2"), replaced)


def test_gguf_tokenizer_and_template_come_from_the_metadata(hf_models, tmp_path):
    from mlcc.runtime.engine import Engine

    path = tmp_path / "qwen2.gguf"
    write_gguf(hf_models("qwen2"), "qwen2", path)
    _compile_gguf(path, tmp_path / "art")
    with Engine(tmp_path / "art", target="llvm", max_batch=1) as e:
        ids = e.encode_chat([{"role": "user", "content": "hi"}])
        assert e.tokenizer.decode(ids) == "user\nhi\nassistant\n"
        assert e.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=3).choices


def test_a_truncated_gguf_says_how_much_is_missing(hf_models, tmp_path):
    from mlcc.compiler.weights import load_source
    from mlcc.errors import ModelSourceError

    whole = tmp_path / "whole.gguf"
    write_gguf(hf_models("llama"), "llama", whole)
    size = whole.stat().st_size
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[: size // 2])
    with pytest.raises(ModelSourceError, match=rf"truncated or incomplete file \(expected {size} bytes, found "
                                               rf"{size // 2}\)"):
        load_source(cut)
