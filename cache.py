"""Where mlcc keeps what it builds once and reuses: JIT-compiled models, the wasm runtime, npm packages, NCCL's
bridge, tuning databases. `MLCC_CACHE_DIR` moves all of it (default `~/.cache/mlcc`)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import filelock


def cache_root() -> Path:
    return Path(os.environ.get("MLCC_CACHE_DIR", Path.home() / ".cache" / "mlcc"))


def lock_dir() -> Path:
    """Where the cache's lock files live: this user's runtime directory, not the cache. flock keeps a lock file in
    place on release (waiters must share its inode), so next to the entries they would pile up as empty files."""
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return base / f"mlcc-locks-{uid}"


def cache_lock(entry: Path) -> filelock.FileLock:
    """Held while a cache entry is built: two servers, or two test processes, starting together build it once. The
    lock is named by the entry's absolute path, so processes on this machine sharing a cache share its lock."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    locks = lock_dir()
    locks.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = hashlib.sha256(str(entry.resolve()).encode()).hexdigest()[:24]
    return filelock.FileLock(locks / f"{entry.name[:80]}-{key}.lock")
