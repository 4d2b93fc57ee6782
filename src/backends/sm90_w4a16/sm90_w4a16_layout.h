// The prepacked NVFP4 weight layout read by the sm90 W4A16 grouped GEMM. Host (prepack) and
// device (mainloop) both include this file; it is the single source of truth for the layout.
//
// The weights are the A operand of `wgmma ... m64nNk16` taken from REGISTERS (decoded weights
// are born in registers, and wgmma reads B only from shared memory): M = output features,
// N = tokens. The register fragment of A for one k16 step gives thread (warp w, lane 4g + t)
// of the warpgroup the 8 elements
//     a0,a1 = (row r0, k 2t, 2t+1)    a2,a3 = (row r1, k 2t, 2t+1)
//     a4,a5 = (row r0, k 2t+8, 2t+9)  a6,a7 = (row r1, k 2t+8, 2t+9),  r0 = 16w + g, r1 = r0 + 8.
// Prepacking reshuffles the checkpoint's code bits and re-encodes each scale byte one-to-one
// (nothing is rounded: the codes' bits move, every scale keeps its exact value; a block with
// scale 0 stores codes 0) so that:
//   * one 16-byte load gives a thread its codes for 4 k16 steps (one 64-wide K chunk); the 128
//     threads of a warpgroup read one contiguous 2 KiB block per (64-row tile, K chunk);
//   * word s of those 16 bytes holds the step-s codes of elements a_0..a_7, their bits placed
//     (below) so that each bf16x2 A register j = {a_2j, a_2j+1} is one mask of a shifted or
//     rotated word (one register takes two): 9 integer instructions per 8 weights;
//   * the 8 scale bytes a thread needs per chunk (rows r0, r1 x 4 steps) are contiguous, shared
//     by the 4 threads of a quad, as two words each holding steps 2i and 2i + 1 (below).
//
// Code bit placement. An e2m1 code is (sign, e1, e0, m). Placing (e1, e0, m) at bf16 bits 8, 7, 6
// and the sign at bit 15 makes the bf16 value exactly e2m1 * 2^-126 for all 16 codes (code 1, 0.5,
// becomes the subnormal 2^-127); the mainloop multiplies by the block scale times 2^118 (exact,
// normal), so the A operand is e2m1 * scale * 2^-8 and the epilogue multiplies by 2^8.
// Register j's targets are bits T = {6, 7, 8, 15} (element a_2j) and T + 16 (element a_2j+1):
//     j = 0: rotl(word, 10) & 0x81C081C0       sources (T - 10) mod 32
//     j = 1:       word     & 0x81C081C0       sources  T
//     j = 2:  (word << 4)   & 0x81C081C0       sources  T - 4
//     j = 3:  (word << 6)   & 0x80C080C0       sources  T - 6, except bits 8 and 24 (e1),
//           | (word >> 2)   & 0x01000100       which come from 10 and 26.
// The four sets tile the 32 bits. Translates of T alone cannot tile them (searched exhaustively,
// rotations included), so one register needs two terms; this choice costs 5 LOP3, one rotate
// and one right shift on the integer pipe and two left shifts that ptxas issues as IMAD.SHL on
// the FMA pipe (the previous placement, translates by 6, 3 and 0 plus a three-term register,
// cost 11 instructions per step; the decode loop is issue-bound, ncu: ~0.9 IPC per scheduler).
// A block whose scale is 0 stores codes 0 (its weights are 0 whatever the codes), so that the
// mainloop's scale conversion need not special-case a zero scale.
//
// Scale encoding. Every nonzero ue4m3 scale is 2^x * 1.mmm with x in [-9, 8] (the subnormals
// 0x01..0x07 normalised) and 3 mantissa bits, so one byte holds it as (x + 21) << 3 | mmm with
// x + 21 in [12, 29]: five bits. Shifted left by 4 that byte is the low five exponent bits and
// the top three mantissa bits of a bf16, and OR-ing 0x7000 (exponent bits 224) makes it exactly
// bf16(scale * 2^118): exponent 224 + x + 21 = x + 118 + 127. Scale 0 encodes as 0 (bf16 2^97,
// harmless: its block's codes are 0). A scale word holds the encoded bytes E_a, E_b of steps
// a = 2i and b = 2i + 1 for row r0 in its low half and row r1 in its high half, each half as
//     bits 4..11 = E_a,  bits 12..15 = E_b & 0xF,  bits 0..3 = E_b >> 4,
// so step a's bf16x2 scale pair is one LOP3, (word & 0x0FF00FF0) | 0x70007000, and step b's a
// byte swap within each half (one PRMT) and the same LOP3: 1.5 instructions per step where the
// hardware e4m3x2 -> f16x2 conversion and its rebias took 2.
#pragma once

#include <cstdint>

namespace megamoe::kernels::sm90::w4a16 {

inline constexpr int kTileM = 64;                    // rows per warpgroup tile (wgmma M)
inline constexpr int kChunkK = 64;                   // K per pipeline chunk (4 wgmma k16 steps)
inline constexpr int kStepsPerChunk = kChunkK / 16;  // k16 steps per chunk
inline constexpr int kThreadsPerWarpgroup = 128;
inline constexpr int kCodeBytesPerTile = kTileM * kChunkK / 2;    // 2048: (64, 64) e2m1
inline constexpr int kScaleBytesPerTile = kTileM * kChunkK / 16;  // 256: (64, 4) ue4m3
static_assert(kCodeBytesPerTile == kThreadsPerWarpgroup * 16, "one 16-byte load per thread");

// Element p (0..7) of a thread's step word: tile-local row offset from r0 and k offset from 2t.
constexpr int nibble_row_offset(int p) { return 8 * ((p >> 1) & 1); }
constexpr int nibble_k_offset(int p) { return (p & 1) + 8 * (p >> 2); }

// For W13 the tiles interleave gate and up rows so that a thread's accumulator rows r0 and
// r0 + 8 are the gate and the up projection of the same intermediate column: SwiGLU then runs
// in registers in the epilogue. Tile m, local row 16w + g + 8h holds intermediate column
// 32m + 8w + g of the gate (h = 0) or the up (h = 1) projection.
inline constexpr int kW13ColumnsPerTile = kTileM / 2;
constexpr int64_t w13_intermediate_column(int64_t m_tile, int local_row) {
  return m_tile * kW13ColumnsPerTile + 8 * (local_row / 16) + (local_row % 8);
}
constexpr bool w13_is_up_row(int local_row) { return (local_row % 16) >= 8; }

// Bit position in its step word of bit b (0: m, 1: e0, 2: e1, 3: sign) of element a_p's code:
// the source of target bit T[b] + 16 * (p % 2) of register p / 2 (see the table above).
constexpr int code_bit_position(int p, int b) {
  constexpr int kTargetBits[4] = {6, 7, 8, 15};
  const int target = kTargetBits[b] + 16 * (p % 2);
  switch (p / 2) {
    case 0: return (target + 32 - 10) % 32;
    case 1: return target;
    case 2: return target - 4;
    default: return target % 16 == 8 ? target + 2 : target - 6;
  }
}
// The bf16x2 bits of A register j (0..3) of a step word: for each half, e2m1 * 2^-126 of its
// element (see the table above). Host (layout tests) and device (the mainloop) share it.
constexpr uint32_t step_register(uint32_t word, int j) {
  constexpr uint32_t kMask = 0x81C081C0u;  // bf16 bits 15, 8, 7, 6 of both halves
  switch (j) {
    case 0: return ((word << 10) | (word >> 22)) & kMask;  // a rotate: one SHF.L.W
    case 1: return word & kMask;
    case 2: return (word << 4) & kMask;
    default: return ((word << 6) & 0x80C080C0u) | ((word >> 2) & 0x01000100u);
  }
}

// The A operand carries a factor 2^-8 (see above): the epilogue multiplies accumulators by this.
inline constexpr float kAccumulatorUnscale = 256.0f;

// The prepacked byte of a valid ue4m3 scale (0x00..0x7E; see "Scale encoding" above).
constexpr uint8_t encode_scale(uint8_t ue4m3) {
  const int field = ue4m3 >> 3, mant = ue4m3 & 7;
  if (ue4m3 == 0) return 0;
  if (field > 0) return static_cast<uint8_t>((field - 7 + 21) << 3 | mant);
  // Subnormal mant * 2^-9: normalise the leading one of mant into the implicit bit.
  const int lead = mant >= 4 ? 2 : mant >= 2 ? 1 : 0;
  return static_cast<uint8_t>((lead - 9 + 21) << 3 | ((mant << (3 - lead)) & 7));
}
// The ue4m3 byte of a prepacked scale byte: encode_scale's inverse (0 stays 0; a subnormal comes
// back as the subnormal it was).
constexpr uint8_t decode_scale(uint8_t encoded) {
  if (encoded == 0) return 0;
  const int x = (encoded >> 3) - 21, mant = encoded & 7;  // the value 2^x * 1.mant
  if (x >= -6) return static_cast<uint8_t>((x + 7) << 3 | mant);
  return static_cast<uint8_t>((8 | mant) >> (3 - (x + 9)));  // subnormal: (1.mant * 2^(x + 9)) * 2^-9
}
// The 16-bit half of a scale word for one row: encoded scales of steps 2i (a) and 2i + 1 (b).
constexpr uint16_t scale_half(uint8_t encoded_a, uint8_t encoded_b) {
  return static_cast<uint16_t>(encoded_a << 4 | (encoded_b & 0xF) << 12 | encoded_b >> 4);
}
inline constexpr uint32_t kScaleMask = 0x0FF00FF0u;       // E at bits 4..11 of both halves
inline constexpr uint32_t kScaleExponentHigh = 0x70007000u;  // bf16 exponent bits 224
// bf16x2 {lo: row r0, hi: row r1} of (scale * 2^118) for step 2i + kOdd of a scale word (host
// reference of the mainloop's decode, which swaps the bytes with one PRMT).
template <int kOdd>
constexpr uint32_t scale_register(uint32_t word) {
  if constexpr (kOdd) word = ((word >> 8) & 0x00FF00FFu) | ((word << 8) & 0xFF00FF00u);
  return (word & kScaleMask) | kScaleExponentHigh;
}

}  // namespace megamoe::kernels::sm90::w4a16
