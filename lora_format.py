"""The adapter pool of a build serving LoRA adapters (CompileOptions.max_loras): its size and the projections
adapters may target, shared by the compiler (relax_models/lora.py builds the pool's inputs from it, compiler/lora.py
writes it into mlcc-config.json's "lora") and the runtime (runtime/device/lora.py maps adapters onto it).
Kept free of TVM."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class LoraTarget:
    """An adaptable projection: our module name, its input width, and the HF modules whose outputs it fuses, with
    their widths (HF name, rows), in output order. scale: what the weight loader multiplied the projection by
    (Granite's residual multiplier), which the adapter's product needs too."""

    name: str
    in_features: int
    parts: tuple[tuple[str, int], ...]
    scale: float = 1.0

    @property
    def out_features(self) -> int:
        return sum(rows for _, rows in self.parts)

    def pool_shapes(self, max_loras: int, max_rank: int) -> tuple[list[int], list[int]]:
        """A [adapters, parts, rank, in] and B [adapters, out, rank]: each part has a rank slice of its own."""
        return [max_loras, len(self.parts), max_rank, self.in_features], [max_loras, self.out_features, max_rank]


@dataclasses.dataclass(frozen=True)
class LoraLayout:
    """The pool: max_loras adapters of rank up to max_rank in `dtype`, one A and one B per target, in this order."""

    max_loras: int
    max_rank: int
    dtype: str
    targets: tuple[LoraTarget, ...]

    def to_config(self) -> dict[str, Any]:
        return {"max_loras": self.max_loras, "max_rank": self.max_rank, "dtype": self.dtype,
                "targets": [{"name": t.name, "in": t.in_features, "parts": [list(p) for p in t.parts],
                             "scale": t.scale} for t in self.targets]}

    @classmethod
    def from_config(cls, d: dict[str, Any]) -> LoraLayout:
        targets = tuple(LoraTarget(t["name"], int(t["in"]), tuple((str(m), int(r)) for m, r in t["parts"]),
                                   float(t.get("scale", 1.0))) for t in d["targets"])
        return cls(int(d["max_loras"]), int(d["max_rank"]), str(d["dtype"]), targets)

    def modules(self) -> dict[str, tuple[int, int]]:
        """HF module name → (target index, part index)."""
        return {m: (i, p) for i, t in enumerate(self.targets) for p, (m, _) in enumerate(t.parts)}

    def module_kinds(self) -> list[str]:
        """The adaptable modules' short names (q_proj, ...), in order."""
        return list(dict.fromkeys(m.rsplit(".", 1)[-1] for t in self.targets for m, _ in t.parts))
