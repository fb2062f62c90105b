"""Meta-schedule tuning of a model's kernels with the xgboost cost model, and the tuning database compile reuses.

The database is a meta-schedule JSON database directory (database_workload.json + database_tuning_record.json),
keyed by workload (structural hash of the PrimFunc) and target. A record is committed only when its measured
latency beats the default schedule measured the same way, so applying the database never slows a kernel down.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import tvm
from tvm import tirx

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TaskReport:
    name: str
    default_us: float
    tuned_us: float | None
    trials: int
    seconds: float
    kept: bool


def _arg_specs(f: tirx.PrimFunc) -> list[tuple[list, str]] | None:
    """(shape, dtype) of each parameter buffer, or None when a dimension is symbolic."""
    specs = []
    for t in f.ty.params:
        dims = list(t.shape.values) if hasattr(t.shape, "values") else list(t.shape)
        if any(not isinstance(d, (int, tirx.IntImm)) for d in dims):
            return None
        specs.append(([int(d) for d in dims], str(t.dtype)))
    return specs


def extract_tasks(mod: tvm.ir.IRModule, max_tasks: int | None = None) -> list[tuple[str, tirx.PrimFunc]]:
    """Static-shape matmul kernels (decode GEMVs, fixed-size GEMMs), largest first. Kernels with symbolic
    dimensions are left to the default rules: a record is only valid for the shape it was tuned on. Kernels that
    are already scheduled (mlcc's hand-written CUDA kernels) are what compile uses: nothing to tune."""
    tasks = []
    for gv, f in mod.functions.items():
        if not isinstance(f, tirx.PrimFunc) or "matmul" not in gv.name_hint:
            continue
        if f.attrs is not None and "tirx.is_scheduled" in f.attrs:
            continue
        specs = _arg_specs(f)
        if specs is None:
            continue
        tasks.append((max(int(np.prod(s)) for s, _ in specs), gv.name_hint, f))
    tasks.sort(key=lambda t: -t[0])
    return [(n, f) for _, n, f in tasks[:max_tasks]]


def _latency_us(func: tirx.PrimFunc, target: tvm.target.Target) -> float:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
    dev = tvm.cpu() if target.kind.name == "llvm" else tvm.device(target.kind.name, 0)
    args = [tvm.runtime.tensor(np.zeros(shape, dtype=dtype), dev) for shape, dtype in _arg_specs(func)]
    return lib.mod.time_evaluator("main", dev, number=20, repeat=3, min_repeat_ms=20)(*args).mean * 1e6


def tune(mod: tvm.ir.IRModule, target: tvm.target.Target, default_schedule: Callable[[tirx.PrimFunc], tirx.PrimFunc],
         trials: int, db_dir: str | Path, max_tasks: int | None = None) -> list[TaskReport]:
    """Tune each task, compare with `default_schedule`, and merge the winners into the database at db_dir."""
    from tvm.s_tir import meta_schedule as ms

    from mlcc.tvm_compat import import_tensor_intrinsics

    import_tensor_intrinsics()  # meta-schedule's space generation imports them on first use: minutes in TVM's way
    db_dir = Path(db_dir)
    db_dir.mkdir(parents=True, exist_ok=True)
    db = ms.database.JSONDatabase(work_dir=str(db_dir))
    reports = []
    tasks = extract_tasks(mod, max_tasks)
    for i, (name, func) in enumerate(tasks):
        log.info("tuning %d/%d %s (%d trials)", i + 1, len(tasks), name, trials)
        t0 = time.time()
        default_func = default_schedule(func) or func
        default_us = _latency_us(default_func, target)
        task_mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        with tempfile.TemporaryDirectory() as wd:
            run_db = ms.tune_tir(mod=task_mod, target=target, work_dir=wd, max_trials_global=trials,
                                 num_trials_per_iter=min(trials, 16), cost_model="xgb",
                                 builder=ms.builder.LocalBuilder(max_workers=2, timeout_sec=300),
                                 runner=ms.runner.LocalRunner(timeout_sec=120))
            best = ms.tir_integration.compile_tir(run_db, task_mod, target)
            tuned_us = _latency_us(best.mod["main"], target) if best is not None else None
            kept = tuned_us is not None and tuned_us < default_us
            if kept:
                for rec in run_db.get_top_k(run_db.commit_workload(task_mod), 1):
                    db.commit_tuning_record(ms.database.TuningRecord(
                        rec.trace, db.commit_workload(task_mod), rec.run_secs, target, rec.args_info))
        reports.append(TaskReport(name, default_us, tuned_us, trials, time.time() - t0, kept))
        log.info("%s: default %.1f us, tuned %s us, %s", name, default_us,
                 f"{tuned_us:.1f}" if tuned_us else "-", "kept" if kept else "not kept")
    return reports
