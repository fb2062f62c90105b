"""Llama family (Llama 2/3, Mistral, SmolLM2) in TVM's relax.frontend.nn, shaped like HF's modeling_llama.

Attention goes through TVM's PagedKVCache, which also applies RoPE (incl. llama3 scaling), so the model itself
never manages cache memory. q/k/v and gate/up are fused into single projections as in MLC-LLM; the weight
loader concatenates the HF tensors accordingly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from tvm import relax as rx
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
from tvm.target import Target

from mlcc.errors import TensorParallelError

from .config_utils import rope_theta_and_scaling


@dataclasses.dataclass
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    head_dim: int = 0
    tie_word_embeddings: bool = False
    context_window_size: int = 4096
    attention_bias: bool = False
    hidden_act: str = "silu"
    tensor_parallel_shards: int = 1   # attention heads and MLP columns split across this many GPUs

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "LlamaConfig":
        theta, scaling = rope_theta_and_scaling(cfg)
        context = cfg.get("max_position_embeddings", 4096)
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
            # Mistral-style sliding attention equals full attention while the context fits in the window,
            # so cap the context there instead of compiling a sliding-window KV cache.
            context = min(context, int(cfg["sliding_window"]))
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            head_dim=cfg.get("head_dim") or 0,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            context_window_size=context,
            attention_bias=bool(cfg.get("attention_bias", False)),
            hidden_act=cfg.get("hidden_act", "silu"),
        )


class TiedEmbedding(nn.Embedding):
    """Embedding whose table doubles as the LM head (tie_word_embeddings)."""

    def lm_head_forward(self, x: Tensor) -> Tensor:
        return op.matmul(x, op.permute_dims(self.weight), out_dtype=self.weight.dtype)


def _allreduce_across_shards(x: Tensor, shards: int) -> Tensor:
    """Each shard holds a partial sum of a row-split projection; NCCL adds them up (no-op on one GPU)."""
    return op.ccl_allreduce(x, "sum") if shards > 1 else x


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        self.shards = cfg.tensor_parallel_shards
        self.num_q_heads = cfg.num_attention_heads // self.shards
        self.num_kv_heads = cfg.num_key_value_heads // self.shards
        self.head_dim = cfg.head_dim
        qkv_out = (self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_q_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, kv_cache: PagedKVCache, layer_id: int) -> Tensor:
        b, s, _ = x.shape
        qkv = op.reshape(self.qkv_proj(x), (b, s, self.num_q_heads + 2 * self.num_kv_heads, self.head_dim))
        out = kv_cache.attention_with_fused_qkv(layer_id, qkv, self.num_q_heads, sm_scale=self.head_dim**-0.5)
        out = self.o_proj(op.reshape(out, (b, s, self.num_q_heads * self.head_dim)))
        return _allreduce_across_shards(out, self.shards)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        self.shards = cfg.tensor_parallel_shards
        self.intermediate_size = cfg.intermediate_size // self.shards
        self.act = cfg.hidden_act
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return _allreduce_across_shards(self.down_proj(ACTIVATIONS[self.act](gate) * up), self.shards)


ACTIVATIONS = {
    "silu": op.silu,
    "gelu": op.gelu,
    "gelu_pytorch_tanh": lambda x: op.gelu(x, approximate="tanh"),
}


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False)
        self.mlp = LlamaMLP(cfg)

    def forward(self, h: Tensor, kv_cache: PagedKVCache, layer_id: int) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), kv_cache, layer_id)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        embed_cls = TiedEmbedding if cfg.tie_word_embeddings else nn.Embedding
        self.embed_tokens = embed_cls(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False)

    def forward(self, h: Tensor, kv_cache: PagedKVCache) -> Tensor:
        for layer_id, layer in enumerate(self.layers):
            h = layer(h, kv_cache, layer_id)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    """The exported functions follow MLC-LLM's contract (embed, prefill, decode, batch_*, create_paged_kv_cache)."""

    def __init__(self, cfg: LlamaConfig, target: Target, dtype: str = "float32"):
        self.cfg = cfg
        self.target = target
        self.dtype = dtype
        self.model = LlamaModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def to(self, dtype: str | None = None) -> None:
        super().to(dtype=dtype)
        if dtype is not None:
            self.dtype = dtype

    # -- pieces shared by the entry points -------------------------------------------------------------------
    def embed_scale(self, h: Tensor) -> Tensor:
        """Hook for families that scale embeddings (Gemma)."""
        return h

    def logits(self, h: Tensor) -> Tensor:
        if self.lm_head is None:
            out = self.model.embed_tokens.lm_head_forward(h)
        else:
            out = self.lm_head(h)
        return out.astype("float32") if out.dtype != "float32" else out

    # -- entry points ----------------------------------------------------------------------------------------
    def embed(self, input_ids: Tensor) -> Tensor:
        return self.embed_scale(self.model.embed_tokens(input_ids))

    def prefill(self, embeds: Tensor, kv_cache: PagedKVCache):
        """One sequence, [1, n, hidden] → logits of the last position [1, 1, vocab]."""
        h = op.tensor_expr_op(_last_position, "last_position", [self.model(embeds, kv_cache)])
        return self.logits(h), kv_cache

    def decode(self, embeds: Tensor, kv_cache: PagedKVCache):
        return self.logits(self.model(embeds, kv_cache)), kv_cache

    def batch_prefill(self, embeds: Tensor, logit_positions: Tensor, kv_cache: PagedKVCache):
        """Ragged prefill of several sequences packed in [1, total, hidden]; logits at the given positions."""
        h = self.model(embeds, kv_cache)
        return self.logits(op.take(h, logit_positions, axis=1)), kv_cache

    def batch_decode(self, embeds: Tensor, kv_cache: PagedKVCache):
        return self.logits(self.model(embeds, kv_cache)), kv_cache

    def create_paged_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                              prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                              support_sliding_window: tirx.Var) -> PagedKVCache:
        cfg = self.cfg
        return TIRPagedKVCache(
            attn_kind="mha", max_batch_size=max_batch_size, max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size, page_size=page_size, support_sliding_window=support_sliding_window,
            layer_partition=rx.ShapeExpr([0, cfg.num_hidden_layers]), num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads // cfg.tensor_parallel_shards,
            num_key_value_heads=cfg.num_key_value_heads // cfg.tensor_parallel_shards, qk_head_dim=cfg.head_dim, v_head_dim=cfg.head_dim, mla_original_qk_head_dim=0, mla_original_v_head_dim=0,
            rope_mode=RopeMode.NORMAL, rope_scale=1, rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling or {},
            rope_ext_factors=rx.prim_value(0), rotary_dim=cfg.head_dim, enable_disaggregation=False,
            dtype=self.dtype, target=self.target,
        )

    def get_default_spec(self) -> dict:
        h = self.cfg.hidden_size
        packed = {"param_mode": "packed", "effect_mode": "none"}
        kv = nn.spec.Object(object_type=PagedKVCache)
        return {
            "embed": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), "$": packed},
            "prefill": {"embeds": nn.spec.Tensor([1, "seq_len", h], self.dtype), "kv_cache": kv, "$": packed},
            "decode": {"embeds": nn.spec.Tensor([1, 1, h], self.dtype), "kv_cache": kv, "$": packed},
            "batch_prefill": {"embeds": nn.spec.Tensor([1, "seq_len", h], self.dtype),
                              "logit_positions": nn.spec.Tensor(["batch_size"], "int32"), "kv_cache": kv, "$": packed},
            "batch_decode": {"embeds": nn.spec.Tensor(["batch_size", 1, h], self.dtype), "kv_cache": kv, "$": packed},
            "create_paged_kv_cache": {
                "max_batch_size": int, "max_total_seq_len": int, "prefill_chunk_size": int, "page_size": int,
                "support_sliding_window": int, "$": {"param_mode": "none", "effect_mode": "none"}},
        }


def _last_position(x: te.Tensor) -> te.Tensor:
    b, s, d = x.shape
    return te.compute((b, 1, d), lambda i, _, k: x[i, s - 1, k], name="last_position")


# -- weights -----------------------------------------------------------------------------------------------------

def hf_weight_plan(cfg: LlamaConfig) -> dict[str, tuple[list[str], Any]]:
    """Our parameter name → (HF tensor names, how to combine them)."""
    plan: dict[str, tuple[list[str], Any]] = {"model.embed_tokens.weight": (["model.embed_tokens.weight"], None),
                                              "model.norm.weight": (["model.norm.weight"], None)}
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = (["lm_head.weight"], None)
    concat = lambda ts: np.concatenate(ts, axis=0)  # noqa: E731
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        plan[f"{p}.input_layernorm.weight"] = ([f"{p}.input_layernorm.weight"], None)
        plan[f"{p}.post_attention_layernorm.weight"] = ([f"{p}.post_attention_layernorm.weight"], None)
        plan[f"{p}.self_attn.qkv_proj.weight"] = ([f"{p}.self_attn.{x}_proj.weight" for x in "qkv"], concat)
        if cfg.attention_bias:
            plan[f"{p}.self_attn.qkv_proj.bias"] = ([f"{p}.self_attn.{x}_proj.bias" for x in "qkv"], concat)
        plan[f"{p}.self_attn.o_proj.weight"] = ([f"{p}.self_attn.o_proj.weight"], None)
        plan[f"{p}.mlp.gate_up_proj.weight"] = ([f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"], concat)
        plan[f"{p}.mlp.down_proj.weight"] = ([f"{p}.mlp.down_proj.weight"], None)
    return plan


# -- tensor parallelism -------------------------------------------------------------------------------------------

def check_tensor_parallel(cfg: LlamaConfig, shards: int, group_size: int | None) -> None:
    """Every shard gets whole heads and whole quantization groups, or we refuse with the reason."""
    if shards < 1:
        raise TensorParallelError(f"--tensor-parallel must be >= 1, got {shards}")
    if shards == 1:
        return
    for what, n in (("attention heads", cfg.num_attention_heads), ("key/value heads", cfg.num_key_value_heads),
                    ("intermediate size", cfg.intermediate_size)):
        if n % shards:
            raise TensorParallelError(f"--tensor-parallel {shards}: the model's {what} ({n}) do not split evenly; "
                                      f"use a shard count that divides {n}")
    if group_size:
        for what, n in (("attention output width", cfg.num_attention_heads // shards * cfg.head_dim),
                        ("MLP width", cfg.intermediate_size // shards)):
            if n % group_size:
                raise TensorParallelError(
                    f"--tensor-parallel {shards}: each shard's {what} ({n}) is not a multiple of the "
                    f"quantization group size {group_size}; use fewer shards or an unquantized (q0*) build")


def shard_weight(name: str, w: np.ndarray, cfg: LlamaConfig, rank: int, shards: int) -> np.ndarray:
    """Rank `rank`'s slice of a full (fused) weight: q/k/v and gate/up split by output rows per head / column
    block, o_proj and down_proj by input columns (their partial outputs are summed by the all-reduce);
    embeddings, norms and the LM head are replicated."""
    if shards == 1:
        return w
    hd = cfg.head_dim

    def block(x: np.ndarray, axis: int) -> np.ndarray:
        n = x.shape[axis] // shards
        return np.take(x, np.arange(rank * n, (rank + 1) * n), axis=axis)

    if ".qkv_proj." in name:
        q_rows, kv_rows = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        q, k, v = np.split(w, [q_rows, q_rows + kv_rows], axis=0)
        return np.concatenate([block(q, 0), block(k, 0), block(v, 0)], axis=0)
    if ".gate_up_proj." in name:
        gate, up = np.split(w, 2, axis=0)
        return np.concatenate([block(gate, 0), block(up, 0)], axis=0)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return block(w, 1)
    return w


def gguf_config(fields: dict[str, Any], arch: str, vocab_size: int, has_output: bool) -> dict[str, Any]:
    """HF-style config dict from GGUF metadata (llama.cpp key names)."""
    g = lambda k, d=None: fields.get(f"{arch}.{k}", d)  # noqa: E731
    n_heads = int(g("attention.head_count"))
    cfg = {
        "hidden_size": int(g("embedding_length")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(g("attention.head_count_kv", n_heads)),
        "vocab_size": vocab_size,
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 4096)),
        "tie_word_embeddings": not has_output,
    }
    if g("attention.key_length"):
        cfg["head_dim"] = int(g("attention.key_length"))
    return cfg


def unpermute_gguf_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf permutation of q/k rows (interleaved → half-split RoPE layout)."""
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_fixups(cfg: LlamaConfig) -> dict[str, Any]:
    """Per-HF-name transforms applied to dequantized GGUF tensors."""
    fix = {}
    for i in range(cfg.num_hidden_layers):
        fix[f"model.layers.{i}.self_attn.q_proj.weight"] = lambda w: unpermute_gguf_qk(w, cfg.num_attention_heads)
        fix[f"model.layers.{i}.self_attn.k_proj.weight"] = lambda w: unpermute_gguf_qk(w, cfg.num_key_value_heads)
    return fix

