// The prepacked NVFP4 weight layout read by the sm90 W4A16 grouped GEMM. Host (prepack) and
// device (mainloop) both include this file; it is the single source of truth for the layout.
//
// The weights are the A operand of `wgmma ... m64nNk16` taken from REGISTERS (decoded weights
// are born in registers, and wgmma reads B only from shared memory): M = output features,
// N = tokens. The register fragment of A for one k16 step gives thread (warp w, lane 4g + t)
// of the warpgroup the 8 elements
//     a0,a1 = (row r0, k 2t, 2t+1)    a2,a3 = (row r1, k 2t, 2t+1)
//     a4,a5 = (row r0, k 2t+8, 2t+9)  a6,a7 = (row r1, k 2t+8, 2t+9),  r0 = 16w + g, r1 = r0 + 8.
// Prepacking is a reshuffle of the checkpoint's nibbles and scale bytes (same bits, nothing
// converted: code bits move, scale bytes move; a block with scale 0 stores codes 0) so that:
//   * one 16-byte load gives a thread its codes for 4 k16 steps (one 64-wide K chunk); the 128
//     threads of a warpgroup read one contiguous 2 KiB block per (64-row tile, K chunk);
//   * word s of those 16 bytes holds the step-s codes of elements a_0..a_7, their bits placed
//     (below) so that each bf16x2 A register j = {a_2j, a_2j+1} is one mask of a shifted or
//     rotated word (one register takes two): 9 integer instructions per 8 weights;
//   * the 8 scale bytes a thread needs per chunk (rows r0, r1 x 4 steps) are contiguous, shared
//     by the 4 threads of a quad: byte 2s + h = scale(row r0 + 8h, k-block 4*chunk + s).
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
// bf16x2 of (block scale * 2^118) from the f16x2 of the block scale: (f16 >> 3) + this.
inline constexpr uint32_t kScaleF16ToBf16Times2Pow118 = (112u + 118u) << 7 | ((112u + 118u) << 7) << 16;

}  // namespace megamoe::kernels::sm90::w4a16
