"""Published 4-bit checkpoints (compiler/int4_checkpoint.py) kept as they are: AWQ "gemm" and GPTQ ("gptq" with its
zero points stored less one, and "gptq_v2") written here by their packing formulas, compressed-tensors pack-quantized
W4A16 written by the compressed-tensors library. Each is dequantized by a reference that is not mlcc's reader
(compressed-tensors' AutoAWQ unpacking, AutoGPTQ's torch formula, compressed-tensors' own decompression), compiled on
llvm in the scheme that keeps it (q4f32_awq / q4f32_g128: float32 math on exactly the published values) and compared
with transformers float32 carrying those dequantized weights: logits within 1e-4 and greedy ids identical. The
converted codes, scales and zero points are the published ones bit for bit. What mlcc cannot keep or read is one
ModelSourceError naming the problem and the fix."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_support import assert_matches_reference, edited, reference_model, rel_err
from conftest import PROMPT, write_tokenizer
from test_cuda_nvrtc import nvrtc  # noqa: F401 - the fixture

from mlcc.errors import ModelSourceError

KIND = "llama_g128"   # projections of 128 and 384 inputs: one and three groups of 128
GROUP = 128
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]   # AutoAWQ's WQLinear_GEMM.from_linear: nibble i holds column order_map[i]


def _as_int32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, np.int64).astype(np.uint32).view(np.int32))


def _quantize(w: torch.Tensor, sym: bool, g_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [out, in], float16 scales and integer zeros [out, groups]: min/max round-to-nearest per group (channels
    grouped by g_idx), as GPTQ's and AWQ's quantizers start from."""
    out = w.shape[0]
    groups = int(g_idx.max()) + 1
    scales, zeros = torch.empty(out, groups), torch.empty(out, groups)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            scales[:, g] = (torch.maximum(-lo, hi) * 2 / 15).half().float()
            zeros[:, g] = 8
        else:
            scales[:, g] = ((hi - lo) / 15).half().float()
            zeros[:, g] = torch.round(-lo / scales[:, g]).clamp(0, 15)
    codes = torch.clamp(torch.round(w / scales[:, g_idx]) + zeros[:, g_idx], 0, 15)
    return codes.to(torch.int64), scales.half(), zeros.to(torch.int64)


def _awq_pack(codes_t: torch.Tensor) -> np.ndarray:
    """[rows, cols] codes → int32 [rows, cols/8] in AWQ's order (WQLinear_GEMM.from_linear)."""
    rows, cols = codes_t.shape
    packed = np.zeros((rows, cols // 8), np.int64)
    for col in range(cols // 8):
        for i in range(8):
            packed[:, col] |= codes_t[:, col * 8 + AWQ_ORDER[i]].numpy() << (4 * i)
    return packed


def _awq_dequantize(qweight, qzeros, scales) -> tuple[torch.Tensor, torch.Tensor]:
    """(float [out, in], codes [out, in]) by compressed-tensors' AutoAWQ converter's unpacking (AutoAWQ's own)."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    iw, iz = AutoAWQConverter.unpack_awq(qweight, qzeros, 4)
    iw, iz = AutoAWQConverter.reverse_awq_order(iw, iz, 4)
    iw, iz = iw & 15, iz & 15
    w = (iw - iz.repeat_interleave(GROUP, 0)).float() * scales.float().repeat_interleave(GROUP, 0)
    return w.T.contiguous(), iw.T.to(torch.uint8)


def _gptq_dequantize(qweight, qzeros, scales, g_idx, v1: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float [out, in], codes [out, in]) by AutoGPTQ's torch dequantization (qlinear_cuda_old), v1's +1 included."""
    wf = torch.arange(0, 32, 4, dtype=torch.int32)
    zeros = torch.bitwise_right_shift(qzeros.unsqueeze(2).expand(-1, -1, 8), wf.unsqueeze(0)) & 15
    zeros = (zeros + (1 if v1 else 0)).reshape(scales.shape)
    weight = torch.bitwise_right_shift(qweight.unsqueeze(1).expand(-1, 8, -1), wf.unsqueeze(-1)) & 15
    weight = weight.reshape(-1, weight.shape[2])
    w = scales[g_idx.long()].float() * (weight - zeros[g_idx.long()]).float()
    return w.T.contiguous(), weight.T.to(torch.uint8)


def _write(src: Path, out: Path, stored_for, qc: dict) -> tuple[Path, dict, dict]:
    """A copy of `src` whose projections are stored by stored_for(name, w) → (tensors, dequantized, codes)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    state = load_file(out / "model.safetensors")
    stored, weights, codes = {}, {}, {}
    for name, w in state.items():
        if name.endswith("proj.weight"):
            tensors, weights[name], codes[name] = stored_for(name.removesuffix(".weight"), w.float())
            stored.update(tensors)
        else:
            stored[name] = weights[name] = w
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config))
    return out, weights, codes


def _awq_checkpoint(src: Path, out: Path) -> tuple[Path, dict, dict]:
    def stored_for(base: str, w: torch.Tensor):
        codes, scales, zeros = _quantize(w, False, torch.arange(w.shape[1]) // GROUP)
        t = {f"{base}.qweight": _as_int32(_awq_pack(codes.T)), f"{base}.qzeros": _as_int32(_awq_pack(zeros.T)),
             f"{base}.scales": scales.T.contiguous()}
        return (t, *_awq_dequantize(t[f"{base}.qweight"], t[f"{base}.qzeros"], t[f"{base}.scales"]))

    return _write(src, out, stored_for, {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                         "version": "gemm", "modules_to_not_convert": None})


def _gptq_checkpoint(src: Path, out: Path, sym: bool, fmt: str, desc_act: bool = False, group: int = GROUP
                     ) -> tuple[Path, dict, dict]:
    v1 = fmt == "gptq"

    def stored_for(base: str, w: torch.Tensor):
        k = w.shape[1]
        # act-order: channels quantized in a permuted order, group j // GROUP for the j-th of them (AutoGPTQ's g_idx)
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(k)) if desc_act else torch.arange(k)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
        codes, scales, zeros = _quantize(w, sym, g_idx.long())
        packed = np.zeros((k // 8, w.shape[0]), np.int64)
        for j in range(8):
            packed |= codes.T[j::8].numpy() << (4 * j)
        z = (zeros.T - (1 if v1 else 0)).numpy()   # [groups, out]
        qzeros = np.zeros((z.shape[0], z.shape[1] // 8), np.int64)
        for j in range(8):
            qzeros |= (z[:, j::8] & 15) << (4 * j)
        t = {f"{base}.qweight": _as_int32(packed), f"{base}.qzeros": _as_int32(qzeros),
             f"{base}.scales": scales.T.contiguous(), f"{base}.g_idx": g_idx}
        return (t, *_gptq_dequantize(t[f"{base}.qweight"], t[f"{base}.qzeros"], t[f"{base}.scales"], g_idx, v1))

    qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym, "desc_act": desc_act,
          "checkpoint_format": fmt}
    return _write(src, out, stored_for, qc)


def _compressed_tensors_checkpoint(src: Path, preset: str, out: Path) -> tuple[Path, dict, dict]:
    """`src` quantized by compressed-tensors' W4A16 presets (group 128; scales and zero points from each group's
    min/max, as llm-compressor's observers compute them), saved as llm-compressor saves it; the dequantized weights
    decompressed by compressed-tensors, the codes unpacked by it."""
    import transformers as tf
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file

    model = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]),
                              show_progress=False)
    with torch.no_grad():
        for _, m in model.named_modules():
            args = getattr(getattr(m, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            g = m.weight.reshape(m.weight.shape[0], -1, args.group_size)
            scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
            m.weight_scale.copy_(scale.reshape(m.weight_scale.shape))
            m.weight_zero_point.copy_(zp.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    write_tokenizer(out)
    compressor.decompress_model(model)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if k.endswith(".weight")}
    state = load_file(out / "model.safetensors")
    codes = {f"{b}.weight": (unpack_from_int32(state[f"{b}.weight_packed"], 4, torch.Size(state[f"{b}.weight_shape"]
                                                                                          .tolist())) + 8).to(
        torch.uint8) for b in (n.removesuffix(".weight_packed") for n in state if n.endswith(".weight_packed"))}
    return out, weights, codes


CASES = {   # name → (how it is written, the scheme that keeps it, what Int4Format.describe says)
    "awq": (lambda src, out: _awq_checkpoint(src, out), "q4f32_awq", "awq gemm, group 128, zero points"),
    "gptq_sym": (lambda src, out: _gptq_checkpoint(src, out, True, "gptq"), "q4f32_g128",
                 "gptq gptq, group 128, symmetric"),
    "gptq_v2_asym": (lambda src, out: _gptq_checkpoint(src, out, False, "gptq_v2"), "q4f32_awq",
                     "gptq gptq_v2, group 128, zero points"),
    "gptq_asym": (lambda src, out: _gptq_checkpoint(src, out, False, "gptq"), "q4f32_awq",
                  "gptq gptq, group 128, zero points"),
    "ct_sym": (lambda src, out: _compressed_tensors_checkpoint(src, "W4A16", out), "q4f32_g128",
               "compressed-tensors pack-quantized, group 128, symmetric"),
    "ct_asym": (lambda src, out: _compressed_tensors_checkpoint(src, "W4A16_ASYM", out), "q4f32_awq",
                "compressed-tensors pack-quantized, group 128, zero points"),
    "gptq_desc_act": (lambda src, out: _gptq_checkpoint(src, out, False, "gptq_v2", desc_act=True), "q4f32_awq",
                      "gptq gptq_v2, group 128, zero points, act-order"),
    "gptq_g64": (lambda src, out: _gptq_checkpoint(src, out, True, "gptq", group=64), "q4f32_g128",
                 "gptq gptq, group 64, symmetric"),
}
KEPT = [c for c in CASES if c not in ("gptq_desc_act", "gptq_g64")]


@pytest.fixture(scope="session")
def int4_checkpoints(tmp_path_factory, hf_models):
    """int4_checkpoints(name) → (folder, dequantized weights, published codes [out, in] by checkpoint name)."""
    cache: dict[str, tuple[Path, dict, dict]] = {}

    def get(name: str) -> tuple[Path, dict, dict]:
        if name not in cache:
            torch.manual_seed(0)
            cache[name] = CASES[name][0](hf_models(KIND), tmp_path_factory.mktemp(f"int4-{name}") / "model")
        return cache[name]

    return get


@pytest.mark.parametrize("name", KEPT)
def test_checkpoint_kept_4bit_matches_transformers_on_its_dequantized_weights(name, int4_checkpoints, hf_models,
                                                                             tmp_path, caplog):
    from mlcc.compiler.build import compile_model
    from mlcc.compiler.weights import load_source

    folder, weights, _ = int4_checkpoints(name)
    _, scheme, described = CASES[name]
    fmt = load_source(folder).int4.format
    assert fmt.describe() == described and fmt.scheme("float32") == scheme
    with caplog.at_level(logging.INFO, logger="mlcc.compiler.build"):
        compile_model(folder, "llvm", scheme, tmp_path / "art")
    assert [r.getMessage() for r in caplog.records if "4-bit checkpoint" in r.getMessage()] == \
        [f"4-bit checkpoint ({described}): codes, scales and zero points kept as published in {scheme}"]

    assert_matches_reference(tmp_path / "art", reference_model(hf_models(KIND), weights))


def _converted(folder: Path, scheme: str) -> dict[str, np.ndarray]:
    from mlcc.compiler import weight_conversion
    from mlcc.compiler.build import export_module
    from mlcc.compiler.weights import load_source
    from mlcc.quantization import QUANTIZATIONS
    from mlcc.targets import get_target

    source = load_source(folder)
    built = export_module(source, get_target("llvm"), QUANTIZATIONS[scheme])
    return dict(weight_conversion.converted_params(source, built, workers=2))


def _nibbles(words: np.ndarray) -> np.ndarray:
    """uint32 [rows, w] → [rows, 8w], low nibble first (mlcc's layout, mlcc.quantization)."""
    return ((words[:, :, None] >> (np.arange(8, dtype=np.uint32) * 4)) & 15).reshape(words.shape[0], -1)


@pytest.mark.parametrize("name", ["awq", "gptq_sym", "ct_asym"])
def test_codes_scales_and_zero_points_are_the_published_ones_bit_for_bit(name, int4_checkpoints):
    """No re-rounding: the stored codes are the published codes, the scales their float16 (or float32) values, the
    zero points theirs; q/k/v and gate/up stacked by rows."""
    from safetensors.torch import load_file

    folder, weights, codes = int4_checkpoints(name)
    scheme = CASES[name][1]
    params = _converted(folder, scheme)
    state = load_file(folder / "model.safetensors")
    layer = "model.layers.1"
    for ours, theirs in ((f"{layer}.self_attn.qkv_proj", [f"{layer}.self_attn.{x}_proj" for x in "qkv"]),
                         (f"{layer}.mlp.down_proj", [f"{layer}.mlp.down_proj"])):
        published = torch.cat([codes[f"{t}.weight"] for t in theirs]).numpy()
        np.testing.assert_array_equal(_nibbles(params[f"{ours}.q_weight"]), published)
        scale = params[f"{ours}.q_scale"]
        assert scale.dtype == np.float32
        if name.startswith("ct"):
            published_scale = torch.cat([state[f"{t}.weight_scale"] for t in theirs])
        else:
            published_scale = torch.cat([state[f"{t}.scales"].T for t in theirs])
        assert scale.tobytes() == published_scale.float().numpy().tobytes()
        # the zero points: what the weight minus codes·scale says they are
        w = torch.cat([weights[f"{t}.weight"] for t in theirs]).numpy()
        expected_zero = np.round(published - w / np.repeat(scale, GROUP, axis=1))
        if scheme.endswith("g128"):
            assert f"{ours}.q_zero" not in params and (expected_zero == 8).all()
        else:
            groups = scale.shape[1]
            zero = _nibbles(params[f"{ours}.q_zero"])[:, :groups]
            np.testing.assert_array_equal(np.repeat(zero, GROUP, axis=1), expected_zero)


def test_act_order_loads_dequantized_and_is_not_kept(int4_checkpoints, tmp_path):
    """A desc_act checkpoint with a scattered g_idx reads as its dequantized weights (every scheme that re-quantizes
    takes it); the 4-bit schemes refuse to keep it, naming the ones that take it."""
    from mlcc.compiler.weights import load_source

    folder, weights, _ = int4_checkpoints("gptq_desc_act")
    source = load_source(folder)
    down = "model.layers.0.mlp.down_proj.weight"
    assert source.int4_weight(down).g_idx is not None
    np.testing.assert_array_equal(source.get(down), weights[down].numpy())
    with pytest.raises(ModelSourceError, match=r"cannot be kept as published in q4f32_awq: its input channels are "
                       r"in act-order \(desc_act\) groups.*--quant q4f32_1"):
        _converted(folder, "q4f32_awq")
    params = _converted(folder, "q4f32_1")   # re-quantized from the dequantized values
    assert params["model.layers.0.mlp.down_proj.q_weight"].shape == (128, 384 // 8)


def test_symmetric_scheme_refuses_zero_points_and_float16_scales_must_be_exact(int4_checkpoints):
    folder = int4_checkpoints("awq")[0]
    with pytest.raises(ModelSourceError, match=r"zero points other than 8, which q4f32_g128 does not store; "
                       r"compile with --quant q4f32_awq"):
        _converted(folder, "q4f32_g128")
    folder = int4_checkpoints("ct_sym")[0]   # float32 scales: float16 would round them
    with pytest.raises(ModelSourceError, match=r"scales of .* are not all float16 values .* --quant q4f32_g128"):
        _converted(folder, "q4f16_g128")


def test_float16_scheme_runs_the_published_weights(int4_checkpoints, hf_models, tmp_path):
    """q4f16_awq: the same codes with float16 scales and activations, close to the float32 reference."""
    from mlcc.compiler.build import compile_model
    from mlcc.runtime.device.model import LoadedModel

    folder, weights, _ = int4_checkpoints("awq")
    compile_model(folder, "llvm", "q4f16_awq", tmp_path / "art")
    m = LoadedModel(tmp_path / "art")
    m.create_kv_cache(1, 256, 64)
    m.add_sequence(0)
    ours = m.prefill([0], [PROMPT]).numpy()[0]
    with torch.no_grad():
        ref = reference_model(hf_models(KIND), weights)(torch.tensor([PROMPT])).logits[0, -1].double().numpy()
    assert rel_err(ours, ref) < 2e-2


def test_asymmetric_scheme_quantizes_float_weights_itself():
    """q4*_awq from a float checkpoint: min/max round-to-nearest with a zero point per group, within half a step."""
    from mlcc.compiler.quant_schemes import dequantize_weight, quantize_weight
    from mlcc.quantization import QUANTIZATIONS

    w = np.random.default_rng(0).standard_normal((16, 384)).astype(np.float32)
    for name in ("q4f32_awq", "q4f32_g128"):
        q = QUANTIZATIONS[name]
        parts = quantize_weight(w, q)
        assert [p.shape for p in parts] == [(16, 48), (16, 3)] + ([(16, 1)] if name.endswith("awq") else [])
        step = np.repeat(parts[1], GROUP, axis=1)
        assert (np.abs(dequantize_weight(parts[0], parts[1], q, *parts[2:]) - w) <= step * 0.5001).all()


def _ct_weights(qc: dict) -> dict:
    return qc["config_groups"]["group_0"]["weights"]


REFUSALS = {
    "3-bit gptq": ("gptq_sym", lambda qc: qc.update(bits=3), r"a 3-bit GPTQ checkpoint: not supported"),
    "8-bit gptq": ("gptq_sym", lambda qc: qc.update(bits=8), r"a 8-bit GPTQ checkpoint: not supported"),
    "gptq marlin": ("gptq_sym", lambda qc: qc.update(checkpoint_format="marlin"),
                    r"a GPTQ checkpoint in the 'marlin' format \(another kernel's packing\): not supported"),
    "awq exllama": ("awq", lambda qc: qc.update(version="exllama"),
                    r"an AWQ checkpoint of version 'exllama' \(its own packing\): not supported"),
    "awq gemv": ("awq", lambda qc: qc.update(version="gemv"), r"an AWQ checkpoint of version 'gemv'"),
    "awq without zero points": ("awq", lambda qc: qc.update(zero_point=False), r"AWQ checkpoint without zero points"),
    "int8 pack-quantized": ("ct_sym", lambda qc: _ct_weights(qc).update(num_bits=8),
                            r"int8 pack-quantized weights \(config group 'group_0'\): not supported, mlcc reads int4"),
    "w4a8": ("ct_sym", lambda qc: qc["config_groups"]["group_0"].update(input_activations={
        "type": "int", "num_bits": 8, "dynamic": True, "strategy": "token"}),
        r"int4 weights with quantized activations"),
    "unknown method": ("awq", lambda qc: qc.update(quant_method="hqq"),
                       r"a checkpoint quantized with 'hqq', which mlcc does not read"),
    "config of another checkpoint": ("awq", lambda qc: (qc.clear(), qc.update(quant_method="gptq", bits=4)),
                                     (r"'model.layers.0.mlp.down_proj.qzeros' has shape \[3, 16\]; gptq gptq, group "
                                      r"128, symmetric of a \[16, 3072\] weight stores \[24, 2\]: the checkpoint and "
                                      r"its config.json disagree")),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_cannot_be_read_is_one_error_naming_the_problem(case, int4_checkpoints, tmp_path):
    from mlcc.compiler.weights import load_source

    checkpoint, config, message = REFUSALS[case]
    folder = edited(int4_checkpoints(checkpoint)[0], tmp_path / "model", config)
    with pytest.raises(ModelSourceError, match=message):
        load_source(folder)


def test_groups_of_64_are_read_but_not_kept(int4_checkpoints):
    """A published group that does not split into 128s reads (dequantized); keeping it is refused in one line."""
    from mlcc.compiler.weights import load_source

    folder, weights, _ = int4_checkpoints("gptq_g64")
    down = "model.layers.0.mlp.down_proj.weight"
    np.testing.assert_array_equal(load_source(folder).get(down), weights[down].numpy())
    with pytest.raises(ModelSourceError, match=r"cannot be kept as published in q4f32_g128: its groups of 64 input "
                       r"channels do not split into groups of 128; compile with --quant q4f32_1"):
        _converted(folder, "q4f32_g128")


def test_config_and_tensors_that_disagree_are_one_error(int4_checkpoints, tmp_path):
    from mlcc.compiler.weights import load_source

    folder = edited(int4_checkpoints("gptq_sym")[0], tmp_path / "model", lambda qc: qc.update(group_size=64))
    with pytest.raises(ModelSourceError, match=r"'model.layers.0.mlp.down_proj.qzeros' has shape \[3, 16\]; gptq "
                       r"gptq, group 64, symmetric of a \[128, 384\] weight stores \[6, 16\]: the checkpoint and "
                       r"its config.json disagree"):
        load_source(folder)


@pytest.mark.parametrize("quant", ["q4f16_awq", "q4f16_g128"])
def test_cuda_library_compiles_through_nvrtc(quant, int4_checkpoints, tmp_path, nvrtc):  # noqa: F811
    """mlcc's q4 CUDA kernels (GEMVs, the tensor-core GEMM) decode groups of 32 centred on 7 and refuse these
    schemes: the projections take dlight's kernels of the Relax dequantize block (and q4*_g128's prefill the
    dequantize-to-scratch + cuBLASLt path), and the whole library's source compiles for sm_90."""
    from test_cuda_nvrtc import _assert_compiles, _cuda_source

    from mlcc.compiler.build import compile_library, export_module
    from mlcc.compiler.weights import load_source
    from mlcc.quantization import QUANTIZATIONS
    from mlcc.schedules.cuda_gemv import Q4_HELPER
    from mlcc.targets import get_target

    built = export_module(load_source(int4_checkpoints("awq")[0]), get_target("cuda"), QUANTIZATIONS[quant])
    src = _cuda_source(compile_library(built, tmp_path / "model.so").mod)
    assert f"{Q4_HELPER}(" not in src
    _assert_compiles(nvrtc, src)
