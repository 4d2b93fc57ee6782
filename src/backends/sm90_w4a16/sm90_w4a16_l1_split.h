// L1 split in K on the one-warpgroup decode tiles: the arithmetic that host (workspace, dispatch
// counts, tests) and device (sm90_w4a16_scheduler.cuh, sm90_w4a16_epilogue.cuh) share. One
// definition for both sides: constexpr functions (the CUDA sources build with
// --expt-relaxed-constexpr).
//
// An L1 tile (expert, 64-row tile, token tile) of a split GEMM is k_splits work items, each over
// K / k_splits. Each item stores its fp32 sums of the tile's valid (row, slot) pairs in its
// slice of the partial buffer, then counts itself on the tile's arrival counter; the item that
// arrives last adds the slices in slice order (the same order whichever item is last, so the
// result is bitwise the same from run to run) and runs the SwiGLU epilogue of a whole item.
#pragma once

#include <algorithm>
#include <cstdint>

namespace megamoe::w4a16_split {

// K slices per L1 tile, at most (the partial buffer holds this many slices).
inline constexpr int kMaxL1KSplits = 4;
// Slots (T * (top_k + shared slices)) up to which L1 may split: the partial buffer and the arrival
// counters are sized for this many (the split pays only where L1 has few items per SM: tiny T).
inline constexpr int64_t kL1SplitMaxSlots = 64;

// Where an item of an expert's L1 schedule sits: its local index is
// ((m_block * k_splits) + k_split) * n_tiles + n_tile (split_expert_work's order, which the
// dispatch's per-expert counts and early start's first item follow).
struct ItemCoords {
  int m_block, k_split, n_tile;
};
constexpr ItemCoords item_coords(int local, int n_tiles, int k_splits) {
  return {local / n_tiles / k_splits, (local / n_tiles) % k_splits, local % n_tiles};
}

// The arrival counter of an item's tile: one per (first slot of the token tile, 64-row tile). The
// first slots of an expert's token tiles are distinct and experts' slots are disjoint, so every
// tile of a run has its own counter; slot_begin < slots.
constexpr int64_t arrival_index(int slot_begin, int m_tile, int m_tiles) {
  return static_cast<int64_t>(slot_begin) * m_tiles + m_tile;
}
constexpr int64_t arrival_count(int64_t slots, int64_t m_tiles) { return slots * m_tiles; }

// The partial buffer: (kMaxL1KSplits, partial_slots, rows) fp32, rows = 2I in the prepacked W13
// row order (m_tile * 64 + row of the tile). Element (slice, slot, row):
constexpr int64_t partial_offset(int k_split, int64_t slice_floats, int slot, int64_t rows, int64_t row) {
  return k_split * slice_floats + static_cast<int64_t>(slot) * rows + row;
}
// Slots the workspace holds partial sums and arrival counters for.
constexpr int64_t partial_slots(int64_t max_tokens, int64_t slots_per_token) {
  return std::min(max_tokens * slots_per_token, kL1SplitMaxSlots);
}

// Whether L1 of a layer may split into k_splits slices at `slots` slots: K = hidden_size in whole
// 64-wide chunks, the same number in every slice.
constexpr bool can_split(int64_t hidden_size, int64_t slots, int k_splits) {
  return k_splits >= 1 && k_splits <= kMaxL1KSplits && slots <= kL1SplitMaxSlots && hidden_size % 64 == 0 &&
         (hidden_size / 64) % k_splits == 0;
}

}  // namespace megamoe::w4a16_split
