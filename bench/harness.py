"""What the benchmark scripts share: their command line (subcommands, the docstring as --help), the preset model
shapes, real models' GGUF files, build metadata and writing results.

The scripts run as `python bench/NAME.py ...` from the checkout root: they import this module (and each other) by
bare name, from bench/, and mlcc from wherever Python finds it (the installed package, or PYTHONPATH). Nothing here
imports from tests/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
# where real models' GGUF files are looked for (the slow tests download theirs here too)
WEIGHTS = Path(os.environ.get("MLCC_WEIGHTS_CACHE", Path.home() / ".cache" / "mlcc" / "weights"))


def cli(doc: str | None, commands: dict[str, tuple[Callable, Callable[[argparse.ArgumentParser], None] | None]],
        argv: list[str] | None = None) -> None:
    """One subcommand per entry: name -> (function taking the parsed args, function adding its arguments)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, (_, configure) in commands.items():
        s = sub.add_parser(name)
        if configure is not None:
            configure(s)
    a = p.parse_args(argv)
    commands[a.cmd][0](a)


def presets() -> dict:
    """mlcc.relax_models.presets.PRESETS (name -> Preset: family, HF config). Loaded from its file, not through the
    mlcc.relax_models package: importing that package builds the model families on TVM's compiler, which a
    runtime-only TVM (enough to run prebuilt libraries) does not have, and the table itself needs nothing."""
    import importlib.util

    import mlcc

    path = Path(mlcc.__file__).resolve().parent / "relax_models" / "presets.py"
    spec = importlib.util.spec_from_file_location("mlcc_bench_presets", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module.PRESETS


def build_shape_with_tokenizer(model: str, quant: str, target: str, out: str | Path,
                               tokenizer_gguf: str | Path | None = None, layers: int | None = None,
                               vocab_multiple: int = 1, options=None) -> dict[str, Any]:
    """A preset's shape compiled with no checkpoint (weights random at load: `--weights random`) but with a real
    tokenizer and chat template, a GGUF's (default: the bundled SmolLM2-135M-Instruct's), so that text goes in and
    out as with a real model. The shape's vocab_size becomes the tokenizer's token count, rounded up to
    `vocab_multiple`: at 1 every id the random model can sample decodes to text (the preset's own vocabulary, Llama
    3's 128,256, would let it sample ids past SmolLM2's 49,152 that decode to nothing). `layers` replaces the
    decoder's depth (a small stand-in built the same way). Only the library, config and tokenizer are written: a few
    MB whatever the shape. Returns what was built."""
    import shutil

    from mlcc import artifact
    from mlcc.compiler.build import compile_shape_only
    from mlcc.compiler.tokenizer_files import write_tokenizer
    from mlcc.runtime.jit import default_model_path

    gguf = Path(tokenizer_gguf) if tokenizer_gguf else default_model_path()
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    write_tokenizer("gguf", gguf, out)
    vocab = json.loads((out / "tokenizer.json").read_text())
    n_tokens = max([*vocab["model"]["vocab"].values(), *[t["id"] for t in vocab.get("added_tokens", [])]]) + 1
    preset = presets()[model]
    cfg = preset.hf_config()
    cfg["vocab_size"] = -(-n_tokens // vocab_multiple) * vocab_multiple
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    seconds = compile_shape_only(preset.family, cfg, target, quant, out, options=options)
    # compile_shape_only writes its placeholder tokenizer (a word per id) over the real one: written again after it
    info = write_tokenizer("gguf", gguf, out)
    config = artifact.read_config(out)
    config["tokenizer"] = info
    (out / artifact.CONFIG_FILE).write_text(json.dumps(config, indent=1))
    return {"out": str(out), "shape": model, "quant": quant, "target": target, "layers": cfg["num_hidden_layers"],
            "vocab_size": cfg["vocab_size"], "tokenizer_tokens": n_tokens, "tokenizer": gguf.name,
            "compile_s": round(seconds, 1), "bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file())}


def cached_gguf(name: str, given: str | None = None) -> Path:
    """A real model's file: `given` when passed, else WEIGHTS/name. Exits naming both when it is not there, since
    downloading multi-hundred-MB checkpoints is not a benchmark's business."""
    path = Path(given) if given else WEIGHTS / name
    if not path.exists():
        raise SystemExit(f"{path} is missing: pass the file, or put {name} in {WEIGHTS} (MLCC_WEIGHTS_CACHE; "
                         "`python -m pytest -m slow tests/test_real_weights.py` downloads the Qwen2.5-Coder-0.5B one)")
    return path


def add_options_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a CompileOptions field for the build (repeatable), e.g. --option pdl=0")


def parse_options(items: list[str]):
    from mlcc.options import CompileOptions

    return CompileOptions.parse(items)


def source_commit() -> str:
    """The short commit of the mlcc being imported (a worktree of another commit counts as that commit), with
    '+dirty' when its tracked files differ from it; 'unknown' outside git."""
    import mlcc

    where = str(Path(mlcc.__file__).resolve().parent)
    try:
        rev = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", where, "diff", "--quiet", "HEAD", "--", "."],
                               capture_output=True).returncode != 0
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def build_info(options=None) -> dict[str, Any]:
    """Where and from what a set of libraries was built, written beside them."""
    return {"commit": source_commit(), "host": platform.node(), "cpus": _cpus(),
            "options": options.to_dict() if options is not None else None}


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def device_name() -> str:
    """The first GPU's name as nvidia-smi gives it ("unknown" without one)."""
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, check=False).stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        return "unknown"


def write_json(out: str | Path, name: str, obj: Any) -> Path:
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(json.dumps(obj, indent=1))
    return d / name
