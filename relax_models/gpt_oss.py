"""gpt-oss (OpenAI's open-weight MoE): the Llama block with biases on q/k/v and o, attention sinks (a learned logit
per head in every softmax's denominator), sliding and full layers alternating, YaRN RoPE, and in every layer a
mixture of experts whose router and experts carry biases and whose experts apply a clamped SwiGLU.

Its router takes the top k of biased logits and softmaxes over those k (= a softmax over all, renormalised over the
k). Each expert computes gate, up = x·W_gu + b_gu; gate = min(gate, limit), up = clamp(up, ±limit);
(up + 1) · gate · sigmoid(alpha · gate); then ·W_d + b_d (transformers' modeling_gpt_oss.py). HF stores the stacked
experts transposed ([E, in, out]) with gate and up interleaved column by column; the weight plan turns them into
the [E, out, in] gate-then-up layout of moe.py. Published checkpoints keep the expert weights in MXFP4
(compiler/mxfp4_checkpoint.py reads them); a model built from one keeps them so (`mxfp4_experts`: the MXFP4 scheme
of mlcc.quantization, whatever --quant says, decoded in the expert kernels), exactly the published values in a
quarter of float16's bytes.

llama.cpp's GGUF (`gpt-oss`) stores the experts already split and transposed (`ffn_gate_exps`, `ffn_up_exps`
[E, I, hidden], `ffn_down_exps` [E, hidden, I], each with its bias), usually as GGML's MXFP4 blocks, kept as
they are as well; it carries no SwiGLU alpha or limit, which llama.cpp fixes at 1.702 and 7.0.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from tvm import relax as rx
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.target import Target

from mlcc.errors import UnsupportedConfigError
from mlcc.quantization import MXFP4

from .blocks import DecoderForCausalLM
from .config_utils import decoder_config, gguf_rope_scaling, gguf_single_value
from .llama import gguf_config as llama_gguf_config
from .moe import ExpertsMLP, MoEConfig, Router, check_moe_config
from .moe_gemm import expert_gemv, grouped_gemm
from .moe_kernels import ExpertFormat, sort_by_expert, topk_softmax, weighted_sum
from .weight_plans import Plan, _concat_rows, decoder_plan


@dataclasses.dataclass
class GptOssConfig(MoEConfig):
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mxfp4_experts: bool = False   # the checkpoint's experts are MXFP4: kept so, whatever --quant says


def config_from_hf(cfg: dict[str, Any]) -> GptOssConfig:
    base = decoder_config(cfg, sliding_pattern=lambda i: i % 2 == 0, o_bias=bool(cfg.get("attention_bias", True)),
                          attention_bias=bool(cfg.get("attention_bias", True)), attention_sinks=True)
    return check_moe_config(GptOssConfig(
        **dataclasses.asdict(base), num_experts=int(cfg["num_local_experts"]),
        experts_per_token=int(cfg["num_experts_per_tok"]), moe_intermediate_size=int(cfg["intermediate_size"]),
        norm_topk_prob=True, swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        mxfp4_experts=str((cfg.get("quantization_config") or {}).get("quant_method", "")).lower() == "mxfp4"))


def _take_rows(table: Tensor, rows: Tensor) -> Tensor:
    """table[rows] ("clip": the rows are in bounds; TVM warns at every compile about "fast")."""
    return op.wrap_nested(rx.op.take(table._expr, rows._expr, axis=0, mode="clip"), name="take")


def _clamped_swiglu_te(gate_up: te.Tensor, *, inter: int, alpha: float, limit: float) -> te.Tensor:
    dtype = gate_up.dtype

    def value(r, i):
        gate = tirx.min(gate_up[r, i], tirx.const(limit, dtype))
        up = tirx.max(tirx.min(gate_up[r, inter + i], tirx.const(limit, dtype)), tirx.const(-limit, dtype))
        return (up + tirx.const(1, dtype)) * (gate * tirx.sigmoid(gate * tirx.const(alpha, dtype)))

    return te.compute((gate_up.shape[0], inter), value, name="clamped_swiglu")


class BiasedRouter(Router):
    def __init__(self, hidden: int, out: int):
        super().__init__(hidden, out)
        self.bias = nn.Parameter((out,))

    def forward(self, x: Tensor) -> Tensor:
        return (op.matmul(x, op.permute_dims(self.weight)) + self.bias).astype("float32")


class GptOssExperts(ExpertsMLP):
    """moe.py's stacked experts with a bias on each projection and the clamped SwiGLU between them."""

    def __init__(self, experts: int, hidden: int, inter: int, alpha: float, limit: float):
        super().__init__(experts, hidden, inter)
        self.gate_up_bias = nn.Parameter((experts, 2 * inter))
        self.down_bias = nn.Parameter((experts, hidden))
        self.alpha, self.limit = alpha, limit

    def _swiglu(self, gate_up: Tensor) -> Tensor:
        fn = functools.partial(_clamped_swiglu_te, inter=self.inter, alpha=self.alpha, limit=self.limit)
        return op.tensor_expr_op(fn, "clamped_swiglu", [gate_up])

    def one_token(self, x: Tensor, ids: Tensor, weights: Tensor, fmt: ExpertFormat, target: Target) -> Tensor:
        gate_up = expert_gemv(x, ids, self.gate_up_proj.tensors(), fmt, 2 * self.inter, target)
        mid = self._swiglu(gate_up + _take_rows(self.gate_up_bias, ids))
        y = expert_gemv(mid, ids, self.down_proj.tensors(), fmt, self.hidden, target)
        return weighted_sum(y + _take_rows(self.down_bias, ids), weights, None, target)

    def grouped(self, x: Tensor, ids: Tensor, weights: Tensor, fmt: ExpertFormat, num_experts: int,
                target: Target) -> Tensor:
        k = int(weights.shape[1])
        row_slot, slot_row, indptr = sort_by_expert(ids, num_experts, target)
        row_expert = _take_rows(ids, row_slot)  # the expert of each grouped row
        gate_up = grouped_gemm(x, row_slot, ids, indptr, self.gate_up_proj.tensors(), fmt, 2 * self.inter, k,
                               True, target)
        mid = self._swiglu(gate_up + _take_rows(self.gate_up_bias, row_expert))
        y = grouped_gemm(mid, row_slot, ids, indptr, self.down_proj.tensors(), fmt, self.hidden, k, False, target)
        return weighted_sum(y + _take_rows(self.down_bias, row_expert), weights, slot_row, target)


class GptOssMoE(nn.Module):
    def __init__(self, cfg: GptOssConfig, target: Target):
        self.target = target
        self.k, self.num_experts = cfg.experts_per_token, cfg.num_experts
        self.gate = BiasedRouter(cfg.hidden_size, cfg.num_experts)
        self.experts = GptOssExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_alpha,
                                     cfg.swiglu_limit)
        if cfg.mxfp4_experts:  # (the quantizer leaves them so: they are no longer plain weights)
            self.experts.gate_up_proj = self.experts.gate_up_proj.group_quantized(MXFP4)
            self.experts.down_proj = self.experts.down_proj.group_quantized(MXFP4)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        flat = op.reshape(x, (b * s, h))
        weights, ids = topk_softmax(self.gate(flat), self.num_experts, self.k, True, self.target)
        fmt = ExpertFormat(x.dtype, self.experts.gate_up_proj.scheme)
        if isinstance(b * s, int) and b * s == 1:  # decode: one token, a GEMV over its k experts
            out = self.experts.one_token(flat, op.reshape(ids, (self.k,)), weights, fmt, self.target)
        else:
            out = self.experts.grouped(flat, op.reshape(ids, (b * s * self.k,)), weights, fmt, self.num_experts,
                                       self.target)
        return op.reshape(out, (b, s, h))


class GptOssForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: GptOssConfig, target: Target, dtype: str = "float32"):
        super().__init__(cfg, target, dtype)
        for layer in self.model.layers:
            layer.mlp = GptOssMoE(cfg, target)


MODEL_CLS = GptOssForCausalLM


def _gate_up_rows(ts: list[np.ndarray]) -> np.ndarray:
    """HF's [E, hidden, 2I] with gate and up interleaved → [E, 2I, hidden], gate rows then up rows."""
    w = ts[0]
    return np.concatenate([w[:, :, 0::2], w[:, :, 1::2]], axis=2).transpose(0, 2, 1)


def _gate_up_bias(ts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([ts[0][:, 0::2], ts[0][:, 1::2]], axis=1)


def _transposed(ts: list[np.ndarray]) -> np.ndarray:
    return ts[0].transpose(0, 2, 1)


def _padded_sinks(width: int) -> Callable[[list[np.ndarray]], np.ndarray]:
    def pad(ts: list[np.ndarray]) -> np.ndarray:
        out = np.zeros(width, np.float32)
        out[: ts[0].size] = ts[0].reshape(-1)
        return out

    return pad


def hf_weight_plan(cfg: GptOssConfig) -> Plan:
    plan = decoder_plan(cfg)
    for i in range(cfg.num_hidden_layers):
        ours = hf = f"model.layers.{i}"
        del plan[f"{ours}.mlp.gate_up_proj.weight"], plan[f"{ours}.mlp.down_proj.weight"]
        plan[f"{ours}.self_attn.sinks"] = ([f"{hf}.self_attn.sinks"], _padded_sinks(cfg.sink_heads * cfg.head_dim))
        mlp = f"{hf}.mlp"
        plan[f"{ours}.mlp.gate.weight"] = ([f"{mlp}.router.weight"], None)
        plan[f"{ours}.mlp.gate.bias"] = ([f"{mlp}.router.bias"], None)
        plan[f"{ours}.mlp.experts.gate_up_proj.weight"] = ([f"{mlp}.experts.gate_up_proj"], _gate_up_rows)
        plan[f"{ours}.mlp.experts.gate_up_bias"] = ([f"{mlp}.experts.gate_up_proj_bias"], _gate_up_bias)
        plan[f"{ours}.mlp.experts.down_proj.weight"] = ([f"{mlp}.experts.down_proj"], _transposed)
        plan[f"{ours}.mlp.experts.down_bias"] = ([f"{mlp}.experts.down_proj_bias"], None)
    return plan


def gguf_weight_plan(cfg: GptOssConfig) -> Plan:
    """The GGUF layout under the HF-style names gguf's table maps to it (see the module docstring)."""
    plan = decoder_plan(cfg)
    for i in range(cfg.num_hidden_layers):
        ours = hf = f"model.layers.{i}"
        del plan[f"{ours}.mlp.gate_up_proj.weight"], plan[f"{ours}.mlp.down_proj.weight"]
        plan[f"{ours}.self_attn.sinks"] = ([f"{hf}.self_attn.sinks.weight"],
                                           _padded_sinks(cfg.sink_heads * cfg.head_dim))
        mlp = f"{hf}.mlp"
        plan[f"{ours}.mlp.gate.weight"] = ([f"{mlp}.router.weight"], None)
        plan[f"{ours}.mlp.gate.bias"] = ([f"{mlp}.router.bias"], None)
        experts = f"{mlp}.experts"
        plan[f"{ours}.mlp.experts.gate_up_proj.weight"] = (
            [f"{experts}.gate_proj.weight", f"{experts}.up_proj.weight"], _concat_rows)
        plan[f"{ours}.mlp.experts.gate_up_bias"] = ([f"{experts}.gate_proj.bias", f"{experts}.up_proj.bias"],
                                                    _concat_rows)
        plan[f"{ours}.mlp.experts.down_proj.weight"] = ([f"{experts}.down_proj.weight"], None)
        plan[f"{ours}.mlp.experts.down_bias"] = ([f"{experts}.down_proj.bias"], None)
    return plan


def gguf_config(fields: dict[str, Any], arch: str, vocab_size: int, has_output: bool) -> dict[str, Any]:
    """HF-style config from llama.cpp's `gpt-oss` keys."""
    g = lambda k, d=None: fields.get(f"{arch}.{k}", d)  # noqa: E731
    cfg = llama_gguf_config(fields, arch, vocab_size, has_output)
    base, swa_base = g("rope.freq_base"), g("rope.freq_base_swa")
    if swa_base is not None and base is not None and float(swa_base) != float(base):
        raise UnsupportedConfigError(f"GGUF {arch}.rope.freq_base_swa ({swa_base}) differs from rope.freq_base "
                                     f"({base}): gpt-oss with a RoPE base of its own for sliding layers is not "
                                     "supported")
    scaling = gguf_rope_scaling(fields, arch)
    if scaling is not None:
        scaling["truncate"] = False  # gpt-oss's own YaRN (its config.json); GGUF has no key for it
    pattern = g("attention.sliding_window_pattern")
    n = cfg["num_hidden_layers"]
    if isinstance(pattern, list):
        layer_types = [bool(p) for p in pattern][:n]
    else:  # llama.cpp's rule for a period n: layer i slides unless it is the last of its period; gpt-oss: 2
        period = int(pattern or 2)
        layer_types = [period == 0 or i % period < period - 1 for i in range(n)]
    cfg.update(num_local_experts=int(g("expert_count")), num_experts_per_tok=int(g("expert_used_count")),
               intermediate_size=int(gguf_single_value(fields, f"{arch}.expert_feed_forward_length")),
               attention_bias=True, rope_scaling=scaling,
               layer_types=["sliding_attention" if s else "full_attention" for s in layer_types],
               # llama.cpp's fixed constants for gpt-oss's clamped SwiGLU (the file does not carry them)
               swiglu_alpha=1.702, swiglu_limit=7.0)
    return cfg
