// The (sm_90, w4a8) row's tile table (no CUDA dependency: the tools list its names).
#pragma once

namespace megamoe::runtime {

// The row's tile table (docs/w4a8.md §8): the one-warpgroup tiles decode in the MMA warpgroup's
// registers (RS wgmma), the 128-token one overlapped (block kb + 1 decoded under block kb's
// wgmmas: faster at 128 tokens, slower at 32, docs/perf/2026-11-29-h200-w4a8-v43.md); the
// warp-specialized ones have a producer warpgroup decode each weight block once into shared
// memory for two consumer warpgroups (SS wgmma): tall 128 rows x 128 tokens, wide 64 rows x 256
// tokens.
struct W4a8Tile {
  const char* name;
  int block_m_tiles;      // 64-row tiles per work item
  int block_n;            // tokens per work item
  bool warp_specialized;  // producer + two consumers (else one warpgroup)
  bool overlapped;        // one warpgroup that decodes block kb + 1 while block kb's wgmmas run
};
inline constexpr W4a8Tile kW4a8Tiles[] = {
    {"fp8_narrow32", 1, 32, false, false},
    {"fp8_single128", 1, 128, false, true},
    {"fp8_tall128", 2, 128, true, false},
    {"fp8_wide256", 1, 256, true, false},
};
inline constexpr int kW4a8TileNarrow32 = 0, kW4a8TileSingle128 = 1, kW4a8TileTall128 = 2, kW4a8TileWide256 = 3;

}  // namespace megamoe::runtime
