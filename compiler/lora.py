"""A build that serves LoRA adapters (CompileOptions.max_loras): which projections adapters may target, read from
the family's weight plan, and the model surgery that gives each of them its adapters' product
(relax_models/lora.py). The targets go into mlcc-config.json, so the runtime maps an adapter's tensors onto the pool
without the models."""

from __future__ import annotations

from typing import Any

import numpy as np
from tvm.relax.frontend import nn

from mlcc.errors import UnsupportedConfigError
from mlcc.lora_format import LoraLayout, LoraTarget
from mlcc.options import CompileOptions
from mlcc.relax_models import Family
from mlcc.relax_models.lora import LoraProjection, LoraTokens

# our projections adapters may target, with what each fuses (HF's names for the parts)
_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def check_lora(options: CompileOptions, target_kind: str, tensor_parallel: int) -> None:
    """Refuse LoRA where it is not served, in one line."""
    if not options.max_loras:
        return
    if target_kind == "webgpu":
        raise UnsupportedConfigError("--option max_loras: the web engine serves no LoRA adapters yet; compile the "
                                     "webgpu build without it (merge an adapter into the model to run it there)")
    if tensor_parallel > 1:
        raise UnsupportedConfigError("--option max_loras: LoRA adapters are not served with --tensor-parallel yet; "
                                     "use one GPU or drop the option")


def lora_targets(family: Family, cfg: Any, model: nn.Module) -> list[LoraTarget]:
    """The adaptable projections of `model` in the pool's order: those of `_PROJECTIONS` whose weight the plan reads
    from HF tensors that an adapter's modules name (each part's rows from the model's own widths)."""
    plan = family.weight_plan(cfg)
    modules = _named_modules(model)
    targets = []
    for name, module in modules.items():
        if not name.endswith(_PROJECTIONS) or f"{name}.weight" not in plan:
            continue   # (a mixture-of-experts layer's MLP is no plain projection)
        sources, combine = plan[f"{name}.weight"]
        scale = _plan_scale(sources, combine)
        if scale is None:
            continue
        out, k = _widths(module)
        rows = _part_rows(name, cfg, out, len(sources))
        targets.append(LoraTarget(name, k, tuple((s.removesuffix(".weight"), r) for s, r in zip(sources, rows)),
                                  scale))
    return targets


def _named_modules(model: nn.Module) -> dict[str, nn.Module]:
    found: dict[str, nn.Module] = {}

    class _Collect(nn.Mutator):
        def visit_module(self, name: str, node: nn.Module):
            found[name] = node
            return self.visit(name, node)

    _Collect().visit("", model)
    return found


def _widths(module: nn.Module) -> tuple[int, int]:
    """(out, in) of a plain or quantized projection."""
    return int(module.out_features), int(module.in_features)


def _part_rows(name: str, cfg: Any, out: int, parts: int) -> list[int]:
    if parts == 1:
        return [out]
    if name.endswith("qkv_proj") and parts == 3:
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        return [q, kv, kv]
    if parts == 2 and out % 2 == 0:   # gate, up
        return [out // 2, out // 2]
    raise UnsupportedConfigError(f"{name}: cannot tell the widths of its {parts} fused parts for LoRA")


def _plan_scale(sources: list[str], combine) -> float | None:
    """The factor the plan's combine multiplies the weight by (1 for a plain concatenation), or None where it does
    more than concatenate and scale (no adapter maps onto such a weight)."""
    if combine is None:
        return 1.0
    try:
        out = np.asarray(combine([np.ones((1, 1), np.float32) for _ in sources]), dtype=np.float32)
    except Exception:  # noqa: BLE001 - a combine that needs real tensors: not adaptable
        return None
    if out.shape != (len(sources), 1) or not np.all(out == out.flat[0]):
        return None
    return float(out.flat[0])


def add_lora(model: nn.Module, family: Family, cfg: Any, options: CompileOptions, dtype: str) -> LoraLayout:
    """Give `model`'s adaptable projections their adapters' product (after quantization: the projection may be
    quantized); returns the pool they read, for mlcc-config.json."""
    targets = lora_targets(family, cfg, model)
    if not targets:
        raise UnsupportedConfigError(f"--option max_loras: {family.name} has no projection LoRA adapters can target")
    layout = LoraLayout(options.max_loras, options.max_lora_rank, dtype, tuple(targets))
    tokens = LoraTokens(layout)
    index = {t.name: i for i, t in enumerate(targets)}

    class _Wrap(nn.Mutator):
        def visit_module(self, name: str, node: nn.Module):
            if name in index:
                return LoraProjection(node, tokens, index[name])
            return self.visit(name, node)

    _Wrap().visit("", model)
    model.lora = tokens
    return layout
