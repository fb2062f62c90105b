// RMSNorm folded into a decode GEMV (schedules/cuda_gemv.py), on fp16 pairs given as 32-bit words.
#include <cuda_fp16.h>
__device__ __forceinline__ float mlcc_h2_sumsq(unsigned x) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&x));
  return f.x * f.x + f.y * f.y;
}
// fp16(rs * x * g) for an fp16 pair, in fp32 and in the order of TVM's rms_norm, so the GEMV sees its input bits
__device__ __forceinline__ unsigned mlcc_h2_rms_scale(unsigned x, unsigned g, float rs) {
  const float2 xf = __half22float2(*reinterpret_cast<const __half2*>(&x));
  const float2 gf = __half22float2(*reinterpret_cast<const __half2*>(&g));
  const __half2 r = __floats2half2_rn(rs * xf.x * gf.x, rs * xf.y * gf.y);
  return *reinterpret_cast<const unsigned*>(&r);
}
// fp16(x * g) for an fp16 pair, in fp32
__device__ __forceinline__ unsigned mlcc_h2_mul(unsigned x, unsigned g) {
  const float2 xf = __half22float2(*reinterpret_cast<const __half2*>(&x));
  const float2 gf = __half22float2(*reinterpret_cast<const __half2*>(&g));
  const __half2 r = __floats2half2_rn(xf.x * gf.x, xf.y * gf.y);
  return *reinterpret_cast<const unsigned*>(&r);
}
