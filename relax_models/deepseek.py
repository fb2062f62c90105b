"""DeepSeek-V2 and -V3: multi-head latent attention (MLA) and mixture-of-experts layers with shared experts and
group-limited routing.

MLA compresses each token's keys and values into one latent c (kv_lora_rank wide, RMS-normed) plus one rotary key
k_pe (qk_rope_head_dim) shared by every head; head h's key is [W_uk[h]·c, k_pe] and its value W_uv[h]·c. Attention
runs on the latent, with the up-projections absorbed into the query and the output as in DeepSeek's own inference
code: q_lat[h] = W_uk[h]ᵀ·q_nope[h], score = q_lat[h]·c + q_pe[h]·k_pe, out[h] = W_uv[h]·Σ p·c. That is
multi-query attention with one KV head of kv_lora_rank + qk_rope_head_dim channels, which the paged KV cache and the
attention kernels of every other family compute: the cache stores the latent and k_pe as the key, and the latent
again as the value (its rope channels zero), so per token it holds 2·(kv_lora_rank + qk_rope_head_dim) numbers
where the expanded heads would take num_heads·(qk_head_dim + v_head_dim). (TVM's "mla" cache kind keeps the latent
once; it has no CPU kernels, so using it means writing them.)

The first `first_k_dense_replace` layers have a dense MLP; the others route each token to experts_per_token of
n_routed_experts (V2: softmax scores; V3: sigmoid scores, chosen with e_score_correction_bias added), only among the
topk_group best of n_group expert groups (a group's score: V2 its best expert, V3 the sum of its best two), weights
renormalised where norm_topk_prob says so and scaled by routed_scaling_factor, plus n_shared_experts always-on
experts as one MLP. Released checkpoints interleave the rotary channels (V2 always, V3 with rope_interleave); the
weight plan permutes those rows to the half-split layout rope.py rotates.

llama.cpp's GGUF (`deepseek2`, V2 and V3 alike) keeps HF's rows (interleaved rotary channels included) and says
which router in its metadata (`expert_gating_func`: softmax as V2, sigmoid with the `exp_probs_b` correction bias
as V3). Files converted since llama.cpp absorbs the up-projections (`attention.key_length_mla` set) store kv_b_proj
split per head as `attn_k_b` [h, latent, nope] and `attn_v_b` [h, v, latent]; older ones keep `attn_kv_b`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.script import tirx as T
from tvm.target import Target

from mlcc import kv_cache_format
from mlcc.errors import UnsupportedConfigError, UnsupportedKVCacheDtypeError

from . import rope
from .blocks import MLP, DecoderForCausalLM, _rms_norm
from .config_utils import gguf_rope_scaling, gguf_single_value, rope_theta_and_scaling
from .moe import ExpertsMLP, MoEConfig
from .moe_kernels import _OPAQUE, ExpertFormat, _gpu
from .weight_plans import Plan, decoder_plan


@dataclasses.dataclass
class DeepseekConfig(MoEConfig):
    q_lora_rank: int = 0              # 0: q_proj straight from the hidden state (V2-Lite)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    heads: int = 0                    # the model's attention heads (num_attention_heads is theirs in the cache)
    scoring: str = "sigmoid"          # router scores: "sigmoid" (V3) | "softmax" (V2)
    group_score: str = "top2"         # a group's score: "top2" (V3, sum of its best two) | "max" (V2)
    correction_bias: bool = True      # V3's e_score_correction_bias (added for the choice only)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_dense: int = 0
    rope_interleave: bool = True
    kv_b_split: bool = False          # kv_b_proj stored as per-head k_b / v_b (llama.cpp's newer GGUF)


def config_from_hf(cfg: dict[str, Any]) -> DeepseekConfig:
    # V3's router (sigmoid scores with a correction bias, groups by their best two) or V2's (softmax, groups by
    # their best): transformers picks it by model_type; a GGUF (one architecture for both) by its gating function
    kind = cfg.get("model_type")
    v3 = cfg["scoring_func"] == "sigmoid" if kind == "deepseek2" else kind != "deepseek_v2"
    theta, scaling = rope_theta_and_scaling(cfg)
    heads = int(cfg["num_attention_heads"])
    rope_dim, nope = int(cfg["qk_rope_head_dim"]), int(cfg["qk_nope_head_dim"])
    latent = int(cfg["kv_lora_rank"])
    method = cfg.get("topk_method", "noaux_tc" if v3 else "greedy")
    if method not in ("noaux_tc", "greedy", "group_limited_greedy"):
        raise UnsupportedConfigError(f"topk_method {method!r} is not supported; supported: greedy, "
                                     "group_limited_greedy, noaux_tc")
    grouped = method != "greedy"
    n = int(cfg["num_hidden_layers"])
    first = int(cfg.get("first_k_dense_replace") or 0)
    scale = (nope + rope_dim) ** -0.5
    if scaling and scaling.get("mscale_all_dim"):  # transformers' yarn_apply_mscale
        m = rope.yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale *= m * m
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    if experts < 1:
        raise UnsupportedConfigError("a DeepSeek-architecture model without routed experts (n_routed_experts) is not "
                                     "supported; mlcc runs DeepSeek-V2/V3's mixture of experts")
    return DeepseekConfig(
        hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["intermediate_size"]), num_hidden_layers=n,
        # the cache sees multi-query attention over the latent (see the module docstring)
        num_attention_heads=heads, num_key_value_heads=1, head_dim=latent + rope_dim, rotary_dim=rope_dim,
        vocab_size=int(cfg["vocab_size"]), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_scaling=scaling, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        context_window_size=int(cfg.get("max_position_embeddings", 4096)), attention_scale=scale,
        hidden_act=cfg.get("hidden_act", "silu"), num_experts=experts,
        experts_per_token=int(cfg["num_experts_per_tok"]), moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts") or 0),
        sparse_layers=[i >= first for i in range(n)], q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        kv_lora_rank=latent, qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim, v_head_dim=int(cfg["v_head_dim"]),
        heads=heads, scoring="sigmoid" if v3 else "softmax", group_score="top2" if v3 else "max",
        correction_bias=v3, n_group=int(cfg.get("n_group") or 1) if grouped else 1,
        topk_group=int(cfg.get("topk_group") or 1) if grouped else 1,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0), first_dense=first,
        rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
        kv_b_split=bool(cfg.get("kv_b_split", False)))


class LatentAttention(nn.Module):
    def __init__(self, cfg: DeepseekConfig, layer_id: int):
        if kv_cache_format.is_quantized(cfg.kv_cache_dtype):
            raise UnsupportedKVCacheDtypeError(f"--kv-cache-dtype {cfg.kv_cache_dtype}: DeepSeek's latent attention "
                                               "keeps a float KV cache; use --kv-cache-dtype auto")
        self.cfg, self.layer_id = cfg, layer_id
        h, qk = cfg.heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
            self.q_a_norm = _rms_norm(cfg, cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, h * qk, bias=False)
        self.kv_a_proj = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_norm = _rms_norm(cfg, cfg.kv_lora_rank)
        # kv_b_proj split per head and absorbed: w_uk [h, nope, latent] into q, w_uv [h, latent, v] out of the output
        self.w_uk = nn.Parameter((h, cfg.qk_nope_head_dim, cfg.kv_lora_rank))
        self.w_uv = nn.Parameter((h, cfg.kv_lora_rank, cfg.v_head_dim))
        self.o_proj = nn.Linear(h * cfg.v_head_dim, cfg.hidden_size, bias=False)
        self.rope = rope.rope_for_layer(cfg, layer_id)

    def forward(self, x: Tensor, kv_cache: Any) -> Tensor:
        cfg = self.cfg
        b, s, _ = x.shape
        h, nope, rd, lat = cfg.heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))) if cfg.q_lora_rank else self.q_proj(x)
        q_nope, q_pe = op.split(op.reshape(q, (b * s, h, nope + rd)), [nope], axis=2)
        c, k_pe = op.split(op.reshape(self.kv_a_proj(x), (b * s, lat + rd)), [lat], axis=1)
        c = self.kv_a_norm(c)
        # RoPE on q_pe and k_pe in one launch: k_pe as one more head
        pe = op.concat([q_pe, op.reshape(k_pe, (b * s, 1, rd))], dim=1)
        pe = op.reshape(self.rope(op.reshape(pe, (b, s, h + 1, rd)), kv_cache.get_query_positions(b * s), h + 1),
                        (b * s, h + 1, rd))
        q_pe, k_pe = op.split(pe, [h], axis=1)
        q_lat = op.permute_dims(op.matmul(op.permute_dims(q_nope, [1, 0, 2]), self.w_uk), [1, 0, 2])  # [n, h, lat]
        c = op.reshape(c, (b * s, 1, lat))
        qkv = op.concat([op.concat([q_lat, q_pe], dim=2), op.concat([c, k_pe], dim=2),
                         op.concat([c, op.zeros((b * s, 1, rd), c.dtype)], dim=2)], dim=1)
        out = kv_cache.attention_with_fused_qkv(self.layer_id, op.reshape(qkv, (b, s, h + 2, lat + rd)), h,
                                                sm_scale=cfg.attention_scale)
        o_lat = op.split(op.reshape(out, (b * s, h, lat + rd)), [lat], axis=2)[0]
        o = op.permute_dims(op.matmul(op.permute_dims(o_lat, [1, 0, 2]), self.w_uv), [1, 0, 2])  # [n, h, v]
        return self.o_proj(op.reshape(o, (b, s, h * cfg.v_head_dim)))


def _route(logits: Tensor, bias: Tensor, cfg: DeepseekConfig) -> tuple[Tensor, Tensor]:
    """Group-limited top-k of one token per row (transformers' DeepseekV2/V3 routers): logits [T, E] float32 →
    (weights [T, k] float32, ids [T, k] int32)."""
    tokens = logits.shape[0]
    e, k, groups, keep = cfg.num_experts, cfg.experts_per_token, cfg.n_group, cfg.topk_group
    per = e // groups
    sigmoid, top2 = cfg.scoring == "sigmoid", cfg.group_score == "top2"
    normalize, factor = cfg.norm_topk_prob, cfg.routed_scaling_factor
    neg = T.float32(-3.0e38)

    @T.prim_func(private=True, s_tir=True)
    def func(lg_h: T.handle, bias_h: T.handle, w_h: T.handle, ids_h: T.handle):
        T.func_attr(_OPAQUE)
        n = T.int64()
        lg = T.match_buffer(lg_h, (n, e), "float32")
        bs = T.match_buffer(bias_h, (e,), "float32")
        w = T.match_buffer(w_h, (n, k), "float32")
        ids = T.match_buffer(ids_h, (n, k), "int32")
        for t in T.parallel(n):
            with T.sblock("route"):
                T.reads()
                T.writes()
                score = T.sblock_alloc_buffer((e,), "float32")
                choice = T.sblock_alloc_buffer((e,), "float32")
                gscore = T.sblock_alloc_buffer((groups,), "float32")
                acc = T.sblock_alloc_buffer((3,), "float32")
                best = T.sblock_alloc_buffer((1,), "int32")
                acc[0] = lg[t, 0]
                for i in T.serial(e):
                    acc[0] = T.max(acc[0], lg[t, i])
                acc[1] = T.float32(0)
                for i in T.serial(e):
                    if sigmoid:
                        score[i] = T.float32(1) / (T.float32(1) + T.exp(T.float32(0) - lg[t, i]))
                    else:
                        score[i] = T.exp(lg[t, i] - acc[0])
                        acc[1] = acc[1] + score[i]
                for i in T.serial(e):
                    if not sigmoid:
                        score[i] = score[i] / acc[1]
                    choice[i] = score[i] + bs[i]
                # each group's score; then keep the best `keep` groups (the others' experts out of the choice)
                for g in T.serial(groups):
                    acc[0] = neg
                    acc[1] = neg
                    for i in T.serial(per):
                        if choice[g * per + i] > acc[0]:
                            acc[1] = acc[0]
                            acc[0] = choice[g * per + i]
                        elif choice[g * per + i] > acc[1]:
                            acc[1] = choice[g * per + i]
                    gscore[g] = acc[0] + acc[1] if top2 else acc[0]
                for j in T.serial(keep):
                    best[0] = 0
                    for g in T.serial(groups):
                        if gscore[g] > gscore[best[0]]:
                            best[0] = g
                    gscore[best[0]] = T.float32(-2.0e38)  # picked
                for g in T.serial(groups):
                    if gscore[g] > T.float32(-1.0e38):  # not picked
                        for i in T.serial(per):
                            choice[g * per + i] = neg
                acc[2] = T.float32(0)
                for j in T.serial(k):
                    best[0] = 0
                    for i in T.serial(e):
                        if choice[i] > choice[best[0]]:
                            best[0] = i
                    ids[t, j] = best[0]
                    w[t, j] = score[best[0]]
                    acc[2] = acc[2] + score[best[0]]
                    choice[best[0]] = neg
                for j in T.serial(k):
                    if normalize:
                        w[t, j] = w[t, j] / (acc[2] + T.float32(1e-20)) * T.float32(factor)
                    else:
                        w[t, j] = w[t, j] * T.float32(factor)

    return op.tensor_ir_op(func, "deepseek_route", [logits, bias],
                           [Tensor.placeholder([tokens, k], "float32"), Tensor.placeholder([tokens, k], "int32")])


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: DeepseekConfig, target: Target):
        if _gpu(target):
            raise UnsupportedConfigError(f"DeepSeek's group-limited router has a CPU kernel only, none for target "
                                         f"'{target.kind.name}'; compile it for --target llvm")
        self.cfg, self.target = cfg, target
        self.gate = nn.Parameter((cfg.num_experts, cfg.hidden_size))
        self.correction_bias = nn.Parameter((cfg.num_experts,), "float32")
        self.experts = ExpertsMLP(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        shared = cfg.shared_expert_intermediate_size
        self.shared_experts = MLP(dataclasses.replace(cfg, intermediate_size=shared)) if shared else None

    def to(self, dtype: str | None = None) -> None:
        super().to(dtype)
        self.correction_bias.to("float32")

    def forward(self, x: Tensor) -> Tensor:
        cfg = self.cfg
        b, s, hid = x.shape
        flat = op.reshape(x, (b * s, hid))
        logits = op.matmul(flat.astype("float32"), op.permute_dims(self.gate.astype("float32")))
        weights, ids = _route(logits, self.correction_bias, cfg)
        fmt = ExpertFormat(x.dtype, self.experts.gate_up_proj.scheme)
        if isinstance(b * s, int) and b * s == 1:
            out = self.experts.one_token(flat, op.reshape(ids, (cfg.experts_per_token,)), weights, fmt, self.target)
        else:
            out = self.experts.grouped(flat, op.reshape(ids, (b * s * cfg.experts_per_token,)), weights, fmt,
                                       cfg.num_experts, self.target)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return op.reshape(out, (b, s, hid))


class DeepseekForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: DeepseekConfig, target: Target, dtype: str = "float32"):
        super().__init__(cfg, target, dtype)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = LatentAttention(cfg, i)
            if cfg.sparse_layers[i]:
                layer.mlp = DeepseekMoE(cfg, target)


MODEL_CLS = DeepseekForCausalLM


def _half_split(rows: int, per: int, start: int) -> np.ndarray:
    """Row order that turns the interleaved rotary pairs of each `per`-row block (its rotary rows from `start`)
    into the half-split layout."""
    order = []
    for block in range(rows // per):
        base = block * per
        rot = list(range(base + start, base + per))
        order += list(range(base, base + start)) + rot[0::2] + rot[1::2]
    return np.asarray(order)


def hf_weight_plan(cfg: DeepseekConfig) -> Plan:
    plan = decoder_plan(cfg)
    h, nope, rd, lat = cfg.heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    q_order = _half_split(h * (nope + rd), nope + rd, nope) if cfg.rope_interleave else None
    kv_order = _half_split(lat + rd, lat + rd, lat) if cfg.rope_interleave else None

    def rows(order):
        return (lambda ts: ts[0][order]) if order is not None else None

    def uk(ts):
        return ts[0].reshape(h, nope + cfg.v_head_dim, lat)[:, :nope, :]

    def uv(ts):
        return ts[0].reshape(h, nope + cfg.v_head_dim, lat)[:, nope:, :].transpose(0, 2, 1)

    for i in range(cfg.num_hidden_layers):
        ours = hf = f"model.layers.{i}"
        attn = f"{hf}.self_attn"
        for name in ("qkv_proj.weight", "o_proj.weight"):
            del plan[f"{ours}.self_attn.{name}"]
        if cfg.q_lora_rank:
            plan[f"{ours}.self_attn.q_a_proj.weight"] = ([f"{attn}.q_a_proj.weight"], None)
            plan[f"{ours}.self_attn.q_a_norm.weight"] = ([f"{attn}.q_a_layernorm.weight"], None)
            plan[f"{ours}.self_attn.q_b_proj.weight"] = ([f"{attn}.q_b_proj.weight"], rows(q_order))
        else:
            plan[f"{ours}.self_attn.q_proj.weight"] = ([f"{attn}.q_proj.weight"], rows(q_order))
        plan[f"{ours}.self_attn.kv_a_proj.weight"] = ([f"{attn}.kv_a_proj_with_mqa.weight"], rows(kv_order))
        plan[f"{ours}.self_attn.kv_a_norm.weight"] = ([f"{attn}.kv_a_layernorm.weight"], None)
        plan[f"{ours}.self_attn.w_uk"] = ([f"{attn}.kv_b_proj.weight"], uk)
        plan[f"{ours}.self_attn.w_uv"] = ([f"{attn}.kv_b_proj.weight"], uv)
        plan[f"{ours}.self_attn.o_proj.weight"] = ([f"{attn}.o_proj.weight"], None)
        if cfg.sparse_layers[i]:
            mlp = f"{hf}.mlp"
            del plan[f"{ours}.mlp.gate_up_proj.weight"], plan[f"{ours}.mlp.down_proj.weight"]
            plan[f"{ours}.mlp.gate"] = ([f"{mlp}.gate.weight"], None)
            plan[f"{ours}.mlp.correction_bias"] = (
                ([f"{mlp}.gate.e_score_correction_bias"], None) if cfg.correction_bias
                else ([f"{mlp}.gate.weight"], lambda ts: np.zeros(ts[0].shape[0], np.float32)))
            # (stacked from the per-expert tensors by the weight source, as moe_plan reads them)
            plan[f"{ours}.mlp.experts.gate_up_proj.weight"] = (
                [f"{mlp}.experts.gate_proj.weight", f"{mlp}.experts.up_proj.weight"], lambda ts: np.concatenate(ts, 1))
            plan[f"{ours}.mlp.experts.down_proj.weight"] = ([f"{mlp}.experts.down_proj.weight"], None)
            if cfg.shared_expert_intermediate_size:
                shared = f"{mlp}.shared_experts"
                plan[f"{ours}.mlp.shared_experts.gate_up_proj.weight"] = (
                    [f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"], lambda ts: np.concatenate(ts, 0))
                plan[f"{ours}.mlp.shared_experts.down_proj.weight"] = ([f"{shared}.down_proj.weight"], None)
    return plan


def gguf_weight_plan(cfg: DeepseekConfig) -> Plan:
    """The HF plan under the names gguf's table maps llama.cpp's tensors from, with kv_b_proj read from its per-head
    halves where the file splits it (see the module docstring)."""
    plan = hf_weight_plan(cfg)
    for i in range(cfg.num_hidden_layers):
        ours = hf = f"model.layers.{i}"
        if cfg.kv_b_split:
            attn = f"{hf}.self_attn"
            plan[f"{ours}.self_attn.w_uk"] = ([f"{attn}.k_b_proj.weight"], _transposed_heads)
            plan[f"{ours}.self_attn.w_uv"] = ([f"{attn}.v_b_proj.weight"], _transposed_heads)
        if cfg.sparse_layers[i] and cfg.correction_bias:
            plan[f"{ours}.mlp.correction_bias"] = ([f"{hf}.mlp.gate.e_score_correction.bias"], None)
    return plan


def _transposed_heads(ts: list[np.ndarray]) -> np.ndarray:
    return ts[0].transpose(0, 2, 1)


# llama.cpp's expert_gating_func values → HF scoring_func
_GATING = {1: "softmax", 2: "sigmoid"}


def gguf_config(fields: dict[str, Any], arch: str, vocab_size: int, has_output: bool) -> dict[str, Any]:
    """HF-style config from llama.cpp's `deepseek2` keys."""
    g = lambda k, d=None: fields.get(f"{arch}.{k}", d)  # noqa: E731
    rope_dim = int(g("rope.dimension_count"))
    latent = int(g("attention.kv_lora_rank"))
    split = g("attention.key_length_mla") is not None
    # split files give the per-head sizes in the *_mla keys (key_length is then the latent's); older ones in
    # key_length / value_length, as for any MHA
    qk_head = int(g("attention.key_length_mla") if split else g("attention.key_length"))
    v_head = int(g("attention.value_length_mla") if split else g("attention.value_length"))
    n = int(g("block_count"))
    # llama.cpp's reading of files that do not say: sigmoid for GLM 4.7 Lite's shapes, else softmax (V2)
    glm_lite = n in (47, 48) and vocab_size == 154880
    gating = int(g("expert_gating_func") or (2 if glm_lite else 1))
    if gating not in _GATING:
        raise UnsupportedConfigError(f"GGUF {arch}.expert_gating_func {gating} is not supported; supported: 1 "
                                     "(softmax, DeepSeek-V2), 2 (sigmoid, DeepSeek-V3)")
    if g("attention.temperature_scale"):
        raise UnsupportedConfigError(f"GGUF {arch}.attention.temperature_scale: attention temperature tuning "
                                     "(llama.cpp's for Mistral Large) is not supported")
    if not g("expert_count"):
        raise UnsupportedConfigError(f"GGUF {arch} without {arch}.expert_count (a model with no routed experts) is "
                                     "not supported; mlcc runs DeepSeek-V2/V3's mixture of experts")
    groups = int(g("expert_group_count") or 1)
    cfg: dict[str, Any] = {
        "hidden_size": int(g("embedding_length")), "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": n, "num_attention_heads": int(g("attention.head_count")), "vocab_size": vocab_size,
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)), "max_position_embeddings": int(g("context_length", 4096)),
        "tie_word_embeddings": not has_output, "q_lora_rank": int(g("attention.q_lora_rank") or 0),
        "kv_lora_rank": latent, "qk_rope_head_dim": rope_dim, "qk_nope_head_dim": qk_head - rope_dim,
        "v_head_dim": v_head, "n_routed_experts": int(g("expert_count")),
        "num_experts_per_tok": int(g("expert_used_count")),
        "moe_intermediate_size": int(gguf_single_value(fields, f"{arch}.expert_feed_forward_length")),
        "n_shared_experts": int(g("expert_shared_count") or 0),
        "first_k_dense_replace": int(g("leading_dense_block_count") or 0),
        "routed_scaling_factor": float(g("expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(g("expert_weights_norm", False)), "scoring_func": _GATING[gating],
        "n_group": groups, "topk_group": int(g("expert_group_used_count") or groups),
        "topk_method": "noaux_tc" if gating == 2 else "group_limited_greedy" if groups > 1 else "greedy",
        # llama.cpp rotates DeepSeek's rows as stored: interleaved pairs
        "rope_interleave": True, "kv_b_split": split,
    }
    scaling = gguf_rope_scaling(fields, arch)
    if scaling is not None and g("rope.scaling.yarn_log_multiplier") is not None:
        # the converter writes 0.1 · mscale_all_dim, and llama.cpp's cos/sin factor is HF's with mscale equal to it
        scaling["mscale"] = scaling["mscale_all_dim"] = float(g("rope.scaling.yarn_log_multiplier")) / 0.1
    cfg["rope_scaling"] = scaling
    return cfg
