"""speculative_config: vLLM's names, validated with pydantic; unknown keys and bad values are a
SpeculativeConfigError naming the key.

    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft", "model": "<artifacts folder | HF folder | .gguf>", "num_speculative_tokens": 4}

As in vLLM: with only one of prompt_lookup_min/max given the other equals it, with neither both are 5; a config
with `model` and no method is a draft model ("draft_model" is vLLM's spelling of "draft").
disable_by_batch_size: requests do not speculate while more than this many decode together (a batch already
reads the weights once for several tokens). quantization: the draft's, where it is compiled on first use.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mlcc.errors import SpeculativeConfigError

MAX_SPECULATIVE_TOKENS = 16


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, protected_namespaces=())

    method: Literal["ngram", "draft", "draft_model"] | None = None
    num_speculative_tokens: int = Field(ge=1, le=MAX_SPECULATIVE_TOKENS)
    prompt_lookup_max: int | None = Field(default=None, ge=1)
    prompt_lookup_min: int | None = Field(default=None, ge=1)
    model: str | None = None
    quantization: str | None = None
    disable_by_batch_size: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> "SpeculativeConfig":
        method = self.method or ("draft" if self.model else None)
        if method is None:
            raise ValueError("give 'method': 'ngram' or 'draft' (with 'model')")
        if method == "draft_model":
            method = "draft"
        object.__setattr__(self, "method", method)
        if method == "draft":
            if not self.model:
                raise ValueError("method 'draft' needs 'model': the draft's artifacts folder, HF folder or .gguf")
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ValueError("prompt_lookup_min/max are n-gram settings; method 'draft' takes none")
            return self
        if self.model is not None or self.quantization is not None:
            raise ValueError("method 'ngram' takes no 'model' or 'quantization'")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
        if lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) is larger than prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        return self


def parse_speculative_config(value: "SpeculativeConfig | dict[str, Any] | str | None") -> SpeculativeConfig | None:
    """A dict, its JSON text (the --speculative-config flag) or a SpeculativeConfig; None: no speculation."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise SpeculativeConfigError(f"speculative_config is not valid JSON ({e}); e.g. "
                                         '\'{"method": "ngram", "num_speculative_tokens": 5}\'') from e
    if not isinstance(value, dict):
        raise SpeculativeConfigError(f"speculative_config must be an object, not {type(value).__name__}")
    unknown = sorted(set(value) - set(SpeculativeConfig.model_fields))
    if unknown:   # before any other problem: a misspelt key is the likeliest one
        raise SpeculativeConfigError(f"speculative_config has unknown key '{unknown[0]}'; it takes "
                                     f"{', '.join(SpeculativeConfig.model_fields)}")
    try:
        return SpeculativeConfig(**value)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err.get("loc", ()))
        msg = err["msg"].removeprefix("Value error, ")
        raise SpeculativeConfigError(f"speculative_config{'.' + key if key else ''}: {msg}") from None
