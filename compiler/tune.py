"""`mlcc tune`: extract a model's kernels for a target/quantization and tune them into a tuning database."""

from __future__ import annotations

from pathlib import Path

from mlcc.cache import cache_root
from mlcc.errors import ToolchainError, UnsupportedTargetError
from mlcc.options import CompileOptions
from mlcc.schedules.tuning import TaskReport, tune
from mlcc.targets import get_target

from .build import export_module
from .quantize import get_quantization
from .weights import load_source


def default_tuning_db() -> Path:
    return cache_root() / "tuning-db"


def tune_model(model: str | Path, target: str, quant: str, trials: int, db: str | Path | None = None,
               max_tasks: int | None = None, options: CompileOptions | None = None) -> list[TaskReport]:
    """Tune the kernels a build of `model` with these options would schedule with the default rules."""
    import importlib.util

    import tvm

    from mlcc.schedules import default_schedule_for

    from .pipeline import kernel_passes

    preset, q = get_target(target), get_quantization(quant)
    if importlib.util.find_spec("xgboost") is None:
        raise ToolchainError("mlcc tune needs xgboost for its cost model: pip install xgboost-cpu "
                             "(or install mlcc with the [tune] extra)")
    built = export_module(load_source(model), preset, q, options=options)
    if not preset.can_run_here():
        raise UnsupportedTargetError(f"tuning measures kernels on the device: target '{preset.name}' cannot run on this machine")
    with built.target:
        mod = tvm.transform.Sequential(kernel_passes(built.target, built.options))(built.mod)
    return tune(mod, built.target, default_schedule_for(built.target), trials, db or default_tuning_db(), max_tasks)


def format_report(reports: list[TaskReport]) -> str:
    lines = [f"{'kernel':40} {'default us':>11} {'tuned us':>9} {'trials':>6} {'secs':>6}  kept"]
    for r in reports:
        tuned = f"{r.tuned_us:9.1f}" if r.tuned_us is not None else f"{'-':>9}"
        lines.append(f"{r.name:40} {r.default_us:11.1f} {tuned} {r.trials:6d} {r.seconds:6.0f}  {'yes' if r.kept else 'no'}")
    return "\n".join(lines)
