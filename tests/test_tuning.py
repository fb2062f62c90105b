"""`mlcc tune` on the CPU: meta-schedule + xgboost on a tiny model's largest kernel, a database record committed
only when faster than the default schedule, and `mlcc compile --tuning-db` applying it with unchanged results."""

import json
import subprocess
import sys

import pytest

from test_parity import PROMPT, hf_logits, hf_model, rel_err


def _records(db):
    f = db / "database_tuning_record.json"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.exists() else []


def test_tune_then_compile_with_the_database(hf_models, tmp_path):
    from mlcc.compiler.build import compile_model
    from mlcc.compiler.tune import tune_model
    from mlcc.runtime.model import LoadedModel

    db = tmp_path / "db"
    reports = tune_model(hf_models("llama"), "llvm", "q4f32_1", trials=16, db=db, max_tasks=1)
    assert len(reports) == 1
    r = reports[0]
    assert r.default_us > 0 and r.tuned_us is not None and r.seconds > 0
    assert r.kept == (r.tuned_us < r.default_us)          # never slower: a record only when it wins
    assert len(_records(db)) == (1 if r.kept else 0)

    out = tmp_path / "tuned"
    compile_model(hf_models("llama"), "llvm", "q4f32_1", out, tuning_db=db)
    m = LoadedModel(out)
    m.create_kv_cache(1, 256, 64)
    m.add_sequence(0)
    hf = hf_model(hf_models("llama"), "q4f32_1")
    assert rel_err(m.prefill([0], [PROMPT]).numpy()[0], hf_logits(hf, PROMPT)[-1]) <= 1e-4
    assert rel_err(m.decode([0], [42]).numpy()[0], hf_logits(hf, PROMPT + [42])[-1]) <= 1e-4

    if r.kept:  # the record is what compile used for that kernel
        import tvm
        from tvm import relax

        from mlcc.compiler.build import export_module
        from mlcc.compiler.pipeline import kernel_passes
        from mlcc.compiler.quantize import get_quantization
        from mlcc.compiler.weights import load_source
        from mlcc.schedules import default_schedule_passes
        from mlcc.targets import get_target

        built = export_module(load_source(hf_models("llama")), get_target("llvm"), get_quantization("q4f32_1"))
        with built.target:
            fused = tvm.transform.Sequential(kernel_passes(built.target))(built.mod)
            tuned = tvm.transform.Sequential([relax.transform.MetaScheduleApplyDatabase(str(db))]
                                             + default_schedule_passes(built.target))(fused)
            plain = tvm.transform.Sequential(default_schedule_passes(built.target))(fused)
        assert tuned[r.name].script() != plain[r.name].script()


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
