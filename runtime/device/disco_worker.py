"""Entry point of a tensor-parallel worker process (TVM disco's ProcessSession): TVM's own disco worker, after
loading the NCCL collectives and registering the functions mlcc's controller calls on every worker."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from mlcc import artifact

_LOAD_LOCK = threading.Lock()   # TVM's tensor cache is one per process (worker 0 shares the controller's)


def load_shard_params(model_dir: str, specs_json: str, weights: str):
    """Runs on each disco worker (registered as mlcc.tp.load_params): this rank's parameters onto this rank's
    GPU."""
    import tvm

    from mlcc.runtime.device.model import load_params

    rank = int(tvm.get_global_func("runtime.disco.worker_id")()[0])  # a Shape([id])
    with _LOAD_LOCK:
        return load_params(Path(model_dir) / artifact.shard_dir(rank), json.loads(specs_json), tvm.cuda(rank),
                           weights, seed=rank)


def register_worker_functions() -> None:
    """mlcc.tp.load_params (this rank's weights), mlcc.tp.register_cuda_jit(arch) (CUDA source in the library
    compiled at load for the arch recorded at build time) and mlcc.tp.prepare_cublaslt(library), in this process; the controller calls them on all
    workers through the session."""
    import tvm

    from mlcc import tvm_compat

    tvm.register_global_func("mlcc.tp.load_params", load_shard_params, override=True)
    tvm.register_global_func("mlcc.tp.register_cuda_jit", tvm_compat.register_cuda_jit, override=True)
    tvm.register_global_func("mlcc.tp.prepare_cublaslt", prepare_cublaslt, override=True)


def prepare_cublaslt(library: str) -> None:
    """Runs on each disco worker before the library loads: the cuBLASLt shim for this rank's GPU where the library
    calls it (runtime.device.cublaslt)."""
    import tvm

    from mlcc.runtime.device import cublaslt

    cublaslt.prepare_for(Path(library), int(tvm.get_global_func("runtime.disco.worker_id")()[0]))


def main() -> None:
    from mlcc import tvm_compat
    from mlcc.runtime.device import nccl_ccl

    tvm_compat.load_backend_runtimes("cuda")
    nccl_ccl.load()
    register_worker_functions()
    from tvm.exec.disco_worker import main as disco_worker_main

    disco_worker_main()


if __name__ == "__main__":
    try:
        main()
    except (OSError, KeyboardInterrupt):
        pass
