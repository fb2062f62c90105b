"""A stand-in for the Hugging Face Hub: the HTTP endpoints huggingface_hub 2.x calls to download a model, serving
repos from local folders, for tests that point HF_ENDPOINT at it (never the internet).

What huggingface_hub asks (hf_api.py, file_download.py, _snapshot_download.py):
- `GET /api/models/{repo}/revision/{rev}`: the repo's info (`sha`, `siblings`), by model_info / repo_info;
- `GET /api/models/{repo}/tree/{rev}?recursive=True`: the file listing (`type`, `path`, `size`, `oid`), one page
  (no `Link` header: no next page);
- `HEAD` then `GET /{repo}/resolve/{rev}/{path}`: a file, whose HEAD must carry `X-Repo-Commit`, an `ETag` and the
  size (no `X-Xet-Hash`: a plain HTTP download).
Errors as the Hub sends them: 404 with `X-Error-Code: RepoNotFound` or `EntryNotFound`, 403 `GatedRepo`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class FakeHub:
    """repos: {"org/name": folder}; gated: repo ids answered 403 GatedRepo. `downloads` lists the files GET (repo,
    path) in order; `url` is what HF_ENDPOINT takes."""

    def __init__(self, repos: dict[str, Path], gated: frozenset[str] = frozenset()):
        self.repos = repos
        self.gated = gated
        self.downloads: list[tuple[str, str]] = []
        self.url = ""

    def sha(self, repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    def files(self, repo: str) -> list[Path]:
        root = self.repos[repo]
        return sorted(p for p in root.rglob("*") if p.is_file())


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:   # quiet: pytest shows the test's own output
            pass

        def _error(self, status: int, code: str) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", "application/json")
            body = json.dumps({"error": code}).encode()
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, data, repo: str) -> None:
            body = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("X-Repo-Commit", hub.sha(repo))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _repo(self, parts: list[str]) -> str | None:
            """The repo of the request, having answered the error where it is unknown or gated."""
            repo = "/".join(parts[:2])
            if repo in hub.gated:
                self._error(403, "GatedRepo")
                return None
            if repo not in hub.repos:
                self._error(404, "RepoNotFound")
                return None
            return repo

        def _serve(self) -> None:
            parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
            if parts[:2] == ["api", "models"]:
                repo = self._repo(parts[2:])
                if repo is None:
                    return
                rest = parts[4:]
                root = hub.repos[repo]
                if not rest or rest[0] == "revision":
                    self._json({"id": repo, "sha": hub.sha(repo), "private": False, "gated": False,
                                "siblings": [{"rfilename": p.relative_to(root).as_posix()} for p in hub.files(repo)]},
                               repo)
                elif rest[0] == "tree":
                    self._json([{"type": "file", "path": p.relative_to(root).as_posix(), "size": p.stat().st_size,
                                 "oid": hashlib.sha1(p.read_bytes()).hexdigest()} for p in hub.files(repo)], repo)
                else:
                    self._error(404, "EntryNotFound")
                return
            if len(parts) > 4 and parts[2] == "resolve":
                repo = self._repo(parts)
                if repo is None:
                    return
                f = hub.repos[repo].joinpath(*parts[4:])
                if not f.is_file():
                    self._error(404, "EntryNotFound")
                    return
                data = f.read_bytes()
                self.send_response(200)
                self.send_header("X-Repo-Commit", hub.sha(repo))
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                if self.command == "GET":
                    hub.downloads.append((repo, "/".join(parts[4:])))
                    self.wfile.write(data)
                return
            self._error(404, "RepoNotFound")

        do_GET = do_HEAD = _serve

    return Handler


@contextlib.contextmanager
def fake_hub(repos: dict[str, Path], gated: frozenset[str] = frozenset()) -> Iterator[FakeHub]:
    """Serves `repos` on a free loopback port for the duration of the block."""
    hub = FakeHub(repos, gated)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
