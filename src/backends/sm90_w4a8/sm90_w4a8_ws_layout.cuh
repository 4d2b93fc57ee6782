// The warp-specialized W4A8 tile (docs/w4a8.md §8.2): one producer warpgroup copies each 128-K
// block of an item's operands and decodes its weights once into e4m3 A fragments in shared
// memory; two consumer warpgroups load them (one 16-byte load per k32 step) and run fp8 wgmmas
// with A from registers and B from shared memory, each 64 rows x 128 tokens, with the per-block
// promotion. A from registers, not shared memory: an SS wgmma would read the decoded tile through
// the async proxy, and the proxy fence that needs (MEMBAR.ALL.CTA) also waits for the producer's
// cp.async copies still in flight, one memory latency per block. Two shapes of item, by how the consumers split it:
//   kMTiles = 2 (tall): 128 weight rows x 128 tokens; consumer c takes 64-row tile c, B is shared.
//   kMTiles = 1 (wide):  64 weight rows x 256 tokens; consumer c takes tokens 128c.., A is shared.
// Wide decodes each weight once per 256 tokens (half the decode per MAC) but pads an expert's
// tokens to 256.
#pragma once

#include <cstdint>

#include "backends/sm90_w4a16/sm90_w4a16_layout.h"
#include "backends/sm90_w4a8/sm90_w4a8_layout.h"

namespace megamoe::kernels::sm90::detail {

inline constexpr int kW4a8WsConsumers = 2;
inline constexpr int kW4a8WsThreads = (1 + kW4a8WsConsumers) * w4a16::kThreadsPerWarpgroup;
inline constexpr int kW4a8WsConsumerTokens = 128;  // each consumer's wgmma N

// Shared memory: kStages stages of one 128-K block each, then the stages' barriers.
//   B codes    (kBlockN tokens, 128) e4m3, one 128-byte swizzled row per token     [1024-aligned]
//   A          kMTiles x 4 k32 steps x 128 threads x 16 bytes: consumer thread tid's four e4m3x4
//              A registers of step f of tile i at ((4 i + f) * 128 + tid) * 16
//   W codes    kMTiles x two 64-K chunks of 2048 bytes (the prepacked order)
//   W scales   kMTiles x the two chunks' 256-byte scale tiles
//   act scales (kBlockN) fp32: each token's block scale 2^e (0 past the item's slots)
//   addends    (4 producer warps) the decode's constant of the block's expert, per warp
// Barriers per stage: full (256 producer arrivals: each thread's copies landed, by
// cp.async.mbarrier.arrive, and its decode stored), empty (256 consumer arrivals: the block's
// wgmmas and shared-memory reads done).
template <int kMTiles>
struct W4a8WsLayout {
  static_assert(kMTiles == 1 || kMTiles == 2, "an item is one (wide) or two (tall) 64-row tiles");
  static constexpr int kBlockN = kW4a8WsConsumers * kW4a8WsConsumerTokens / kMTiles;
  static constexpr int kFullArrivals = 2 * w4a16::kThreadsPerWarpgroup;
  static constexpr int kBBytes = kBlockN * w4a8::kActBlock;
  static constexpr int kATileBytes = w4a16::kTileM * w4a8::kActBlock;
  static constexpr int kAOffset = kBBytes;
  static constexpr int kWCodeOffset = kAOffset + kMTiles * kATileBytes;
  static constexpr int kWCodeTileBytes = 2 * w4a16::kCodeBytesPerTile;
  static constexpr int kWScaleOffset = kWCodeOffset + kMTiles * kWCodeTileBytes;
  static constexpr int kWScaleTileBytes = 2 * w4a16::kScaleBytesPerTile;
  static constexpr int kActScaleOffset = kWScaleOffset + kMTiles * kWScaleTileBytes;
  static constexpr int kAddendOffset = kActScaleOffset + kBlockN * 4;
  static constexpr int kStageBytes = (kAddendOffset + 16 + 1023) / 1024 * 1024;
  // As many stages as fit beside nothing else (227 KB per CTA, one CTA per SM).
  static constexpr int kStages = kMTiles == 2 ? 5 : 4;
  // The copies run kCopyAhead blocks ahead of the decode, which runs about one ahead of the MMA:
  // block j + kCopyAhead reuses the stage of block j - 2, normally released while the decode of
  // block j runs (the consumers are on j - 1), so the producer does not wait on the MMA.
  static constexpr int kCopyAhead = kStages - 2;
  static constexpr int kBarrierOffset = kStages * kStageBytes;
  static constexpr int kBytes = kBarrierOffset + 2 * kStages * 8;
  static constexpr int kAllocBytes = kBytes + 1024;  // room to align the base to 1024 B
  static_assert(kAllocBytes <= 227 * 1024, "the stages must fit one CTA's shared memory: use fewer kStages");
  static_assert(kBBytes % 1024 == 0, "each B stage must be whole 1024-byte swizzle atoms");
  static_assert(kATileBytes == 4 * w4a16::kThreadsPerWarpgroup * 16, "a tile's block is 4 k32 steps of 16 bytes per thread");
  static_assert(kBlockN * 8 % w4a16::kThreadsPerWarpgroup == 0, "the B pieces split evenly over the producer");

  __device__ static uint32_t full_bar(uint32_t base, int s) { return base + kBarrierOffset + s * 8; }
  __device__ static uint32_t empty_bar(uint32_t base, int s) { return base + kBarrierOffset + (kStages + s) * 8; }
};

}  // namespace megamoe::kernels::sm90::detail
