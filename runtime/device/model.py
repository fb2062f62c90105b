"""A compiled model loaded for execution: library + weights on a device, and the paged KV cache calls.

Only TVM's runtime is used here (works with TVM_USE_RUNTIME_LIB=1); nothing from mlcc.compiler is imported.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from mlcc import artifact, tvm_compat
from mlcc.errors import RequestError
from mlcc.runtime.device.graph_decode import GraphDecode, register_graph_attention
from mlcc.runtime.device.interface import EmbedRows, KVCacheOps, ModelFunctions
from mlcc.runtime.device.token_fetch import UploadBuffer

log = logging.getLogger(__name__)


def _random_param(spec: dict[str, Any], rng: np.random.Generator) -> np.ndarray:
    """Random values for speed runs: one random block tiled over the tensor (an 8B model in seconds)."""
    shape, dtype = spec["shape"], spec["dtype"]
    if "norm" in spec["name"]:
        return np.ones(shape, dtype=dtype)
    n = int(np.prod(shape))
    if dtype == "uint32":
        block = rng.integers(0, 1 << 32, size=min(n, 1 << 20), dtype=np.uint32)
    elif dtype.startswith("float8"):
        import ml_dtypes

        # codes spread over the format's range, as a quantizer's per-channel scale makes them; the scale (q_scale,
        # 0.002) brings them back to the other weights' size
        block = (rng.standard_normal(min(n, 1 << 20), dtype=np.float32) * 16).astype(getattr(ml_dtypes, dtype))
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
    (disco functions run on every worker). Subclasses set fns, kv_ops, params, _shape, _reshape, hidden, vocab,
    context_window, device_kind, dev, argmax and sample, and say how ids, positions and logits move:
    _embed_shaped(ids, shape), _positions(int32 array), _logits(outputs, rows), to_device(array), _count(value),
    and, for the logit functions, _upload(name, array) (or _logit_function raising where they are not offered)."""

    fns: ModelFunctions
    kv_ops: KVCacheOps
    # device sampling as the Sampler calls it: argmax(logits) -> ids with .numpy(); sample(...) as
    # ModelFunctions.sample_top_p_top_k, or None where sampling runs on the host
    argmax: Callable | None = None
    sample: Callable | None = None
    graph: GraphDecode | None = None   # batch-1 decode as one CUDA graph, where the library has it
    lora: Any = None   # the adapter slots of a build serving LoRA adapters (runtime.device.lora.LoraPool)
    max_prefill_chunk: int = 0   # new tokens per sequence per forward (sliding-window models); 0: any
    kv: Any = None

    def create_kv_cache(self, max_batch: int, max_total_tokens: int, prefill_chunk: int, page_size: int = 16):
        S = self._shape
        self.kv = self.fns.create_paged_kv_cache(S([max_batch]), S([max_total_tokens]), S([prefill_chunk]),
                                                 S([page_size]), S([0]))
        self.page_size, self.prefill_chunk, self.max_batch = page_size, prefill_chunk, max_batch
        # each sequence's length in the cache: a pipelined decode's last step may have fed one token more than
        # its request counted (runtime.device.graph_decode)
        self.seq_lens: dict[int, int] = {}
        if self.graph is not None:
            self.graph.attach(self.kv, page_size)
        return self.kv

    @property
    def bidirectional_images(self) -> bool:
        """Whether an image's tokens are prefilled attending to each other both ways (prefill_image)."""
        return getattr(self.fns, "prefill_image", None) is not None

    @property
    def has_sliding_window(self) -> bool:
        return any(self.config.get("model_config", {}).get("layer_sliding") or [])

    def free_pages(self) -> int:
        return self._count(self.kv_ops.free_pages(self.kv))

    def add_sequence(self, seq_id: int) -> None:
        self.kv_ops.add_sequence(self.kv, seq_id)
        self.seq_lens[seq_id] = 0
        if self.graph is not None:
            self.graph.add(seq_id)

    def remove_sequence(self, seq_id: int) -> None:
        self.kv_ops.remove_sequence(self.kv, seq_id)
        self.seq_lens.pop(seq_id, None)
        if self.graph is not None:
            self.graph.forget(seq_id)

    def fork_sequence(self, parent: int, child: int, pos: int = -1) -> None:
        """`child` starts as a copy of `parent`'s first `pos` tokens (-1: all): full pages are shared, a partly
        filled last page is copied (TVM's ForkSequence)."""
        self.kv_ops.fork_sequence(self.kv, parent, child, pos)
        self.seq_lens[child] = self.seq_lens.get(parent, 0) if pos < 0 else pos
        if self.graph is not None:
            self.graph.forget(parent)

    def popn(self, seq_id: int, n: int) -> None:
        self.kv_ops.popn(self.kv, seq_id, n)
        self.seq_lens[seq_id] = self.seq_lens.get(seq_id, n) - n
        if self.graph is not None:
            self.graph.grow([seq_id], [-n])

    def _grow(self, seq_ids: Sequence[int], lens: Sequence[int]) -> None:
        for s, n in zip(seq_ids, lens):
            self.seq_lens[s] = self.seq_lens.get(s, 0) + n
        if self.graph is not None:
            self.graph.grow(seq_ids, lens)

    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int32)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab):
            # the compiled take() does no bounds check (TVM's fast mode); never let a bad id reach it
            raise ValueError(f"token id out of range [0, {self.vocab}): {int(arr.min())}..{int(arr.max())}")
        return arr

    def prefill(self, seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]],
                images: Sequence[EmbedRows | None] | None = None, bidirectional: bool = False):
        """Ragged prefill of several sequences in one call; logits [len(seq_ids), vocab] of each last token.
        images: per sequence, the encoder's rows that replace its image tokens' embeddings (or None).
        bidirectional: one sequence whose new tokens (an image's) attend to each other both ways (the library's
        prefill_image; at most max_prefill_chunk tokens).

        A model with sliding-window layers takes at most `max_prefill_chunk` new tokens of a sequence per forward
        (TVM's sliding attention is exact only then): longer lists go through in rounds."""
        limit = self.max_prefill_chunk
        if bidirectional:
            if len(seq_ids) != 1 or (limit and len(token_lists[0]) > limit) or self.fns.prefill_image is None:
                raise ValueError("a bidirectional prefill takes one sequence of at most max_prefill_chunk tokens, "
                                 "in a library with prefill_image")
            return self._prefill_once(seq_ids, token_lists, images, self.fns.prefill_image)
        if not limit or max(len(t) for t in token_lists) <= limit:
            return self._prefill_once(seq_ids, token_lists, images)
        rows: dict[int, Any] = {}
        for start in range(0, max(len(t) for t in token_lists), limit):
            live = [i for i, t in enumerate(token_lists) if len(t) > start]
            part = None if images is None else [
                images[i].window(start, start + limit) if images[i] is not None else None for i in live]
            out = self._prefill_once([seq_ids[i] for i in live], [token_lists[i][start:start + limit] for i in live],
                                     part)
            host = out.numpy() if len(live) < len(seq_ids) else None
            for row, i in enumerate(live):
                rows[i] = (out, row, host)
        if all(r[0] is rows[0][0] for r in rows.values()):
            return rows[0][0]  # every sequence ended in the last round
        return self.to_device(np.stack([r[2][r[1]] if r[2] is not None else r[0].numpy()[r[1]]
                                        for _, r in sorted(rows.items())]))

    def _prefill_once(self, seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]],
                      images: Sequence[EmbedRows | None] | None = None, single: Callable | None = None):
        lens = [len(t) for t in token_lists]
        flat = [t for ts in token_lists for t in ts]
        if images is not None and any(r is not None for r in images):
            emb = self._spliced_embeds(flat, lens, images)
        else:
            emb = self._embed_shaped(flat, [1, len(flat), self.hidden])
        self.kv_ops.begin_forward(self.kv, self._shape(list(seq_ids)), self._shape(lens))
        if len(seq_ids) == 1:
            out = (single or self.fns.prefill)(emb, self.kv, self.params)
        else:
            pos = self._positions(np.cumsum(lens).astype(np.int32) - 1)
            out = self.fns.batch_prefill(emb, pos, self.kv, self.params)
        self.kv_ops.end_forward(self.kv)
        self._grow(seq_ids, lens)
        return self._logits(out, len(seq_ids))

    def _spliced_embeds(self, flat: list[int], lens: list[int], images: Sequence[EmbedRows | None]):
        """The token embeddings with the image tokens' rows replaced by the encoder's (spliced on the host: one
        round trip per prefill that reads image tokens)."""
        starts = np.cumsum([0, *lens[:-1]])
        at = np.concatenate([r.offsets + s for r, s in zip(images, starts) if r is not None])
        ids = np.asarray(flat, dtype=np.int32)
        ids[at] = 0   # (an image token id may lie past the embedding table, as in transformers)
        host = self.embed(ids.tolist()).numpy().reshape(len(flat), self.hidden)
        host[at] = np.concatenate([r.rows for r in images if r is not None]).astype(host.dtype)
        return self._reshape(self.to_device(host), self._shape([1, len(flat), self.hidden]))

    def embed_images(self, pixels: np.ndarray) -> np.ndarray:
        """Preprocessed images float32 [n, channels, size, size] → the rows of their image tokens [n, tokens,
        hidden] on the host."""
        if self.fns.image_embed is None:
            raise RequestError(f"{self.dir} takes no images: its library has no image encoder", param="messages")
        dtype = self.config.get("model_dtype", "float32")
        return self.fns.image_embed(self.to_device(pixels.astype(dtype)), self.params).numpy()

    def decode(self, seq_ids: Sequence[int], tokens: Sequence[int]):
        """One new token for each sequence; logits [len(seq_ids), vocab]."""
        n = len(seq_ids)
        self.kv_ops.begin_forward(self.kv, self._shape(list(seq_ids)), self._shape([1] * n))
        if n == 1 and self.graph is not None and self.graph.serves(seq_ids[0]):
            out = self.graph(seq_ids[0], self.ids_to_device([tokens[0]]))
        else:
            emb = self._embed_shaped(tokens, [n, 1, self.hidden])
            out = (self.fns.decode if n == 1 else self.fns.batch_decode)(emb, self.kv, self.params)
        self.kv_ops.end_forward(self.kv)
        self._grow(seq_ids, [1] * n)
        return self._logits(out, n)

    def prefill_all(self, seq_id: int, ids: Sequence[int]):
        """Prefill of one sequence returning the logits of every position, [len(ids), vocab] (echo's prompt
        logprobs); at most the prefill chunk of tokens."""
        limit = self.max_prefill_chunk
        if limit and len(ids) > limit:  # sliding windows: in rounds, as prefill
            parts = [self.prefill_all(seq_id, ids[i:i + limit]).numpy() for i in range(0, len(ids), limit)]
            return self.to_device(np.concatenate(parts))
        n = len(ids)
        emb = self._embed_shaped(ids, [1, n, self.hidden])
        self.kv_ops.begin_forward(self.kv, self._shape([seq_id]), self._shape([n]))
        out = self.fns.batch_prefill(emb, self._positions(np.arange(n, dtype=np.int32)), self.kv, self.params)
        self.kv_ops.end_forward(self.kv)
        self._grow([seq_id], [n])
        return self._logits(out, n)

    def verify(self, seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]]):
        """One ragged forward over several sequences returning the logits of every new position,
        [sum of lengths, vocab] in order (speculative verification: runtime.spec.speculative); each list at most
        max_prefill_chunk long, all together at most the prefill chunk."""
        lens = [len(t) for t in token_lists]
        flat = [t for ts in token_lists for t in ts]
        emb = self._embed_shaped(flat, [1, len(flat), self.hidden])
        self.kv_ops.begin_forward(self.kv, self._shape(list(seq_ids)), self._shape(lens))
        out = self.fns.batch_prefill(emb, self._positions(np.arange(len(flat), dtype=np.int32)), self.kv,
                                     self.params)
        self.kv_ops.end_forward(self.kv)
        self._grow(seq_ids, lens)
        return self._logits(out, len(flat))

    # -- logit functions (compiler/sampler.attach_logit_functions), on the logits where they are -------------------
    @property
    def has_logit_functions(self) -> bool:
        return all(getattr(self.fns, name) is not None for name in ModelFunctions.LOGIT_FUNCTIONS)

    def require_logit_function(self, name: str, param: str) -> None:
        """Refuse a request (RequestError naming `param`) that needs a logit function this model lacks, before it
        is queued."""
        self._logit_function(name, param)

    def _logit_function(self, name: str, param: str) -> Callable:
        fn = getattr(self.fns, name)
        if fn is None:
            raise RequestError(f"'{param}' needs the library function {name}, which {self.dir} was built without "
                               "(an older mlcc); recompile the model with `mlcc compile` to use it", param=param)
        return fn

    def _upload(self, name: str, a: np.ndarray):
        """`a` in a device buffer kept per (name, shape), so a decode step allocates nothing."""
        raise NotImplementedError

    def mask_logits(self, logits, bitmask: np.ndarray):
        """-inf wherever bit v % 32 of word v // 32 of a row's mask is 0 (llguidance's layout); bitmask int32
        [rows, ceil(vocab / 32)]. Returns new logits."""
        fn = self._logit_function("apply_bitmask", "response_format")
        bitmask = np.ascontiguousarray(bitmask, dtype=np.int32)
        words = -(-self.vocab // 32)
        if bitmask.shape != (int(logits.shape[0]), words):
            raise ValueError(f"bitmask of shape {bitmask.shape}: need [{int(logits.shape[0])}, {words}] int32 words")
        return fn(logits, self._upload("bitmask", bitmask))

    def bias_logits(self, logits, rows: np.ndarray, token_ids: np.ndarray, bias: np.ndarray):
        """logits[rows[i], token_ids[i]] += bias[i]; repeated pairs add up. Returns new logits."""
        fn = self._logit_function("apply_logit_bias", "logit_bias")
        rows, token_ids = np.asarray(rows, dtype=np.int64).ravel(), np.asarray(token_ids, dtype=np.int64).ravel()
        bias = np.asarray(bias, dtype=np.float32).ravel()
        if not (rows.size == token_ids.size == bias.size) or rows.size == 0:
            raise ValueError(f"logit bias: rows, token_ids and bias need one equal, non-zero length "
                             f"(got {rows.size}, {token_ids.size}, {bias.size})")
        if token_ids.min() < 0 or token_ids.max() >= self.vocab or rows.min() < 0 or rows.max() >= logits.shape[0]:
            # the kernel writes where it is told: never let a bad index reach it
            raise ValueError(f"logit bias: token id out of range [0, {self.vocab}) or row out of range "
                             f"[0, {int(logits.shape[0])})")
        keys, where = np.unique(rows * self.vocab + token_ids, return_inverse=True)
        if keys.size < rows.size:  # the GPU kernel gives each pair one thread: repeated pairs would race
            bias = np.bincount(where, weights=bias).astype(np.float32)
        rows, token_ids = (keys // self.vocab).astype(np.int32), (keys % self.vocab).astype(np.int32)
        return fn(logits, self._upload("bias_rows", rows), self._upload("bias_ids", token_ids),
                  self._upload("bias", bias))

    def logprobs(self, logits, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Log-softmax of each row at ids[i], and the row's K most likely tokens (K = 20; descending, ties in
        index order, -inf for masked tokens): (f32[rows], int32[rows, K], f32[rows, K]). Only these cross to the
        host."""
        fn = self._logit_function("logprobs", "logprobs")
        out = fn(logits, self._upload("logprob_ids", self._check_ids(np.asarray(ids).ravel())))
        return out[0].numpy(), out[1].numpy(), out[2].numpy()


class LoadedModel(PagedModel):
    def __init__(self, model_dir: str | Path, device_id: int = 0, verify_checksums: bool = True,
                 weights: str = "files", num_threads: int | None = None):
        """weights="random" fills parameters with random values (speed benchmarks of shape-only builds).
        num_threads: CPU builds' thread count (runtime.device.cpu_threads: default, the usable physical cores)."""
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
        if weights == "files" and self.config.get("weights") == "none":
            raise artifact.ArtifactError(
                f"{self.dir} is a shape-only build: it has no weight files. For benchmarks, load it with random "
                "weights: `--weights random` (mlcc serve, mlcc bench throughput) or Engine(..., weights='random')")
        if verify_checksums and weights == "files":
            artifact.verify_shards(self.dir)
        tvm_compat.load_backend_runtimes(self.device_kind)
        if self.device_kind == "cpu":
            from mlcc.runtime.device.cpu_threads import configure_cpu_threads

            configure_cpu_threads(num_threads)
        if self.device_kind == "cuda" and self.config.get("cuda_arch"):
            tvm_compat.register_cuda_jit(self.config["cuda_arch"])
        self.dev = tvm.device(self.device_kind, device_id)
        if not self.dev.exist:
            raise artifact.ArtifactError(
                f"{self.dir} was compiled for {self.config['target']} but no {self.device_kind} device is present; "
                f"recompile with `mlcc compile SOURCE --target llvm --output DIR` to run on this CPU")
        lib_path = self.dir / self.config["library"]
        if not lib_path.exists():
            raise artifact.ArtifactError(f"{lib_path}: library is missing; recompile with `mlcc compile`")
        if self.device_kind == "cpu":
            artifact.check_cpu(self.config, self.dir)
        self.lib = tvm.runtime.load_module(str(lib_path))
        if self.device_kind == "cuda":
            register_graph_attention()  # before the VM resolves the library's external calls
            if artifact.built_options(self.config).vendor_gemm:
                from mlcc.runtime.device import cublaslt

                cublaslt.prepare_for(lib_path, device_id)  # the library calls mlcc.cublaslt.* by name
        self.vm = VirtualMachine(self.lib, self.dev)
        if not self.vm.module.implements_function("_metadata"):  # a foreign .so
            raise artifact.ArtifactError(f"{lib_path}: not an mlcc library (no ABI stamp); recompile with "
                                         "`mlcc compile`")
        self.fns = ModelFunctions.lookup(lambda n: self.vm[n], self.vm.module.implements_function, lib_path)
        lib_stamp = json.loads(str(self.fns.metadata()))
        artifact.check_stamp(lib_stamp, self.config, self.dir)
        self.stamp = lib_stamp

        self.params = load_params(self.dir, self.config["params"], self.dev, weights)
        self._shape = ShapeTuple
        self.kv_ops = KVCacheOps.lookup(tvm.get_global_func)
        if "lora" in self.config:   # its forward functions also take each token's adapter slot and the pool
            from mlcc.runtime.device.lora import LoraLayout, LoraPool

            self.lora = LoraPool(LoraLayout.from_config(self.config["lora"]), self.dev)
            self.fns, self.kv_ops = self.lora.wrap(self.fns, self.kv_ops, lambda name: self.vm[name])
        self._reshape = tvm.get_global_func("vm.builtin.reshape")
        self.argmax, self.sample = self.fns.argmax_logits, self.fns.sample_top_p_top_k
        if self.fns.decode_graph is not None:
            model_cfg = self.config.get("model_config", {})
            window = int(model_cfg.get("sliding_window") or 0) if any(model_cfg.get("layer_sliding") or []) else 0
            self.graph = GraphDecode(self.fns.decode_graph, self.kv_ops, ShapeTuple, self.params, self.dev,
                                     model_cfg.get("num_hidden_layers"), window)
        self._ids_buffers: dict = {}
        self._buffers: dict = {}
        self.hidden = int(self.config["hidden_size"])
        self.vocab = int(self.config["vocab_size"])
        self.context_window = int(self.config["context_window_size"])
        self.max_prefill_chunk = int(self.config.get("model_config", {}).get("max_prefill_chunk") or 0)

    def _count(self, value) -> int:
        return int(value)

    # -- forward -------------------------------------------------------------------------------------------------
    def to_device(self, a: np.ndarray):
        import tvm

        return tvm.runtime.tensor(a, self.dev)

    def _ids_to_dev(self, ids: np.ndarray):
        """A decode step's token ids go into a device buffer kept per length: a fresh allocation is a cudaMalloc,
        0.12 ms of every H200 decode step (bench/decode.py profile). Only the embedding reads it, before the next
        call can overwrite it: TVM copies host→device on the stream its kernels run on and waits for the copy."""
        if ids.size > 256:
            return self.to_device(ids)
        buf = self._ids_buffers.get(ids.size)
        if buf is None:
            import tvm

            buf = self._ids_buffers[ids.size] = tvm.runtime.empty(ids.shape, str(ids.dtype), self.dev)
        buf.copyfrom(ids)
        return buf

    def _upload(self, name: str, a: np.ndarray):
        """Into a buffer kept per (name, shape): the copy is queued behind the kernels that read its last contents
        (runtime.device.token_fetch.UploadBuffer: on CUDA without waiting for them)."""
        a = np.ascontiguousarray(a)
        key = (name, a.shape, str(a.dtype))
        buf = self._buffers.get(key)
        if buf is None:
            if len(self._buffers) >= 64:  # logit_bias lengths vary with the batch: keep only recent ones
                self._buffers.clear()
            buf = self._buffers[key] = UploadBuffer(self.dev, a.shape, str(a.dtype))
        return buf.upload(a)

    def ids_to_device(self, ids: Sequence[int]):
        return self._ids_to_dev(self._check_ids(ids))

    def decode_fed_back(self, seq_id: int, ids) -> tuple[Any, Any]:
        """Batch-1 decode of a token id already on the device (the previous step's sampled id, never read back).
        Returns (logits, step tail): the event recorded after this step's last KV-cache read where the step has
        one (decode_graph, runtime.device.graph_decode), else None."""
        self.kv_ops.begin_forward(self.kv, self._shape([seq_id]), self._shape([1]))
        if self.graph is not None and self.graph.serves(seq_id):
            out, tail = self.graph(seq_id, ids), self.graph.tail
        else:
            emb = self._reshape(self.fns.embed(ids, self.params), self._shape([1, 1, self.hidden]))
            out, tail = self.fns.decode(emb, self.kv, self.params), None
        self.kv_ops.end_forward(self.kv)
        self._grow([seq_id], [1])
        return self._logits(out, 1), tail

    def embed(self, ids: Sequence[int]):
        return self.fns.embed(self.ids_to_device(ids), self.params)

    def _embed_shaped(self, ids: Sequence[int], shape: list[int]):
        return self._reshape(self.embed(ids), self._shape(shape))

    def _positions(self, pos: np.ndarray):
        return self.to_device(pos)

    def _logits(self, out, rows: int):
        """On the device: the sampler runs the compiled argmax/sampler on it."""
        return self._reshape(out[0], self._shape([rows, self.vocab]))
