"""What the web tests share: the Node.js dependencies (a fixture), running node and headless Chromium on a built
site, and the CPU target's answer to compare with."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

JS = Path(__file__).resolve().parents[1] / "web" / "js"
PROMPT = "What is the capital of France?"


def missing_tools() -> list[str]:
    return [t for t in ("emcc", "node", "npm", "chromium") if shutil.which(t) is None]


@pytest.fixture(scope="module")
def node_path():
    missing = missing_tools()
    if missing:
        msg = f"web tools missing: {missing} (apt-get install emscripten npm chromium)"
        if os.environ.get("MLCC_REQUIRE_WEB") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    from mlcc.web.npm_deps import node_modules

    return str(node_modules())


def run_node(args: list[str], node_path: str, cwd: Path | None = None, timeout: int = 900,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "NODE_PATH": node_path, **(env or {})}
    return subprocess.run(["node", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def cpu_answer(model_dir: Path, max_tokens: int) -> tuple[str, int]:
    from mlcc.runtime.engine import Engine

    engine = Engine(model_dir)
    r = engine.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens,
                                       temperature=0)
    return r.choices[0].message.content, r.usage.completion_tokens


@contextlib.contextmanager
def serve(folder: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "-d",
                             str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/"
    finally:
        proc.terminate()
        proc.wait()


def in_node(site: Path, build: str, node_path: str, max_tokens: int, env: dict[str, str] | None = None,
            extra: tuple[str, ...] = ()) -> dict:
    where = f"models/{build}" if build else "."
    proc = run_node(["node_chat.mjs", where, "--prompt", PROMPT, "--max-tokens", str(max_tokens), "--json", *extra],
                    node_path, cwd=site, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def in_browser(site: Path, node_path: str, max_tokens: int, screenshot: Path | None = None,
               typed: bool = False, reload: bool = False) -> dict:
    with serve(site) as url:
        args = [str(JS / "browser_run.mjs"), url, "--prompt", PROMPT, "--max-tokens", str(max_tokens)]
        if screenshot:
            args += ["--screenshot", str(screenshot)]
        if typed:
            args.append("--typed")
        if reload:
            args.append("--reload")
        proc = run_node(args, node_path)
    out = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {"error": proc.stderr}
    assert proc.returncode == 0 and out["ok"], out
    return out
