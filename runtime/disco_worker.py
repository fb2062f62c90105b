"""Entry point of a tensor-parallel worker process (TVM disco's ProcessSession): TVM's own disco worker, after
loading what mlcc's workers call: the NCCL collectives, the shard loader, CUDA's runtime-compile hook."""

from __future__ import annotations

import os


def main() -> None:
    import tvm

    from mlcc.runtime import nccl_ccl
    from mlcc.runtime.model import _load_backend_runtimes, _register_cuda_jit
    from mlcc.runtime.tensor_parallel import _load_shard_params

    _load_backend_runtimes("cuda")
    nccl_ccl.load()
    if os.environ.get("MLCC_CUDA_ARCH"):
        _register_cuda_jit(os.environ["MLCC_CUDA_ARCH"])
    tvm.register_global_func("mlcc.tp.load_params", _load_shard_params, override=True)
    from tvm.exec.disco_worker import main as disco_worker_main

    disco_worker_main()


if __name__ == "__main__":
    try:
        main()
    except (OSError, KeyboardInterrupt):
        pass
