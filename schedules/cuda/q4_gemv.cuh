// q4f16_1 decode GEMV (schedules/cuda_gemv.py): eight 4-bit codes of one 32-bit word against their activations,
// two codes per HFMA2. MLC's layout holds code j in bits 4j..4j+3 of the word (low first).
#include <cuda_fp16.h>
__device__ __forceinline__ half2 mlcc_u2h(unsigned v) { union { unsigned u; half2 h; } c; c.u = v; return c.h; }
__device__ __forceinline__ unsigned mlcc_h2u(half2 v) { union { unsigned u; half2 h; } c; c.h = v; return c.u; }
__device__ __forceinline__ unsigned mlcc_lop3_and_or(unsigned a, unsigned b, unsigned c) {
  unsigned d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));  // (a & b) | c
  return d;
}
// acc (fp16x2 bits) += sum over the 8 codes of word w of (code - 7) * x, x given as its 4 natural-order fp16 pairs.
// `(w >> s) & 0x000F000F | 0x64006400` puts codes j and j+4 into the two fp16 halves as 1024 + code; codes 1/5 and
// 3/7 are masked in place instead (bits 4-7 and 20-23), giving 1024 + 16 * code, and brought to code - 7 by one
// HFMA2 (x 1/16, - 71) in place of the HSUB2, so a word needs one shift. Exact in fp16.
__device__ __forceinline__ unsigned mlcc_q4x8_hfma2_s1(unsigned w, unsigned x01, unsigned x23, unsigned x45,
                                                       unsigned x67, unsigned acc) {
  const half2 bias = mlcc_u2h(0x64076407u);     // 1024 + 7 in both halves
  const half2 sixteenth = mlcc_u2h(0x2C002C00u);  // 1/16
  const half2 bias16 = mlcc_u2h(0xD470D470u);     // -71 = -(1024 / 16 + 7)
  const unsigned w8 = w >> 8;
  half2 a = mlcc_u2h(acc);
  a = __hfma2(__hsub2(mlcc_u2h(mlcc_lop3_and_or(w, 0x000F000Fu, 0x64006400u)), bias),
              mlcc_u2h(__byte_perm(x01, x45, 0x5410)), a);
  a = __hfma2(__hfma2(mlcc_u2h(mlcc_lop3_and_or(w, 0x00F000F0u, 0x64006400u)), sixteenth, bias16),
              mlcc_u2h(__byte_perm(x01, x45, 0x7632)), a);
  a = __hfma2(__hsub2(mlcc_u2h(mlcc_lop3_and_or(w8, 0x000F000Fu, 0x64006400u)), bias),
              mlcc_u2h(__byte_perm(x23, x67, 0x5410)), a);
  a = __hfma2(__hfma2(mlcc_u2h(mlcc_lop3_and_or(w8, 0x00F000F0u, 0x64006400u)), sixteenth, bias16),
              mlcc_u2h(__byte_perm(x23, x67, 0x7632)), a);
  return mlcc_h2u(a);
}
__device__ __forceinline__ float mlcc_h2_sum(unsigned acc) {
  const half2 a = mlcc_u2h(acc);
  return __low2float(a) + __high2float(a);
}
