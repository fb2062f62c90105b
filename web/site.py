"""`mlcc web`: a static site (demo chat page + JS engine + vendored tvmjs/tokenizer + model builds) that any
static file server can serve, e.g. `python -m http.server -d SITE`. The same folder runs in Node.js too."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from mlcc import artifact
from mlcc.errors import SiteError

from .npm_deps import JS_DIR, VENDOR, node_modules

log = logging.getLogger(__name__)

# the page, the engine and every module it imports (all of web/js/*.js), and the Node.js runner
PAGE_FILES = (*sorted(p.name for p in JS_DIR.glob("*.js")), "index.html", "node_chat.mjs")
MODEL_FILES = ("mlcc-config.json", "tensor-cache.json", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json")


def _model_entry(model_dir: Path, site_models: Path) -> dict:
    config = artifact.read_config(model_dir)
    if config.get("device") != "webgpu":
        raise SiteError(f"{model_dir} was compiled for {config.get('target')}; the web bundle needs WebGPU builds: "
                        f"mlcc compile SOURCE --target webgpu --quant q4f32_1 --output DIR")
    artifact.verify_shards(model_dir)
    name = model_dir.resolve().name
    dest = site_models / name
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    cache = json.loads((model_dir / artifact.TENSOR_CACHE_FILE).read_text())
    files = [config["library"], *MODEL_FILES, *(s["dataPath"] for s in cache["records"])]
    for f in files:
        if (model_dir / f).exists():
            shutil.copy2(model_dir / f, dest / f)
    size = sum((dest / f).stat().st_size for f in files if (dest / f).exists())
    return {"id": name, "url": f"models/{name}", "dtype": config["model_dtype"],
            "quantization": config["quantization"], "bytes": size}


def build_site(model_dirs: list[str | Path], output: str | Path, title: str = "mlcc chat") -> Path:
    """Write the site into `output`: index.html, engine, vendor/, models/<name>/, site.json."""
    if not model_dirs:
        raise SiteError("give at least one WebGPU model folder")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    entries = [_model_entry(Path(d), out / "models") for d in model_dirs]
    # float16 builds first: the engine takes the first one the GPU can run and falls back to float32
    entries.sort(key=lambda e: e["dtype"] != "float16")
    nm = node_modules()
    (out / "vendor").mkdir(exist_ok=True)
    for src, names in VENDOR.items():
        for name in names:
            shutil.copy2(nm / src, out / "vendor" / name)
    for name in PAGE_FILES:
        text = (JS_DIR / name).read_text()
        if name == "index.html":
            text = text.replace("{{TITLE}}", title)
        (out / name).write_text(text)
    (out / "package.json").write_text(json.dumps({"private": True, "type": "module"}, indent=2) + "\n")
    (out / "site.json").write_text(json.dumps({"title": title, "models": entries}, indent=1))
    log.info("wrote site %s with %d model build(s): %s", out, len(entries), ", ".join(e["id"] for e in entries))
    return out
