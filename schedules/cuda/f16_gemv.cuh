// float16 decode GEMV (schedules/cuda_gemv.py): products of fp16 pairs summed in fp32.
#include <cuda_fp16.h>
// acc + w.lo * x.lo + w.hi * x.hi in fp32, w and x given as the bits of an fp16 pair
__device__ __forceinline__ float mlcc_f16x2_fma(unsigned w, unsigned x, float acc) {
  const float2 wf = __half22float2(*reinterpret_cast<const __half2*>(&w));
  const float2 xf = __half22float2(*reinterpret_cast<const __half2*>(&x));
  return fmaf(wf.y, xf.y, fmaf(wf.x, xf.x, acc));
}
