// IEEE binary16 <-> binary32 conversion, the one template the runtime sources call:
// __extendXfYf2__<SrcInt, SrcRep, SrcSigBits, Dst, DstRep, DstSigBits>(bits) widens half bits to float.
#ifndef MLCC_BUILTIN_FP16_H_
#define MLCC_BUILTIN_FP16_H_

#include <cstdint>
#include <cstring>

template <typename SRC_T, typename SRC_REP_T, int SRC_SIG_BITS, typename DST_T, typename DST_REP_T,
          int DST_SIG_BITS>
inline DST_T __extendXfYf2__(SRC_T a) {
  static_assert(SRC_SIG_BITS == 10 && DST_SIG_BITS == 23 && sizeof(DST_T) == 4, "half -> float only");
  uint32_t h = static_cast<uint16_t>(a);
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);  // normal: rebias 15 -> 127
  } else if (man == 0) {
    bits = sign;  // zero
  } else {
    int shift = 0;  // subnormal half: normalize
    while ((man & 0x400u) == 0) {
      man <<= 1;
      ++shift;
    }
    bits = sign | ((113 - shift) << 23) | ((man & 0x3ffu) << 13);
  }
  DST_T out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

#endif  // MLCC_BUILTIN_FP16_H_
