"""The decoder-only transformer every family shares, in TVM's relax.frontend.nn, shaped like HF's modeling_llama.

One block with switches covers the families: where the RMSNorms sit (before and/or after attention and MLP), q/k
RMSNorm (per head or over the whole projection), attention and final-logit soft-capping, attention sinks, a sliding
window per layer, partial rotary and per-layer RoPE bases, Granite's multipliers. A family file only parses its config
into `DecoderConfig` and says where its weights live.

Attention goes through TVM's PagedKVCache, so the model never manages cache memory. q/k/v and gate/up are fused into
single projections as in MLC-LLM (the weight loader concatenates HF's tensors), which is also what the CUDA decode
kernels and tensor-parallel sharding are keyed on. RoPE runs inside the KV cache where TVM's one RoPE fits the
model; models with sliding windows, two RoPE bases, partial rotary or LongRoPE rotate q/k here instead (rope.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
from tvm import relax as rx
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
from tvm.target import Target

from mlcc import kv_cache_format

from . import rope
from .kv_quant import QuantKVLayout, pack_qkv, unpack_output
from .lora import LoraTokens


@dataclasses.dataclass
class DecoderConfig:
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
    attention_bias: bool = False      # biases on q/k/v
    o_bias: bool = False              # a bias on the output projection as well (HF Llama's attention_bias)
    hidden_act: str = "silu"
    tensor_parallel_shards: int = 1   # attention heads and MLP columns split across this many GPUs
    # -- switches of the shared block (defaults: Llama) --
    pre_norms: bool = True            # RMSNorm before attention and MLP (OLMo2: none)
    post_norms: bool = False          # RMSNorm on the attention and MLP outputs (Gemma 2/3, OLMo2)
    qk_norm: str = ""                 # "" | "head" (Qwen3, Gemma 3: per head) | "projection" (OLMo2: whole q / k)
    attention_scale: float = 0.0      # softmax scale; 0 → head_dim ** -0.5
    attn_softcap: float = 0.0         # cap · tanh(score / cap) before the softmax (Gemma 2); 0: none
    final_softcap: float = 0.0        # the same on the logits
    embedding_scale: float = 1.0      # Gemma: √hidden (rounded to the model dtype); Granite: embedding_multiplier
    # Granite's multipliers of each residual branch and of the logits, folded into the weights they follow
    # (weight_plans.decoder_plan) so the projections stay plain GEMVs
    residual_scale: float = 1.0       # residual_multiplier
    logit_scale: float = 1.0          # 1 / logits_scaling
    sliding_window: int = 0           # the window of the layers that slide (one size: TVM's KV cache keeps one)
    layer_sliding: list[bool] = dataclasses.field(default_factory=list)  # per layer; empty: none slide
    rotary_dim: int = 0               # partial rotary (Phi-3); 0 → head_dim
    rope_local_theta: float = 0.0     # Gemma 3: the sliding layers' RoPE base; 0 → rope_theta
    max_prefill_chunk: int = 0        # tokens one prefill chunk may hold (sliding windows need ≤ window); 0: any
    weight_prefix: str = "model"      # where the checkpoint keeps the decoder (Gemma 3's multimodal ones elsewhere)
    kv_cache_dtype: str = "auto"      # "auto" (the model's dtype) | "int8" | "fp8_e4m3" (kv_quant.py)
    attention_sinks: bool = False     # a learned logit per head in every softmax's denominator (gpt-oss)

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not self.rotary_dim:
            self.rotary_dim = self.head_dim
        if self.layer_sliding and not any(self.layer_sliding):
            self.layer_sliding = []
        if self.layer_sliding and not self.max_prefill_chunk:
            self.max_prefill_chunk = self.sliding_window

    @property
    def rope_in_model(self) -> bool:
        """Whether q/k are rotated by the model (rope.py) rather than by the KV cache: TVM's cache has one RoPE base
        and full rotary for every layer, and with sliding layers it switches to rotating keys inside attention. A
        quantized cache stores keys rotated, as float keys are rotated before they are quantized."""
        kind = (self.rope_scaling or {}).get("rope_type", "default")
        return bool(self.layer_sliding or self.rope_local_theta or self.rotary_dim != self.head_dim
                    or kind not in ("default", "llama3") or kv_cache_format.is_quantized(self.kv_cache_dtype))

    def is_sliding(self, layer_id: int) -> bool:
        return bool(self.layer_sliding and self.layer_sliding[layer_id])

    @property
    def sink_heads(self) -> int:
        """The extra q heads that carry the attention sinks to the attention kernels (head_dim sinks each)."""
        q_heads = self.num_attention_heads // self.tensor_parallel_shards
        return -(-q_heads // self.head_dim) if self.attention_sinks else 0


class TiedEmbedding(nn.Embedding):
    """Embedding whose table doubles as the LM head (tie_word_embeddings)."""

    def lm_head_forward(self, x: Tensor) -> Tensor:
        return op.matmul(x, op.permute_dims(self.weight), out_dtype=self.weight.dtype)


def _allreduce_across_shards(x: Tensor, shards: int) -> Tensor:
    """Each shard holds a partial sum of a row-split projection; NCCL adds them up (no-op on one GPU)."""
    return op.ccl_allreduce(x, "sum") if shards > 1 else x


def _rms_norm(cfg: DecoderConfig, width: int) -> nn.RMSNorm:
    return nn.RMSNorm(width, -1, cfg.rms_norm_eps, bias=False)


def _opaque_softcap(logits: Tensor, cap: float) -> Tensor:
    """The logits' soft-cap as a kernel of its own (op_pattern 8, opaque, keeps FuseOps from fusing it): fused,
    it would make the LM head a matmul with a tanh epilogue, which the decode GEMV kernels do not match."""
    return op.tensor_expr_op(lambda x: te.compute(x.shape, lambda *i: tirx.tanh(x(*i) / cap) * cap, name="softcap"),
                             "logit_softcap", [logits], attrs={"op_pattern": 8})


def _head_norm_te(x: te.Tensor, q_weight: te.Tensor, k_weight: te.Tensor, *, q_heads: int, kv_heads: int,
                  eps: float) -> te.Tensor:
    """Per-head RMSNorm of the q and k heads of a fused qkv [tokens, heads, d], v passed through, as one kernel:
    split, two norms and a concat were four launches per layer of batch-1 decode. HF's arithmetic: the mean
    square and the scaling in float32, rounded to the model dtype, then times the weight."""
    tokens, heads, d = x.shape
    normed_heads = q_heads + kv_heads
    r = te.reduce_axis((0, d), name="r")
    # the sums run over every head, v's included: with the reduction's domain narrower than the output's, the
    # CUDA reduction schedule launches only the normed heads' blocks and never writes v
    sumsq = te.compute((tokens, heads),
                       lambda t, h: te.sum(x[t, h, r].astype("float32") * x[t, h, r].astype("float32"), axis=r),
                       name="head_sumsq")

    def value(t, h, i):
        inv = tirx.rsqrt(sumsq[t, h] / tirx.const(int(d), "float32") + tirx.const(eps, "float32"))
        weight = tirx.if_then_else(h < q_heads, q_weight[i], k_weight[i])
        normed = (x[t, h, i].astype("float32") * inv).astype(x.dtype) * weight
        return tirx.if_then_else(h < normed_heads, normed, x[t, h, i])

    return te.compute(x.shape, value, name="qk_head_norm")


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_id: int):
        self.cfg = cfg
        self.layer_id = layer_id
        self.shards = cfg.tensor_parallel_shards
        self.num_q_heads = cfg.num_attention_heads // self.shards
        self.num_kv_heads = cfg.num_key_value_heads // self.shards
        self.head_dim = cfg.head_dim
        qkv_out = (self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.attention_bias)
        # (every shard adds its bias before the all-reduce sums them: shard 0 holds it, the others zeros)
        self.o_proj = nn.Linear(self.num_q_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = _rms_norm(cfg, self.head_dim), _rms_norm(cfg, self.head_dim)
        elif cfg.qk_norm == "projection":
            self.q_norm = _rms_norm(cfg, self.num_q_heads * self.head_dim)
            self.k_norm = _rms_norm(cfg, self.num_kv_heads * self.head_dim)
        self.rope = rope.rope_for_layer(cfg, layer_id) if cfg.rope_in_model else None
        # set while an entry point is traced whose new tokens attend to each other both ways (the CPU attention
        # kernels read a negative softmax scale so: schedules/cpu_attention.py)
        self.bidirectional = False
        if cfg.attention_sinks:
            # The sinks reach the attention kernels as extra q heads after the real ones (schedules/cpu_attention.py
            # reads them there), so the KV cache stores nothing more than without them.
            self.sinks = nn.Parameter((cfg.sink_heads * self.head_dim,))

    def _head_norm(self) -> tuple:
        """The per-head q/k RMSNorm as (te function of qkv [tokens, heads, d] and the two weights, weights)."""
        fn = functools.partial(_head_norm_te, q_heads=self.num_q_heads, kv_heads=self.num_kv_heads,
                               eps=self.cfg.rms_norm_eps)
        return fn, [self.q_norm.weight, self.k_norm.weight]

    def _normed_qkv(self, qkv: Tensor) -> Tensor:
        """q and k RMS-normalized (before RoPE, as in HF), v as it is; qkv is [b, s, heads, head_dim]."""
        b, s, _, d = qkv.shape
        hq, hkv = self.num_q_heads, self.num_kv_heads
        if self.cfg.qk_norm == "projection":
            q, k, v = op.split(qkv, [hq, hq + hkv], axis=2)
            q = op.reshape(self.q_norm(op.reshape(q, (b, s, hq * d))), (b, s, hq, d))
            k = op.reshape(self.k_norm(op.reshape(k, (b, s, hkv * d))), (b, s, hkv, d))
            return op.concat([q, k, v], dim=2)
        fn, weights = self._head_norm()
        out = op.tensor_expr_op(fn, "qk_head_norm", [op.reshape(qkv, (b * s, hq + 2 * hkv, d)), *weights])
        return op.reshape(out, (b, s, hq + 2 * hkv, d))

    def forward(self, x: Tensor, kv_cache: PagedKVCache) -> Tensor:
        b, s, _ = x.shape
        heads = self.num_q_heads + 2 * self.num_kv_heads
        qkv = op.reshape(self.qkv_proj(x), (b, s, heads, self.head_dim))
        # per-head q/k norms run in the RoPE's kernel where the model rotates (one launch, not two)
        fused_norm = self.cfg.qk_norm == "head" and self.rope is not None
        if self.cfg.qk_norm and not fused_norm:
            qkv = self._normed_qkv(qkv)
        if self.rope is not None:
            positions = kv_cache.get_query_positions(b * s)
            qkv = self.rope(qkv, positions, self.num_q_heads + self.num_kv_heads,
                            before=self._head_norm() if fused_norm else None)
        scale = self.cfg.attention_scale or self.head_dim**-0.5
        scale = -scale if self.bidirectional else scale
        if self.cfg.attention_sinks:
            extra = self.cfg.sink_heads
            q, kv = op.split(qkv, [self.num_q_heads], axis=2)
            sinks = op.broadcast_to(op.reshape(self.sinks, (1, 1, extra, self.head_dim)), (b, s, extra, self.head_dim))
            out = kv_cache.attention_with_fused_qkv(self.layer_id, op.concat([q, sinks, kv], dim=2),
                                                    self.num_q_heads + extra, sm_scale=scale)
            out = op.split(out, [self.num_q_heads], axis=2)[0]
        elif kv_cache_format.is_quantized(self.cfg.kv_cache_dtype):
            layout = QuantKVLayout(self.cfg.kv_cache_dtype, qkv.dtype, self.num_q_heads, self.num_kv_heads,
                                   self.head_dim)
            packed = op.reshape(pack_qkv(op.reshape(qkv, (b * s, heads, self.head_dim)), layout),
                                (b, s, layout.cache_q_heads + 2 * self.num_kv_heads, layout.row))
            out = kv_cache.attention_with_fused_qkv(self.layer_id, packed, layout.cache_q_heads, sm_scale=scale)
            out = unpack_output(op.reshape(out, (b * s, layout.cache_q_heads, layout.row)), layout)
        else:
            out = kv_cache.attention_with_fused_qkv(self.layer_id, qkv, self.num_q_heads, sm_scale=scale)
        out = self.o_proj(op.reshape(out, (b, s, self.num_q_heads * self.head_dim)))
        return _allreduce_across_shards(out, self.shards)


ACTIVATIONS = {
    "silu": op.silu,
    "gelu": op.gelu,
    "gelu_pytorch_tanh": lambda x: op.gelu(x, approximate="tanh"),
}


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"activation {cfg.hidden_act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        self.shards = cfg.tensor_parallel_shards
        self.intermediate_size = cfg.intermediate_size // self.shards
        self.act = cfg.hidden_act
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return _allreduce_across_shards(self.down_proj(ACTIVATIONS[self.act](gate) * up), self.shards)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_id: int):
        if cfg.pre_norms:
            self.pre_attn_norm, self.pre_mlp_norm = _rms_norm(cfg, cfg.hidden_size), _rms_norm(cfg, cfg.hidden_size)
        if cfg.post_norms:
            self.post_attn_norm, self.post_mlp_norm = _rms_norm(cfg, cfg.hidden_size), _rms_norm(cfg, cfg.hidden_size)
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = MLP(cfg)
        self.pre_norms, self.post_norms = cfg.pre_norms, cfg.post_norms

    def forward(self, h: Tensor, kv_cache: PagedKVCache) -> Tensor:
        a = self.self_attn(self.pre_attn_norm(h) if self.pre_norms else h, kv_cache)
        h = h + (self.post_attn_norm(a) if self.post_norms else a)
        m = self.mlp(self.pre_mlp_norm(h) if self.pre_norms else h)
        return h + (self.post_mlp_norm(m) if self.post_norms else m)


class DecoderModel(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        embed_cls = TiedEmbedding if cfg.tie_word_embeddings else nn.Embedding
        self.embed_tokens = embed_cls(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = _rms_norm(cfg, cfg.hidden_size)

    def forward(self, h: Tensor, kv_cache: PagedKVCache) -> Tensor:
        for layer in self.layers:
            h = layer(h, kv_cache)
        return self.norm(h)


class DecoderForCausalLM(nn.Module):
    """The exported functions follow MLC-LLM's contract (embed, prefill, decode, batch_*, create_paged_kv_cache)."""

    def __init__(self, cfg: DecoderConfig, target: Target, dtype: str = "float32"):
        self.cfg = cfg
        self.target = target
        self.dtype = dtype
        self.model = DecoderModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # a build that serves LoRA adapters (compiler/lora.py): the forward entry points then take each token's
        # adapter slot and the adapter pool after the KV cache
        self.lora: LoraTokens | None = None

    def to(self, dtype: str | None = None) -> None:
        super().to(dtype=dtype)
        if dtype is not None:
            self.dtype = dtype

    # -- pieces shared by the entry points -------------------------------------------------------------------
    def logits(self, h: Tensor) -> Tensor:
        if self.lm_head is None:
            out = self.model.embed_tokens.lm_head_forward(h)
        else:
            out = self.lm_head(h)
        out = out.astype("float32") if out.dtype != "float32" else out
        return _opaque_softcap(out, self.cfg.final_softcap) if self.cfg.final_softcap else out

    # -- entry points ----------------------------------------------------------------------------------------
    def embed(self, input_ids: Tensor) -> Tensor:
        h = self.model.embed_tokens(input_ids)
        if self.cfg.embedding_scale != 1.0:
            # HF multiplies in the activation dtype: round the factor to it first (Gemma's √hidden in fp16)
            h = h * np.array(self.cfg.embedding_scale, dtype=self.dtype).item()
        return h

    def _bind_lora(self, lora_ids: Tensor | None, lora_pool: list[Tensor] | None) -> None:
        if self.lora is not None:
            self.lora.bind(lora_ids, lora_pool)

    def prefill(self, embeds: Tensor, kv_cache: PagedKVCache, lora_ids: Tensor | None = None,
                lora_pool: list[Tensor] | None = None):
        """One sequence, [1, n, hidden] → logits of the last position [1, 1, vocab]."""
        self._bind_lora(lora_ids, lora_pool)
        h = op.tensor_expr_op(_last_position, "last_position", [self.model(embeds, kv_cache)])
        return self.logits(h), kv_cache

    def decode(self, embeds: Tensor, kv_cache: PagedKVCache, lora_ids: Tensor | None = None,
               lora_pool: list[Tensor] | None = None):
        self._bind_lora(lora_ids, lora_pool)
        return self.logits(self.model(embeds, kv_cache)), kv_cache

    def batch_prefill(self, embeds: Tensor, logit_positions: Tensor, kv_cache: PagedKVCache,
                      lora_ids: Tensor | None = None, lora_pool: list[Tensor] | None = None):
        """Ragged prefill of several sequences packed in [1, total, hidden]; logits at the given positions."""
        self._bind_lora(lora_ids, lora_pool)
        h = self.model(embeds, kv_cache)
        # "clip" instead of nn.op.take's "fast": the same gather (the positions are in bounds), without TVM's warning
        # that fast mode segfaults on out-of-bounds indices at every compile
        rows = op.wrap_nested(rx.op.take(h._expr, logit_positions._expr, axis=1, mode="clip"), name="take")
        return self.logits(rows), kv_cache

    def batch_decode(self, embeds: Tensor, kv_cache: PagedKVCache, lora_ids: Tensor | None = None,
                     lora_pool: list[Tensor] | None = None):
        self._bind_lora(lora_ids, lora_pool)
        return self.logits(self.model(embeds, kv_cache)), kv_cache

    # A LoRA build's forward functions with the adapters: the plain ones run steps where no token has one, at the
    # speed of a build without LoRA
    def prefill_lora(self, embeds: Tensor, kv_cache: PagedKVCache, lora_ids: Tensor, lora_pool: list[Tensor]):
        return self.prefill(embeds, kv_cache, lora_ids, lora_pool)

    def decode_lora(self, embeds: Tensor, kv_cache: PagedKVCache, lora_ids: Tensor, lora_pool: list[Tensor]):
        return self.decode(embeds, kv_cache, lora_ids, lora_pool)

    def batch_prefill_lora(self, embeds: Tensor, logit_positions: Tensor, kv_cache: PagedKVCache,
                           lora_ids: Tensor, lora_pool: list[Tensor]):
        return self.batch_prefill(embeds, logit_positions, kv_cache, lora_ids, lora_pool)

    def batch_decode_lora(self, embeds: Tensor, kv_cache: PagedKVCache, lora_ids: Tensor,
                          lora_pool: list[Tensor]):
        return self.batch_decode(embeds, kv_cache, lora_ids, lora_pool)

    def create_paged_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                              prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                              support_sliding_window: tirx.Var) -> PagedKVCache:
        cfg = self.cfg
        # Sliding layers: TVM's "mha_sliding" kind attends to the last `layer_sliding_window_size` tokens, exact
        # as long as one prefill chunk fits in the window (max_prefill_chunk); the other layers see everything.
        kinds = ["mha_sliding" if cfg.is_sliding(i) else "mha" for i in range(cfg.num_hidden_layers)]
        if kinds and all(k == "mha_sliding" for k in kinds):
            # TVM allocates the q/k/v staging buffers only when some layer is plain "mha": one unused layer of that
            # kind at the end (its pages cost 1/layers of the cache)
            kinds.append("mha")
        layers = len(kinds)
        q_heads = cfg.num_attention_heads // cfg.tensor_parallel_shards + cfg.sink_heads
        kv_heads = cfg.num_key_value_heads // cfg.tensor_parallel_shards
        head_dim, dtype = cfg.head_dim, self.dtype
        if kv_cache_format.is_quantized(cfg.kv_cache_dtype):
            # the byte geometry of kv_quant.py: int8 pages of (codes, scale) rows, q and output as raw bytes
            layout = QuantKVLayout(cfg.kv_cache_dtype, self.dtype, q_heads, kv_heads, cfg.head_dim)
            q_heads, head_dim, dtype = layout.cache_q_heads, layout.row, "int8"
        return TIRPagedKVCache(
            attn_kind=kinds if cfg.layer_sliding else "mha", max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len, prefill_chunk_size=prefill_chunk_size, page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=rx.ShapeExpr([0, layers]), num_hidden_layers=layers,
            num_attention_heads=q_heads, num_key_value_heads=kv_heads, qk_head_dim=head_dim,
            v_head_dim=head_dim, mla_original_qk_head_dim=0, mla_original_v_head_dim=0,
            rope_mode=RopeMode.NONE if cfg.rope_in_model else RopeMode.NORMAL, rope_scale=1,
            rope_theta=cfg.rope_theta, rope_scaling={} if cfg.rope_in_model else (cfg.rope_scaling or {}),
            rope_ext_factors=rx.prim_value(0), rotary_dim=head_dim, enable_disaggregation=False,
            dtype=dtype, target=self.target,
            **({"layer_sliding_window_size": cfg.sliding_window} if cfg.layer_sliding else {}),
        )

    def get_default_spec(self) -> dict:
        h = self.cfg.hidden_size
        packed = {"param_mode": "packed", "effect_mode": "none"}
        kv = nn.spec.Object(object_type=PagedKVCache)
        spec = {
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
        if self.lora is not None:   # each token's adapter slot (as many as the embeds' tokens) and the pool
            for name, tokens in (("prefill", "seq_len"), ("decode", 1), ("batch_prefill", "seq_len"),
                                 ("batch_decode", "batch_size")):
                args = {k: v for k, v in spec[name].items() if k != "$"}
                spec[f"{name}_lora"] = {**args, "lora_ids": nn.spec.Tensor([tokens], "int32"),
                                        "lora_pool": self.lora.pool_spec(), "$": packed}
        return spec


def _last_position(x: te.Tensor) -> te.Tensor:
    b, s, d = x.shape
    return te.compute((b, 1, d), lambda i, _, k: x[i, s - 1, k], name="last_position")
