"""`mlcc compile`: artifacts layout, fused dequantization, CUDA cross-compile, and one-line errors on bad input."""

import json
import subprocess
import sys

import pytest

from mlcc import artifact
from mlcc.options import CompileOptions


def mlcc(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "mlcc", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def test_artifacts_folder_layout(compiled):
    d = compiled("llama", "q4f16_1")
    cfg = json.loads((d / artifact.CONFIG_FILE).read_text())
    assert (d / cfg["library"]).exists()
    cache = json.loads((d / artifact.TENSOR_CACHE_FILE).read_text())
    for shard in cache["records"]:
        assert len(shard["sha256"]) == 64
        assert (d / shard["dataPath"]).stat().st_size == shard["nbytes"]
        for rec in shard["records"]:
            assert {"name", "shape", "dtype", "byteOffset"} <= set(rec)
    stamp = cfg["stamp"]
    assert stamp["arch"] == "llama" and stamp["quantization"] == "q4f16_1" and stamp["tvm"] == artifact.tvm_version()
    # the hash covers exactly the parameters listed (names, shapes, dtypes), in the VM's order
    params = cfg["params"]
    assert len(params) == len({p["name"] for p in params}) == len(cache_names(cache))
    assert {p["name"] for p in params} == cache_names(cache)
    assert stamp["param_hash"] != artifact.param_hash(params[::-1])
    assert stamp["options"] == CompileOptions().to_dict()
    assert cfg["tokenizer"]["chat_template"] and (d / "tokenizer.json").exists()
    assert cfg["context_window_size"] == 512


def cache_names(cache):
    return {r["name"] for s in cache["records"] for r in s["records"]}


def _lowered_primfuncs(hf_folder, target_name, quant):
    import tvm

    from mlcc.compiler.build import export_module
    from mlcc.compiler.pipeline import build_pipeline
    from mlcc.compiler.quantize import get_quantization
    from mlcc.compiler.weights import load_source
    from mlcc.targets import get_target

    built = export_module(load_source(hf_folder), get_target(target_name), get_quantization(quant))
    mod = build_pipeline(built.target, None, built.options)(built.mod)
    return {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}


@pytest.mark.parametrize("target", ["llvm", "cuda"])
def test_dequantize_is_fused_into_its_matmul(target, hf_models):
    funcs = _lowered_primfuncs(hf_models("llama"), target, "q4f16_1")
    # (mlcc_dequantize_*: the decoder into cuBLASLt's float16 scratch for long prefill chunks, a weight in memory
    # by design; compiler/vendor_gemm.py)
    deq = {n: f for n, f in funcs.items() if "dequantize" in n and not n.startswith("mlcc_dequantize_")}
    assert len(deq) >= 5, sorted(funcs)
    for name, f in deq.items():
        script = f.script()
        # a materialised weight would be a separate "dequantize" block writing its own buffer
        assert 'T.sblock("dequantize")' not in script, f"{name} writes the dequantized weight to memory"
        if "matmul" in name or target == "cuda":
            assert f.attrs.get("tirx.is_scheduled"), f"{name} was left unscheduled on {target}"


def test_cuda_cross_compile_exports_kernels(hf_models, tmp_path):
    r = mlcc("compile", str(hf_models("llama")), "--target", "cuda", "--quant", "q4f16_1", "--output",
             str(tmp_path / "cuda"))
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = json.loads((tmp_path / "cuda" / artifact.CONFIG_FILE).read_text())
    assert cfg["device"] == "cuda" and cfg["stamp"]["target"] == "cuda"
    lib = (tmp_path / "cuda" / "model.so").read_bytes()
    assert lib.count(b"__global__") > 20  # CUDA source travels in the .so when built without a GPU


@pytest.mark.parametrize("args,message", [
    (["compile", "{missing}", "--output", "{out}"], "no such file or folder"),
    (["compile", "{hf}", "--quant", "q3f7", "--output", "{out}"], "unknown quantization 'q3f7'"),
    (["compile", "{hf}", "--target", "vulkan9", "--output", "{out}"], "unsupported target 'vulkan9'"),
    (["compile", "{unknown_arch}", "--output", "{out}"], "unknown architecture 'bert'"),
    (["compile", "{no_weights}", "--output", "{out}"], "no *.safetensors"),
    (["compile", "{hf}", "--target", "webgpu", "--quant", "e4m3_e4m3_f16", "--output", "{out}"],
     "e4m3_e4m3_f16 cannot run on target 'webgpu': WGSL has no 8-bit types"),
])
def test_bad_input_is_one_clear_line(args, message, hf_models, tmp_path):
    unknown = tmp_path / "bert"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (unknown / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    no_weights = tmp_path / "empty"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({"model_type": "llama"}))
    subst = {"{missing}": str(tmp_path / "nope"), "{out}": str(tmp_path / "out"), "{hf}": str(hf_models("llama")),
             "{unknown_arch}": str(unknown), "{no_weights}": str(no_weights)}
    r = mlcc(*[subst.get(a, a) for a in args])
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("mlcc: error:")]
    assert len(lines) == 1 and message in lines[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_targets_lists_every_preset_and_what_runs_here():
    from mlcc.targets import TARGETS

    r = mlcc("targets")
    assert r.returncode == 0, r.stderr
    rows = {ln.split()[0]: ln.split()[2] for ln in r.stdout.splitlines()[1:] if ln and not ln.startswith(" ")}
    assert set(rows) == set(TARGETS)
    assert rows["llvm"] == "runs" and rows["rocm-gfx942"] == "compile-only" and rows["metal"] == "compile-only"


def test_compile_options_are_in_the_stamp_and_refused_when_they_differ(hf_models, tmp_path):
    """A non-default build records its options; asking for other options than a folder was built with fails in
    one line naming the option and the flags that rebuild the folder with the options asked for."""
    from mlcc.errors import ArtifactError

    out = tmp_path / "cuda-nopdl"
    r = mlcc("compile", str(hf_models("llama")), "--target", "cuda", "--quant", "q4f16_1", "--option", "pdl=0",
             "--option", "decode_graph=off", "--output", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = artifact.read_config(out)
    built = artifact.built_options(cfg)
    assert built == CompileOptions(pdl=False, decode_graph=False)
    assert cfg["stamp"]["options"]["pdl"] is False
    lib = (out / "model.so").read_bytes()
    # (the option names are in the stamp, so look for what only a decode graph calls: the captured attention)
    assert b"griddepcontrol" not in lib and artifact.GRAPH_ATTENTION.encode() not in lib
    default = tmp_path / "cuda-default"
    r = mlcc("compile", str(hf_models("llama")), "--target", "cuda", "--quant", "q4f16_1", "--output", str(default))
    assert r.returncode == 0, r.stderr[-2000:]
    lib = (default / "model.so").read_bytes()
    assert b"griddepcontrol" in lib and artifact.GRAPH_ATTENTION.encode() in lib
    artifact.check_options(cfg, None, out)
    artifact.check_options(cfg, built, out)
    with pytest.raises(ArtifactError, match=r"pdl=True \(built with False\).*--option decode_graph=0 --output"):
        artifact.check_options(cfg, CompileOptions(decode_graph=False), out)


@pytest.mark.parametrize("items,message", [
    (["pdl=maybe"], "pdl takes 1/0"), (["splits=3"], "KEY one of"), (["decode_attention_splits=-1"], "non-negative"),
])
def test_bad_compile_options_are_refused(items, message):
    from mlcc.errors import CompileOptionsError

    with pytest.raises(CompileOptionsError, match=message):
        CompileOptions.parse(items)
    with pytest.raises(CompileOptionsError, match="unknown compile option"):
        CompileOptions.from_dict({"pdl": True, "q4_kernel": "tc"})


@pytest.mark.parametrize("fmt", ["sharded-safetensors", "pytorch-bin", "bf16"])
def test_checkpoint_formats_load_identically(fmt, hf_models, tmp_path):
    """Sharded safetensors, pytorch_model.bin (torch.load weights_only) and bf16 weights all convert."""
    import shutil

    import numpy as np
    import torch
    import transformers as tf

    from mlcc.compiler.weights import iter_float_params, load_source
    from mlcc.relax_models import family_for

    src = hf_models("llama")
    model = tf.AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    d = tmp_path / fmt
    if fmt == "sharded-safetensors":
        model.save_pretrained(d, max_shard_size="100KB")
        assert len(list(d.glob("*.safetensors"))) > 1
    elif fmt == "pytorch-bin":
        d.mkdir()
        shutil.copy(src / "config.json", d / "config.json")
        torch.save(model.state_dict(), d / "pytorch_model.bin")
    else:
        model.to(torch.bfloat16).save_pretrained(d)
    ref_src = load_source(src)
    fam = family_for("llama")
    cfg = fam.config_from_hf(ref_src.config)
    ref = dict(iter_float_params(ref_src, fam, cfg))
    got = dict(iter_float_params(load_source(d), fam, cfg))
    assert ref.keys() == got.keys()
    for k in ref:
        want = ref[k].astype(np.float32)
        if fmt == "bf16":  # bf16 keeps 8 mantissa bits
            want = torch.from_numpy(want).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(got[k], want, err_msg=k)


def test_tensor_intrinsics_import_with_the_fast_stack_walk():
    """In a fresh interpreter (the import happens once per process): every MMA intrinsic TVM's own import registers
    is there, and inspect.stack is the standard library's again afterwards."""
    code = (
        "import inspect, tvm\n"
        "stack = inspect.stack\n"
        "from mlcc.tvm_compat import import_tensor_intrinsics\n"
        "import_tensor_intrinsics()\n"
        "from tvm.s_tir import TensorIntrin\n"
        "from tvm.s_tir.tensor_intrin import cuda\n"
        "names = [v for k, v in vars(cuda).items() if k.endswith('_INTRIN') and isinstance(v, str)]\n"
        "assert len(names) > 40, len(names)\n"
        "for n in names: TensorIntrin.get(n)\n"
        "assert inspect.stack is stack\n"
        "print('ok', len(names))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-2000:]
