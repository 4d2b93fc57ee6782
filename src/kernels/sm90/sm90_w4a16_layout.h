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
// converted) so that:
//   * one 16-byte load gives a thread its codes for 4 k16 steps (one 64-wide K chunk); the 128
//     threads of a warpgroup read one contiguous 2 KiB block per (64-row tile, K chunk);
//   * word s of those 16 bytes holds the step-s codes with nibble p = element a_p, so that
//     decode_e2m1x8, which produces register j = {nibble 2j, nibble 2j+1}, yields the A
//     fragment registers in order;
//   * the 8 scale bytes a thread needs per chunk (rows r0, r1 x 4 steps) are contiguous, shared
//     by the 4 threads of a quad: byte 2s + h = scale(row r0 + 8h, k-block 4*chunk + s).
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

}  // namespace megamoe::kernels::sm90::w4a16
