// Device-side NVFP4 decoders of the checkpoint layout (nibble 2j = element 2j), used by the
// dequantizer; the MoE mainloops decode their prepacked layout instead
// (sm90/sm90_w4a16_decode.cuh). Exact by construction: an e2m1 value
// times a ue4m3 scale has at most 6 significant bits and lies in [2^-10, 2688], so it is exactly
// representable in bf16 (docs/design.md §2); every step below is a bit move or an exact product.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>

namespace megamoe::kernels {

// e2m1 -> bf16 by two-level `prmt` lookup. Every bf16 byte an e2m1 value needs (the low byte
// of a magnitude, the high byte with or without the sign) is one of 7 distinct bytes, so they fit
// one 8-byte prmt pool. A first lookup maps each code's magnitude to a *selector byte* (low
// nibble: pool index of the low byte, high nibble: pool index of the high byte); the sign adds 4
// to the high index (pointing at the negative high bytes); a second prmt then assembles two bf16
// values at once from two selector bytes.
//   code:   0      1      2      3      4      5      6      7      (+8: negative)
//   value:  0      0.5    1      1.5    2      3      4      6
//   bf16:   0x0000 0x3F00 0x3F80 0x3FC0 0x4000 0x4040 0x4080 0x40C0 (0x8000 | ...)
// pool:     [0]=00 [1]=3F [2]=40 [3]=80 [4]=80 [5]=BF [6]=C0 [7]=00
//   high byte index: 0, 1,1,1, 2,2,2,2 (+4 when negative: 80, BF, C0)
//   low byte index:  0, 0, 3, 6, 0, 2, 3, 6
inline constexpr uint32_t kBf16BytePool0 = 0x80403F00u;    // pool bytes 3..0
inline constexpr uint32_t kBf16BytePool1 = 0x00C0BF80u;    // pool bytes 7..4
inline constexpr uint32_t kE2m1Selectors0 = 0x16131000u;   // selector bytes of codes 3..0
inline constexpr uint32_t kE2m1Selectors1 = 0x26232220u;   // selector bytes of codes 7..4

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// The four table words, held in registers across a mainloop. `prmt` overwrites its pool
// register in SASS, so with literal tables ptxas re-materialises the pool (one move) before every
// lookup. Loading them from global memory once makes them ordinary values it keeps.
inline constexpr uint32_t kSignPool = 0x80808080u;        // see e2m1x4_selectors
struct E2m1Tables {
  uint32_t pool0, pool1, sel0, sel1, sign;
};
__device__ const uint32_t kE2m1TablesInMemory[5] = {kBf16BytePool0, kBf16BytePool1, kE2m1Selectors0,
                                                    kE2m1Selectors1, kSignPool};
__device__ __forceinline__ E2m1Tables load_e2m1_tables() {
  return {__ldg(&kE2m1TablesInMemory[0]), __ldg(&kE2m1TablesInMemory[1]),
          __ldg(&kE2m1TablesInMemory[2]), __ldg(&kE2m1TablesInMemory[3]),
          __ldg(&kE2m1TablesInMemory[4])};
}

// Selector bytes of the 4 codes in the low 16 bits of `q`: the magnitude's selector, plus 0x40
// where the sign bit is set. The sign comes from prmt's sign-replicate mode: a selector nibble
// with bit 3 set yields 0xFF (the replicated msb of pool byte 0x80), a clear one yields 0x80.
__device__ __forceinline__ uint32_t e2m1x4_selectors(uint32_t q, const E2m1Tables& tab) {
  const uint32_t magnitude = prmt(tab.sel0, tab.sel1, q & 0x7777u);
  const uint32_t negative = prmt(tab.sign, tab.sign, q);
  return magnitude | (negative & 0x40404040u);
}

// Decodes the 8 e2m1 codes of one 32-bit word (nibble i = code i) into four bf16x2 registers:
//   out[j] = { lo half: code 2j, hi half: code 2j + 1 }, j = 0..3.
// Cost: 15 integer instructions for 8 values (2 selector lookups, 2 sign lookups, 4 assembling
// prmts, masks and shifts), exact for every code including -0.
__device__ __forceinline__ void decode_e2m1x8(uint32_t q, const E2m1Tables& tab, uint32_t (&out)[4]) {
  const uint32_t sel_lo = e2m1x4_selectors(q, tab);        // codes 0..3
  const uint32_t sel_hi = e2m1x4_selectors(q >> 16, tab);  // codes 4..7
  out[0] = prmt(tab.pool0, tab.pool1, sel_lo);
  out[1] = prmt(tab.pool0, tab.pool1, sel_lo >> 16);
  out[2] = prmt(tab.pool0, tab.pool1, sel_hi);
  out[3] = prmt(tab.pool0, tab.pool1, sel_hi >> 16);
}

// Two ue4m3 scale bytes (low byte first) -> float2, exact: the hardware e4m3x2 -> f16x2
// conversion keeps subnormal scales (codes 0x01..0x07 = m * 2^-9 are normal in f16).
__device__ __forceinline__ float2 ue4m3x2_to_float2(uint16_t two) {
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), __NV_E4M3);
  return __half22float2(*reinterpret_cast<__half2*>(&h));
}

}  // namespace megamoe::kernels
