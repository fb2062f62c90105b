"""`mlcc tune` on the CPU: meta-schedule + xgboost on a tiny model's largest kernels, a database record committed
only when faster than the default schedule, and `mlcc compile --tuning-db` applying it with unchanged results."""

import json
import subprocess
import sys

import pytest
from test_parity import PROMPT, hf_logits, hf_model, rel_err

# the latencies tune() sees, in its order per task (default schedule, then the tuned one): the first task's tuned
# schedule wins, the second's loses, whatever this machine measures
FAKE_US = [(2.0, 1.0), (1.0, 2.0)]


def _records(db):
    f = db / "database_tuning_record.json"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.exists() else []


@pytest.fixture(scope="module")
def tuned(hf_models, tmp_path_factory):
    """(reports, db): two tasks tuned with FAKE_US in place of the measured latencies (each schedule is still built
    and run once)."""
    from mlcc.compiler.tune import tune_model
    from mlcc.schedules import tuning

    measured = tuning._latency_us
    calls = []

    def fake_latency_us(func, target):
        measured(func, target)
        calls.append(func)
        task, which = divmod(len(calls) - 1, 2)
        return FAKE_US[task][which]

    db = tmp_path_factory.mktemp("tuning") / "db"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tuning, "_latency_us", fake_latency_us)
        reports = tune_model(hf_models("llama"), "llvm", "q4f32_1", trials=4, db=db, max_tasks=2)
    assert len(calls) == 4  # default and tuned, per task
    return reports, db


def _task_mods(hf_models):
    """(fused module, its tasks as tune() saw them) for the tiny llama on the CPU."""
    import tvm

    from mlcc.compiler.build import export_module
    from mlcc.compiler.pipeline import kernel_passes
    from mlcc.compiler.quantize import get_quantization
    from mlcc.compiler.weights import load_source
    from mlcc.schedules.tuning import extract_tasks
    from mlcc.targets import get_target

    built = export_module(load_source(hf_models("llama")), get_target("llvm"), get_quantization("q4f32_1"))
    with built.target:
        fused = tvm.transform.Sequential(kernel_passes(built.target, built.options))(built.mod)
    tasks = {name: tvm.IRModule({"main": f.with_attr("global_symbol", "main")}) for name, f in extract_tasks(fused, 2)}
    return built, fused, tasks


def test_only_a_faster_schedule_is_recorded(tuned):
    reports, db = tuned
    assert [(r.default_us, r.tuned_us, r.kept) for r in reports] == [(2.0, 1.0, True), (1.0, 2.0, False)]
    assert len({r.name for r in reports}) == 2 and all(r.trials == 4 and r.seconds > 0 for r in reports)
    assert len(_records(db)) == 1


def test_compile_applies_the_kept_record_and_only_it(tuned, hf_models):
    import tvm
    import tvm_ffi
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    from mlcc.schedules import default_schedule_passes

    (kept, lost), db_dir = tuned
    built, fused, tasks = _task_mods(hf_models)
    assert set(tasks) == {kept.name, lost.name}
    db = ms.database.JSONDatabase(work_dir=str(db_dir))
    assert db.has_workload(tasks[kept.name]) and not db.has_workload(tasks[lost.name])
    with built.target:
        record = db.query_schedule(tasks[kept.name], built.target, workload_name="main").mod["main"]
    def schedule(tuning_db: bool):  # (on a copy: the passes change the module they are given)
        with built.target:
            passes = ([relax.transform.MetaScheduleApplyDatabase(str(db_dir))] if tuning_db else []) \
                + default_schedule_passes(built.target)
            return tvm.transform.Sequential(passes)(tvm.IRModule(dict(fused.functions.items())))

    applied, plain = schedule(True), schedule(False)
    # the kept task's kernel is the record's schedule, not the default one; the other keeps the default schedule
    tvm.ir.assert_structural_equal(applied[kept.name],
                                   record.without_attr("global_symbol").with_attr("tirx.is_scheduled", True))
    assert not tvm_ffi.structural_equal(applied[kept.name], plain[kept.name])
    tvm.ir.assert_structural_equal(applied[lost.name], plain[lost.name])


def test_a_model_compiled_with_the_database_keeps_its_results(tuned, hf_models, tmp_path):
    from mlcc.compiler.build import compile_model
    from mlcc.runtime.device.model import LoadedModel

    _, db = tuned
    out = tmp_path / "tuned"
    compile_model(hf_models("llama"), "llvm", "q4f32_1", out, tuning_db=db)
    m = LoadedModel(out)
    m.create_kv_cache(1, 256, 64)
    m.add_sequence(0)
    hf = hf_model(hf_models("llama"), "q4f32_1")
    assert rel_err(m.prefill([0], [PROMPT]).numpy()[0], hf_logits(hf, PROMPT)[-1]) <= 1e-4
    assert rel_err(m.decode([0], [42]).numpy()[0], hf_logits(hf, PROMPT + [42])[-1]) <= 1e-4


def test_compile_with_a_missing_database_is_one_clear_line(hf_models, tmp_path):
    p = subprocess.run([sys.executable, "-m", "mlcc", "compile", str(hf_models("llama")), "--output",
                        str(tmp_path / "o"), "--tuning-db", str(tmp_path / "nope")], capture_output=True, text=True)
    assert p.returncode == 2 and "no tuning database there" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("target", ["cuda"])
def test_tuning_needs_a_runnable_target(target, hf_models, tmp_path):
    from mlcc.targets import get_target

    if get_target(target).can_run_here():
        pytest.skip("this machine has the GPU, so tuning for it is allowed here")
    from mlcc.compiler.tune import tune_model

    with pytest.raises(ValueError, match="cannot run on this machine"):
        tune_model(hf_models("llama"), target, "q4f16_1", trials=4, db=tmp_path / "db")
