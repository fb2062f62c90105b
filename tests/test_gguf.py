"""GGUF loading on small random models written the way llama.cpp's converter writes them (Q/K RoPE-permuted for
Llama, names from gguf's own table, byte-level BPE tokenizer metadata), compared with transformers."""

import numpy as np
import pytest
import torch

from mlcc.runtime.model import LoadedModel
from test_parity import PROMPT, hf_logits, hf_model, rel_err


def _permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py: reshape(n_head, 2, dim/n_head/2, ...).swapaxes(1, 2)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir, kind: str, path) -> None:
    import gguf
    import transformers as tf
    from tokenizers import Tokenizer

    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    cfg = model.config
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[kind]
    name = gguf.MODEL_ARCH_NAMES[arch]
    w = gguf.GGUFWriter(str(path), name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + [f"[PAD{i}]" for i in range(cfg.vocab_size - len(vocab))]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges([])
    w.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tmap = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        a = t.numpy()
        if kind == "llama" and hf_name.endswith("q_proj.weight"):
            a = _permute_like_llama_cpp(a, cfg.num_attention_heads)
        if kind == "llama" and hf_name.endswith("k_proj.weight"):
            a = _permute_like_llama_cpp(a, cfg.num_key_value_heads)
        w.add_tensor(tmap.get_name(hf_name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gguf_model_matches_transformers(kind, hf_models, tmp_path):
    from mlcc.compiler.build import compile_model
    from mlcc.runtime.engine import Engine

    path = tmp_path / f"{kind}.gguf"
    write_gguf(hf_models(kind), kind, path)
    out = tmp_path / "art"
    compile_model(path, "llvm", "q0f32", out)
    m = LoadedModel(out)
    m.create_kv_cache(1, 256, 64)
    m.add_sequence(0)
    hf = hf_model(hf_models(kind))
    assert rel_err(m.prefill([0], [PROMPT]).numpy()[0], hf_logits(hf, PROMPT)[-1]) <= 1e-4
    assert rel_err(m.decode([0], [42]).numpy()[0], hf_logits(hf, PROMPT + [42])[-1]) <= 1e-4
    with Engine(out, target="llvm", max_batch=1) as e:  # tokenizer and chat template came from the GGUF metadata
        ids = e.encode_chat([{"role": "user", "content": "hi"}])
        assert e.tokenizer.decode(ids) == "user\nhi\nassistant\n"
        assert e.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=3).choices
