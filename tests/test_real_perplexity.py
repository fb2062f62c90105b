"""Perplexity guard (slow): every weight scheme that runs on the CPU keeps its recorded perplexity on the real
SmolLM2-135M-Instruct (the bundled Q4_1 GGUF, on Hamlet) and Qwen2.5-Coder-0.5B-Instruct (its Q4_K_M GGUF, on
Python's argparse.py), and the schemes keep their measured distance from the published weights (q0f32).

The slice: the first 512-token chunk of each text, llama-perplexity's method (`mlcc perplexity --context 512
--chunks 1`: 255 tokens scored), small because the float16 schemes' CPU prefill is slow (2-11 tok/s on the shared
2-core machine, against 40-75 for the float32 ones). RECORDED was measured with 2 threads; 1 thread (q0f32, q8f32_1,
q4f32_1) and a second run (all of SmolLM2's schemes) gave the same values to the 4 decimals printed, as did q0f32 over
8 chunks (25.3859 with 1 and 2 threads): the CPU kernels split rows across threads, not reductions. So the
tolerances are for schedule and accumulation-order changes, not run-to-run noise:

- float32 compute (q0f32, q8f32_1, q4f32_1): relative 1e-3. q0f32 is transformers float32 on the same tokens to
  1e-5, and rounding the weights to float16 alone (q0f16) moves it by 6e-4: a kernel that loses float32 accuracy, or
  a scheme that falls back to another (q8f32_1 is 2e-3 from q0f32), fails.
- float16 compute (q0f16, q8f16_1, q4f16_1, e4m3_e4m3_f16): relative 3e-3, float16 accumulation being more sensitive
  to a schedule's order; a wrong scale, bias or rotary moves perplexity by percents. It does not tell q8f16_1 from
  q0f16 (2.7e-3 apart): the int8 schemes' own tests check their codes.
- Against the published weights (q0f32 of the same GGUF): q0f16 and the q8 schemes within 1%, e4m3_e4m3_f16 within
  5% (+2.2% measured), the q4 schemes within 30% (SmolLM2's Q4_1 + Q8_0 re-quantized to symmetric 4-bit groups of
  32: +25% on this slice, +47% over 8 chunks; Qwen's Q4_K_M: +12%). llama.cpp runs the published 4-bit weights
  themselves, which is what q0f32 computes in float32 (25.399 against 25.386 over 8 chunks on SmolLM2): mlcc's q4
  re-quantizes an already 4-bit file, so "q4 within llama.cpp Q4_K_M's perplexity" does not hold and is not asserted.

    python -m pytest -q -m slow tests/test_real_perplexity.py --timeout 1800
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from mlcc.runtime.serve.perplexity import run_perplexity

pytestmark = pytest.mark.slow

CONTEXT, CHUNKS = 512, 1
F32_TOLERANCE, F16_TOLERANCE = 1e-3, 3e-3
# (model, scheme) -> ppl on the slice (`mlcc perplexity --target llvm --context 512 --chunks 1`, 2 threads)
RECORDED = {
    ("smollm2", "q0f32"): 7.7428,
    ("smollm2", "q0f16"): 7.7477,
    ("smollm2", "q8f32_1"): 7.7590,
    ("smollm2", "q8f16_1"): 7.7687,
    ("smollm2", "q4f32_1"): 9.6806,
    ("smollm2", "q4f16_1"): 9.6875,
    ("smollm2", "e4m3_e4m3_f16"): 7.9158,
    ("qwen-0.5b", "q0f32"): 6.1917,
    ("qwen-0.5b", "q4f32_1"): 6.9238,
}
# largest ppl / q0f32 ppl of the same model on the slice
BOUND_OVER_Q0F32 = {"q0f16": 1.01, "q8f32_1": 1.01, "q8f16_1": 1.01, "e4m3_e4m3_f16": 1.05, "q4f32_1": 1.3,
                    "q4f16_1": 1.3}
_measured: dict[tuple[str, str], float] = {}


def _model_and_text(model: str) -> tuple[Path, Path]:
    from test_perplexity import hamlet
    from test_real_weights import CACHE, qwen_coder_gguf

    from mlcc.runtime.jit import default_model_path

    if model == "smollm2":
        return default_model_path(), hamlet(CACHE)
    return qwen_coder_gguf(), Path(argparse.__file__)


def _ppl(model: str, quant: str) -> float:
    if (model, quant) not in _measured:
        gguf, text = _model_and_text(model)
        r = run_perplexity(gguf, text, target="llvm", quant=quant, context=CONTEXT, chunks=CHUNKS)
        assert (r.chunks, r.scored_tokens) == (CHUNKS, CHUNKS * (CONTEXT // 2 - 1))
        print(f"{model} {quant}: ppl {r.ppl:.4f} ({r.tokens_per_second:.1f} tok/s)")
        _measured[model, quant] = r.ppl
    return _measured[model, quant]


@pytest.mark.parametrize("model,quant", list(RECORDED), ids=[f"{m}-{q}" for m, q in RECORDED])
def test_perplexity_stays_at_the_recorded_value(model, quant):
    from mlcc.quantization import get_quantization

    tolerance = F32_TOLERANCE if get_quantization(quant).model_dtype == "float32" else F16_TOLERANCE
    ppl = _ppl(model, quant)
    assert math.isclose(ppl, RECORDED[model, quant], rel_tol=tolerance), (model, quant, ppl, RECORDED[model, quant])


@pytest.mark.parametrize("model,quant", [k for k in RECORDED if k[1] != "q0f32"], ids=lambda x: x)
def test_distance_from_the_published_weights(model, quant):
    ratio = _ppl(model, quant) / _ppl(model, "q0f32")
    assert 1 / BOUND_OVER_Q0F32[quant] < ratio <= BOUND_OVER_Q0F32[quant], (model, quant, ratio)
