"""mlcc: a multi-target LLM compiler and runtime built on Apache TVM.

    from mlcc import Engine
    engine = Engine()                     # the bundled SmolLM2-135M-Instruct, compiled for this machine on first use
    engine.chat.completions.create(messages=[{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The engine pulls in TVM and the openai types: import it on first use, so `import mlcc` (and the artifact format,
# which reads __version__) stays light.
_LAZY = {"Engine": "mlcc.runtime.engine", "AsyncEngine": "mlcc.runtime.engine", "CompileOptions": "mlcc.options",
         "compile_model": "mlcc.compiler.build"}

if TYPE_CHECKING:
    from mlcc.compiler.build import compile_model
    from mlcc.options import CompileOptions
    from mlcc.runtime.engine import AsyncEngine, Engine

__all__ = ["AsyncEngine", "CompileOptions", "Engine", "__version__", "compile_model", "errors"]


def __getattr__(name: str) -> Any:
    if name == "errors":
        import importlib

        return importlib.import_module("mlcc.errors")
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mlcc' has no attribute {name!r}")
