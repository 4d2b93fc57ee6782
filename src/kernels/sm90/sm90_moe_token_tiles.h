// How many token tiles an expert of c slots takes. The dispatch kernel and the GEMMs schedule
// work items by it (sm90_moe_dispatch.cuh, sm90_w4a16_scheduler.cuh), and the host heuristic
// estimates tile counts with it (sm90_moe_heuristics.cpp): one definition for both sides (a
// constexpr function; the CUDA sources build with --expt-relaxed-constexpr).
#pragma once

namespace megamoe::kernels::sm90 {

// Tiles of `step` tokens, the last of which takes up to block_n (block_n - step more: the
// absorbing tile) so that a short remainder needs no tile of its own; step == block_n for every
// other tile.
template <class Count>
constexpr Count expert_token_tiles(Count c, int block_n, int step) {
  if (c <= 0) return 0;
  if (c <= block_n) return 1;
  return (c - (block_n - step) + step - 1) / step;
}

}  // namespace megamoe::kernels::sm90
