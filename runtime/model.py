"""A compiled model loaded for execution: library + weights on a device, and the paged KV cache calls.

Only TVM's runtime is used here (works with TVM_USE_RUNTIME_LIB=1); nothing from mlcc.compiler is imported.
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from mlcc import artifact

from .token_fetch import CudaEvent, cuda_runtime

log = logging.getLogger(__name__)

_DEVICE_TYPES = {"cpu": 1, "cuda": 2, "rocm": 10, "metal": 8, "vulkan": 7, "webgpu": 15, "opencl": 4}


def _register_cuda_jit(arch: str) -> None:
    """Libraries cross-compiled on a GPU-less host carry CUDA source, compiled when loaded. TVM's own callback asks
    the current Target for the arch, which runtime-only mode cannot answer; we know it from the build."""
    import tvm_ffi
    from tvm.support import nvcc

    def compile_for_arch(code: str) -> bytes:
        mode = os.environ.get("TVM_CUDA_COMPILE_MODE", "nvrtc").lower()
        return nvcc.compile_cuda(code, target_format="cubin" if mode == "nvrtc" else "fatbin", arch=arch,
                                 compiler=mode)

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_for_arch, override=True)


def _load_backend_runtimes(device: str) -> None:
    """In runtime-only mode TVM skips loading its CUDA runtime library; do it by hand."""
    import tvm

    if device != "cuda" or hasattr(tvm, "relax"):
        return
    from tvm.base import _LOADED_LIBS
    from tvm_ffi.libinfo import load_lib_ctypes

    d = Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent
    if "tvm_runtime_cuda" not in _LOADED_LIBS:
        _LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes(package="tvm", target_name="tvm_runtime_cuda",
                                                           extra_lib_paths=[d], mode="RTLD_LOCAL")


# On unless MLCC_STEP_TAIL=0 (H200 A/B, session 9: 8B q4f16_1 +5.0%, q0f16 +2.5%): decode_graph records an event right after the step's last KV-cache
# read (the last layer's attention), so the pipelined loop may queue the next step's KV metadata while the rest of
# the step (last MLP, LM head, sampling) runs. id(model) -> (kv_cache, last layer id, CudaEvent, device)
_STEP_TAILS: dict[int, tuple] = {}


def _register_graph_attention() -> None:
    """The paged-attention call of decode_graph: TVM's builtin under a name RewriteCUDAGraph captures, plus the
    graph key it ignores. Python runs here only on a layout's first step and its capture; replays skip the host."""
    import tvm
    import tvm_ffi

    builtin = tvm.get_global_func("vm.builtin.attention_kv_cache_attention_with_fused_qkv")

    def attention(kv_cache, layer_id, sm_scale, qkv, _cache_id, _layout, out) -> None:
        builtin(kv_cache, layer_id, sm_scale, qkv, out)
        for kv, last, event, dev in list(_STEP_TAILS.values()):
            if layer_id == last and kv.same_as(kv_cache):
                event.record(tvm_ffi.get_raw_stream(dev), in_graph=True)  # every replay records it

    tvm_ffi.register_global_func(artifact.GRAPH_ATTENTION, attention, override=True)


def _random_param(spec: dict[str, Any], rng: np.random.Generator) -> np.ndarray:
    """Random values for speed runs: one random block tiled over the tensor (an 8B model in seconds)."""
    shape, dtype = spec["shape"], spec["dtype"]
    if "norm" in spec["name"]:
        return np.ones(shape, dtype=dtype)
    n = int(np.prod(shape))
    if dtype == "uint32":
        block = rng.integers(0, 1 << 32, size=min(n, 1 << 20), dtype=np.uint32)
    else:
        scale = 0.002 if spec["name"].endswith("q_scale") else 0.02
        block = (rng.standard_normal(min(n, 1 << 20), dtype=np.float32) * scale).astype(dtype)
    return np.resize(block, n).reshape(shape)


def load_params(folder: Path, specs: list[dict[str, Any]], dev, weights: str = "files", seed: int = 0) -> list:
    """Parameters in the VM's order onto `dev`: from the tensor cache in `folder`, or random for speed runs."""
    import tvm

    if weights == "random":
        import tvm_ffi

        rng = np.random.default_rng(seed)
        # one FFI Array, like the tensor-cache path: a Python list would be converted on every VM call
        return tvm_ffi.convert([tvm.runtime.tensor(_random_param(p, rng), dev) for p in specs])
    tvm.get_global_func("vm.builtin.tensor_cache.load")(str(folder), dev.dlpack_device_type(), dev.index)
    params = tvm.get_global_func("vm.builtin.param_array_from_cache_by_name")([p["name"] for p in specs])
    tvm.get_global_func("vm.builtin.tensor_cache.clear")()
    return params


class PagedModel:
    """The KV-cache calls and forward passes shared by LoadedModel (local VM functions) and TensorParallelModel
    (disco functions run on every worker). Subclasses say how ids, positions and logits move:
    _embed_shaped(ids, shape), _positions(int32 array), _logits(outputs, rows)."""

    # batch-1 decode as one CUDA graph (subclasses set it where the library has decode_graph); the lengths of the
    # sequences it may serve: one block of pages each (never forked), the case its graphs are keyed for
    _decode_graph = None
    _graph_seq_len: dict[int, int]
    _kv_cache_id = 0   # numbers each KV cache: a graph replays the addresses of the cache it was captured with

    def create_kv_cache(self, max_batch: int, max_total_tokens: int, prefill_chunk: int, page_size: int = 16):
        S = self._shape
        self.kv = self._f["create_paged_kv_cache"](S([max_batch]), S([max_total_tokens]), S([prefill_chunk]),
                                                   S([page_size]), S([0]))
        self.page_size, self.prefill_chunk, self.max_batch = page_size, prefill_chunk, max_batch
        self._graph_seq_len = {}
        self._kv_cache_id += 1
        return self.kv

    def add_sequence(self, seq_id: int) -> None:
        self._kv_add(self.kv, seq_id)
        self._graph_seq_len[seq_id] = 0

    def remove_sequence(self, seq_id: int) -> None:
        self._kv_remove(self.kv, seq_id)
        self._graph_seq_len.pop(seq_id, None)

    def fork_sequence(self, parent: int, child: int) -> None:
        self._kv_fork(self.kv, parent, child, -1)
        self._graph_seq_len.pop(parent, None)   # both now span more than one block of pages

    def popn(self, seq_id: int, n: int) -> None:
        self._kv_popn(self.kv, seq_id, n)
        if seq_id in self._graph_seq_len:
            self._graph_seq_len[seq_id] -= n

    def _grow(self, seq_ids: Sequence[int], lens: Sequence[int]) -> None:
        for s, n in zip(seq_ids, lens):
            if s in self._graph_seq_len:
                self._graph_seq_len[s] += n

    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int32)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab):
            # the compiled take() does no bounds check (TVM's fast mode); never let a bad id reach it
            raise ValueError(f"token id out of range [0, {self.vocab}): {int(arr.min())}..{int(arr.max())}")
        return arr

    def prefill(self, seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]]):
        """Ragged prefill of several sequences in one call; logits [len(seq_ids), vocab] of each last token."""
        lens = [len(t) for t in token_lists]
        flat = [t for ts in token_lists for t in ts]
        emb = self._embed_shaped(flat, [1, len(flat), self.hidden])
        self._kv_begin(self.kv, self._shape(list(seq_ids)), self._shape(lens))
        if len(seq_ids) == 1:
            out = self._f["prefill"](emb, self.kv, self.params)
        else:
            pos = self._positions(np.cumsum(lens).astype(np.int32) - 1)
            out = self._f["batch_prefill"](emb, pos, self.kv, self.params)
        self._kv_end(self.kv)
        self._grow(seq_ids, lens)
        return self._logits(out, len(seq_ids))

    def decode(self, seq_ids: Sequence[int], tokens: Sequence[int]):
        """One new token for each sequence; logits [len(seq_ids), vocab]."""
        n = len(seq_ids)
        self._kv_begin(self.kv, self._shape(list(seq_ids)), self._shape([1] * n))
        if n == 1 and self._decode_graph is not None and seq_ids[0] in self._graph_seq_len:
            out = self._graph_step(seq_ids[0], tokens[0])
        else:
            emb = self._embed_shaped(tokens, [n, 1, self.hidden])
            out = self._f["decode" if n == 1 else "batch_decode"](emb, self.kv, self.params)
        self._kv_end(self.kv)
        self._grow(seq_ids, [1] * n)
        return self._logits(out, n)


class LoadedModel(PagedModel):
    def __init__(self, model_dir: str | Path, device_id: int = 0, verify_checksums: bool = True,
                 weights: str = "files"):
        """weights="random" fills parameters with random values (speed benchmarks of shape-only builds)."""
        import tvm
        from tvm.runtime import ShapeTuple
        from tvm.runtime.vm import VirtualMachine

        self.dir = Path(model_dir)
        self.config = artifact.read_config(self.dir)
        self.device_kind = self.config["device"]
        if self.device_kind == "webgpu":
            raise artifact.ArtifactError(
                f"{self.dir} is a {self.config['target']} build (model.wasm): it runs in a browser or Node.js, not in "
                f"the Python engine; `mlcc web {self.dir} --output SITE` writes the page and node_chat.mjs")
        if verify_checksums and weights == "files":
            artifact.verify_shards(self.dir)
        _load_backend_runtimes(self.device_kind)
        if self.device_kind == "cuda" and self.config.get("cuda_arch"):
            _register_cuda_jit(self.config["cuda_arch"])
        self.dev = tvm.device(self.device_kind, device_id)
        if not self.dev.exist:
            raise artifact.ArtifactError(
                f"{self.dir} was compiled for {self.config['target']} but no {self.device_kind} device is present; "
                f"recompile with `mlcc compile SOURCE --target llvm --output DIR` to run on this CPU")
        lib_path = self.dir / self.config["library"]
        if not lib_path.exists():
            raise artifact.ArtifactError(f"{lib_path}: library is missing; recompile with `mlcc compile`")
        self.lib = tvm.runtime.load_module(str(lib_path))
        if self.device_kind == "cuda":
            _register_graph_attention()  # before the VM resolves the library's external calls
        self.vm = VirtualMachine(self.lib, self.dev)
        try:
            lib_stamp = json.loads(str(self.vm["_metadata"]()))
        except Exception as e:  # noqa: BLE001 - a foreign .so has no _metadata
            raise artifact.ArtifactError(f"{lib_path}: not an mlcc library (no ABI stamp); recompile with "
                                         "`mlcc compile`") from e
        artifact.check_stamp(lib_stamp, self.config, self.dir)
        self.stamp = lib_stamp

        self.params = load_params(self.dir, self.config["params"], self.dev, weights)
        self._shape = ShapeTuple
        self._f = {n: self.vm[n] for n in ("embed", "prefill", "decode", "batch_prefill", "batch_decode",
                                           "prefill_all_logits", "create_paged_kv_cache")}
        g = tvm.get_global_func
        self._kv_add = g("vm.builtin.kv_state_add_sequence")
        self._kv_remove = g("vm.builtin.kv_state_remove_sequence")
        self._kv_fork = g("vm.builtin.kv_state_fork_sequence")
        self._kv_popn = g("vm.builtin.kv_state_popn")
        self._kv_begin = g("vm.builtin.kv_state_begin_forward")
        self._kv_end = g("vm.builtin.kv_state_end_forward")
        self._kv_free_pages = g("vm.builtin.attention_kv_cache_get_num_available_pages")
        self._kv_total_len = g("vm.builtin.attention_kv_cache_get_total_sequence_length")
        self._reshape = g("vm.builtin.reshape")
        self._kv_sync = g("vm.builtin.attention_kv_cache_get_query_positions")
        if self.vm.module.implements_function(artifact.GRAPH_DECODE_FUNCTION) and \
                os.environ.get("MLCC_DECODE_GRAPH", "1") != "0":
            self._decode_graph = self.vm[artifact.GRAPH_DECODE_FUNCTION]
        self._tail_event = self.step_tail = None
        if self._decode_graph is not None and os.environ.get("MLCC_STEP_TAIL", "1") == "1":
            cuda = cuda_runtime()
            layers = self.config.get("model_config", {}).get("num_hidden_layers")
            if cuda is not None and layers:
                self._tail_event, self._last_layer = CudaEvent(cuda), int(layers) - 1
                weakref.finalize(self, _STEP_TAILS.pop, id(self), None)
        self.kv = None
        self._ids_buffers: dict = {}
        self.hidden = int(self.config["hidden_size"])
        self.vocab = int(self.config["vocab_size"])
        self.context_window = int(self.config["context_window_size"])

    def create_kv_cache(self, max_batch: int, max_total_tokens: int, prefill_chunk: int, page_size: int = 16):
        kv = super().create_kv_cache(max_batch, max_total_tokens, prefill_chunk, page_size)
        if self._tail_event is not None:  # before any graph of this cache is captured
            _STEP_TAILS[id(self)] = (kv, self._last_layer, self._tail_event, self.dev)
        return kv

    def free_pages(self) -> int:
        return int(self._kv_free_pages(self.kv))

    # -- forward -------------------------------------------------------------------------------------------------
    def _to_dev(self, a: np.ndarray):
        import tvm

        return tvm.runtime.tensor(a, self.dev)

    def _ids_to_dev(self, ids: np.ndarray):
        """A decode step's token ids go into a device buffer kept per length: a fresh allocation is a cudaMalloc,
        0.12 ms of every H200 decode step (bench/profile_decode.py). Only the embedding reads it, before the next
        call can overwrite it: TVM copies host→device on the stream its kernels run on and waits for the copy."""
        if ids.size > 256:
            return self._to_dev(ids)
        buf = self._ids_buffers.get(ids.size)
        if buf is None:
            import tvm

            buf = self._ids_buffers[ids.size] = tvm.runtime.empty(ids.shape, str(ids.dtype), self.dev)
        buf.copyfrom(ids)
        return buf

    def _graph_step(self, seq_id: int, token: int):
        """One decode_graph call: the id goes in, the embedding lookup and the step's graph run in the library."""
        return self._graph_call(seq_id, self.ids_to_device([token]))

    def _graph_call(self, seq_id: int, ids):
        """decode_graph for a step already begun (begin_forward) on `seq_id`, the id already on the device."""
        self._kv_sync(self.kv)  # the graph's kernels read the cache's metadata from the device: put this step's there
        layout = artifact.graph_decode_layout(self._graph_seq_len[seq_id] + 1, self.page_size)
        return self._decode_graph(ids, self._shape([self._kv_cache_id, layout]), self.kv, self.params)

    def decode_fed_back(self, seq_id: int, ids):
        """Batch-1 decode of a token id already on the device (the previous step's sampled id, never read back)."""
        self._kv_begin(self.kv, self._shape([seq_id]), self._shape([1]))
        # step_tail: the event recorded after this step's last KV-cache read, where it has one (decode_graph)
        if self._decode_graph is not None and seq_id in self._graph_seq_len:
            out, self.step_tail = self._graph_call(seq_id, ids), self._tail_event
        else:
            emb = self._reshape(self._f["embed"](ids, self.params), self._shape([1, 1, self.hidden]))
            out, self.step_tail = self._f["decode"](emb, self.kv, self.params), None
        self._kv_end(self.kv)
        self._grow([seq_id], [1])
        return self._logits(out, 1)

    def ids_to_device(self, ids: Sequence[int]):
        return self._ids_to_dev(self._check_ids(ids))

    def embed(self, ids: Sequence[int]):
        return self._f["embed"](self.ids_to_device(ids), self.params)

    def _embed_shaped(self, ids: Sequence[int], shape: list[int]):
        return self._reshape(self.embed(ids), self._shape(shape))

    def _positions(self, pos: np.ndarray):
        return self._to_dev(pos)

    def _logits(self, out, rows: int):
        """On the device: the sampler runs the compiled argmax/sampler on it."""
        return self._reshape(out[0], self._shape([rows, self.vocab]))

    def prefill_all_logits(self, seq_id: int, tokens: Sequence[int]):
        emb = self._embed_shaped(tokens, [1, len(tokens), self.hidden])
        self._kv_begin(self.kv, self._shape([seq_id]), self._shape([len(tokens)]))
        logits, _ = self._f["prefill_all_logits"](emb, self.kv, self.params)
        self._kv_end(self.kv)
        self._grow([seq_id], [len(tokens)])
        return logits

    def info(self) -> dict[str, Any]:
        return {"dir": str(self.dir), "target": self.config["target"], "quantization": self.config["quantization"],
                "stamp": self.stamp}
