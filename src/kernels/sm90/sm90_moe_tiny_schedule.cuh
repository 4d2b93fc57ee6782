// The schedule of a tiny batch (T * k <= 32 routed selections), computed by one warp from the
// top-k ids alone: each selection's slot and its expert's place in the work-item lists.
//
// Two users must agree on it exactly:
//   * the one-CTA dispatch kernel places the selections at these slots (rather than in the order
//     its shared-memory atomics happen to give) and publishes the schedule for the GEMMs;
//   * the L1 GEMM's CTAs (early start) recompute it, each for its own first work item, so that
//     item runs while the dispatch kernel is still running. At decode the dispatch and the
//     hand-off to L1 are ~6.7 us of the layer's critical path (Qwen3-30B T=1 on H200:
//     docs/perf/2026-11-21-h200-w4a16-v7.md), against a ~1 us load of the ids.
// The order is the dispatch's: virtual experts by id (routed experts 0..E-1, then the shared
// slices), slots of an expert in selection order, invalid ids (outside [0, E)) not placed.
//
// A gated batch (rows that other ranks send, runtime/token_gate.h) is tiny when it holds at most
// 32 valid selections among at most kTinyMaxEntries ids (most of a received row's ids belong to
// other ranks: -1): tiny_compact moves the valid ones into lanes, in selection order, and the
// schedule is the same function of them.
#pragma once

#include <climits>
#include <cstdint>

#include "kernels/sm90/sm90_moe_token_tiles.h"

namespace megamoe::kernels::sm90 {

// Up to this many routed selections (T * k) the schedule is one warp's (a selection per lane).
inline constexpr int kTinyMaxSelections = 32;
// Early start also holds the slot -> token map in shared memory: at most this many slots
// (T * (k + shared slices)).
inline constexpr int kTinyMaxSlots = 64;

// Up to this many ids (rows * k) a gated batch may be tiny: eight 32-id loads per warp.
inline constexpr int kTinyMaxEntries = 256;

// Whether a batch of `entries` ids of which `valid` are in [0, E) runs the tiny schedule.
__host__ __device__ constexpr bool tiny_batch(int64_t entries, int64_t valid) {
  return entries <= kTinyMaxEntries && valid <= kTinyMaxSelections;
}

// A lane's selection after tiny_compact: its id and its index among the batch's ids (token
// entry / k), for lanes below `valid`.
struct TinyEntry {
  int32_t id;
  int32_t entry;
  int32_t valid;  // the batch's valid ids (every lane the same); > kTinyMaxSelections: not tiny
};

// Every lane of the warp calls this (full mask), for entries <= kTinyMaxEntries: lane L gets the
// L-th id in [0, E) of ids[0, entries), in entry order. The loads are issued together.
__device__ __forceinline__ TinyEntry tiny_compact(const int32_t* ids, int entries, int32_t num_experts) {
  constexpr int kChunks = kTinyMaxEntries / 32;
  const int lane = threadIdx.x % 32;
  int32_t id[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) id[c] = 32 * c + lane < entries ? ids[32 * c + lane] : -1;
  TinyEntry out{-1, 0, 0};
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const unsigned valid = __ballot_sync(0xffffffffu, id[c] >= 0 && id[c] < num_experts);
    // Lane L takes the (L - found)-th valid id of this chunk, where there is one.
    const int want = lane - out.valid;
    const bool mine = want >= 0 && want < __popc(valid);
    const int src = mine ? static_cast<int>(__fns(valid, 0, want + 1)) : 0;
    const int32_t got = __shfl_sync(0xffffffffu, id[c], src);
    if (mine) {
      out.id = got;
      out.entry = 32 * c + src;
    }
    out.valid += __popc(valid);
  }
  return out;
}

// One lane's routed selection, within its expert.
struct TinySelection {
  bool valid;           // a selection (lane < T * k) with an expert id in [0, E)
  int32_t expert;       // its id (INT_MAX where not valid, so it sorts after every expert)
  int32_t rank;         // among its expert's selections, in selection (lane) order
  int32_t count;        // its expert's selections
  bool leader;          // rank 0: the lane that speaks for its expert
};

// Every lane of the warp calls this (full mask); lanes >= selections pass in_range = false.
__device__ __forceinline__ TinySelection tiny_select(int32_t id, bool in_range, int32_t num_experts) {
  const int lane = threadIdx.x % 32;
  TinySelection s;
  s.valid = in_range && id >= 0 && id < num_experts;
  s.expert = s.valid ? id : INT_MAX;
  // Lanes that are not valid get keys no valid id can take (negative and distinct per lane).
  const unsigned same = __match_any_sync(0xffffffffu, s.valid ? id : -1 - lane);
  s.rank = __popc(same & ((1u << lane) - 1u));
  s.count = __popc(same);
  s.leader = s.valid && s.rank == 0;
  return s;
}

// For each lane: the sums of v[0..kN) over the experts with a smaller id than its own (each
// expert counted once, through its leader), and (total) over all valid experts. One shuffle
// round per lane of the warp; ~32 independent shuffles per value.
template <int kN>
__device__ __forceinline__ void tiny_sum_before(const TinySelection& s, const int32_t (&v)[kN],
                                                int32_t (&before)[kN], int32_t (&total)[kN]) {
  const int32_t key = s.leader ? s.expert : INT_MAX;
#pragma unroll
  for (int i = 0; i < kN; ++i) before[i] = total[i] = 0;
#pragma unroll 4
  for (int j = 0; j < 32; ++j) {
    const int32_t kj = __shfl_sync(0xffffffffu, key, j);
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const int32_t vj = __shfl_sync(0xffffffffu, v[i], j);
      if (kj != INT_MAX) total[i] += vj;
      if (kj < s.expert) before[i] += vj;
    }
  }
}

}  // namespace megamoe::kernels::sm90
