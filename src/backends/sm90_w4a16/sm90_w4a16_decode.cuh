// Decode of one prepacked k16 step (sm90_w4a16_layout.h) into the four bf16x2 A registers of an
// RS wgmma, scaled by the step's block scales. Shared by every sm90 W4A16 mainloop.
//
// Cost per 8 weights (one k16 step): 5 LOP3, one rotate and one right shift on the integer pipe,
// 2 left shifts that ptxas issues as IMAD.SHL on the FMA pipe, 4 HMUL2, and for the step's two
// scales one LOP3 (and one PRMT every other step): 14.5 instructions. The loop is issue-bound at the
// narrow (decode) tiles, so the instruction count, not the pipe, is what the layout minimises.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "backends/sm90_w4a16/sm90_w4a16_layout.h"

namespace megamoe::kernels::sm90::w4a16 {

// The bf16x2 {lo: row r0, hi: row r1} of (scale * 2^118) for step 2i + kOdd of a prepacked scale
// word (sm90_w4a16_layout.h, "Scale encoding"): exact for every valid scale, subnormals
// included. The even step's pair already sits in place (one LOP3); the odd step's is a byte swap
// within each half away (one PRMT more). The host reference is w4a16::scale_register.
template <int kOdd>
__device__ __forceinline__ uint32_t scale_pair_to_bf16x2(uint32_t word) {
  if constexpr (kOdd) word = __byte_perm(word, 0, 0x2301);
  // (word & mask) | high as one LOP3 with the constant in a register: written as C++ ptxas
  // splits it into an AND and an OR (a LOP3 takes one immediate).
  uint32_t bits;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(bits) : "r"(word), "n"(kScaleMask), "r"(kScaleExponentHigh));
  return bits;
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
template <int kOdd>
__device__ __forceinline__ void decode_step(uint32_t word, uint32_t scale_word, uint32_t (&a)[4]) {
  const uint32_t s = scale_pair_to_bf16x2<kOdd>(scale_word);
  a[0] = bf16x2_mul_lo(step_register(word, 0), s);  // (r0, k 2t..2t+1)
  a[1] = bf16x2_mul_hi(step_register(word, 1), s);  // (r1, k 2t..2t+1)
  a[2] = bf16x2_mul_lo(step_register(word, 2), s);  // (r0, k 2t+8..2t+9)
  a[3] = bf16x2_mul_hi(step_register(word, 3), s);  // (r1, k 2t+8..2t+9)
}

}  // namespace megamoe::kernels::sm90::w4a16
