"""FP8 checkpoints as published (compiler/fp8_checkpoint.py): compressed-tensors float-quantized checkpoints written by
the compressed-tensors library itself, and a transformers `fp8` block checkpoint written by transformers' block
formula, compiled on llvm (q0f32) against transformers float32 carrying the same dequantized weights: the same math,
so logits within 1e-4 (relative to the largest |logit|) and greedy ids identical. What mlcc cannot serve is one
ModelSourceError naming the problem and the fix."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_support import assert_matches_reference, edited, reference_model
from conftest import write_tokenizer

from mlcc.errors import ModelSourceError

BLOCK = [48, 48]   # rows and columns of 64 and 128 are not multiples: the last block of each is partial


def _compressed_tensors_checkpoint(src: Path, preset: str, out: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """`src` quantized by compressed-tensors with one of its FP8 presets (scales from each weight's min/max, as
    llm-compressor's observers compute them), saved as llm-compressor saves it; and the dequantized weights,
    decompressed by compressed-tensors."""
    import transformers as tf
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    model = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]),
                              show_progress=False)
    with torch.no_grad():
        for _, m in model.named_modules():
            args = getattr(getattr(m, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            w = m.weight
            lo, hi = (w.amin(1, keepdim=True), w.amax(1, keepdim=True)) if args.strategy == "channel" else \
                (w.amin(), w.amax())
            m.weight_scale.copy_(calculate_qparams(lo, hi, args)[0].reshape(m.weight_scale.shape))
            if hasattr(m, "input_scale"):   # a static activation scale, as calibration would leave it
                m.input_scale.fill_(0.05)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    write_tokenizer(out)
    compressor.decompress_model(model)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if k.endswith(".weight")}
    return out, weights


def _block_quantize(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Fp8Quantize formula (integrations/finegrained_fp8.py) over a ceil grid of blocks, as
    DeepSeek-V3's checkpoints have it: each block's absmax maps to e4m3's 448, weight_scale_inv = 1 / that scale."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    rows, cols = w.shape
    gr, gc = -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(gr * block[0], gc * block[1])
    padded[:rows, :cols] = w
    tiles = padded.reshape(gr, block[0], gc, block[1])
    max_abs = tiles.abs().amax(dim=(1, 3))
    scales = torch.where(max_abs > 0, fp8_max / max_abs, torch.ones_like(max_abs))
    q = torch.clamp(tiles * scales[:, None, :, None], -fp8_max, fp8_max).to(torch.float8_e4m3fn)
    return q.reshape(padded.shape)[:rows, :cols].contiguous(), (1.0 / scales).to(torch.float32)


def _fp8_block_checkpoint(src: Path, out: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """`src` as a transformers `fp8` (FineGrainedFP8, DeepSeek-V3 style) checkpoint: every decoder Linear block-
    quantized, lm_head in modules_to_not_convert; and the dequantized weights by transformers' own dequantizer."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    shutil.copytree(src, out)
    state = load_file(out / "model.safetensors")
    stored, weights = {}, {}
    for name, w in state.items():
        if name.endswith("proj.weight"):
            q, scale_inv = _block_quantize(w, BLOCK)
            stored[name], stored[name.replace(".weight", ".weight_scale_inv")] = q, scale_inv
            weights[name] = _dequantize_fp8_weight(q, scale_inv, BLOCK, torch.float32)
        else:
            stored[name] = weights[name] = w
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": BLOCK, "modules_to_not_convert": ["lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return out, weights


@pytest.fixture(scope="session")
def fp8_checkpoints(tmp_path_factory, hf_models):
    """fp8_checkpoints(name) → (folder, dequantized weights by checkpoint name), built once per session."""
    recipes = {
        "ct_channel_dynamic": lambda out: _compressed_tensors_checkpoint(hf_models("llama"), "FP8_DYNAMIC", out),
        "ct_tensor_static": lambda out: _compressed_tensors_checkpoint(hf_models("qwen2"), "FP8", out),
        "hf_block": lambda out: _fp8_block_checkpoint(hf_models("llama"), out),
    }
    cache: dict[str, tuple[Path, dict[str, torch.Tensor]]] = {}

    def get(name: str) -> tuple[Path, dict[str, torch.Tensor]]:
        if name not in cache:
            cache[name] = recipes[name](tmp_path_factory.mktemp(f"fp8-{name}") / "model")
        return cache[name]

    return get


CASES = {  # checkpoint → (family whose random model it quantizes, what config.json says)
    "ct_channel_dynamic": ("llama", ("compressed-tensors", "channel", None, "dynamic", "token")),
    "ct_tensor_static": ("qwen2", ("compressed-tensors", "tensor", None, "static", "tensor")),
    "hf_block": ("llama", ("fp8", "block", tuple(BLOCK), "dynamic", "group")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_checkpoint_compiles_and_matches_transformers_on_its_dequantized_weights(name, fp8_checkpoints,
                                                                                    hf_models, tmp_path, caplog):
    from mlcc.compiler.build import compile_model
    from mlcc.compiler.weights import load_source

    folder, weights = fp8_checkpoints(name)
    kind, (method, strategy, block, act, act_strategy) = CASES[name]
    fmt = load_source(folder).fp8.format
    assert (fmt.method, fmt.strategy, fmt.block_size, fmt.activation_scheme, fmt.activation_strategy) == \
        (method, strategy, block, act, act_strategy)
    assert fmt.ignore == ("lm_head",)

    with caplog.at_level(logging.INFO, logger="mlcc.compiler.build"):
        compile_model(folder, "llvm", "q0f32", tmp_path / "art")
    notes = [r.getMessage() for r in caplog.records if "FP8 checkpoint" in r.getMessage()]
    assert notes == [(f"FP8 checkpoint ({fmt.describe()}): weights dequantized to float and kept as float32 (q0f32) "
                     "on this target")]

    assert_matches_reference(tmp_path / "art", reference_model(hf_models(kind), weights, keep_missing=True))


def test_fp8_weights_read_raw_or_dequantized_a_few_rows_at_a_time(fp8_checkpoints):
    """What an e4m3 scheme reads (codes as stored, scales) and what every other scheme reads (float32, whole or by
    rows) agree with each other and with the libraries' own dequantization."""
    from safetensors import safe_open

    from mlcc.compiler.weights import load_source

    for name in CASES:
        folder, weights = fp8_checkpoints(name)
        source = load_source(folder)
        down = "model.layers.1.mlp.down_proj.weight"
        w = source.fp8_weight(down)
        with safe_open(folder / "model.safetensors", "pt") as f:
            assert np.array_equal(w.codes.view(np.uint8), f.get_tensor(down).view(torch.uint8).numpy())
        assert source.fp8_weight("lm_head.weight") is None and source.fp8_weight("model.norm.weight") is None
        whole = source.get(down)
        np.testing.assert_array_equal(whole, weights[down].numpy())
        rows, read = source.row_reader(down)
        np.testing.assert_array_equal(np.concatenate([read(lo, min(lo + 7, rows)) for lo in range(0, rows, 7)]),
                                      whole)
        per_row = w.row_scales()
        if name == "hf_block":   # 128 columns in blocks of 48: scales vary along a row
            assert per_row is None
        else:
            np.testing.assert_array_equal(w.codes.astype(np.float32) * per_row[:, None], whole)


@pytest.mark.parametrize("name", ["ct_channel_dynamic", "hf_block"])
def test_fp8_weights_requantized_as_the_float_checkpoint_of_the_same_weights(name, fp8_checkpoints, hf_models,
                                                                            tmp_path, monkeypatch):
    """q4f32_1 from an FP8 checkpoint, converted a few rows at a time, is byte for byte q4f32_1 from a float
    checkpoint carrying its dequantized weights."""
    from mlcc.compiler import weight_conversion
    from mlcc.compiler.build import export_module
    from mlcc.compiler.weights import load_source
    from mlcc.quantization import QUANTIZATIONS
    from mlcc.targets import get_target

    folder, weights = fp8_checkpoints(name)
    kind = CASES[name][0]
    reference_model(hf_models(kind), weights, keep_missing=True).save_pretrained(tmp_path / "float")
    fp8, plain = load_source(folder), load_source(tmp_path / "float")
    built = export_module(plain, get_target("llvm"), QUANTIZATIONS["q4f32_1"])
    monkeypatch.setattr(weight_conversion, "SLICE_ELEMENTS", 1000)   # every matrix in several slices
    got = list(weight_conversion.converted_params(fp8, built, workers=2))
    ref = list(weight_conversion.converted_params(plain, built, workers=2))
    assert [n for n, _ in got] == [n for n, _ in ref]
    for (n, a), (_, b) in zip(got, ref):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), n


def _group(qc):
    return qc["config_groups"]["group_0"]


REFUSALS = {
    # name: (checkpoint, config edit, tensor edit, message)
    "int4 pack-quantized": ("ct_channel_dynamic", lambda qc: (
        qc.update(format="pack-quantized"), _group(qc).update(format="pack-quantized"),
        _group(qc)["weights"].update(type="int", num_bits=4, strategy="group", group_size=128)), None,
        # (read as a 4-bit checkpoint: tests/test_awq_gptq.py)
        r"int4 weights with quantized activations \(config group 'group_0'\): not supported, mlcc reads W4A16"),
    "int8 weights": ("ct_channel_dynamic", lambda qc: _group(qc)["weights"].update(type="int"), None,
                     r"int8 weights \(compressed-tensors config group 'group_0'\): not supported yet"),
    "2:4 sparse": ("ct_channel_dynamic", lambda qc: qc.update(sparsity_config={
        "format": "sparse-24-bitmask", "sparsity_structure": "2:4", "targets": ["Linear"]}), None,
        r"with sparse-24-bitmask sparsity: sparse weights are not supported; use the model's dense checkpoint"),
    "unknown strategy": ("ct_channel_dynamic", lambda qc: _group(qc)["weights"].update(strategy="attn_head"), None,
                         r"FP8 weights with the 'attn_head' scale strategy \(config group 'group_0'\): not supported"),
    "asymmetric": ("ct_channel_dynamic", lambda qc: _group(qc)["weights"].update(symmetric=False), None,
                   r"asymmetric FP8 weights"),
    "static scales missing": ("ct_channel_dynamic", lambda qc: _group(qc)["input_activations"].update(
        dynamic=False, strategy="tensor"), None,
        (r"config.json says activations have static scales, but 'model.layers.0.mlp.down_proj.weight' has no "
        r"'model.layers.0.mlp.down_proj.input_scale'")),
    "static scales of a dynamic config": ("ct_tensor_static", lambda qc: _group(qc)["input_activations"].update(
        dynamic=True, strategy="token"), None,
        (r"'model.layers.0.mlp.down_proj.input_scale' is a static activation scale, but config.json says activations "
        r"are dynamic")),
    "scales of another strategy": ("ct_channel_dynamic", lambda qc: _group(qc)["weights"].update(
        strategy="block", block_structure=[32, 32]), None,
        (r"'model.layers.0.mlp.down_proj.weight_scale' has shape \[64, 1\], block scales of a \[64, 128\] weight have "
        r"\[2, 4\]")),
    "scale missing": ("hf_block", None, lambda sd: sd.pop("model.layers.0.self_attn.q_proj.weight_scale_inv"),
                      (r"'model.layers.0.self_attn.q_proj.weight' has no "
                      r"'model.layers.0.self_attn.q_proj.weight_scale_inv' beside it")),
    "ue8m0 scales": ("hf_block", lambda qc: qc.update(scale_fmt="ue8m0"), None,
                     r"an fp8 checkpoint with ue8m0 \(power-of-two\) scales: not supported yet"),
    "gptq": ("hf_block", lambda qc: (qc.clear(), qc.update(quant_method="gptq", bits=4)), None,
             r"is float8_e4m3, but config.json has no FP8 quantization_config"),
    "float8 without a config": ("hf_block", lambda qc: qc.clear(), None,
                                r"is float8_e4m3, but config.json has no FP8 quantization_config"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_cannot_be_served_is_one_error_naming_the_problem_and_the_fix(case, fp8_checkpoints, tmp_path):
    from mlcc.compiler.weights import load_source

    checkpoint, config, tensors, message = REFUSALS[case]
    folder = edited(fp8_checkpoints(checkpoint)[0], tmp_path / "model", config, tensors)
    with pytest.raises(ModelSourceError, match=message):
        load_source(folder)


def test_mlcc_compile_refuses_in_one_line(fp8_checkpoints, tmp_path):
    import subprocess
    import sys

    folder = edited(fp8_checkpoints("ct_channel_dynamic")[0], tmp_path / "model", REFUSALS["int4 pack-quantized"][1])
    r = subprocess.run([sys.executable, "-m", "mlcc", "compile", str(folder), "--output", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("mlcc: error:")]
    assert len(lines) == 1 and "int4 weights with quantized activations" in lines[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()
