"""Link a compiled WebGPU executable into a standalone .wasm with TVM's wasm runtime (emscripten)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mlcc.tvm_compat import environment

from .wasm_runtime import build_runtime, emcc_env

log = logging.getLogger(__name__)


def export_wasm(executable: Any, out_path: Path) -> None:
    from tvm.support import emcc

    home = build_runtime()

    def fcompile(output: str, objects: list[str], options: list[str] | None = None) -> None:
        # create_tvmjs_wasm finds the runtime (*.bc names) under $TVM_HOME/web/dist/wasm and runs emcc with os.environ
        with environment({**emcc_env(), "TVM_HOME": str(home)}):
            emcc.create_tvmjs_wasm(output, objects, options)

    # LLVM 22 bitcode does not link with Debian's wasm-ld 14; plain objects do.
    fcompile.object_format = "o"
    log.info("linking %s with emscripten ...", out_path.name)
    executable.export_library(str(out_path), fcompile=fcompile)
