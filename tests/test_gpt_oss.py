"""gpt-oss compiled for the CPU against transformers on a small random config (attention sinks, biases on q/k/v/o,
sliding and full layers with a prompt longer than the window, YaRN, the biased router and experts with the clamped
SwiGLU, tokens on different experts): q0f32 logits rel. err ≤ 1e-4 and 32 greedy ids identical; ragged batches and
a forked sequence (the sink counted once when a decode reads two chunks); an MXFP4 checkpoint's experts kept in
MXFP4 by the build; GPU targets refused in one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import PROMPT
from test_moe import expert_choices
from test_parity import hf_logits, hf_model, rel_err, run_greedy

from mlcc.compiler import mxfp4_checkpoint
from mlcc.runtime.device.model import LoadedModel


def test_q0f32_prefill_decode_and_32_greedy_tokens(compiled, hf_models):
    hf = hf_model(hf_models("gpt_oss"))
    choices = expert_choices(hf, PROMPT)
    assert len(set(choices)) >= len(PROMPT) // 3, f"too few distinct expert sets: {choices}"
    m = LoadedModel(compiled("gpt_oss"))
    m.create_kv_cache(2, 256, 64)
    ours = run_greedy(m, hf, PROMPT, 32, 1e-4)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(PROMPT):].tolist()
    assert ours == ref


def test_sinks_change_the_logits(hf_models):
    """The reference itself: without its sinks the model's logits move far beyond the tolerance (so the parity
    test sees them)."""
    hf = hf_model(hf_models("gpt_oss"))
    base = hf_logits(hf, PROMPT)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    assert rel_err(hf_logits(hf, PROMPT), base) > 1e-2


def check_ragged_batch_and_fork(folder, hf, fork_tokens: list[int]) -> None:
    """Two sequences prefilled and decoded together, then a child forked from the first that decodes
    `fork_tokens`: its steps read the shared pages and its own in two chunks."""
    m = LoadedModel(folder)
    m.create_kv_cache(4, 256, 64)
    a, b = PROMPT[:7], PROMPT[2:]
    m.add_sequence(0)
    m.add_sequence(1)
    for lg, ids in ((m.prefill([0, 1], [a, b]).numpy(), (a, b)), (m.decode([0, 1], [11, 22]).numpy(),
                                                                  (a + [11], b + [22]))):
        assert max(rel_err(lg[i], hf_logits(hf, ids[i])[-1]) for i in (0, 1)) <= 1e-4
    m.fork_sequence(0, 2)
    m.popn(2, 1)
    for n in range(1, len(fork_tokens) + 1):
        lg = m.decode([2], [fork_tokens[n - 1]]).numpy()
        assert rel_err(lg[0], hf_logits(hf, a + fork_tokens[:n])[-1]) <= 1e-4


def test_ragged_batch_and_a_forked_sequence(compiled, hf_models):
    check_ragged_batch_and_fork(compiled("gpt_oss"), hf_model(hf_models("gpt_oss")), [33, 44, 55])


def test_gpu_targets_refused_in_one_line(hf_models):
    from mlcc.compiler.build import export_module
    from mlcc.compiler.quantize import get_quantization
    from mlcc.compiler.weights import load_source
    from mlcc.errors import UnsupportedConfigError
    from mlcc.targets import get_target

    for target in ("cuda", "webgpu"):
        with pytest.raises(UnsupportedConfigError, match="attention sinks.*--target llvm") as e:
            export_module(load_source(hf_models("gpt_oss")), get_target(target), get_quantization("q4f16_1"))
        assert "\n" not in str(e.value)


def test_mxfp4_roundtrip():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 5, 64)).astype(np.float32)
    blocks, scales = mxfp4_checkpoint.quantize(w)
    assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2)
    once = mxfp4_checkpoint.dequantize(blocks, scales)
    assert np.abs(once - w).max() <= 0.5 * np.abs(w).max()   # 4-bit
    np.testing.assert_array_equal(mxfp4_checkpoint.dequantize(*mxfp4_checkpoint.quantize(once)), once)


def write_mxfp4_checkpoint(src, ref, ckpt) -> None:
    """`src` written as OpenAI publishes gpt-oss into `ckpt` (experts as MXFP4 blocks and scales, quantization_config
    mxfp4), and into `ref` the same values in float."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    packed, floats = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4_checkpoint.quantize(tensors[name].swapaxes(1, 2))   # stored [E, out, in]
        floats[name] = np.ascontiguousarray(mxfp4_checkpoint.dequantize(blocks, scales).swapaxes(1, 2))
        del packed[name]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
    for folder, weights in ((ref, floats), (ckpt, packed)):
        shutil.copytree(src, folder)
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                      "model.layers.*.mlp.router"]}
    (ckpt / "config.json").write_text(json.dumps(cfg))


def test_mxfp4_checkpoint_matches_its_dequantized_weights(hf_models, tmp_path):
    """A checkpoint written as OpenAI publishes gpt-oss against transformers carrying the same values in float."""
    from mlcc.compiler.build import compile_model

    ref, ckpt = tmp_path / "float", tmp_path / "mxfp4"
    write_mxfp4_checkpoint(hf_models("gpt_oss"), ref, ckpt)
    compile_model(ckpt, "llvm", "q0f32", tmp_path / "art")
    assert_mxfp4_experts(tmp_path / "art", 8, 64, 64)
    m = LoadedModel(tmp_path / "art")
    m.create_kv_cache(1, 256, 64)
    run_greedy(m, hf_model(ref), PROMPT, 4, 1e-4)


def assert_mxfp4_experts(folder, experts: int, hidden: int, inter: int) -> None:
    """The build stores the experts as MXFP4 (codes eight a uint32, one uint8 exponent per 32), not as floats."""
    params = {p["name"]: p for p in json.loads((folder / "mlcc-config.json").read_text())["params"]}
    for proj, out, k in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
        base = f"model.layers.0.mlp.experts.{proj}"
        assert f"{base}.weight" not in params
        assert (params[f"{base}.q_weight"]["dtype"], params[f"{base}.q_weight"]["shape"]) == (
            "uint32", [experts, out, k // 8])
        assert (params[f"{base}.q_scale"]["dtype"], params[f"{base}.q_scale"]["shape"]) == (
            "uint8", [experts, out, k // 32])


def test_mxfp4_expert_gemv_decodes_every_code_and_exponent():
    """The expert GEMV over MXFP4 weights (random bytes: every code) against numpy's dequantized product, each row
    with one exponent, subnormal powers of two (exponents 0 and 1) included: rel. err per row ≤ 1e-6."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend import nn

    from mlcc.compiler.quant_schemes import pack_codes
    from mlcc.quantization import MXFP4
    from mlcc.relax_models.moe_gemm import expert_gemv
    from mlcc.relax_models.moe_kernels import ExpertFormat

    experts, n, k = 3, 8, 64
    target = tvm.target.Target("llvm")

    class Kernel(nn.Module):
        def forward(self, x, ids, w, s):
            return expert_gemv(x, ids, [w, s], ExpertFormat("float32", MXFP4), n, target)

    mod, _ = Kernel().export_tvm({"forward": {
        "x": nn.spec.Tensor((1, k), "float32"), "ids": nn.spec.Tensor((experts,), "int32"),
        "w": nn.spec.Tensor((experts, n, k // 8), "uint32"), "s": nn.spec.Tensor((experts, n, k // 32), "uint8")}})
    vm = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (experts, n, k // 32, 16), dtype=np.uint8)
    words = pack_codes(mxfp4_checkpoint.unpacked_codes(blocks).reshape(-1, k), MXFP4).reshape(experts, n, k // 8)
    for exps, magnitude in (([2, 60, 126, 127, 128, 180], 1.0), ([0, 1], 2.0 ** 100)):
        row_exp = np.resize(np.asarray(exps, np.uint8), experts * n).reshape(experts, n, 1)
        scales = np.ascontiguousarray(np.broadcast_to(row_exp, (experts, n, k // 32)))
        x = (rng.standard_normal((1, k)) * magnitude).astype(np.float32)
        ref = mxfp4_checkpoint.dequantize(blocks, scales).astype(np.float64) @ x[0].astype(np.float64)
        out = vm["forward"](*(tvm.runtime.tensor(a) for a in (x, np.arange(experts, dtype=np.int32), words,
                                                                scales))).numpy()
        err = np.abs(out - ref).max(axis=-1) / np.abs(ref).max(axis=-1)
        assert err.max() <= 1e-6, (exps, err)
