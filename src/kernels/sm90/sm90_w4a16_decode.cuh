// Decode of one prepacked k16 step (sm90_w4a16_layout.h) into the four bf16x2 A registers of an
// RS wgmma, scaled by the step's block scales. Shared by every sm90 W4A16 mainloop.
//
// Cost per 8 weights (one k16 step): 5 LOP3, one rotate and one right shift on the integer pipe,
// 2 left shifts that ptxas issues as IMAD.SHL on the FMA pipe, 4 HMUL2, and for the step's two
// scales one e4m3x2 conversion and one LEA: 15 instructions. The loop is issue-bound at the
// narrow (decode) tiles, so the instruction count, not the pipe, is what the layout minimises.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>

#include "kernels/sm90/sm90_w4a16_layout.h"

namespace megamoe::kernels::sm90::w4a16 {

// Two NONZERO ue4m3 scale bytes (low byte first; half kHalf of `four`) -> bf16x2 {lo: first,
// hi: second} of (scale * 2^118), exact: the hardware e4m3x2 -> f16x2 conversion (subnormal scales 0x01..0x07
// become normal f16), then a bit move. Every nonzero scale has at most 3 mantissa bits and an
// f16 exponent field in [6, 23], so its bf16 is the f16 shifted right by 3 (the dropped mantissa
// bits are zero) with the exponent rebiased by 127 - 15 + 118; both halves move at once (the
// high half's three lowest bits, zero, are what cross into the low half, and no sum carries).
// The largest scale, 448 * 2^118 < 2^127, stays finite. A zero byte would not give 0: the
// prepack clears the codes of every block whose scale is 0, which then decode to 0.
// The conversion reads the half in place (F2FP ... R.H1): no shift to extract it.
template <int kHalf>
__device__ __forceinline__ uint32_t scale_pair_to_bf16x2(uint32_t four) {
  uint32_t bits;
  if constexpr (kHalf == 0) {
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(bits) : "r"(four));
  } else {
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}\n" : "=r"(bits) : "r"(four));
  }
  return (bits >> 3) + kScaleF16ToBf16Times2Pow118;
}

// a * (low half of s, twice) and a * (high half of s, twice): ptxas folds the half selection
// into the multiply as an operand modifier (HMUL2.BF16_V2 ... R.H0_H0 / R.H1_H1).
__device__ __forceinline__ uint32_t bf16x2_mul_lo(uint32_t a, uint32_t s) {
  const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                   __low2bfloat162(*reinterpret_cast<const __nv_bfloat162*>(&s)));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t bf16x2_mul_hi(uint32_t a, uint32_t s) {
  const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                   __high2bfloat162(*reinterpret_cast<const __nv_bfloat162*>(&s)));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// One step word + its (row r0, row r1) scale bytes -> A registers a[0..3] (layout: a[0], a[2]
// are row r0, a[1], a[3] row r1), each e2m1 * scale * 2^-8 exactly (kAccumulatorUnscale undoes
// the 2^-8 in the epilogue). The products are exact: e2m1 * scale has at most 6 significant
// bits and, times 2^-8, lies in [2^-18, 2^3.4], normal in bf16.
template <int kHalf>
__device__ __forceinline__ void decode_step(uint32_t word, uint32_t scale_pairs, uint32_t (&a)[4]) {
  const uint32_t s = scale_pair_to_bf16x2<kHalf>(scale_pairs);
  a[0] = bf16x2_mul_lo(step_register(word, 0), s);  // (r0, k 2t..2t+1)
  a[1] = bf16x2_mul_hi(step_register(word, 1), s);  // (r1, k 2t..2t+1)
  a[2] = bf16x2_mul_lo(step_register(word, 2), s);  // (r0, k 2t+8..2t+9)
  a[3] = bf16x2_mul_hi(step_register(word, 3), s);  // (r1, k 2t+8..2t+9)
}

}  // namespace megamoe::kernels::sm90::w4a16
