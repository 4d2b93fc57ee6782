// The (sm_90, w4a8) row's tile table (no CUDA dependency: the tools list its names).
#pragma once

namespace megamoe::runtime {

// The row's tile table (docs/w4a8.md §8): the one-warpgroup tiles decode in the MMA warpgroup's
// registers (RS wgmma), the 128-token one overlapped (block kb + 1 decoded under block kb's
// wgmmas: faster at 128 tokens, slower at 32, docs/perf/2026-11-29-h200-w4a8-v43.md); the
// warp-specialized ones have a producer warpgroup decode each weight block once into shared
// memory for two consumer warpgroups (SS wgmma): tall 128 rows x 128 tokens, wide 64 rows x 256
// tokens. The absorbing tile is the 128-token one whose expert's last item takes up to 160
// tokens (the W4A16 row's absorbing schedule): a remainder of up to 32 tokens costs no item of its
// own, whose decode would cost as much as a full one's.
struct W4a8Tile {
  const char* name;
  int block_m_tiles;      // 64-row tiles per work item
  int block_n;            // tokens per work item (an expert's last; the others take tile_step)
  int tile_step;          // tokens per work item but an expert's last (block_n, or less: absorbing)
  bool warp_specialized;  // producer + two consumers (else one warpgroup)
  bool overlapped;        // one warpgroup that decodes block kb + 1 while block kb's wgmmas run
                          // (absorbing: on its tile_step-wide items)
};
inline constexpr W4a8Tile kW4a8Tiles[] = {
    {"fp8_narrow32", 1, 32, 32, false, false},
    {"fp8_single128", 1, 128, 128, false, true},
    {"fp8_tall128", 2, 128, 128, true, false},
    {"fp8_wide256", 1, 256, 256, true, false},
    {"fp8_absorb160", 1, 160, 128, false, true},
};
inline constexpr int kW4a8TileNarrow32 = 0, kW4a8TileSingle128 = 1, kW4a8TileTall128 = 2, kW4a8TileWide256 = 3,
                     kW4a8TileAbsorb160 = 4;

}  // namespace megamoe::runtime
