// The compile-time shape of a W4A16 grouped-GEMM tile (warpgroups, tokens, stages) and what it
// implies: the token widths an item may run at, the K chunks per pipeline group, the token step
// of an expert's tiles, whether early start applies, and the shared-memory layout that host and
// device agree on. The whitelist of tiles is src/backends/sm90_w4a16/sm90_w4a16_tiles.h.
#pragma once

#include <cstdint>

#include "backends/sm90_w4a16/sm90_w4a16_layout.h"

namespace megamoe::kernels::sm90 {

namespace detail {

// Token widths a tile of kBlockN tokens may run at: multiples of the step up to kBlockN. The
// step is 32 from the 64-token tile up (fewer mainloop instantiations; a two-warpgroup tile
// copies B in 256-thread rounds of 32 rows) and 16 below.
template <int kBlockN>
inline constexpr int kTokenWidthStep = kBlockN >= 64 ? 32 : 16;

// K chunks per pipeline group of a tile of kBlockN tokens (see gemm_item,
// sm90_w4a16_mainloop_pipelined.cuh).
template <int kBlockN>
inline constexpr int kChunksPerGroup = kBlockN <= 64 ? 2 : 1;

// Tokens per tile but an expert's last (expert_token_tiles): the 160-token tile is the absorbing
// tile (128-token tiles, the last up to 160: kAbsorbingTile on the host), every other tile its
// own width.
template <int kBlockN>
inline constexpr int kTileStep = kBlockN == 160 ? 128 : kBlockN;

// Tiles that may see an early start: T * k <= 32 puts at most 32 tokens on an expert, which the
// heuristic runs on a one-warpgroup tile of at most 48 tokens. The others do not carry its code:
// it raises their register pressure (the 128-token L1 kernel spilled with it).
template <bool kIsL1, int kWarpgroups, int kBlockN>
inline constexpr bool kMayStartEarly = kIsL1 && kWarpgroups == 1 && kBlockN <= 48;

// The L2 combine's staging in shared memory (combine_staged in sm90_w4a16_epilogue.cuh, both
// combines): per warpgroup,
// kStagedColumns tokens of its 64 rows, kStagedStride floats apart. 68 (not 64) puts the scalar
// stores of a warp's (4 tokens, 8 rows) on 32 distinct banks and keeps each token's rows 16-byte
// aligned (272 B apart).
inline constexpr int kStagedColumns = 32;
inline constexpr int kStagedStride = 68;

}  // namespace detail

// Shared-memory footprint of one configuration (host and device agree through this).
template <int kWarpgroups, int kBlockN, int kStages>
struct W4a16SmemLayout {
  static constexpr int kBTileBytes = kBlockN * w4a16::kChunkK * 2;  // (BLOCK_N, 64) bf16
  static constexpr int kCodeStageBytes = kWarpgroups * w4a16::kCodeBytesPerTile;
  static constexpr int kScaleStageBytes = kWarpgroups * w4a16::kScaleBytesPerTile;
  static constexpr int kBOffset = 0;
  static constexpr int kCodeOffset = kBOffset + kStages * kBTileBytes;
  static constexpr int kScaleOffset = kCodeOffset + kStages * kCodeStageBytes;
  // The L2 combine's staging (combine_staged): in the B stages, free once every warpgroup is past its
  // last wgmma (a CTA barrier); the absorbing tile (four warpgroups), whose warpgroups run their
  // epilogues while others still compute (no CTA barrier between items), has its own.
  static constexpr bool kOwnStaging = kWarpgroups == 4;
  static constexpr int kStagingBytes = kWarpgroups * detail::kStagedColumns * detail::kStagedStride * 4;
  static constexpr int kStagingOffset = kOwnStaging ? kScaleOffset + kStages * kScaleStageBytes : kBOffset;
  // The absorbing tile's slot table (combine_staged): per item, its slots' tokens (int32) and routing
  // weights (fp32), kBlockN each, in two buffers (items alternate).
  static constexpr int kSlotTableBufferBytes = kBlockN * 8;
  static constexpr int kSlotTableBytes = kOwnStaging ? 2 * kSlotTableBufferBytes : 0;
  static constexpr int kSlotTableOffset = kScaleOffset + kStages * kScaleStageBytes + (kOwnStaging ? kStagingBytes : 0);
  static constexpr int kBytes = kSlotTableOffset + kSlotTableBytes;
  static constexpr int kAllocBytes = kBytes + 1024;  // room to align the base to 1024 B
  static_assert(kBTileBytes % 1024 == 0,
                "BLOCK_N must be a multiple of 8 so each B stage is whole 1024-byte swizzle atoms");
  static_assert(kOwnStaging || kStagingBytes <= kStages * kBTileBytes,
                "the L2 combine's staging (combine_staged) must fit in the B stages: add stages or tokens");
};

namespace detail {

// Aligns the dynamic shared memory to 1024 B (the 128-byte swizzle atom) by offsetting the array
// itself, so the compiler still knows the pointer is shared memory and emits LDS rather than
// generic loads.
__device__ __forceinline__ uint8_t* aligned_dynamic_smem() {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t smem_misalign = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 1023u;
  return smem_raw + ((1024u - smem_misalign) & 1023u);
}

}  // namespace detail

}  // namespace megamoe::kernels::sm90
