"""LoRA adapters on the decoder's projections, several in one step (Punica's gathered low-rank products).

Each token of a step carries the pool slot of its request's adapter (-1: none), and a projection y = x W^T adds
(x A[slot]^T) B[slot]^T: A is the adapter's down-projection, B its up-projection with the adapter's scaling folded
in. The pool holds `max_loras` adapters of rank up to `max_rank`, smaller ranks padded with zeros. The pool is no
weight: the entry points that take adapters (DecoderForCausalLM's `*_lora` twins) take it as an input (A and B of
every adapted projection, in the order of mlcc/lora_format.py's LoraLayout.targets), filled at run time by
runtime/device/lora.py; the plain entry points leave the projections as they are.

HF keeps q/k/v and gate/up apart where the decoder fuses them: a fused projection's adapter holds one A per HF part
(`parts`) and each output row of B reads the rank slice of its own part's A.
"""

from __future__ import annotations

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from mlcc.lora_format import LoraLayout


class LoraTokens:
    """What one traced entry point gives the adapted projections: each token's adapter slot and the pool."""

    def __init__(self, layout: LoraLayout):
        self.layout = layout
        self.ids: Tensor | None = None
        self.pool: list[Tensor] = []

    def pool_spec(self) -> list[nn.spec.Tensor]:
        specs, n = [], self.layout
        for t in n.targets:
            a, b = t.pool_shapes(n.max_loras, n.max_rank)
            specs += [nn.spec.Tensor(a, n.dtype), nn.spec.Tensor(b, n.dtype)]
        return specs

    def bind(self, ids: Tensor | None, pool: list[Tensor] | None) -> None:
        self.ids, self.pool = ids, list(pool or [])


def _shrink(x: te.Tensor, ids: te.Tensor, a: te.Tensor) -> te.Tensor:
    """x [n, in] @ A[slot]^T per token and part → float32 [n, parts, rank]; zero for tokens without an adapter."""
    n, k = x.shape
    _, parts, rank, _ = a.shape
    i = te.reduce_axis((0, k), name="i")

    def value(t, p, r):
        slot = ids[t]
        prod = x[t, i].astype("float32") * a[tirx.max(slot, 0), p, r, i].astype("float32")
        return te.sum(tirx.if_then_else(slot >= 0, prod, tirx.const(0.0, "float32")), axis=i)

    return te.compute((n, parts, rank), value, name="lora_shrink")


def _expand(xa: te.Tensor, ids: te.Tensor, b: te.Tensor, bounds: tuple[int, ...]) -> te.Tensor:
    """xa [n, parts, rank] @ B[slot]^T → float32 [n, out]: output row o reads the rank slice of its part, the parts'
    first rows being `bounds`."""
    n, _, rank = xa.shape
    out = b.shape[1]
    r = te.reduce_axis((0, rank), name="r")

    def part(o):
        p = tirx.const(0, "int32")
        for start in bounds:
            p = p + (o >= start).astype("int32")
        return p

    return te.compute((n, out), lambda t, o: te.sum(
        xa[t, part(o), r] * b[tirx.max(ids[t], 0), o, r].astype("float32"), axis=r), name="lora_expand")


def lora_delta(x: Tensor, tokens: LoraTokens, index: int) -> Tensor:
    """The adapters' product for projection `index` of the pool, x [..., in] → [..., out] in x's dtype."""
    target = tokens.layout.targets[index]
    a, b = tokens.pool[2 * index], tokens.pool[2 * index + 1]
    lead = list(x.shape[:-1])
    flat = op.reshape(x, (-1, target.in_features))
    bounds, start = [], 0
    for _, rows in target.parts[:-1]:
        start += rows
        bounds.append(start)
    xa = op.tensor_expr_op(_shrink, "lora_shrink", [flat, tokens.ids, a])
    delta = op.tensor_expr_op(lambda xa, ids, b: _expand(xa, ids, b, tuple(bounds)), "lora_expand",
                              [xa, tokens.ids, b])
    if delta.dtype != x.dtype:
        delta = delta.astype(x.dtype)
    return op.reshape(delta, (*lead, target.out_features))


class LoraProjection(nn.Module):
    """A projection (plain or quantized) plus its adapters' product. It holds the projection's own parameters under
    their own names, so the weights of a build without LoRA fit it unchanged."""

    def __init__(self, base: nn.Module, tokens: LoraTokens, index: int):
        self._base = (base,)   # (in a tuple: not a submodule, whose parameters would be named base.*)
        for name, value in vars(base).items():
            if isinstance(value, nn.Parameter):
                setattr(self, name, value)
        self.tokens, self.index = tokens, index

    def forward(self, x: Tensor) -> Tensor:
        if self.tokens.ids is None:   # an entry point without adapters
            return self._base[0](x)
        return self._base[0](x) + lora_delta(x, self.tokens, self.index)

    def to(self, dtype: str | None = None) -> None:  # cast (or not) by the projection it wraps
        return None
