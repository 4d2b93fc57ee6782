// The persistent tile scheduler of the sm90 W4A16 grouped GEMM: work items (expert, m-block,
// k-slice, n-tile) decoded from the dispatch kernel's per-expert prefix sums, claimed from an
// atomic counter past the first wave; the L2-cache prefetch of an item's weights before the grid
// dependency wait; and early start, where a tiny batch's L1 CTAs compute their first item from the
// top-k ids while the dispatch kernel still runs (sm90_moe_tiny_schedule.cuh).
#pragma once

#include <cstdint>

#include "kernels/common/pdl.cuh"
#include "kernels/common/ptx_cp_async.cuh"
#include "kernels/sm90/sm90_moe_tiny_schedule.cuh"
#include "kernels/sm90/sm90_signal.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_l1_split.h"
#include "backends/sm90_w4a16/sm90_w4a16_layout.h"
#include "backends/sm90_w4a16/sm90_w4a16_params.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_tile.cuh"

namespace megamoe::kernels::sm90 {

namespace detail {

// One work item of the persistent schedule: (expert, m-block, k-split, n-tile), from the
// dispatch kernel's per-expert prefix of work items.
struct WorkItem {
  int expert, m_block, k_split, slot_begin, slot_end;
  // Where L1 reads its slots' tokens: the dispatch's slot_token, or early start's copy in
  // shared memory.
  const int32_t* slot_token;
};
// Splits an expert's work index, ((m_block * k_splits) + k_split) * n_tiles + n_tile, into w's
// m-block and k-slice; returns the n-tile. Consecutive work items share an m-block (the same
// weights) across n-tiles, so CTAs that run together hit the same weight bytes in the L2 cache.
__device__ __forceinline__ int split_expert_work(const W4a16GemmParams& p, int local, int n_tiles, WorkItem& w) {
  w.k_split = (local / n_tiles) % p.k_splits;
  w.m_block = local / n_tiles / p.k_splits;
  return local % n_tiles;
}
// Decodes work item `work` (0 <= work < tile_offsets[num_experts] = total). The items are
// expert-major, and under balanced routing every expert holds about total / E of them: the
// expert is guessed from the item's share of the total and checked, with its two neighbours, in
// one round of independent loads (the window's item and slot offsets); where the guess misses
// (skewed routing) a binary search over the rest follows. A binary search alone is a chain of
// log2(E') dependent loads at the start of every item, then the slot offsets' round trip, all
// exposed latency (docs/perf/2026-11-22-h100-w4a16-v22.md). `total` only picks where the search
// starts (any value is correct; <= 0: a binary search over all experts).
template <int kBlockN>
__device__ __forceinline__ WorkItem decode_work(const W4a16GemmParams& p, int work, int total) {
  const int num_experts = p.num_experts;
  int expert = -1, item0 = 0, slot0 = 0, slot1 = 0;
  int lo = 0, hi = num_experts;
  if (num_experts >= 3 && total > 0) {
    const int guess = static_cast<int>(static_cast<int64_t>(work) * num_experts / total);
    const int first = max(0, min(guess - 1, num_experts - 3));  // the window: experts first .. first + 2
    int32_t t[4], s[4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      t[i] = p.tile_offsets[first + i];
      s[i] = p.expert_offsets[first + i];
    }
    if (work >= t[0] && work < t[3]) {
      // The window's last expert whose items start at or before `work` (empty experts are
      // skipped: their range is empty).
      const int i = (work >= t[1]) + (work >= t[2]);
      expert = first + i;
      item0 = i == 0 ? t[0] : i == 1 ? t[1] : t[2];
      slot0 = i == 0 ? s[0] : i == 1 ? s[1] : s[2];
      slot1 = i == 0 ? s[1] : i == 1 ? s[2] : s[3];
    } else if (work < t[0]) {
      hi = first;
    } else {
      lo = first + 3;
    }
  }
  if (expert < 0) {
    // tile_offsets[lo] <= work < tile_offsets[hi]
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (p.tile_offsets[mid] <= work) lo = mid; else hi = mid;
    }
    expert = lo;
    item0 = p.tile_offsets[lo];
    slot0 = p.expert_offsets[lo];
    slot1 = p.expert_offsets[lo + 1];
  }
  WorkItem w;
  w.expert = expert;
  const int count = slot1 - slot0;
  if constexpr (kTileStep<kBlockN> == kBlockN) {
    const int n_tiles = (count + kBlockN - 1) / kBlockN;
    const int n_tile = split_expert_work(p, work - item0, n_tiles, w);
    w.slot_begin = slot0 + n_tile * kBlockN;
    w.slot_end = slot1;  // past kBlockN rows: the tile's width is kBlockN
  } else {
    const int n_tiles = expert_token_tiles(count, kBlockN, kTileStep<kBlockN>);
    const int n_tile = split_expert_work(p, work - item0, n_tiles, w);
    w.slot_begin = slot0 + n_tile * kTileStep<kBlockN>;
    w.slot_end = n_tile == n_tiles - 1 ? slot1 : w.slot_begin + kTileStep<kBlockN>;
  }
  w.slot_token = p.slot_token;
  return w;
}

// The K chunks of a work item: [k_begin, k_begin + chunks) of its 64-row tiles.
struct ItemChunks {
  int k_begin, chunks;
};
__device__ __forceinline__ ItemChunks item_chunks(const W4a16GemmParams& p, const WorkItem& w) {
  const int k_begin = w.k_split * p.k_chunks_per_split;
  return {k_begin, min(p.k_chunks_per_split, p.k_chunks - k_begin)};
}

// Claims the next work item past the first gridDim.x (one thread). The schedulers claim when an
// item's mainloop is done, and the atomic's latency hides behind the epilogue. Claiming when an
// item starts fixes each CTA's next item one item ahead: a CTA on a crowded SM takes an item
// that a CTA finishing earlier could have run, and in the fused launch, where most CTAs run one
// to three items, the second wave is then as uneven as the block scheduler's placement (L2
// items wait for their experts' last L1 items: docs/perf/2026-11-21-h200-w4a16-v7.md).
__device__ __forceinline__ int claim_work(int32_t* counter) {
  return static_cast<int>(gridDim.x) + atomicAdd(counter, 1);
}

// Prefetches the codes and scales of a work item's first kChunks K chunks into the L2 cache:
// both are contiguous along K per 64-row tile (sm90_w4a16_layout.h).
template <int kWarpgroups, int kChunks>
__device__ __forceinline__ void prefetch_item_weights(const W4a16GemmParams& p, const WorkItem& w) {
  using namespace w4a16;
  const auto [k_begin, item_n] = item_chunks(p, w);
  const int n = min(kChunks, item_n);
#pragma unroll
  for (int wg = 0; wg < kWarpgroups; ++wg) {
    const int64_t tile0 = static_cast<int64_t>(w.m_block * kWarpgroups + wg) * p.k_chunks + k_begin;
    ptx::prefetch_to_l2_cache(p.codes + w.expert * p.code_expert_stride + tile0 * kCodeBytesPerTile, n * kCodeBytesPerTile);
    ptx::prefetch_to_l2_cache(p.scales + w.expert * p.scale_expert_stride + tile0 * kScaleBytesPerTile, n * kScaleBytesPerTile);
  }
}

// Before its grid dependency wait (the dispatch for L1, L1 for the two-launch L2), a CTA's
// first item is unknown but its weights are not: the item schedule is expert-major, so with
// every routed expert holding guess_n_tiles n-tiles, item blockIdx.x is a fixed (expert,
// m-block, k-slice). Prefetching that item's first chunks into the L2 cache puts DRAM to work
// while the dispatch runs (one SM, DRAM idle) or while the previous GEMM's tail drains. A wrong
// guess (empty or fuller experts) shifts the experts, but the guessed first wave is still mostly
// the real one's weights, fetched by other CTAs. One thread calls it. Inlined: as an out-of-line
// call it changes ptxas's register allocation of every mainloop after it and grows their K
// groups (docs/perf/2026-11-21-h100-w4a16-v12.md); compare tests/sass/check_sass.sh's counts
// before and after changing it.
template <int kWarpgroups, int kBlockN, int kStages>
__device__ __forceinline__ void prefetch_guessed_item(const W4a16GemmParams& p, int work) {
  const int n_tiles = p.guess_n_tiles;
  if (n_tiles <= 0) return;
  const int per_expert = p.m_tiles / kWarpgroups * p.k_splits * n_tiles;
  const int e = work / per_expert;
  if (e >= p.num_routed) return;
  WorkItem w{};
  w.expert = e;
  split_expert_work(p, work % per_expert, n_tiles, w);
  prefetch_item_weights<kWarpgroups, kStages - kChunksPerGroup<kBlockN>>(p, w);
}

// Early start's shared memory: the tiny batch's slot -> token map, the CTA's first work item and
// the work-item counts.
struct EarlyStart {
  int32_t slot_token[kTinyMaxSlots];
  WorkItem first;  // expert -1: the CTA's first item is not an L1 item
  int32_t l1_items, l2_items;
};

// Whether a one-GEMM launch starts early: an L1 tile that may (kMayStartEarly) given the top-k ids.
template <bool kIsL1, int kWarpgroups, int kBlockN>
__device__ __forceinline__ bool starts_early(const W4a16GemmParams& p) {
  if constexpr (kMayStartEarly<kIsL1, kWarpgroups, kBlockN>) {
    return p.topk_ids != nullptr;
  } else {
    return false;
  }
}

// The tiny batch's schedule from its selections, one per lane (s; `token` the lane's token),
// exactly as the dispatch kernel publishes it (virtual experts in id order; an expert of c slots
// has ceil(c / kBlockN) * (m_tiles / kWarpgroups) * k_splits items), and this CTA's first item
// (blockIdx.x). l2_m_tiles = 0 where no L2 items follow (the two-launch L1 kernel). kL1Split: L1
// splits K into l1.k_splits slices (the other kernels leave the split out, so that their code stays
// what it was). Every thread calls it: each warp computes the same schedule and warp 0 stores it.
// (Run by warp 0 alone, behind a tid < 32 branch, it makes ptxas build the L1 mainloop's wgmma
// descriptors in ordinary instead of uniform registers, which grows every K group:
// docs/perf/2026-11-21-h100-w4a16-v9.md; tests/sass/check_sass.sh.)
template <int kWarpgroups, int kBlockN, bool kL1Split = false>
__device__ __forceinline__ void tiny_schedule(const W4a16GemmParams& l1, int l2_m_tiles, int l2_k_splits, int T,
                                              const TinySelection& s, int token, EarlyStart& es) {
  const int lane = threadIdx.x % 32;
  const int chunks = l1.shared_chunks;
  auto items = [](int count, int m_tiles, int k_splits) {
    return (count + kBlockN - 1) / kBlockN * (m_tiles / kWarpgroups) * k_splits;
  };
  const int l1_k_splits = kL1Split ? l1.k_splits : 1;
  const int32_t v[3] = {s.count, items(s.count, l1.m_tiles, l1_k_splits), items(s.count, l2_m_tiles, l2_k_splits)};
  int32_t before[3], total[3];  // (slots, L1 items, L2 items) of the routed experts
  tiny_sum_before(s, v, before, total);
  const bool writer = threadIdx.x < 32;
  if (writer && s.valid) es.slot_token[before[0] + s.rank] = token;
  // Shared slice c holds every token in order: slots total[0] + c * T + t.
  for (int i = lane; writer && i < T * chunks; i += 32) es.slot_token[total[0] + i] = i % T;
  const int shared_l1 = items(T, l1.m_tiles, l1_k_splits);

  // The first item: a routed expert's (its leader finds it), or a shared slice's, or none.
  const int work = static_cast<int>(blockIdx.x);
  const unsigned owner = __ballot_sync(0xffffffffu, s.leader && before[1] <= work && work < before[1] + v[1]);
  const int src = owner != 0 ? __ffs(owner) - 1 : 0;
  int expert = __shfl_sync(0xffffffffu, s.expert, src);
  int slot0 = __shfl_sync(0xffffffffu, before[0], src);
  int count = __shfl_sync(0xffffffffu, s.count, src);
  int item0 = __shfl_sync(0xffffffffu, before[1], src);
  const int l1_items = total[1] + chunks * shared_l1;
  if (owner == 0) {
    const int c = shared_l1 > 0 ? (work - total[1]) / shared_l1 : 0;
    expert = work < l1_items ? l1.num_routed + c : -1;
    slot0 = total[0] + c * T;
    count = T;
    item0 = total[1] + c * shared_l1;
  }
  const int local = work - item0, n_tiles = (count + kBlockN - 1) / kBlockN;
  if (threadIdx.x == 0) {
    if constexpr (kL1Split) {
      const w4a16_split::ItemCoords c = w4a16_split::item_coords(local, n_tiles, l1_k_splits);
      es.first = WorkItem{expert, c.m_block, c.k_split, slot0 + c.n_tile * kBlockN, slot0 + count, es.slot_token};
    } else {
      es.first = WorkItem{expert, local / n_tiles, 0, slot0 + local % n_tiles * kBlockN, slot0 + count, es.slot_token};
    }
    es.l1_items = l1_items;
    es.l2_items = total[2] + chunks * items(T, l2_m_tiles, l2_k_splits);
  }
}

// Early start from the top-k ids (T * k <= kTinyMaxSelections: a selection per lane).
template <int kWarpgroups, int kBlockN, bool kL1Split = false>
__device__ __forceinline__ void early_schedule(const W4a16GemmParams& l1, int l2_m_tiles, int l2_k_splits,
                                               EarlyStart& es) {
  const int lane = threadIdx.x % 32;
  const int selections = l1.tokens * l1.top_k, T = l1.tokens, chunks = l1.shared_chunks;
  // The host's invariant (can_start_early, src/backends/sm90_w4a16/sm90_w4a16_heuristics.cpp; moe_config,
  // src/backends/sm90_w4a16/sm90_w4a16_backend.cpp), not an input check: past it the map would overflow.
  if (selections > kTinyMaxSelections || T * (l1.top_k + chunks) > kTinyMaxSlots) __trap();
  const bool in_range = lane < selections;
  const TinySelection s = tiny_select(in_range ? l1.topk_ids[lane] : -1, in_range, l1.num_routed);
  tiny_schedule<kWarpgroups, kBlockN, kL1Split>(l1, l2_m_tiles, l2_k_splits, T, s, lane / l1.top_k, es);
}

// Early start on gated rows (runtime/token_gate.h): thread 0 waits for the rows the dispatch's
// gate let through (its {epoch, rows} word), then the schedule is that of their valid ids
// (tiny_compact), as the dispatch places them. Where the batch is not tiny (tiny_batch), the CTA
// waits for the dispatch and takes its first item from the dispatch's schedule: `es` holds the
// same as above either way, so the kernel has no second path (a flag that stays live across
// the mainloops costs descriptor copies in every K group: tests/sass/check_sass.sh). The host's
// invariant: no shared slices (the expert-parallel layer runs its shared expert apart).
template <int kWarpgroups, int kBlockN, bool kL1Split = false>
__device__ __forceinline__ void early_schedule_gated(const W4a16GemmParams& l1, const W4a16GemmParams& l2,
                                                     const runtime::GateRows& gate, EarlyStart& es) {
  __shared__ int32_t rows;
  if (l1.shared_chunks != 0) __trap();
  if (threadIdx.x == 0) rows = wait_gate_rows(gate);
  __syncthreads();
  const int entries = rows * l1.top_k;
  const TinyEntry e = tiny_compact(l1.topk_ids, min(entries, kTinyMaxEntries), l1.num_routed);
  if (tiny_batch(entries, e.valid)) {
    const bool in_range = static_cast<int>(threadIdx.x % 32) < e.valid;
    const TinySelection s = tiny_select(e.id, in_range, l1.num_routed);
    tiny_schedule<kWarpgroups, kBlockN, kL1Split>(l1, l2.m_tiles, l2.k_splits, rows, s, e.entry / l1.top_k, es);
    return;
  }
  // Not tiny: the first item from the dispatch's schedule. Each warp finds its expert with ballots
  // over the item offsets (decode_work inlined here as well changes ptxas's allocation of the
  // mainloops: tests/sass/check_sass.sh).
  static_assert(kTileStep<kBlockN> == kBlockN, "the fused tiles' items are kBlockN tokens wide");
  grid_dependency_wait();  // the dispatch's schedule from here on
  const int lane = threadIdx.x % 32, work = static_cast<int>(blockIdx.x);
  const int l1_items = l1.tile_offsets[l1.num_experts];
  int expert = -1;
  for (int e0 = 0; expert < 0 && e0 < l1.num_experts; e0 += 32) {
    const int e = e0 + lane;
    const bool here = e < l1.num_experts && l1.tile_offsets[e] <= work && work < l1.tile_offsets[e + 1];
    const unsigned hit = __ballot_sync(0xffffffffu, here);
    if (hit != 0) expert = e0 + __ffs(hit) - 1;
  }
  if (threadIdx.x == 0) {
    es.first.expert = -1;
    if (expert >= 0) {
      const int slot0 = l1.expert_offsets[expert], count = l1.expert_offsets[expert + 1] - slot0;
      const int local = work - l1.tile_offsets[expert], n_tiles = (count + kBlockN - 1) / kBlockN;
      if constexpr (kL1Split) {
        const w4a16_split::ItemCoords c = w4a16_split::item_coords(local, n_tiles, l1.k_splits);
        es.first = WorkItem{expert, c.m_block, c.k_split, slot0 + c.n_tile * kBlockN, slot0 + count, l1.slot_token};
      } else {
        es.first = WorkItem{expert, local / n_tiles, 0, slot0 + local % n_tiles * kBlockN, slot0 + count, l1.slot_token};
      }
    }
    es.l1_items = l1_items;
    es.l2_items = l2.tile_offsets[l2.num_experts];
  }
}

}  // namespace detail

}  // namespace megamoe::kernels::sm90
