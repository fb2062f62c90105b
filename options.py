"""Every compile-time choice of a build, in one value that travels with the library.

`CompileOptions` goes from `compile_model` down the pass pipeline to the kernel generators, is written into the
library's ABI stamp and into `mlcc-config.json`, and is part of the JIT cache key: a library built with other
options is never reused silently, and the runtime refuses one whose options differ from those it is asked for.
Options a target cannot use (PDL off Hopper, the CUDA kernels on a CPU) are kept as given and simply have no
effect there. Kept free of TVM so the runtime can read it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mlcc.errors import CompileOptionsError


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    # CUDA sm_90+: every kernel starts with programmatic dependent launch (it is queued while its predecessor drains)
    pdl: bool = True
    # CUDA, one GPU: batch-1 decode as one CUDA graph per step, the paged attention included
    decode_graph: bool = True
    # CUDA: mlcc's decode GEMV kernels for q4f16_1/float16 projections (False: dlight's GEMV rule)
    decode_gemv: bool = True
    # CUDA, with decode_gemv: the preceding RMSNorm and the SwiGLU folded into the GEMVs
    fuse_decode_gemv: bool = True
    # CUDA: split-KV paged decode attention (False: TVM's kernel)
    split_decode_attention: bool = True
    # split-KV attention: chunks each sequence's KV is split into (0: sized to fill the GPU)
    decode_attention_splits: int = 0
    # split-KV attention: most tokens a block scores per step (0: as many as its threads allow, up to 16)
    decode_attention_tokens: int = 0
    # CUDA: TVM's prefill attention rebuilt with a grid that fills the GPU
    wide_prefill_attention: bool = True
    # CUDA sm_80+: projections over several tokens (prefill, batched decode, speculative verify) of 2048 and wider
    # on mlcc's tensor-core GEMM (False: dlight's Matmul rule)
    prefill_gemm: bool = True
    # CUDA sm_80+: prefill self-attention on mlcc's tensor-core kernel (False: TVM's ragged prefill kernel)
    flash_prefill_attention: bool = True
    # CUDA: q4f16_1 projections over up to 8 tokens (speculative verify, a few streams) as one pass over the weights
    few_token_gemv: bool = True
    # CUDA: paged prefill attention of up to 32 query rows (a speculative verify's) on the split-KV kernel
    few_query_attention: bool = True

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            want = bool if f.type in ("bool", bool) else int
            if type(v) is not want:
                raise CompileOptionsError(f"compile option {f.name} must be {want.__name__}, got {v!r}")
            if want is int and v < 0:
                raise CompileOptionsError(f"compile option {f.name} must be >= 0, got {v}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "CompileOptions":
        d = dict(d or {})
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise CompileOptionsError(f"unknown compile option(s) {', '.join(unknown)}; known: {cls.names()}")
        return cls(**d)

    @classmethod
    def parse(cls, items: list[str] | None) -> "CompileOptions":
        """From `KEY=VALUE` strings (the CLI's `--option`): booleans as 1/0/true/false/on/off, integers as digits."""
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        d: dict[str, Any] = {}
        for item in items or []:
            key, sep, raw = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in kinds:
                raise CompileOptionsError(f"--option {item!r}: expected KEY=VALUE with KEY one of {cls.names()}")
            raw = raw.strip().lower()
            if kinds[key] in ("bool", bool):
                if raw not in _BOOLS:
                    raise CompileOptionsError(f"--option {item!r}: {key} takes 1/0, true/false or on/off")
                d[key] = _BOOLS[raw]
            else:
                if not raw.isdigit():
                    raise CompileOptionsError(f"--option {item!r}: {key} takes a non-negative integer")
                d[key] = int(raw)
        return cls(**d)

    def differences(self, other: "CompileOptions") -> dict[str, tuple[Any, Any]]:
        """{name: (self's value, other's value)} where they differ."""
        a, b = self.to_dict(), other.to_dict()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}

    def as_cli(self) -> str:
        """The `--option` flags that rebuild these options (empty for the defaults)."""
        return " ".join(f"--option {k}={int(v) if isinstance(v, bool) else v}"
                        for k, (v, _) in self.differences(CompileOptions()).items())

    @classmethod
    def names(cls) -> str:
        return ", ".join(f.name for f in dataclasses.fields(cls))


_BOOLS = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}
