// The tile table of the sm90 W4A16 grouped GEMM: every tile the kernels are instantiated for,
// once. The heuristic picks from it (sm90_moe_heuristics.cpp), the launch whitelist instantiates
// exactly its entries (sm90_w4a16_launch.cu, one translation unit per entry and GEMM under
// instantiations/), and the tests iterate over it. To add a tile: add an entry here, a
// W4a16TileId, and its translation units; the launcher's static_asserts name what is missing.
#pragma once

#include <cstdint>
#include <string>

namespace megamoe {

// One grouped-GEMM configuration: a tile of the table plus the run-time K split.
struct GemmConfig {
  int warpgroups = 1;  // consumer warpgroups per CTA: BLOCK_M = 64 * warpgroups
  int block_n = 16;    // tokens per tile (wgmma N)
  int stages = 4;      // cp.async pipeline depth
  int k_splits = 1;    // K slices per output tile, added atomically (L2 atomic combine only)
  // Tokens an expert's last tile may hold beyond the others: tiles step by block_n - last_tile_extra
  // tokens, and a remainder of up to last_tile_extra tokens joins the last full tile.
  int last_tile_extra = 0;
  // Each warpgroup decodes a k16 step while its previous step's wgmma runs (the overlapped K loop,
  // sm90_w4a16_mainloop_overlapped.cuh), at two token widths: block_n and a narrower one.
  bool overlapped = false;
  constexpr int tile_step() const { return block_n - last_tile_extra; }
  // The same tile (everything but the K split).
  constexpr bool same_tile(const GemmConfig& o) const {
    return warpgroups == o.warpgroups && block_n == o.block_n && stages == o.stages &&
           last_tile_extra == o.last_tile_extra && overlapped == o.overlapped;
  }
  std::string to_string() const;
};

// A tile the kernels are built for.
struct W4a16TileEntry {
  const char* name;
  GemmConfig config;
  // Resident CTAs per SM the kernel is built for (its __launch_bounds__ minimum, hence its
  // register budget: 65536 / (128 * warpgroups * ctas_per_sm)); the stage counts are chosen so that
  // shared memory allows as many CTAs as registers do.
  int ctas_per_sm;
  // Whether a fused L1 + L2 kernel is built for it (one-warpgroup decode tiles only).
  bool fusable;
};

enum W4a16TileId : int {
  kTileDecode16,
  kTileDecode32,
  kTileDecode48,
  kTileMiddle64,
  kTilePrefill128,
  kTileOverlapped128,
  kTileAbsorbing160,
  kW4a16TileCount,
};

inline constexpr W4a16TileEntry kW4a16Tiles[kW4a16TileCount] = {
    // Decode tiles: one warpgroup, narrow N; the loop is bound by the decode's instructions, so
    // more CTAs per SM (one more warp per scheduler to hide the decode's latency) pay more than
    // deeper pipelines. 16 tokens: <= 80 registers, eight stages of six CTAs fit shared memory.
    {"decode16", {1, 16, 8}, 6, true},
    // 32 tokens: <= 96 registers, six stages so that shared memory holds the five CTAs.
    {"decode32", {1, 32, 6}, 5, true},
    // 48 tokens: six stages (eight would fit only three CTAs in shared memory).
    {"decode48", {1, 48, 6}, 4, false},
    // 64 tokens: two K chunks per wgmma round trip (sm90_w4a16_tile.cuh, kChunksPerGroup).
    {"middle64", {1, 64, 6}, 4, false},
    // Prefill: two warpgroups share a 128-token B tile (half the B traffic per decoded weight);
    // two CTAs per SM, so one CTA's wgmmas run while the other's warpgroups decode.
    {"prefill128", {2, 128, 4}, 2, false},
    // The same tile with the overlapped K loop (token widths 64 and 128).
    {"overlapped128", {2, 128, 4, 1, 0, true}, 2, false},
    // The absorbing tile: four warpgroups (BLOCK_M = 256) on 128-token tiles of which an expert's
    // last takes up to 32 tokens more; one CTA (512 threads at <= 128 registers) per SM.
    {"absorbing160", {4, 160, 6, 1, 32, true}, 1, false},
};

// Whether L1 may split K on the tile (a kernel with the last-arriver SwiGLU is built for it,
// sm90_w4a16_l1_split.h): the one-warpgroup decode tiles that have a fused kernel, in both launches.
constexpr bool l1_splits(const W4a16TileEntry& e) { return e.fusable; }

// Named tiles for the heuristic and the tests.
inline constexpr GemmConfig kFusedTile = kW4a16Tiles[kTileDecode16].config;
inline constexpr GemmConfig kFusedTile32 = kW4a16Tiles[kTileDecode32].config;
inline constexpr GemmConfig kDecode48Tile = kW4a16Tiles[kTileDecode48].config;
inline constexpr GemmConfig kMiddleTile = kW4a16Tiles[kTileMiddle64].config;
inline constexpr GemmConfig kPrefillTile = kW4a16Tiles[kTilePrefill128].config;
inline constexpr GemmConfig kOverlappedPrefillTile = kW4a16Tiles[kTileOverlapped128].config;
inline constexpr GemmConfig kAbsorbingTile = kW4a16Tiles[kTileAbsorbing160].config;
inline constexpr int kFusedTileCtasPerSm = kW4a16Tiles[kTileDecode16].ctas_per_sm;
inline constexpr int kFusedTile32CtasPerSm = kW4a16Tiles[kTileDecode32].ctas_per_sm;

// The table entry of a configuration's tile, or -1 where no kernel is built for it.
constexpr int find_w4a16_tile(const GemmConfig& c) {
  for (int i = 0; i < kW4a16TileCount; ++i) {
    if (kW4a16Tiles[i].config.same_tile(c)) return i;
  }
  return -1;
}

}  // namespace megamoe
