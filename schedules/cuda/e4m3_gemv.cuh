// float8 e4m3 decode GEMV (schedules/cuda_gemv.py): four e4m3 codes of one 32-bit word against their activations,
// two codes per HFMA2. A code becomes an fp16 by moving its bits (sign to bit 15, exponent and mantissa to bits
// 7..13), which reads as the code's value / 256 with zero and the subnormals exact: products of activations with
// codes up to 448 stay far from fp16's range, and the 256 is folded into the row's scale.
#include <cuda_fp16.h>
// two codes, in bytes 1 and 3 of t, as an fp16 pair (value / 256)
__device__ __forceinline__ unsigned mlcc_e4m3x2_as_h2(unsigned t) {
  return mlcc_lop3_and_or(t >> 1, 0x3F803F80u, t & 0x80008000u);
}
// acc (fp16x2 bits) += the 4 codes of word w (code j in byte j) / 256 times x, given as its 2 natural-order fp16 pairs
__device__ __forceinline__ unsigned mlcc_e4m3x4_hfma2(unsigned w, unsigned x01, unsigned x23, unsigned acc) {
  half2 a = mlcc_u2h(acc);
  a = __hfma2(mlcc_u2h(mlcc_e4m3x2_as_h2(__byte_perm(w, 0u, 0x1404))), mlcc_u2h(x01), a);
  a = __hfma2(mlcc_u2h(mlcc_e4m3x2_as_h2(__byte_perm(w, 0u, 0x3424))), mlcc_u2h(x23), a);
  return mlcc_h2u(a);
}
