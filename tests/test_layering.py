"""The import layering of docs/ARCHITECTURE.md, as pyproject.toml's import-linter contracts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    exe = shutil.which("lint-imports")
    assert exe is not None, "import-linter is a test dependency: pip install -e '.[test]'"
    proc = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "BROKEN" not in proc.stdout and proc.stdout.count("KEPT") == 4


def test_importing_the_runtime_does_not_import_the_compiler():
    code = ("import sys, mlcc.runtime.engine, mlcc.runtime.device.model, mlcc.runtime.serve.server; "
            "bad = sorted(m for m in sys.modules if m.startswith(('mlcc.compiler', 'mlcc.schedules', "
            "'mlcc.relax_models'))); print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_public_api():
    import mlcc
    from mlcc import AsyncEngine, CompileOptions, Engine, errors

    assert mlcc.__version__ and Engine.__module__ == "mlcc.runtime.engine" and AsyncEngine is not Engine
    assert issubclass(errors.RequestError, ValueError) and issubclass(errors.ArtifactError, errors.MlccError)
    assert CompileOptions().pdl is True
