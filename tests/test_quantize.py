"""q4 packing against a plain, loop-based reading of MLC's q4f16_1 layout (docs/ARCHITECTURE.md), bit for bit."""

import numpy as np
import pytest

from mlcc.compiler.quantize import (
    QUANTIZATIONS,
    dequantize_weight,
    get_quantization,
    group_dequantize,
    group_quantize,
    quantize_weight,
)


def reference_q4(w: np.ndarray, scale_dtype: str):
    """Straight from the spec: groups of 32 along K, q = clamp(round(w/s)+7, 0, 14), 8 nibbles per uint32 low first."""
    n, k = w.shape
    packed = np.zeros((n, k // 8), dtype=np.uint32)
    scales = np.zeros((n, k // 32), dtype=scale_dtype)
    for i in range(n):
        for g in range(k // 32):
            grp = w[i, g * 32:(g + 1) * 32].astype(np.float32)
            s = np.float32(np.abs(grp).max() / 7)
            s = np.float32(np.array(s, dtype=scale_dtype))
            scales[i, g] = s
            for j in range(32):
                q = int(np.clip(np.round(grp[j] / s) + 7, 0, 14)) if s != 0 else 7
                col = g * 32 + j
                packed[i, col // 8] |= np.uint32(q << (4 * (col % 8)))
    return packed, scales


@pytest.mark.parametrize("quant", ["q4f16_1", "q4f32_1"])
def test_packing_matches_reference_bit_for_bit(quant):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 96)).astype(np.float32)
    w[3, 32:64] = 0.0  # an all-zero group must not divide by zero
    q = get_quantization(quant)
    packed, scale = group_quantize(w, q)
    ref_p, ref_s = reference_q4(w, q.model_dtype)
    assert packed.dtype == np.uint32 and packed.shape == (8, 12)
    assert scale.dtype == np.dtype(q.model_dtype) and scale.shape == (8, 3)
    np.testing.assert_array_equal(packed, ref_p)
    np.testing.assert_array_equal(scale, ref_s)


def test_dequantize_round_trip_error_is_bounded():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    q = get_quantization("q4f32_1")
    back = group_dequantize(*group_quantize(w, q), q)
    step = np.repeat(np.abs(w).reshape(16, 2, 32).max(-1) / 7, 32, axis=1)
    assert np.all(np.abs(back - w) <= step / 2 + 1e-6)


def test_nibble_order_is_low_first():
    q = get_quantization("q4f32_1")
    w = np.zeros((1, 32), np.float32)
    w[0, 0] = 7.0   # code 14 in nibble 0
    w[0, 1] = -7.0  # code 0 in nibble 1
    packed, scale = group_quantize(w, q)
    assert scale[0, 0] == 1.0
    assert packed[0, 0] & 0xF == 14 and (packed[0, 0] >> 4) & 0xF == 0 and (packed[0, 0] >> 8) & 0xF == 7


def test_unknown_quantization_names_choices():
    with pytest.raises(ValueError, match="unknown quantization 'q3f16'.*q4f16_1"):
        get_quantization("q3f16")
    assert set(QUANTIZATIONS) >= {"q0f32", "q0f16", "q4f16_1", "q4f32_1"}


def test_k_not_multiple_of_group_is_rejected():
    with pytest.raises(ValueError, match="multiple of 32"):
        group_quantize(np.zeros((4, 48), np.float32), get_quantization("q4f16_1"))


def test_e4m3_rows_scale_to_448_and_round_to_the_nearest_code():
    import ml_dtypes

    q = get_quantization("e4m3_e4m3_f16")
    rng = np.random.default_rng(2)
    w = rng.standard_normal((6, 64)).astype(np.float32) * np.float32([[1e-3], [1.0], [30.0], [1.0], [1.0], [1.0]])
    w[3] = 0.0                 # an all-zero row must not divide by zero
    w[4, 5] = -7.5             # the row's absmax, negative
    codes, scale = quantize_weight(w, q)
    assert codes.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and codes.shape == (6, 64)
    assert scale.dtype == np.float32 and scale.shape == (6,)
    np.testing.assert_allclose(scale, np.abs(w).max(axis=1) / 448, rtol=1e-7)
    assert codes.astype(np.float32)[4, 5] == -448.0 and not np.isnan(codes.astype(np.float32)).any()
    assert (codes.astype(np.float32)[3] == 0).all()
    back = dequantize_weight(codes, scale, q)
    # 3 mantissa bits: half a step is 1/16 of the value for normal codes; subnormals (below 2^-6) step by 2^-9
    bound = np.maximum(np.abs(w) / 16, 2.0 ** -10 * scale[:, None]) * (1 + 1e-6)
    assert np.all(np.abs(back - w) <= bound)
    np.testing.assert_array_equal(codes.view(np.uint8), (w / np.where(scale == 0, 1, scale)[:, None])
                                  .astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
