"""What a quantized KV cache stores, shared by the compiler (kernels, cache geometry) and the runtime (its size).

Each key and each value row of one (token, KV head) is kept as head_dim 8-bit codes followed by its float32 scale
(absmax / the code's largest value), so a row is head_dim + 4 bytes where the model's dtype takes 2 or 4 per
element. "auto" keeps K and V in the model's dtype. The runtime reads the sizes; only the code builders at the end,
which the compiler's kernels share, import TVM (when called).

float8 codes are encoded and decoded with integer operations rather than TVM's float8 casts: those flush or
misround e4m3's subnormals on the llvm target, and these are exact (round to nearest even) on every target.
"""

from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
SCALE_BYTES = 4
# the largest code magnitude: int8 symmetric, float8 e4m3fn's largest finite value
CODE_MAX = {"int8": 127.0, "fp8_e4m3": 448.0}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def is_quantized(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype != "auto"


def row_bytes(kv_cache_dtype: str, model_dtype: str, head_dim: int) -> int:
    """Bytes one key (or value) row of one token and KV head takes in the cache."""
    if is_quantized(kv_cache_dtype):
        return head_dim + SCALE_BYTES
    return head_dim * _ITEMSIZE[model_dtype]


def bytes_per_token(kv_cache_dtype: str, model_dtype: str, layers: int, kv_heads: int, head_dim: int) -> int:
    """KV-cache bytes one token takes over every layer (K and V)."""
    return 2 * layers * kv_heads * row_bytes(kv_cache_dtype, model_dtype, head_dim)


def unsupported_reason(kv_cache_dtype: str, head_dim: int) -> str | None:
    """Why a model of this head size cannot keep a quantized cache (None: it can)."""
    if is_quantized(kv_cache_dtype) and head_dim % 4:
        return (f"--kv-cache-dtype {kv_cache_dtype} needs a head_dim that is a multiple of 4 (each row's float32 "
                f"scale sits after its codes), this model's is {head_dim}")
    return None


def encode(kv_cache_dtype: str, x):
    """The int32 (int8's range) bits of the code of float32 TIR expression x, already divided by its row's scale
    (|x| <= CODE_MAX)."""
    from tvm import tirx

    x = tirx.max(tirx.min(x, tirx.const(CODE_MAX[kv_cache_dtype], "float32")),
                 tirx.const(-CODE_MAX[kv_cache_dtype], "float32"))
    if kv_cache_dtype == "int8":
        return tirx.Cast("int32", tirx.nearbyint(x))
    i32 = "int32"
    a = tirx.abs(x)
    bits = tirx.reinterpret(i32, a)
    keep = tirx.shift_right(tirx.bitwise_and(bits, tirx.const(0x7FFFFF, i32)), tirx.const(20, i32))
    rem = tirx.bitwise_and(bits, tirx.const(0xFFFFF, i32))
    half = tirx.const(0x80000, i32)
    up = tirx.Select(tirx.Or(rem > half, tirx.And(rem == half, tirx.bitwise_and(keep, tirx.const(1, i32)) == 1)),
                     tirx.const(1, i32), tirx.const(0, i32))
    exp = tirx.shift_right(bits, tirx.const(23, i32)) - tirx.const(127 - 7, i32)
    normal = tirx.min(tirx.shift_left(exp, tirx.const(3, i32)) + keep + up, tirx.const(0x7E, i32))
    # below 2^-6 the codes are subnormal: multiples of 2^-9 (a carry to 8 is the smallest normal code, 0x08)
    subnormal = tirx.Cast(i32, tirx.nearbyint(a * tirx.const(512.0, "float32")))
    code = tirx.Select(a < tirx.const(2.0**-6, "float32"), subnormal, normal)
    return tirx.Select(x < tirx.const(0.0, "float32"), code - tirx.const(128, i32), code)


def decode(kv_cache_dtype: str, c):
    """float32 value of int8 TIR expression c holding a code (to be multiplied by its row's scale)."""
    from tvm import tirx

    if kv_cache_dtype == "int8":
        return tirx.Cast("float32", c)
    i32 = "int32"
    u = tirx.bitwise_and(tirx.Cast(i32, c), tirx.const(0xFF, i32))
    exp = tirx.bitwise_and(tirx.shift_right(u, tirx.const(3, i32)), tirx.const(15, i32))
    man = tirx.bitwise_and(u, tirx.const(7, i32))
    sub = exp == 0
    # (8 + m) * 2^(e - 10), and m * 2^-9 for the subnormals (e = 0)
    sig = tirx.Select(sub, man, man + tirx.const(8, i32))
    pow2 = tirx.reinterpret("float32", tirx.shift_left(tirx.Select(sub, tirx.const(1, i32), exp)
                                                       + tirx.const(127 - 10, i32), tirx.const(23, i32)))
    mag = tirx.Cast("float32", sig) * pow2
    return tirx.Select(u >= tirx.const(128, i32), -mag, mag)
