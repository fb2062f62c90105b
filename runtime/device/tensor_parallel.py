"""A tensor-parallel model: N GPUs of one host driven through TVM disco (worker processes) with NCCL all-reduce.
It offers the subset of LoadedModel's interface the Engine and scheduler use (runtime.device.model.PagedModel), so
`Engine(..., tensor_parallel=N)` runs unchanged on top. Greedy ids come from a compiled argmax on the workers; other
sampling reads worker 0's logits on the host."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from mlcc import artifact, tvm_compat
from mlcc.errors import RequestError
from mlcc.runtime.device.interface import KVCacheOps, ModelFunctions
from mlcc.runtime.device.model import PagedModel

log = logging.getLogger(__name__)

# NVLink multicast stays off: on shared hosts a program using it can take the GPUs out of service (device notes)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class _WorkerLogits:
    """Logits left on the workers (every rank holds the same all-reduced values); copied from worker 0 to the
    host only when someone asks (.numpy()), so greedy decoding moves just the token ids."""

    def __init__(self, model: "TensorParallelModel", dref, rows: int):
        self.model, self.dref, self.shape = model, dref, (rows, model.vocab)

    def numpy(self) -> np.ndarray:
        import tvm

        host = tvm.runtime.empty(self.shape, "float32", tvm.cpu())
        self.model.sess.copy_from_worker_0(host, self.dref)
        self.model.sess.sync_worker_0()
        return host.numpy()


class _Ids:
    def __init__(self, ids: np.ndarray):
        self._ids = ids

    def numpy(self) -> np.ndarray:
        return self._ids


class TensorParallelModel(PagedModel):
    def __init__(self, model_dir: str | Path, verify_checksums: bool = True, weights: str = "files"):
        import tvm
        from tvm.runtime import ShapeTuple

        from mlcc.runtime.device import nccl_ccl

        self.dir = Path(model_dir)
        self.config = artifact.read_config(self.dir)
        self.shards = int(self.config.get("tensor_parallel", 1))
        if self.config["device"] != "cuda":
            raise artifact.ArtifactError(f"{self.dir}: tensor parallelism runs on CUDA GPUs; this build is for "
                                         f"{self.config['target']}")
        if self.shards < 2:
            raise artifact.ArtifactError(f"{self.dir} was compiled for one GPU; recompile with "
                                         "`mlcc compile ... --tensor-parallel N` to shard it")
        tvm_compat.load_backend_runtimes("cuda")
        n_gpus = sum(1 for i in range(16) if tvm.cuda(i).exist)
        if n_gpus < self.shards:
            raise artifact.ArtifactError(f"{self.dir} is sharded over {self.shards} GPUs but this machine has "
                                         f"{n_gpus}; recompile with --tensor-parallel {max(n_gpus, 1)}")
        if verify_checksums and weights == "files":
            for rank in range(self.shards):
                artifact.verify_shards(self.dir / artifact.shard_dir(rank))
        for k, v in NCCL_ENV.items():
            os.environ.setdefault(k, v)
        nccl_ccl.load()
        from tvm.runtime import disco  # after nccl_ccl.load(): it needs libtvm_runtime_extra

        from mlcc.runtime.device.disco_worker import register_worker_functions

        register_worker_functions()   # worker 0 runs in this process

        # Worker processes, not threads: TVM captures CUDA graphs in global mode, which forbids the other threads'
        # CUDA calls while one worker captures.
        self.sess = disco.ProcessSession(num_workers=self.shards, entrypoint="mlcc.runtime.device.disco_worker")
        if self.config.get("cuda_arch"):  # before the library is loaded: its CUDA source is compiled at load
            self.sess.get_global_func("mlcc.tp.register_cuda_jit")(self.config["cuda_arch"])
        self.sess.init_ccl("nccl", *range(self.shards))
        self.sess.get_global_func("mlcc.tp.prepare_cublaslt")(str(self.dir / self.config["library"]))
        self.mod = self.sess.load_vm_module(str(self.dir / self.config["library"]))
        # the library was built for this job: every function the spec lists is there (a missing one fails on call);
        # the logit functions are not offered yet (their results would have to be gathered from worker 0)
        unused = {artifact.GRAPH_DECODE_FUNCTION, *ModelFunctions.LOGIT_FUNCTIONS}
        self.fns = ModelFunctions.lookup(lambda n: self.mod[n], lambda n: n not in unused, self.dir)
        lib_stamp = json.loads(str(self._from_worker0(self.fns.metadata())))
        artifact.check_stamp(lib_stamp, self.config, self.dir)
        self.stamp = lib_stamp
        self.params = self.sess.get_global_func("mlcc.tp.load_params")(
            str(self.dir), json.dumps(self.config["params"]), weights)
        self._shape = ShapeTuple
        self.kv_ops = KVCacheOps.lookup(self.sess.get_global_func)
        self._reshape = self.sess.get_global_func("vm.builtin.reshape")
        self._getitem = self.sess.get_global_func("vm.builtin.tuple_getitem")
        self.argmax = self._argmax_on_workers   # the compiled top-p sampler is not offered: it samples on the host
        self.device_kind = "cuda"
        self.dev = tvm.cuda(0)
        self.hidden = int(self.config["hidden_size"])
        self.vocab = int(self.config["vocab_size"])
        self.context_window = int(self.config["context_window_size"])
        self.max_prefill_chunk = int(self.config.get("model_config", {}).get("max_prefill_chunk") or 0)
        log.info("tensor-parallel model on %d GPUs (disco + NCCL): %s", self.shards, self.dir)

    def _count(self, value) -> int:
        return int(self._from_worker0(value))

    def _logit_function(self, name: str, param: str):
        raise RequestError(f"'{param}' is not supported with tensor parallelism yet; run the model on one GPU "
                           "(compile without --tensor-parallel) to use it", param=param)

    @staticmethod
    def _from_worker0(dref):
        """A small value held by worker 0. (Called through the FFI: in runtime-only TVM the DRef Python class
        is not bound, because libtvm_runtime_extra is loaded after tvm.runtime.disco is imported.)"""
        from tvm.runtime.disco import _ffi_api

        return _ffi_api.DRefDebugGetFromRemote(dref, 0)

    # -- forward -------------------------------------------------------------------------------------------------
    def to_device(self, a: np.ndarray):
        """Host tensors: with several workers, sampling happens on the host."""
        import tvm

        return tvm.runtime.tensor(np.asarray(a), tvm.cpu())

    def _embed_shaped(self, ids: Sequence[int], shape: list[int]):
        ids_ref = self.sess.broadcast(self._check_ids(ids))
        return self._reshape(self.fns.embed(ids_ref, self.params), self._shape(shape))

    def _positions(self, pos: np.ndarray):
        return self.sess.broadcast(pos)

    def _logits(self, out, rows: int) -> _WorkerLogits:
        return _WorkerLogits(self, self._reshape(self._getitem(out, 0), self._shape([rows, self.vocab])), rows)

    def _argmax_on_workers(self, logits) -> _Ids:
        """Greedy ids: computed on the workers, only int32[rows] crosses to the host."""
        import tvm

        if not isinstance(logits, _WorkerLogits):  # rows already brought to the host
            return _Ids(np.asarray(logits.numpy()).argmax(axis=-1).astype(np.int32))
        ids = self.fns.argmax_logits(logits.dref)
        host = tvm.runtime.empty((logits.shape[0],), "int32", tvm.cpu())
        self.sess.copy_from_worker_0(host, ids)
        self.sess.sync_worker_0()
        return _Ids(host.numpy())
