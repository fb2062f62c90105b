"""Where each parameter of the shared decoder comes from in a Hugging Face checkpoint (and so in a GGUF file, whose
names gguf's own tables translate), and how tensor parallelism slices it.

A plan maps our parameter name → (source tensor names, how to combine them): q/k/v and gate/up are concatenated
into the fused projections unless the checkpoint already fuses them (Phi-3).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from mlcc.errors import TensorParallelError

from .blocks import DecoderConfig

Plan = dict[str, tuple[list[str], Callable | None]]

# our norm modules → HF's names, for the layouts in use
LLAMA_NORMS = {"pre_attn_norm": "input_layernorm", "pre_mlp_norm": "post_attention_layernorm"}
SANDWICH_NORMS = {"pre_attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                  "pre_mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}
POST_NORMS = {"post_attn_norm": "post_attention_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}


def _concat(ts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(ts, axis=0)


def decoder_plan(cfg: DecoderConfig, norms: dict[str, str] = LLAMA_NORMS, fused_qkv: bool = False,
                 fused_gate_up: bool = False, prefix: str = "model") -> Plan:
    plan: Plan = {"model.embed_tokens.weight": ([f"{prefix}.embed_tokens.weight"], None),
                  "model.norm.weight": ([f"{prefix}.norm.weight"], None)}
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = (["lm_head.weight"], None)
    for i in range(cfg.num_hidden_layers):
        ours, hf = f"model.layers.{i}", f"{prefix}.layers.{i}"
        for mine, theirs in norms.items():
            plan[f"{ours}.{mine}.weight"] = ([f"{hf}.{theirs}.weight"], None)
        attn = f"{hf}.self_attn"
        if fused_qkv:
            plan[f"{ours}.self_attn.qkv_proj.weight"] = ([f"{attn}.qkv_proj.weight"], None)
        else:
            plan[f"{ours}.self_attn.qkv_proj.weight"] = ([f"{attn}.{x}_proj.weight" for x in "qkv"], _concat)
        if cfg.attention_bias:
            plan[f"{ours}.self_attn.qkv_proj.bias"] = ([f"{attn}.{x}_proj.bias" for x in "qkv"], _concat)
        if cfg.qk_norm:
            plan[f"{ours}.self_attn.q_norm.weight"] = ([f"{attn}.q_norm.weight"], None)
            plan[f"{ours}.self_attn.k_norm.weight"] = ([f"{attn}.k_norm.weight"], None)
        plan[f"{ours}.self_attn.o_proj.weight"] = ([f"{attn}.o_proj.weight"], None)
        if cfg.o_bias:
            plan[f"{ours}.self_attn.o_proj.bias"] = ([f"{attn}.o_proj.bias"], None)
        mlp = f"{hf}.mlp"
        if fused_gate_up:
            plan[f"{ours}.mlp.gate_up_proj.weight"] = ([f"{mlp}.gate_up_proj.weight"], None)
        else:
            plan[f"{ours}.mlp.gate_up_proj.weight"] = ([f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"], _concat)
        plan[f"{ours}.mlp.down_proj.weight"] = ([f"{mlp}.down_proj.weight"], None)
    return _fold_multipliers(plan, cfg)


def _concat_rows(ts: list[np.ndarray]) -> np.ndarray:
    """Stacked [E, out, in] tensors joined along out (gate then up, per expert)."""
    return np.concatenate(ts, axis=1)


def moe_plan(cfg: Any, plan: Plan, block: str, expert_names: tuple[str, str, str], prefix: str = "model") -> Plan:
    """`plan` with the dense MLP of each sparse layer replaced by the MoE block's parameters (relax_models/moe.py).
    block: where the checkpoint keeps the MoE block in a layer ("mlp"; Mixtral "block_sparse_moe");
    expert_names: its gate, up and down projections. Experts are read as one stacked [E, out, in] tensor per
    projection under the name gguf's table gives the merged tensor (`<block>.experts.<name>.weight`); an HF folder
    stores one tensor per expert, which the weight source stacks (compiler/weights.py)."""
    gate, up, down = expert_names
    for i in range(cfg.num_hidden_layers):
        if not cfg.sparse_layers[i]:
            continue
        ours, hf = f"model.layers.{i}.mlp", f"{prefix}.layers.{i}.{block}"
        del plan[f"{ours}.gate_up_proj.weight"], plan[f"{ours}.down_proj.weight"]
        plan[f"{ours}.gate.weight"] = ([f"{hf}.gate.weight"], None)  # the router
        plan[f"{ours}.experts.gate_up_proj.weight"] = (
            [f"{hf}.experts.{gate}.weight", f"{hf}.experts.{up}.weight"], _concat_rows)
        plan[f"{ours}.experts.down_proj.weight"] = ([f"{hf}.experts.{down}.weight"], None)
        if cfg.shared_expert_intermediate_size:
            shared = f"{hf}.shared_expert"
            plan[f"{ours}.shared_expert.gate_up_proj.weight"] = (
                [f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"], _concat)
            plan[f"{ours}.shared_expert.down_proj.weight"] = ([f"{shared}.down_proj.weight"], None)
            # its sigmoid gate is the router's last row (moe.SparseMoE)
            plan[f"{ours}.gate.weight"] = ([f"{hf}.gate.weight", f"{hf}.shared_expert_gate.weight"], _router_rows)
    return plan


def _router_rows(ts: list[np.ndarray]) -> np.ndarray:
    """The router's rows, then the shared expert's gate (GGUF may store that one as a vector)."""
    return np.concatenate([ts[0], ts[1].reshape(1, -1)], axis=0)


def _scaled(combine: Callable | None, factor: float) -> Callable:
    def scaled(ts: list[np.ndarray]) -> np.ndarray:
        return (combine(ts) if combine else ts[0]).astype(np.float32) * np.float32(factor)

    return scaled


def _fold_multipliers(plan: Plan, cfg: DecoderConfig) -> Plan:
    """Granite's multipliers as weights: a residual branch's into its last linear map (its output norm where the
    block has one), the logits' into the final norm (the LM head may be the tied embedding)."""
    last = ((".post_attn_norm.weight", ".post_mlp_norm.weight") if cfg.post_norms
            else (".self_attn.o_proj.weight", ".self_attn.o_proj.bias", ".mlp.down_proj.weight"))
    for name, (srcs, combine) in plan.items():
        factor = (cfg.residual_scale if name.endswith(last) else 1.0) * (
            cfg.logit_scale if name == "model.norm.weight" else 1.0)
        if factor != 1.0:
            plan[name] = (srcs, _scaled(combine, factor))
    return plan


def norm_plus_one(names: list[str]) -> dict[str, Callable]:
    """Gemma's norms compute x̂·(1 + w): storing 1 + w lets the plain RMSNorm do the same math."""
    def plus_one(w: np.ndarray) -> np.ndarray:
        return w.astype(np.float32) + 1.0

    return {n: plus_one for n in names}


def norm_names(plan: Plan) -> list[str]:
    return [src for srcs, _ in plan.values() for src in srcs if src.endswith("norm.weight")]


# -- tensor parallelism -------------------------------------------------------------------------------------------

def check_tensor_parallel(cfg: DecoderConfig, shards: int, group_size: int | None) -> None:
    """Every shard gets whole heads and whole quantization groups, or we refuse with the reason."""
    if shards < 1:
        raise TensorParallelError(f"--tensor-parallel must be >= 1, got {shards}")
    if shards == 1:
        return
    if cfg.qk_norm == "projection":
        raise TensorParallelError("--tensor-parallel: this model normalizes q and k over all heads at once (OLMo2), "
                                  "which a split over GPUs cannot compute without an extra all-reduce; use one GPU")
    mlps = [("MLP", cfg.intermediate_size)] + [  # (mixture-of-experts models: the experts' and the shared one's)
        (label, getattr(cfg, key)) for key, label in (("moe_intermediate_size", "expert MLP"),
                                                      ("shared_expert_intermediate_size", "shared expert MLP"))
        if getattr(cfg, key, 0)]
    for what, n in [("attention heads", cfg.num_attention_heads), ("key/value heads", cfg.num_key_value_heads)] + [
            (f"{label} intermediate size", n) for label, n in mlps]:
        if n % shards:
            raise TensorParallelError(f"--tensor-parallel {shards}: the model's {what} ({n}) do not split evenly; "
                                      f"use a shard count that divides {n}")
    if group_size:
        for what, n in [("attention output width", cfg.num_attention_heads // shards * cfg.head_dim)] + [
                (f"{label} width", n // shards) for label, n in mlps]:
            if n % group_size:
                raise TensorParallelError(
                    f"--tensor-parallel {shards}: each shard's {what} ({n}) is not a multiple of the "
                    f"quantization group size {group_size}; use fewer shards or an unquantized (q0*) build")


def shard_weight(name: str, w: np.ndarray, cfg: Any, rank: int, shards: int) -> np.ndarray:
    """Rank `rank`'s slice of a full (fused) weight: q/k/v and gate/up split by output rows per head / column
    block, o_proj and down_proj by input columns (their partial outputs are summed by the all-reduce);
    embeddings, norms (also the per-head q/k norms) and the LM head are replicated."""
    if shards == 1:
        return w
    if w.ndim == 3:  # stacked experts [E, out, in]: each expert splits like the dense MLP
        return np.stack([shard_weight(name, e, cfg, rank, shards) for e in w])
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
    if name.endswith("o_proj.bias"):  # added once, after the all-reduce of the partial sums
        return w if rank == 0 else np.zeros_like(w)
    return w
