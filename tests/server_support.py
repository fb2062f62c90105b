"""`mlcc serve` as a real process for the server tests: started on a free port, waited for, stopped, its log
checked for crashes."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from mlcc.runtime.serve.loadgen import wait_until_healthy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlcc_serve(model: Path, log: Path, *args: str) -> Iterator[str]:
    """Serves `model` on the CPU (extra command-line args after it) and yields its base URL; afterwards the log
    must hold no traceback: nothing crashed on the way."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlcc", "serve", str(model), "--target", "llvm", "--port", str(port), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_until_healthy(base, proc)
        except RuntimeError as e:
            proc.kill()
            raise RuntimeError(log.read_text()) from e
        try:
            yield base
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Whether `predicate` came true within `timeout` seconds (polled every 50 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False
