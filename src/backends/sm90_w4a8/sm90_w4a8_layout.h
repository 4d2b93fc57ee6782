// What the sm90 W4A8 operands look like (docs/w4a8.md): how the W4A16 prepacked weights
// (sm90_w4a16_layout.h, one copy for both precisions) feed the fp8 wgmma A fragment, the K order
// the activations must be stored in to match, and the per-tensor constant that carries k. Host
// (prepack, tests) and device (decode, activation quantization) both include this file, which
// also holds the activation scale's exponent rule, shared the same way.
//
// The fp8 A fragment. wgmma m64nNk32 .e4m3 with A from registers gives thread (warp w, lane
// 4g + t) of the warpgroup four registers of four bytes (PTX ISA, "Register fragment of A";
// CUTLASS GMMA::ALayout_64x32), r0 = 16w + g, r1 = r0 + 8:
//     reg 0 = (row r0, fragment k 4t..4t+3)     reg 1 = (row r1, fragment k 4t..4t+3)
//     reg 2 = (row r0, fragment k 16+4t..19+4t)  reg 3 = (row r1, fragment k 16+4t..19+4t)
// byte i of a register holding fragment k 4t+i (+16).
//
// The prepacked weights give the same thread, per k16 step s, the codes of (rows r0, r1) x
// (k 2t, 2t+1, 2t+8, 2t+9) (sm90_w4a16_layout.h): per row, a thread holds the k of fragment
// positions 4t..4t+3 of the bf16 fragment, not of the fp8 one. No shuffle between threads is
// needed, because a GEMM's K may be permuted as long as both operands use the same order: the
// decode puts step 2j's elements a4, a0, a5, a1 (row r0) into reg 0 bytes 0..3, a6, a2, a7, a3
// (row r1) into reg 1, and step 2j + 1's likewise into regs 2 and 3 (the order the table decode's
// PRMT selectors come cheapest in: sm90_w4a8_decode_table.h). So fragment position p of a k32
// step holds logical k = k_of_position(p): K is permuted within each aligned 16,
//     position 4t + i  <-  k 2t + (8, 0, 9, 1)[i]        (t, i in 0..3)
//     p: 0 1 2 3   4 5  6 7   8 9 10 11  12 13 14 15
//     k: 8 0 9 1  10 2 11 3  12 4 13  5  14  6 15  7
// and the activations (the B operand, K-major in shared memory) must hold logical k
// k_of_position(p) at byte p of every 16. The activation quantization writes its codes in that
// order (sm90_w4a8_act_quant.cuh); a 128-element activation block (one scale) is a whole number
// of 16s, so the permutation never crosses a block. Each fp8 register holds 4 weights of one row
// and one k16 step, so one block scale per register, as in the W4A16 decode.
//
// The decode's scale constant. The decode (sm90_w4a8_decode.cuh) multiplies each weight's
// e2m1 * 2^-14 (f16) by s * 2^(9-k) (f16) and then by 32: the f16 of s * 2^(9-k) is the
// prepacked scale byte shifted to the f16 exponent and mantissa fields (value s * 2^6) plus
// (3 - k) in both exponent fields of the pair, scale_exponent_addend(k), one integer constant per
// (expert, projection). k must be the tensor's own (format::w4a8_weight_rescale_exponent): then
// s * 2^-k <= 448/6 for every scale of the tensor and the f16 scale stays in [2^-3, 38229].
#pragma once

#include <cstdint>

namespace megamoe::kernels::sm90::w4a8 {

inline constexpr int kFragmentK = 32;            // K of one fp8 wgmma (one A fragment)
inline constexpr int kMinRescaleExponent = -15;  // k of a tensor whose largest scale is 2^-9
inline constexpr int kMaxRescaleExponent = 3;    // k of a tensor whose largest scale is >= 320

// Logical k of fragment (or activation storage) position p, and its inverse; both keep the
// aligned 16 that p or k lies in.
constexpr int k_of_position(int p) {
  constexpr int kOffset[4] = {8, 0, 9, 1};
  return (p & ~15) + 2 * ((p >> 2) & 3) + kOffset[p & 3];
}
constexpr int position_of_k(int k) {
  constexpr int kByte[4] = {1, 3, 0, 2};  // by (k & 1) + 2 * ((k >> 3) & 1)
  return (k & ~15) + 4 * ((k >> 1) & 3) + kByte[(k & 1) + 2 * ((k >> 3) & 1)];
}

// The f16x2 integer addend that turns a pair of prepacked scales, shifted into f16's fields
// (value s * 2^6), into s * 2^(9 - k): 3 - k added to both exponent fields. k in [-15, 3].
constexpr uint32_t scale_exponent_addend(int k) { return static_cast<uint32_t>(3 - k) * 0x04000400u; }

// The f16x2 bits of (e2m1 * 2^-14) of elements a_2j (low half) and a_2j+1 (high half) of a
// prepacked step word (sm90_w4a16_layout.h, code_bit_position): the sign at bits 15/31, the e2m1
// exponent bits at f16 exponent bits 11, 10 and the mantissa bit at 9 (25..27 high), which is
// exactly e2m1 * 2^-14 for all 16 codes (code 1, 0.5, becomes the f16 subnormal 2^-15). The
// layout puts a code's sign 9 bits above its lowest bit (bf16's spacing); f16 needs 6, so each
// pair is masked, copied at two shifts by one multiply (the copies do not overlap, so nothing
// carries) and masked again: 3 instructions, 4 for j = 0 (a rotate first) and 5 for j = 3 (whose
// e1 bits sit apart in the layout).
constexpr uint32_t f16_code_pair(uint32_t word, int j) {
  constexpr uint32_t kF16Bits = 0x8E008E00u;  // sign, e1, e0, m of both halves
  switch (j) {
    case 0: return ((((word << 10) | (word >> 22)) & 0x81C081C0u) * 9u) & kF16Bits;  // rotate, x (1 + 2^3)
    case 1: return ((word & 0x81C081C0u) * 9u) & kF16Bits;                            // x (1 + 2^3)
    case 2: return ((word & 0x081C081Cu) * 144u) & kF16Bits;                          // x (2^4 + 2^7)
    default:  // sign, e0, m: x (2^6 + 2^9); e1: << 1
      return (((word & 0x02030203u) * 576u) & 0x86008600u) | ((word << 1) & 0x08000800u);
  }
}

// The f16x2 {lo: row r0, hi: row r1} of s * 2^(9 - k) for step 2i + kOdd of a prepacked scale word
// (sm90_w4a16_layout.h, "Scale encoding"): the encoded byte E = (x + 21) << 3 | mmm of the scale
// 2^x * 1.mmm, moved to bits 7..14, is f16 with exponent field x + 21, i.e. s * 2^6. Scale 0
// gives 2^(3 - k - 15) or 0: finite, and its block's codes are 0. Host reference of the device
// decode (which swaps the odd step's bytes with one PRMT).
template <int kOdd>
constexpr uint32_t f16_scale_pair(uint32_t word, uint32_t exponent_addend) {
  if constexpr (kOdd) word = ((word >> 8) & 0x00FF00FFu) | ((word << 8) & 0xFF00FF00u);
  return (word & 0x0FF00FF0u) * 8u + exponent_addend;
}

// ---- activations (docs/w4a8.md §1-2; sm90_w4a8_act_quant.cuh)

inline constexpr int kActBlock = 128;              // activation elements per scale, along K
inline constexpr int kMinActScaleExponent = -126;  // 2^e and 2^-e stay normal fp32

// e of a block whose largest magnitude has the fp32 bits `amax_bits` (sign clear, finite): the
// smallest e >= -126 with amax <= 448 * 2^e. With exponent field F and mantissa field M, a
// normal amax is in [2^(F-127), 2^(F-126)) and 448 = 1.75 * 2^8 (mantissa field 0x600000):
// e = F - 135, plus 1 where M > 0x600000. F = 0 (zero, subnormal) falls under the clamp.
constexpr int act_scale_exponent(uint32_t amax_bits) {
  const int e = static_cast<int>(amax_bits >> 23) - 135 + ((amax_bits & 0x7FFFFFu) > 0x600000u ? 1 : 0);
  return e < kMinActScaleExponent ? kMinActScaleExponent : e;
}

}  // namespace megamoe::kernels::sm90::w4a8
