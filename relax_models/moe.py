"""The mixture-of-experts MLP shared by Mixtral, Qwen2-MoE and Qwen3-MoE, in place of the dense MLP of the layers
their configs make sparse (HF's *SparseMoeBlock).

A softmax router picks k experts per token (weights renormalised over the k where the model says so); each expert
is a SwiGLU MLP whose weights are stacked over experts ([E, 2I, H] gate/up, [E, H, I] down) and run through the
kernels of moe_kernels.py / moe_gemm.py: one token (decode) is a GEMV over its k experts' rows, more tokens
(prefill, batches) are grouped by expert on the device and multiplied expert by expert. Qwen2-MoE adds a shared
expert every token passes through, scaled by a sigmoid gate.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.target import Target

from mlcc.quantization import Quantization

from .blocks import ACTIVATIONS, MLP, DecoderConfig, DecoderForCausalLM, _allreduce_across_shards
from .moe_gemm import expert_gemv, grouped_gemm
from .moe_kernels import ExpertFormat, _gpu, expert_gemv_warp, sort_by_expert, topk_softmax, weighted_sum


@dataclasses.dataclass
class MoEConfig(DecoderConfig):
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True           # renormalise the k selected weights to sum to 1 (Mixtral: always)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert; 0: none
    sparse_layers: list[bool] = dataclasses.field(default_factory=list)  # per layer: MoE (else the dense MLP)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.sparse_layers:
            self.sparse_layers = [True] * self.num_hidden_layers


def check_moe_config(cfg: MoEConfig) -> MoEConfig:
    from mlcc.errors import UnsupportedConfigError

    if cfg.num_experts < 1 or not 1 <= cfg.experts_per_token <= cfg.num_experts:
        raise UnsupportedConfigError(
            f"num_experts_per_tok ({cfg.experts_per_token}) must be between 1 and the number of experts "
            f"({cfg.num_experts}); check config.json")
    if len(cfg.sparse_layers) != cfg.num_hidden_layers:
        raise UnsupportedConfigError(f"{len(cfg.sparse_layers)} sparse-layer flags for {cfg.num_hidden_layers} layers")
    if cfg.hidden_act != "silu":
        raise UnsupportedConfigError(f"hidden_act {cfg.hidden_act!r}: the experts support silu (SwiGLU) only")
    return cfg


def sparse_layer_flags(cfg: dict[str, Any], n_layers: int) -> list[bool]:
    """HF Qwen-MoE: layer i is sparse unless listed in mlp_only_layers, and only every decoder_sparse_step-th."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    if step < 1:
        from mlcc.errors import UnsupportedConfigError

        raise UnsupportedConfigError(f"decoder_sparse_step must be >= 1, got {step}")
    return [i not in dense and (i + 1) % step == 0 for i in range(n_layers)]


class Router(nn.Module):
    """A bias-free [out, hidden] projection kept in the model dtype, never group-quantized: routing decisions are
    what a 4-bit router would change first, and its weight is tiny."""

    def __init__(self, hidden: int, out: int):
        self.weight = nn.Parameter((out, hidden))

    def forward(self, x: Tensor) -> Tensor:
        return op.matmul(x, op.permute_dims(self.weight)).astype("float32")


class ExpertWeights(nn.Module):
    """One projection of every expert, stacked: [experts, out, in] in the model dtype."""

    scheme = None  # plain weights

    def __init__(self, experts: int, out_features: int, in_features: int):
        self.experts, self.out_features, self.in_features = experts, out_features, in_features
        self.weight = nn.Parameter((experts, out_features, in_features))

    def tensors(self) -> list[Tensor]:
        return [self.weight]

    def group_quantized(self, q: Quantization) -> "QuantExpertWeights":
        """The same projection in group quantization `q` (compiler/quantize.py swaps it in)."""
        if self.in_features % q.group_size:
            from mlcc.errors import UnsupportedConfigError

            raise UnsupportedConfigError(
                f"{q.name}: expert weights of input width {self.in_features} are not a multiple of the group size "
                f"{q.group_size}; use a q0 quantization for this model")
        return QuantExpertWeights(self.experts, self.out_features, self.in_features, q)


class QuantExpertWeights(nn.Module):
    """Stacked expert weights in group scheme `q`'s layout per expert: codes [E, out, in/per_word], scales
    [E, out, in/group_size]."""

    def __init__(self, experts: int, out_features: int, in_features: int, q: Quantization):
        self.experts, self.out_features, self.in_features = experts, out_features, in_features
        self.scheme = q
        self.q_weight = nn.Parameter((experts, out_features, in_features // q.per_word), q.storage_dtype)
        self.q_scale = nn.Parameter((experts, out_features, in_features // q.group_size), q.scale_dtype)

    def tensors(self) -> list[Tensor]:
        return [self.q_weight, self.q_scale]

    def to(self, dtype: str | None = None) -> None:  # noqa: ARG002 - the codes' storage dtype stays fixed
        return None


class SparseMoE(nn.Module):
    def __init__(self, cfg: MoEConfig, target: Target):
        self.target = target
        self.shards = cfg.tensor_parallel_shards
        self.k, self.num_experts = cfg.experts_per_token, cfg.num_experts
        self.normalize = cfg.norm_topk_prob
        self.hidden = cfg.hidden_size
        self.inter = cfg.moe_intermediate_size // self.shards
        shared = cfg.shared_expert_intermediate_size
        # the shared expert's gate is one more row of the router: one projection, and no 1-column matmul (which
        # dlight's GPU GEMV rule cannot schedule)
        self.gate = Router(cfg.hidden_size, cfg.num_experts + (1 if shared else 0))
        self.experts = ExpertsMLP(cfg.num_experts, cfg.hidden_size, self.inter)
        self.shared_expert = MLP(dataclasses.replace(cfg, intermediate_size=shared)) if shared else None

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        flat = op.reshape(x, (b * s, h))
        logits = self.gate(flat)
        weights, ids = topk_softmax(logits, self.num_experts, self.k, self.normalize, self.target)
        fmt = ExpertFormat(x.dtype, self.experts.gate_up_proj.scheme)
        if isinstance(b * s, int) and b * s == 1:  # decode: one token, a GEMV over its k experts
            out = self.experts.one_token(flat, op.reshape(ids, (self.k,)), weights, fmt, self.target)
        else:
            out = self.experts.grouped(flat, op.reshape(ids, (b * s * self.k,)), weights, fmt, self.num_experts,
                                       self.target)
        out = _allreduce_across_shards(out, self.shards)
        if self.shared_expert is not None:  # (its down projection all-reduces on its own)
            gate = op.sigmoid(op.split(logits, [self.num_experts], axis=1)[1]).astype(x.dtype)
            out = out + gate * self.shared_expert(flat)
        return op.reshape(out, (b, s, h))


class ExpertsMLP(nn.Module):
    """Every expert's SwiGLU MLP: gate and up fused as in the dense MLP, rows [0, I) gate and [I, 2I) up."""

    def __init__(self, experts: int, hidden: int, inter: int):
        self.inter, self.hidden = inter, hidden
        self.gate_up_proj = ExpertWeights(experts, 2 * inter, hidden)
        self.down_proj = ExpertWeights(experts, hidden, inter)

    def _swiglu(self, gate_up: Tensor) -> Tensor:
        gate, up = op.split(gate_up, 2, axis=-1)
        return ACTIVATIONS["silu"](gate) * up

    def one_token(self, x: Tensor, ids: Tensor, weights: Tensor, fmt: ExpertFormat, target: Target) -> Tensor:
        if _gpu(target):  # (the SwiGLU folded into the gate/up GEMV)
            mid = expert_gemv_warp(x, ids, self.gate_up_proj.tensors(), fmt, self.inter, swiglu=True)
            y = expert_gemv_warp(mid, ids, self.down_proj.tensors(), fmt, self.hidden)
        else:
            mid = self._swiglu(expert_gemv(x, ids, self.gate_up_proj.tensors(), fmt, 2 * self.inter, target))
            y = expert_gemv(mid, ids, self.down_proj.tensors(), fmt, self.hidden, target)
        return weighted_sum(y, weights, None, target)

    def grouped(self, x: Tensor, ids: Tensor, weights: Tensor, fmt: ExpertFormat, num_experts: int,
                target: Target) -> Tensor:
        k = int(weights.shape[1])
        row_slot, slot_row, indptr = sort_by_expert(ids, num_experts, target)
        gate_up = grouped_gemm(x, row_slot, ids, indptr, self.gate_up_proj.tensors(), fmt, 2 * self.inter, k,
                               True, target)
        y = grouped_gemm(self._swiglu(gate_up), row_slot, ids, indptr, self.down_proj.tensors(), fmt, self.hidden,
                         k, False, target)
        return weighted_sum(y, weights, slot_row, target)


class MoEForCausalLM(DecoderForCausalLM):
    """The shared decoder with the MoE block as the MLP of the sparse layers."""

    def __init__(self, cfg: MoEConfig, target: Target, dtype: str = "float32"):
        super().__init__(cfg, target, dtype)
        for i, layer in enumerate(self.model.layers):
            if cfg.sparse_layers[i]:
                layer.mlp = SparseMoE(cfg, target)
