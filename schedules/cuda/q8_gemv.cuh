// int8 decode GEMV (schedules/cuda_gemv.py): four int8 codes of one 32-bit word against their activations, two
// codes per HFMA2. q8f16_1 holds code j in byte j of the word, stored + 128. One PRMT puts bytes 0 and 2 (or 1 and
// 3) under a 0x64 high byte, which reads as the fp16 pair 1024 + code (exact: fp16 counts by ones from 1024 to
// 2048), and one HFMA2 (x 1/128, - 9) makes it (code - 128) / 128, exact and within [-1, 1): a unit's 16 products
// stay far from fp16's range whatever the activations, and the 128 is folded into the group's scale.
#include <cuda_fp16.h>
// acc (fp16x2 bits) += the 4 codes of word w, as (code - 128) / 128, times x, given as its 2 natural-order fp16 pairs
__device__ __forceinline__ unsigned mlcc_q8x4_hfma2(unsigned w, unsigned x01, unsigned x23, unsigned acc) {
  const half2 scale = mlcc_u2h(0x20002000u);  // 1/128
  const half2 bias = mlcc_u2h(0xC880C880u);   // -9 = -(1024 / 128 + 1)
  half2 a = mlcc_u2h(acc);
  a = __hfma2(__hfma2(mlcc_u2h(__byte_perm(w, 0x64646464u, 0x4240)), scale, bias),
              mlcc_u2h(__byte_perm(x01, x23, 0x5410)), a);
  a = __hfma2(__hfma2(mlcc_u2h(__byte_perm(w, 0x64646464u, 0x4341)), scale, bias),
              mlcc_u2h(__byte_perm(x01, x23, 0x7632)), a);
  return mlcc_h2u(a);
}
