"""The web engine's JS dependencies (tvmjs, tokenizers, jinja, xgrammar, Dawn for Node), installed once with npm into the
cache from the pinned web/js/package.json + lock."""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
from pathlib import Path

from mlcc.errors import NpmError

log = logging.getLogger(__name__)

JS_DIR = Path(__file__).parent / "js"

# what a site vendors: npm path -> name under SITE/vendor/. The .js files are for the browser (two UMD scripts
# and an ES module); the .cjs copies are for Node, where web-tokenizers' "type": "module" breaks its UMD file.
VENDOR = {
    "@mlc-ai/web-runtime/lib/index.js": ["tvmjs.js", "tvmjs.cjs"],
    "@mlc-ai/web-tokenizers/lib/index.js": ["tokenizers.js", "tokenizers.cjs"],
    "@huggingface/jinja/dist/index.js": ["jinja.js"],
    "@huggingface/jinja/dist/index.cjs": ["jinja.cjs"],
    # structured outputs (JSON schema, regex, EBNF) in the engine; its wasm is inside the script
    "@mlc-ai/web-xgrammar/lib/index.js": ["xgrammar.js", "xgrammar.cjs"],
}


def node_modules() -> Path:
    """Folder holding node_modules for the pinned dependencies (npm ci on first use)."""
    from mlcc.cache import cache_lock, cache_root

    lock = (JS_DIR / "package-lock.json").read_bytes() + (JS_DIR / "package.json").read_bytes()
    home = cache_root() / "web-npm" / hashlib.sha256(lock).hexdigest()[:16]
    done = home / "node_modules" / ".mlcc-complete"
    if done.exists():
        return home / "node_modules"
    npm = shutil.which("npm")
    if npm is None:
        raise NpmError("npm is not installed; the web bundle needs it once to fetch tvmjs and the tokenizer "
                       "(apt-get install npm)")
    with cache_lock(home):
        if not done.exists():
            home.mkdir(parents=True, exist_ok=True)
            for name in ("package.json", "package-lock.json"):
                shutil.copy(JS_DIR / name, home / name)
            log.info("installing the web engine's JS dependencies with npm into %s", home)
            # install scripts stay off: every package we use ships prebuilt files
            proc = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"], check=False, cwd=home,
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise NpmError(f"npm ci failed in {home}:\n{proc.stderr[-3000:]}")
            done.write_text("ok")
    return home / "node_modules"
