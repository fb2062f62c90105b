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
