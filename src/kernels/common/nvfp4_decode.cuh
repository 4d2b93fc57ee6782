// Device-side NVFP4 decoders shared by every sm90 kernel. Exact by construction: an e2m1 value
// times a ue4m3 scale has at most 6 significant bits and lies in [2^-10, 2688], so it is exactly
// representable in bf16 (DESIGN.md §2); every step below is a bit move or an exact product.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>

namespace megamoe::kernels {

// e2m1 magnitude (code & 7) -> bf16 bit pattern, split into its low and high byte so that one
// `prmt` per byte-half looks up four codes at once (prmt selects bytes from an 8-byte pool).
//   code:   0      1      2      3      4      5      6      7
//   value:  0      0.5    1      1.5    2      3      4      6
//   bf16:   0x0000 0x3F00 0x3F80 0x3FC0 0x4000 0x4040 0x4080 0x40C0
inline constexpr uint32_t kE2m1HiBytes0 = 0x3F3F3F00u;  // hi bytes of codes 3..0
inline constexpr uint32_t kE2m1HiBytes1 = 0x40404040u;  // hi bytes of codes 7..4
inline constexpr uint32_t kE2m1LoBytes0 = 0xC0800000u;  // lo bytes of codes 3..0
inline constexpr uint32_t kE2m1LoBytes1 = 0xC0804000u;  // lo bytes of codes 7..4

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// The four table words, held in registers across a mainloop. `prmt` overwrites its pool
// register in SASS, so with literal tables ptxas re-materialises the pool (one move) before every
// lookup. Loading them from global memory once makes them ordinary values it keeps.
struct E2m1Tables {
  uint32_t lo0, lo1, hi0, hi1;
};
__device__ const uint32_t kE2m1TablesInMemory[4] = {kE2m1LoBytes0, kE2m1LoBytes1, kE2m1HiBytes0,
                                                    kE2m1HiBytes1};
__device__ __forceinline__ E2m1Tables load_e2m1_tables() {
  return {__ldg(&kE2m1TablesInMemory[0]), __ldg(&kE2m1TablesInMemory[1]),
          __ldg(&kE2m1TablesInMemory[2]), __ldg(&kE2m1TablesInMemory[3])};
}

// Decodes the 8 e2m1 codes of one 32-bit word (nibble i = code i) into four bf16x2 registers:
//   out[j] = { lo half: code j, hi half: code j + 4 }, j = 0..3.
// Pairing nibble j with nibble j+4 puts both sign bits (bits 4j+3 and 4j+19) exactly 16 bits
// apart, so one shift moves them onto the bf16 sign bits 15 and 31 together.
// Cost: 2 logic ops for the indices, 4 table prmts, 8 interleave prmts, 4 shift+or for signs.
__device__ __forceinline__ void decode_e2m1x8(uint32_t q, const E2m1Tables& tab, uint32_t (&out)[4]) {
  const uint32_t idx_lo = q & 0x77777777u;  // magnitudes; prmt reads the low 4 nibbles
  const uint32_t idx_hi = idx_lo >> 16;
  const uint32_t lo_a = prmt(tab.lo0, tab.lo1, idx_lo);  // lo bytes of codes 0..3
  const uint32_t hi_a = prmt(tab.hi0, tab.hi1, idx_lo);  // hi bytes of codes 0..3
  const uint32_t lo_b = prmt(tab.lo0, tab.lo1, idx_hi);  // codes 4..7
  const uint32_t hi_b = prmt(tab.hi0, tab.hi1, idx_hi);
  const uint32_t c01 = prmt(lo_a, hi_a, 0x5140);  // bf16x2 {code0, code1}
  const uint32_t c23 = prmt(lo_a, hi_a, 0x7362);  // {code2, code3}
  const uint32_t c45 = prmt(lo_b, hi_b, 0x5140);  // {code4, code5}
  const uint32_t c67 = prmt(lo_b, hi_b, 0x7362);  // {code6, code7}
  out[0] = prmt(c01, c45, 0x5410) | ((q << 12) & 0x80008000u);  // {code0, code4}
  out[1] = prmt(c01, c45, 0x7632) | ((q << 8) & 0x80008000u);   // {code1, code5}
  out[2] = prmt(c23, c67, 0x5410) | ((q << 4) & 0x80008000u);   // {code2, code6}
  out[3] = prmt(c23, c67, 0x7632) | (q & 0x80008000u);          // {code3, code7}
}

// Two ue4m3 scale bytes (low byte first) -> float2, exact: the hardware e4m3x2 -> f16x2
// conversion keeps subnormal scales (codes 0x01..0x07 = m * 2^-9 are normal in f16).
__device__ __forceinline__ float2 ue4m3x2_to_float2(uint16_t two) {
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), __NV_E4M3);
  return __half22float2(*reinterpret_cast<__half2*>(&h));
}

// A scale as a bf16x2 register holding it twice (both halves multiply by the same block scale).
// Exact: every ue4m3 value has 4 significant bits and lies inside bf16's normal range.
__device__ __forceinline__ uint32_t bf16x2_splat(float v) {
  const __nv_bfloat162 b = __float2bfloat162_rn(v);
  return *reinterpret_cast<const uint32_t*>(&b);
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                             *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

}  // namespace megamoe::kernels
