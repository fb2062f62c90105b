"""The compiled model as the runtime sees it: the library's functions and TVM's KV-cache builtins, each looked up
once by name into a typed record. The single-device loader (runtime.device.model) and the tensor-parallel one
(runtime.device.tensor_parallel) both build these, from a local VM or from disco's worker functions.

The function names are the contract of docs/ARCHITECTURE.md: relax_models' export spec, the sampling functions
compiler/sampler.py adds (`argmax_logits`, `sample_top_p_top_k`, and the logit functions `apply_bitmask`,
`apply_logit_bias`, `logprobs`), `_metadata` (the ABI stamp) and, in single-GPU CUDA libraries,
compiler/graph_decode.py's `decode_graph`. Libraries built before the logit functions existed lack them; the runtime
then refuses the request fields that need them (runtime.device.model).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mlcc import artifact
from mlcc.errors import ArtifactError

Function = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class EmbedRows:
    """Rows that replace the token embeddings at `offsets` (ascending) of one sequence's token list: an image's
    rows from image_embed in place of its image tokens'."""

    offsets: np.ndarray   # int [k]
    rows: np.ndarray      # [k, hidden]

    def window(self, start: int, stop: int) -> EmbedRows | None:
        """The rows of tokens start..stop, offsets from start; None where there are none."""
        keep = (self.offsets >= start) & (self.offsets < stop)
        return EmbedRows(self.offsets[keep] - start, self.rows[keep]) if keep.any() else None


@dataclasses.dataclass(frozen=True)
class ModelFunctions:
    """A library's entry points. Shapes are per call; `params` is the weights array, `kv` the paged KV cache."""

    metadata: Function               # () -> JSON string: the ABI stamp
    embed: Function                  # (ids int32[n], params) -> [n, hidden]
    prefill: Function                # (embeds [1, n, hidden], kv, params) -> (logits [1, 1, vocab], kv)
    decode: Function                 # (embeds [1, 1, hidden], kv, params) -> (logits [1, 1, vocab], kv)
    batch_prefill: Function          # (embeds [1, n, hidden], last positions int32[b], kv, params) -> (logits [1, b, vocab], kv)
    batch_decode: Function           # (embeds [b, 1, hidden], kv, params) -> (logits [b, 1, vocab], kv)
    create_paged_kv_cache: Function  # (max_batch, max_total_len, prefill_chunk, page_size, sliding window) -> kv
    argmax_logits: Function          # (logits [b, vocab]) -> int32[b]
    # (logits [b, vocab], temperature, top_p, top_k, uniform, rows: all [b]) -> int32[b]; absent in WebGPU builds
    sample_top_p_top_k: Function | None = None
    # (ids int32[1], (KV cache id, metadata layout), kv, params) -> (logits, kv): batch-1 decode as one CUDA graph
    decode_graph: Function | None = None
    # the logit functions (compiler/sampler.attach_logit_functions), absent from older libraries:
    # (logits [b, vocab], bitmask int32 [b, ceil(vocab / 32)]) -> logits, -inf where a token's bit is 0
    apply_bitmask: Function | None = None
    # (logits [b, vocab], rows int32[m], token ids int32[m], bias f32[m]) -> logits with the bias added (pairs unique)
    apply_logit_bias: Function | None = None
    # (logits [b, vocab], ids int32[b]) -> (logprob of ids f32[b], top ids int32[b, K], top logprobs f32[b, K])
    logprobs: Function | None = None
    # (pixel_values [images, channels, size, size], params) -> [images, tokens per image, hidden]: vision-language
    # models only
    image_embed: Function | None = None
    # as prefill, its tokens (one image's) attending to each other both ways: Gemma 3's CPU builds
    prefill_image: Function | None = None

    OPTIONAL = frozenset({"sample_top_p_top_k", "decode_graph", "apply_bitmask", "apply_logit_bias", "logprobs",
                          "image_embed", "prefill_image"})
    LOGIT_FUNCTIONS = ("apply_bitmask", "apply_logit_bias", "logprobs")

    @classmethod
    def lookup(cls, get: Callable[[str], Function], has: Callable[[str], bool], where: Path) -> "ModelFunctions":
        """get(name) -> the function; has(name) -> whether the library defines it."""
        lib_names = {"metadata": "_metadata", "decode_graph": artifact.GRAPH_DECODE_FUNCTION}
        names = {f.name: lib_names.get(f.name, f.name) for f in dataclasses.fields(cls)}
        missing = [lib for field, lib in names.items() if field not in cls.OPTIONAL and not has(lib)]
        if missing:
            raise ArtifactError(f"{where}: the library lacks {', '.join(missing)}: not an mlcc library of this "
                                "version; recompile with `mlcc compile`")
        return cls(**{field: get(lib) if has(lib) else None for field, lib in names.items()})


@dataclasses.dataclass(frozen=True)
class KVCacheOps:
    """TVM's builtins on a paged KV cache (`kv` first in every call)."""

    add_sequence: Function           # (kv, seq_id)
    remove_sequence: Function        # (kv, seq_id)
    fork_sequence: Function          # (kv, parent, child, fork position or -1 for the end)
    popn: Function                   # (kv, seq_id, n)
    begin_forward: Function          # (kv, seq ids, appended lengths): a step's metadata
    end_forward: Function            # (kv)
    free_pages: Function             # (kv) -> pages not held by any sequence
    query_positions: Function        # (kv) -> positions; copies this step's metadata to the device as a side effect

    _BUILTINS = {"add_sequence": "vm.builtin.kv_state_add_sequence",
                 "remove_sequence": "vm.builtin.kv_state_remove_sequence",
                 "fork_sequence": "vm.builtin.kv_state_fork_sequence",
                 "popn": "vm.builtin.kv_state_popn",
                 "begin_forward": "vm.builtin.kv_state_begin_forward",
                 "end_forward": "vm.builtin.kv_state_end_forward",
                 "free_pages": "vm.builtin.attention_kv_cache_get_num_available_pages",
                 "query_positions": "vm.builtin.attention_kv_cache_get_query_positions"}

    @classmethod
    def lookup(cls, get_global: Callable[[str], Function]) -> "KVCacheOps":
        return cls(**{field: get_global(name) for field, name in cls._BUILTINS.items()})
