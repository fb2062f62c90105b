"""Where mlcc keeps what it builds once and reuses: JIT-compiled models, the wasm runtime, npm packages, NCCL's
bridge, tuning databases. `MLCC_CACHE_DIR` moves all of it (default `~/.cache/mlcc`)."""

from __future__ import annotations

import os
from pathlib import Path

import filelock


def cache_root() -> Path:
    return Path(os.environ.get("MLCC_CACHE_DIR", Path.home() / ".cache" / "mlcc"))


def cache_lock(entry: Path) -> filelock.FileLock:
    """Held while a cache entry is built: two servers, or two test processes, starting together build it once."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    return filelock.FileLock(f"{entry}.lock")
