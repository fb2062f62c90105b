"""CPU libraries record the ISA extensions they were compiled for and refuse a CPU without them, before loading."""

import json
import logging
import shutil

import pytest

from mlcc import artifact
from mlcc.errors import ArtifactError
from mlcc.options import CompileOptions

X86_ONLY = pytest.mark.skipif(artifact.host_machine() != "x86_64", reason="x86-64 CPU names and features")


def _host(features, machine=None, name="testcpu"):
    return {"machine": machine or artifact.host_machine(), "name": name, "features": sorted(features)}


def _copy_with_cpu(compiled, tmp_path, **cpu):
    d = tmp_path / "m"
    shutil.copytree(compiled("llama", "q0f32"), d)
    cfg = json.loads((d / artifact.CONFIG_FILE).read_text())
    cfg["stamp"]["cpu"].update(cpu)
    (d / artifact.CONFIG_FILE).write_text(json.dumps(cfg))
    return d, cfg


def test_stamp_records_the_cpu_it_was_compiled_for(compiled):
    from mlcc.targets import cpu_record, get_target

    cfg = artifact.read_config(compiled("llama", "q0f32"))
    cpu = cfg["stamp"]["cpu"]
    assert cpu == cpu_record(get_target("llvm").tvm_target())
    assert cpu["machine"] == artifact.host_machine() and cpu["name"]
    # built here for here: every extension it needs is one this CPU has, and none this CPU has is left out
    assert set(cpu["features"]) == set(artifact.host_cpu()["features"])
    assert set(cpu["features"]) <= set(artifact.CPU_ISA_FEATURES[cpu["machine"]])


def test_generic_target_needs_no_extension():
    from mlcc.targets import cpu_record, get_target

    assert cpu_record(get_target("llvm-generic").tvm_target())["features"] == []


def test_library_needing_a_missing_feature_is_refused_before_it_is_loaded(compiled, tmp_path, monkeypatch):
    from mlcc.runtime.engine import Engine

    d, cfg = _copy_with_cpu(compiled, tmp_path, features=["avx2", "avx512f", "avx512vnni", "fma"], name="znver4")
    monkeypatch.setattr(artifact, "host_cpu", lambda: _host(["avx2", "fma"], name="haswell"))
    loaded = []
    monkeypatch.setattr("tvm.runtime.load_module", lambda *a: loaded.append(a))
    with pytest.raises(ArtifactError) as e:
        Engine(d, target="llvm")
    msg = str(e.value)
    assert "\n" not in msg and not loaded
    assert "compiled for a znver4 CPU and needs avx512f, avx512vnni, which this CPU (haswell) lacks" in msg
    assert "rebuild it on this machine with `mlcc compile SOURCE --target llvm --quant q0f32" in msg


def test_library_whose_features_this_cpu_has_loads(compiled, monkeypatch):
    from mlcc.runtime.device.model import LoadedModel

    cpu = artifact.read_config(compiled("llama", "q0f32"))["stamp"]["cpu"]
    monkeypatch.setattr(artifact, "host_cpu", lambda: _host([*cpu["features"], "amx-tile"]))
    m = LoadedModel(compiled("llama", "q0f32"))
    assert m.stamp["cpu"] == cpu


def test_library_and_config_from_different_cpus_are_refused(compiled, tmp_path):
    from mlcc.runtime.engine import Engine

    d, _ = _copy_with_cpu(compiled, tmp_path, name="another-cpu")
    with pytest.raises(ArtifactError, match="library was built for cpu="):
        Engine(d, target="llvm")


def test_check_against_fake_hosts():
    stamp = {"quantization": "q4f32_1", "cpu": {"machine": "x86_64", "name": "sapphirerapids",
                                                 "features": ["amx-int8", "amx-tile", "avx2", "avx512f"]}}
    artifact.check_cpu({"stamp": stamp}, "d", host=_host(["avx2", "avx512f", "amx-tile", "amx-int8"], "x86_64"))
    with pytest.raises(ArtifactError, match=r"needs amx-int8, amx-tile, which this CPU \(znver4\) lacks"):
        artifact.check_cpu({"stamp": stamp}, "d", host=_host(["avx2", "avx512f"], "x86_64", "znver4"))
    with pytest.raises(ArtifactError, match=r"needs x86_64, which this CPU \(neoverse-v1\) lacks"):
        artifact.check_cpu({"stamp": stamp}, "d", host=_host(["neon", "sve"], "aarch64", "neoverse-v1"))
    arm = {"cpu": {"machine": "aarch64", "name": "neoverse-v1", "features": ["dotprod", "neon", "sve"]}}
    with pytest.raises(ArtifactError, match="needs sve, which"):
        artifact.check_cpu({"stamp": arm}, "d", host=_host(["dotprod", "neon"], "aarch64"))


def test_library_without_a_cpu_record_loads_as_before(caplog):
    stamp = {"format": artifact.FORMAT_VERSION, "quantization": "q4f32_1"}
    with caplog.at_level(logging.WARNING, logger="mlcc.artifact"):
        artifact.check_cpu({"stamp": stamp}, "old", host=_host([]))
    assert "does not record the CPU features" in caplog.text and "--target llvm" in caplog.text


def test_cpuinfo_names_become_llvm_names():
    x86 = "processor\t: 0\nflags\t\t: fpu sse2 pni ssse3 sse4_1 sse4_2 avx avx2 fma bmi1 avx512f avx512_vnni " \
          "avx512_bf16 amx_tile amx_int8\n"
    assert {"sse3", "sse4.1", "sse4.2", "bmi", "avx512vnni", "avx512bf16", "amx-tile", "amx-int8",
            "avx2"} <= artifact._cpuinfo_features(x86)
    arm = "processor\t: 0\nFeatures\t: fp asimd asimdhp asimddp sve i8mm bf16\n"
    assert {"neon", "fullfp16", "dotprod", "sve", "i8mm", "bf16"} <= artifact._cpuinfo_features(arm)


@X86_ONLY
def test_host_target_leaves_out_what_a_hypervisor_hides(monkeypatch):
    """A Zen 4 guest whose hypervisor hides AVX-512: the CPU's name alone would emit AVX-512."""
    from tvm.target import codegen

    from mlcc.targets import cpu_record, get_target

    avx2_only = {"sse3", "ssse3", "sse4.1", "sse4.2", "avx", "avx2", "fma", "f16c", "bmi", "bmi2"}
    monkeypatch.setattr(codegen, "llvm_get_system_cpu", lambda: "znver4")
    monkeypatch.setattr(artifact, "host_cpu_features", lambda: frozenset(avx2_only))
    target = get_target("llvm").tvm_target()
    assert "-avx512f" in list(target.attrs["mattr"])
    rec = cpu_record(target)
    assert rec["name"] == "znver4" and set(rec["features"]) == avx2_only


def test_jit_cache_key_holds_the_cpu(tmp_path, monkeypatch):
    from mlcc.runtime.jit import build_dir

    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    keys = {}
    for name, feats in (("znver4", ["avx2", "avx512f"]), ("haswell", ["avx2"]), ("haswell2", ["avx2"])):
        monkeypatch.setattr(artifact, "host_cpu", lambda n=name, f=feats: _host(f, name=n.rstrip("2")))
        keys[name] = (build_dir(src, "llvm", "q4f32_1", 1, CompileOptions()),
                      build_dir(src, "cuda", "q4f16_1", 1, CompileOptions()))
    assert keys["znver4"][0] != keys["haswell"][0] == keys["haswell2"][0]
    assert keys["znver4"][1] == keys["haswell"][1]   # a GPU build does not depend on the host CPU
