"""The model's side of a quantized KV cache (--kv-cache-dtype int8 / fp8_e4m3): TVM's PagedKVCache seen as bytes.

TVM's cache allocates its pages, staging buffers and outputs in one dtype, that of the fused q/k/v it is handed
(its C++ checks they match). So the cache is created with dtype int8 and a byte geometry, and the model hands it
int8 rows:

- each KV head's key or value row is head_dim codes then the row's float32 scale (absmax / CODE_MAX): head_dim + 4
  bytes, where the model's dtype took 2 or 4 per element. The model quantizes here, before the cache; TVM's
  append, page copy and compaction kernels then move these rows as bytes, unchanged.
- each query head travels as its raw bytes padded to head_dim + 4 elements of the model's dtype, i.e. itemsize
  rows of head_dim + 4 bytes ("q heads" of the cache = itemsize x the model's), and the attention output comes
  back the same way.

Only the attention kernels know the layout: they read q and write the output through a model-dtype view of these
bytes, and dequantize K and V on load (schedules/cpu_attention.py). RoPE therefore runs in the model (rope.py), on
the float q and k, before k is quantized.
"""

from __future__ import annotations

import dataclasses

from tvm import te, tirx
from tvm.relax.frontend.nn import Tensor, op

from mlcc import kv_cache_format

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
_BITS = {"float16": "int16", "bfloat16": "int16", "float32": "int32"}


@dataclasses.dataclass(frozen=True)
class QuantKVLayout:
    """The byte geometry of one shard's cache for a model of this attention shape."""

    kv_cache_dtype: str
    model_dtype: str
    q_heads: int
    kv_heads: int
    head_dim: int

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.model_dtype]

    @property
    def row(self) -> int:
        """The cache's head_dim: bytes of one K/V row (codes, then the scale), elements of one padded q head."""
        return self.head_dim + kv_cache_format.SCALE_BYTES

    @property
    def cache_q_heads(self) -> int:
        return self.itemsize * self.q_heads


def _bytes_of(x, dtype: str):
    """The int32 holding the bits of float TIR expression x of dtype."""
    return tirx.Cast("int32", tirx.reinterpret(_BITS[dtype], x)) if dtype != "float32" else tirx.reinterpret(
        "int32", x)


def pack_qkv(qkv: Tensor, layout: QuantKVLayout) -> Tensor:
    """[tokens, q + 2 kv heads, head_dim] in the model's dtype → the cache's int8 [tokens, cache q + 2 kv heads,
    row]: q as raw bytes, K and V rows quantized."""
    L = layout
    hq, hkv, d, B, row = L.q_heads, L.kv_heads, L.head_dim, L.itemsize, L.row
    code_max = kv_cache_format.CODE_MAX[L.kv_cache_dtype]

    def compute(x: te.Tensor) -> te.Tensor:
        n = x.shape[0]
        k = te.reduce_axis((0, d), name="k")
        absmax = te.compute((n, 2 * hkv), lambda t, j: te.max(tirx.abs(x[t, hq + j, k].astype("float32")), axis=k),
                            name="kv_absmax")

        def byte(t, r, c):
            # q: head r // B, byte p of its B * row bytes; element p // B of it, byte p % B of that element
            p = (r % B) * row + c
            e = p // B
            qbits = _bytes_of(x[t, tirx.min(r // B, hq - 1), tirx.min(e, d - 1)], L.model_dtype)
            qbyte = tirx.Select(e < d, tirx.Cast("int8", tirx.bitwise_and(
                tirx.shift_right(qbits, (p % B * 8).astype("int32")), tirx.const(0xFF, "int32"))),
                tirx.const(0, "int8"))
            j = tirx.max(r - B * hq, 0)
            amax = absmax[t, j]
            inv = tirx.Select(amax > 0, tirx.const(code_max, "float32") / amax, tirx.const(0.0, "float32"))
            code = kv_cache_format.encode(L.kv_cache_dtype, x[t, hq + j, tirx.min(c, d - 1)].astype("float32")
                                          * inv).astype("int8")
            sbits = tirx.reinterpret("int32", amax / tirx.const(code_max, "float32"))
            sbyte = tirx.Cast("int8", tirx.bitwise_and(tirx.shift_right(sbits, ((c - d) * 8).astype("int32")),
                                                       tirx.const(0xFF, "int32")))
            kv = tirx.Select(c < d, code, sbyte)
            return tirx.Select(r < B * hq, qbyte, kv)

        return te.compute((n, B * hq + 2 * hkv, row), byte, name="kv_pack")

    return op.tensor_expr_op(compute, "kv_quant_pack", [qkv])


def unpack_output(o: Tensor, layout: QuantKVLayout) -> Tensor:
    """The cache's int8 attention output [tokens, cache q heads, row] → [tokens, q heads, head_dim] in the model's
    dtype."""
    L = layout
    hq, d, B, row = L.q_heads, L.head_dim, L.itemsize, L.row

    def compute(x: te.Tensor) -> te.Tensor:
        def value(t, h, e):
            bits = tirx.const(0, "int32")
            for k in range(B):
                p = e * B + k
                b = tirx.bitwise_and(x[t, h * B + p // row, p % row].astype("int32"), tirx.const(0xFF, "int32"))
                bits = tirx.bitwise_or(bits, tirx.shift_left(b, tirx.const(8 * k, "int32")))
            if L.model_dtype == "float32":
                return tirx.reinterpret("float32", bits)
            return tirx.reinterpret(L.model_dtype, bits.astype("int16"))

        return te.compute((x.shape[0], hq, d), value, name="kv_unpack")

    return op.tensor_expr_op(compute, "kv_quant_unpack", [o])

