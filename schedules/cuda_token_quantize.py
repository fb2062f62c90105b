"""CUDA: activations quantized per token for an FP8 GEMM (compiler/vendor_gemm.py, scheme.activations): float16
x [a, b, K] → float8 xq [a, b, K] and float32 scales xs [a, b], xs = absmax(token) / the format's largest finite value,
xq = x / xs rounded to nearest and saturated (the CUDA cast's satfinite conversion). One block per token: its threads
read the row coalesced, take the max over a warp butterfly and one shared-memory step, then write the codes.
"""

from __future__ import annotations

from tvm import tirx

from mlcc.quantization import Quantization

THREADS = 256
# the smallest scale written (an all-zero token): keeps x / xs finite
MIN_SCALE = 1e-12


def quantize_tokens_func(k: int, q: Quantization, threads: int = THREADS) -> tirx.PrimFunc:
    """The kernel for rows of `k` float16 activations, quantized to `q.activations`, over any a × b tokens (the
    (1, m, K) and (m, 1, K) activations of a many-token projection alike)."""
    from tvm.script import tirx as T

    warps = threads // 32
    per_thread = -(-k // threads)
    largest = q.float_max

    @T.prim_func(private=True, s_tir=True)
    def quantize_tokens(var_x: T.handle, var_xq: T.handle, var_xs: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        a, b = T.int64(), T.int64()
        x = T.match_buffer(var_x, (a, b, k), "float16")
        xq = T.match_buffer(var_xq, (a, b, k), q.activations)
        xs = T.match_buffer(var_xs, (a, b), "float32")
        for t in T.thread_binding(a * b, thread="blockIdx.x"):
            for ty in T.thread_binding(warps, thread="threadIdx.y"):
                for tx in T.thread_binding(32, thread="threadIdx.x"):
                    with T.sblock("quantize_tokens"):
                        T.reads()
                        T.writes()
                        m = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        red = T.sblock_alloc_buffer((warps,), "float32", scope="shared")
                        m[0] = T.float32(0)
                        for i in range(per_thread):
                            if i * threads + ty * 32 + tx < k:
                                m[0] = T.max(m[0], T.fabs(T.Cast("float32", x[t // b, t % b, i * threads + ty * 32 + tx])))
                        for o in T.unroll(5):
                            m[0] = T.max(m[0], T.call_pure_extern("float32", "__shfl_xor_sync", T.uint32(0xFFFFFFFF),
                                                                  m[0], 1 << o, 32))
                        if tx == 0:
                            red[ty] = m[0]
                        T.evaluate(T.tvm_storage_sync("shared"))
                        m[0] = T.float32(0)
                        for j in range(warps):
                            m[0] = T.max(m[0], red[j])
                        m[0] = T.max(m[0] / T.float32(largest), T.float32(MIN_SCALE))
                        if ty == 0 and tx == 0:
                            xs[t // b, t % b] = m[0]
                        for i in range(per_thread):
                            if i * threads + ty * 32 + tx < k:
                                xq[t // b, t % b, i * threads + ty * 32 + tx] = T.Cast(
                                    q.activations, T.Cast("float32", x[t // b, t % b, i * threads + ty * 32 + tx]) / m[0])

    return quantize_tokens


# What produces a projection's activations, fused into its token quantizer: the float16 tensor it would have
# written (and the quantizer read back) never makes a round trip through memory.
GATED = ("swiglu", "geglu")
GELU_TANH_C = 0.7978845608028654   # sqrt(2 / pi)


def _activation(kind: str, g):
    from tvm.script import tirx as T

    if kind == "swiglu":
        return g * T.sigmoid(g)
    return T.float32(0.5) * g * (T.float32(1) + T.tanh(T.float32(GELU_TANH_C) * (g + T.float32(0.044715) * g * g * g)))


def _block_reduce(value, red, ty, tx, warps: int, combine):
    """value[0] of every thread of the block combined (max or sum) into every thread's value[0], through a warp
    butterfly and one shared-memory step (red: a (warps,) shared buffer used by this reduction only)."""
    from tvm.script import tirx as T

    @T.macro
    def reduce():
        for o in T.unroll(5):
            value[0] = combine(value[0], T.call_pure_extern("float32", "__shfl_xor_sync", T.uint32(0xFFFFFFFF),
                                                            value[0], 1 << o, 32))
        if tx == 0:
            red[ty] = value[0]
        T.evaluate(T.tvm_storage_sync("shared"))
        value[0] = red[0]
        for j in range(1, warps):
            value[0] = combine(value[0], red[j])

    return reduce


def quantize_produced_tokens_func(k: int, q: Quantization, producer: str, eps: float = 0.0,
                                  threads: int = THREADS) -> tirx.PrimFunc:
    """The token quantizer with the kernel before it fused in, over any a × b tokens of `k` outputs:
    producer "swiglu"/"geglu": (gate_up [a, b, 2k] float16, xq, xs), x = act(gate) * up;
    producer "rms_norm": (h [a, b, k] float16, weight [k] float16, xq, xs), x = h / rms(h) * weight (`eps`).
    x is rounded to float16 as the unfused kernel stores it, held in registers (k / threads a thread), then
    quantized as quantize_tokens_func does."""
    from tvm.script import tirx as T

    warps = threads // 32
    per_thread = -(-k // threads)
    largest = q.float_max
    act = q.activations
    gated = producer in GATED
    if not gated and producer != "rms_norm":
        raise ValueError(f"no fused token quantizer for {producer!r}")

    def at(i, ty, tx):
        return i * threads + ty * 32 + tx

    def fp16(v):
        return T.Cast("float32", T.Cast("float16", v))

    @T.macro
    def write_codes(v, m, xq, xs, t, b, ty, tx):
        """m[0]: the token's absmax; v: this thread's activations."""
        m[0] = T.max(m[0] / T.float32(largest), T.float32(MIN_SCALE))
        if ty == 0 and tx == 0:
            xs[t // b, t % b] = m[0]
        for i in T.unroll(per_thread):
            if at(i, ty, tx) < k:
                xq[t // b, t % b, at(i, ty, tx)] = T.Cast(act, v[i] / m[0])

    @T.prim_func(private=True, s_tir=True)
    def quantize_gated_tokens(var_gu: T.handle, var_xq: T.handle, var_xs: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        a, b = T.int64(), T.int64()
        gu = T.match_buffer(var_gu, (a, b, 2 * k), "float16")
        xq = T.match_buffer(var_xq, (a, b, k), act)
        xs = T.match_buffer(var_xs, (a, b), "float32")
        for t in T.thread_binding(a * b, thread="blockIdx.x"):
            for ty in T.thread_binding(warps, thread="threadIdx.y"):
                for tx in T.thread_binding(32, thread="threadIdx.x"):
                    with T.sblock("quantize_gated_tokens"):
                        T.reads()
                        T.writes()
                        v = T.sblock_alloc_buffer((per_thread,), "float32", scope="local")
                        m = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        red = T.sblock_alloc_buffer((warps,), "float32", scope="shared")
                        m[0] = T.float32(0)
                        for i in T.unroll(per_thread):
                            if at(i, ty, tx) < k:
                                v[i] = fp16(_activation(producer, T.Cast("float32", gu[t // b, t % b, at(i, ty, tx)]))
                                            * T.Cast("float32", gu[t // b, t % b, k + at(i, ty, tx)]))
                                m[0] = T.max(m[0], T.fabs(v[i]))
                        _block_reduce(m, red, ty, tx, warps, T.max)()
                        write_codes(v, m, xq, xs, t, b, ty, tx)

    @T.prim_func(private=True, s_tir=True)
    def quantize_normed_tokens(var_h: T.handle, var_w: T.handle, var_xq: T.handle, var_xs: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        a, b = T.int64(), T.int64()
        h = T.match_buffer(var_h, (a, b, k), "float16")
        w = T.match_buffer(var_w, (k,), "float16")
        xq = T.match_buffer(var_xq, (a, b, k), act)
        xs = T.match_buffer(var_xs, (a, b), "float32")
        for t in T.thread_binding(a * b, thread="blockIdx.x"):
            for ty in T.thread_binding(warps, thread="threadIdx.y"):
                for tx in T.thread_binding(32, thread="threadIdx.x"):
                    with T.sblock("quantize_normed_tokens"):
                        T.reads()
                        T.writes()
                        v = T.sblock_alloc_buffer((per_thread,), "float32", scope="local")
                        s = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        m = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        red_sum = T.sblock_alloc_buffer((warps,), "float32", scope="shared")
                        red_max = T.sblock_alloc_buffer((warps,), "float32", scope="shared")
                        s[0] = T.float32(0)
                        for i in T.unroll(per_thread):
                            if at(i, ty, tx) < k:
                                v[i] = T.Cast("float32", h[t // b, t % b, at(i, ty, tx)])
                                s[0] = s[0] + v[i] * v[i]
                        _block_reduce(s, red_sum, ty, tx, warps, lambda x, y: x + y)()
                        s[0] = T.rsqrt(s[0] / T.float32(k) + T.float32(eps))
                        m[0] = T.float32(0)
                        for i in T.unroll(per_thread):
                            if at(i, ty, tx) < k:
                                v[i] = fp16(v[i] * s[0] * T.Cast("float32", w[at(i, ty, tx)]))
                                m[0] = T.max(m[0], T.fabs(v[i]))
                        _block_reduce(m, red_max, ty, tx, warps, T.max)()
                        write_codes(v, m, xq, xs, t, b, ty, tx)

    return quantize_gated_tokens if gated else quantize_normed_tokens
