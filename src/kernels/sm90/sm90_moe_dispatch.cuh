// MoE dispatch on the device: from top-k ids and weights [T, k] to per-expert slot lists,
// offsets and the grouped-GEMM tile schedule, with no host synchronisation.
//
// Experts are "virtual": the E routed experts, then the shared expert split into
// `shared_chunks` slices of I columns each (every token selects every slice with weight 1), so
// all experts have the same I and one GEMM launch serves both.
//
// The gated instantiations (kGated) take their tokens as they arrive from other ranks
// (runtime/token_gate.h): p.tokens is then a bound, the host's choices are made for it, and the
// gate's wait comes before the first read of the ids.
//
// Two paths (the host picks by T * k, see kDispatchSingleCtaItems):
//   * moe_dispatch_kernel: one CTA, for decode, where the dispatch is a chain of latencies;
//   * moe_dispatch_count_kernel + moe_dispatch_place_kernel: many CTAs, each owning a range of
//     tokens, for prefill, where one SM's scattered 4-byte stores (three per selection) set the
//     time: 78 us of Qwen3-30B's 826 us at T=4096 on one CTA (H200, clock64 per phase).
#pragma once

#include <cstdint>

#include "kernels/common/pdl.cuh"
#include "kernels/sm90/sm90_moe_dispatch_limits.h"
#include "kernels/sm90/sm90_moe_pipeline_params.cuh"
#include "kernels/sm90/sm90_moe_tiny_schedule.cuh"
#include "kernels/sm90/sm90_signal.cuh"

namespace megamoe::kernels::sm90 {

namespace dispatch_detail {

// Shared memory of block_exclusive_scan3: the 32 warps' sums, then their exclusive prefixes and
// the totals (row 32).
struct ScanStorage {
  int32_t warp[33][3];
};

// Inclusive prefix sums of three values over a warp's lanes (the three shuffle chains
// interleave).
__device__ __forceinline__ void warp_inclusive_scan3(int32_t (&v)[3], int lane) {
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const int32_t up = __shfl_up_sync(0xffffffffu, v[k], d);
      if (lane >= d) v[k] += up;
    }
  }
}

// Exclusive prefix sums over the CTA of three values per item, two items per thread (items
// 2 * tid and 2 * tid + 1); returns the three totals. Warp shuffles, one warp for the warps'
// sums, two barriers. It replaced three cub raking scans (BLOCK_SCAN_RAKING runs one warp
// serially over the 1024 threads' values), which took ~4000 cycles of the one-CTA dispatch's
// ~9700 at T=1 (clock64, H200); the layer got 0.3-0.4 us faster.
__device__ __forceinline__ void block_exclusive_scan3(int32_t (&x)[2][3], int32_t (&total)[3], ScanStorage& st) {
  static_assert(kDispatchThreads == 32 * 32, "one warp scans the warps' sums: 32 warps of 32 threads");
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t own[3], incl[3];
#pragma unroll
  for (int k = 0; k < 3; ++k) incl[k] = own[k] = x[0][k] + x[1][k];
  warp_inclusive_scan3(incl, lane);
  if (lane == 31) {
#pragma unroll
    for (int k = 0; k < 3; ++k) st.warp[warp][k] = incl[k];
  }
  __syncthreads();
  if (warp == 0) {
    int32_t w[3], wi[3];
#pragma unroll
    for (int k = 0; k < 3; ++k) wi[k] = w[k] = st.warp[lane][k];
    warp_inclusive_scan3(wi, lane);
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      st.warp[lane][k] = wi[k] - w[k];
      if (lane == 31) st.warp[32][k] = wi[k];
    }
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    const int32_t before = st.warp[warp][k] + incl[k] - own[k];
    const int32_t first = x[0][k];
    x[0][k] = before;
    x[1][k] = before + first;
    total[k] = st.warp[32][k];
  }
}

// Exclusive scans over the virtual experts' (slots, L1 tiles, L2 tiles) from counts[] (shared
// memory); each thread owns experts 2 * tid and 2 * tid + 1. cursor[] (shared memory) receives
// the slot offsets; with `publish`, the offsets and the tile prefixes are written to the
// workspace (one CTA per dispatch does that). Ends with a barrier (cursor[] complete). Returns
// the slots of all virtual experts.
__device__ __forceinline__ int32_t scan_offsets(const DispatchParams& p, ScanStorage& storage, const int32_t* counts,
                                             int32_t* cursor, bool publish) {
  const int tid = threadIdx.x;
  const int num_virtual = p.num_experts + p.shared_chunks;
  int32_t v[2][3];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int e = 2 * tid + j;
    const int32_t c = e < num_virtual ? counts[e] : 0;
    v[j][0] = c;
    v[j][1] = expert_token_tiles(c, p.l1_block_n, p.l1_tile_step) * (p.l1_m_tiles / p.l1_block_m_tiles) * p.l1_k_splits;
    v[j][2] = expert_token_tiles(c, p.l2_block_n, p.l2_tile_step) * (p.l2_m_tiles / p.l2_block_m_tiles) * p.l2_k_splits;
  }
  int32_t total[3];
  block_exclusive_scan3(v, total, storage);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int e = 2 * tid + j;
    if (e < num_virtual) {
      cursor[e] = v[j][0];
      if (publish) {
        p.expert_offsets[e] = v[j][0];
        p.l1_tile_offsets[e] = v[j][1];
        p.l2_tile_offsets[e] = v[j][2];
      }
    }
  }
  if (publish && tid == 0) {
    p.expert_offsets[num_virtual] = total[0];
    p.l1_tile_offsets[num_virtual] = total[1];
    p.l2_tile_offsets[num_virtual] = total[2];
  }
  __syncthreads();
  return total[0];
}

// Counts one selection of expert e in counts[] (shared memory), or in invalid when e is outside
// [0, E).
__device__ __forceinline__ void count_selection(const DispatchParams& p, int32_t e, int32_t* counts,
                                                int32_t* invalid) {
  if (e >= 0 && e < p.num_experts) {
    atomicAdd(&counts[e], 1);
  } else {
    atomicAdd(invalid, 1);
  }
}

// Where a slot's token and routing weight go: the workspace's slot_token / slot_weight, or the
// single-CTA kernel's staging copy of them in shared memory.
struct SlotArrays {
  int32_t* token;
  float* weight;
};
__device__ __forceinline__ SlotArrays workspace_slots(const DispatchParams& p) { return {p.slot_token, p.slot_weight}; }

// Stores selection i (token i / k, rank i % k) at `slot` of `out`; slot -1 is an id outside
// [0, E) (skipped by the combine, counted in invalid_ids).
__device__ __forceinline__ void store_selection(const DispatchParams& p, int64_t i, int32_t slot, float weight,
                                                SlotArrays out) {
  const int64_t t = i / p.top_k;
  const int64_t j = i % p.top_k;
  if (slot >= 0) {
    out.token[slot] = static_cast<int32_t>(t);
    out.weight[slot] = weight;
  }
  p.token_slot[t * (p.top_k + p.shared_chunks) + j] = slot;
}

// Places selection i of expert e at the next slot of e's cursor (slot order within an expert:
// whatever the atomics give).
__device__ __forceinline__ void place_selection(const DispatchParams& p, int64_t i, int32_t e, float weight,
                                                int32_t* cursor, SlotArrays out) {
  const int32_t slot = e >= 0 && e < p.num_experts ? atomicAdd(&cursor[e], 1) : -1;
  store_selection(p, i, slot, weight, out);
}

// Shared slices of tokens [t0, t1): slot = offset + token, in token order; offsets[E + c] is
// slice c's slot offset.
__device__ __forceinline__ void place_shared(const DispatchParams& p, int t0, int t1, const int32_t* offsets) {
  const int n = t1 - t0;
  const int64_t shared_items = static_cast<int64_t>(n) * p.shared_chunks;
  for (int64_t i = threadIdx.x; i < shared_items; i += kDispatchThreads) {
    const int c = static_cast<int>(i / n);
    const int32_t t = t0 + static_cast<int32_t>(i % n);
    const int32_t slot = offsets[p.num_experts + c] + t;
    p.slot_token[slot] = t;
    p.slot_weight[slot] = 1.0f;
    p.token_slot[static_cast<int64_t>(t) * (p.top_k + p.shared_chunks) + p.top_k + c] = slot;
  }
}

// A gated tiny batch of more than 32 ids (tiny_batch; most ids -1: other ranks' experts), by one
// warp: its valid selections at the slots the L1 GEMM's early start expects (tiny_compact),
// invalid ones marked -1 in token_slot.
__device__ __forceinline__ void place_tiny_compacted(const DispatchParams& p, int64_t items, const int32_t* cursor) {
  const TinyEntry e = tiny_compact(p.topk_ids, static_cast<int>(items), p.num_experts);
  const int lane = threadIdx.x % 32;
  const TinySelection s = tiny_select(e.id, lane < e.valid, p.num_experts);
  if (s.valid) store_selection(p, e.entry, cursor[s.expert] + s.rank, p.topk_weights[e.entry], workspace_slots(p));
  for (int64_t i = lane; i < items; i += 32) {
    const int32_t id = p.topk_ids[i];
    if (id < 0 || id >= p.num_experts) store_selection(p, i, -1, 0.0f, workspace_slots(p));
  }
}

}  // namespace dispatch_detail

// One CTA, up to kDispatchSingleCtaItems selections: the counts live in shared memory, so the
// whole dispatch is two passes over the ids (held in registers) plus one block scan (of three
// values). Slot order inside an expert is whatever the atomics give (results do not depend on it:
// each GEMM column is computed independently, the combine sums in top-k order through
// token_slot), except for a tiny batch, placed in the order the L1 GEMM's early start recomputes.
// At decode the kernel is a chain of latencies on the critical path of the layer (the L1 GEMM
// waits for it; with early start, from its second work item on), so it reads each input once,
// into registers, and keeps the slot offsets it needs in shared memory rather than re-reading
// the global results it wrote.
//
// Past one selection per thread, the routed slots' tokens and weights are staged in shared memory
// and written out in slot order after placement: stored straight from each selection, they are
// scattered 4-byte stores, each its own L2 transaction, all issued by one SM (4096 for 2048
// selections). H100, interleaved, 2048 selections: DeepSeek-V3 T=256 2244.9 -> 2242.2 us,
// Qwen3-30B T=256 163.4 -> 160.4; unchanged at 1024 (direct stores).
template <bool kGated>
__global__ void __launch_bounds__(kDispatchThreads, 1) moe_dispatch_kernel(DispatchParams p) {
  __shared__ dispatch_detail::ScanStorage scan_storage;
  __shared__ int32_t cursor[kDispatchMaxExperts];
  __shared__ int32_t invalid;
  extern __shared__ int32_t dispatch_stage[];  // kDispatchStageBytes
  int32_t* counts = dispatch_stage;            // until the offsets are scanned
  int32_t* stage_token = dispatch_stage;       // from then on: (kDispatchSingleCtaItems)
  float* stage_weight = reinterpret_cast<float*>(dispatch_stage + kDispatchSingleCtaItems);

  allow_dependent_launch();  // L1's CTAs may be scheduled now; they wait for this grid's results
  const int tid = threadIdx.x;
  const int num_virtual = p.num_experts + p.shared_chunks;
  int32_t T = p.tokens;
  if constexpr (kGated) {
    T = gate_tokens(p.gate, p.tokens);
    if (tid == 0) publish_gate_rows(p.gate, T);
  }
  const int64_t items = static_cast<int64_t>(T) * p.top_k;
  // Every selection is cached in registers: the host runs this kernel only up to
  // kDispatchSingleCtaItems selections (the multi-CTA pair below). An internal invariant, not an
  // input check (T and k are validated on the host): past it, selections would go unplaced.
  if (items > kDispatchSingleCtaItems) __trap();
  // The ids' and weights' loads first: their memory latency overlaps the initialisation below
  // (issued after the counters' stores, they waited for them: the pointers may alias).
  int32_t cached_id[kDispatchCachedPerThread];
  float cached_weight[kDispatchCachedPerThread];
#pragma unroll
  for (int j = 0; j < kDispatchCachedPerThread; ++j) {
    const int64_t i = tid + static_cast<int64_t>(j) * kDispatchThreads;
    cached_id[j] = i < items ? p.topk_ids[i] : 0;
    cached_weight[j] = i < items ? p.topk_weights[i] : 0.0f;
  }
  for (int e = tid; e < num_virtual; e += kDispatchThreads) {
    counts[e] = e < p.num_experts ? 0 : T;
  }
  if (tid == 0) invalid = 0;
  for (int i = tid; i < p.counter_count; i += kDispatchThreads) p.counters[i] = 0;
  __syncthreads();

#pragma unroll
  for (int j = 0; j < kDispatchCachedPerThread; ++j) {
    if (tid + static_cast<int64_t>(j) * kDispatchThreads < items) {
      dispatch_detail::count_selection(p, cached_id[j], counts, &invalid);
    }
  }
  __syncthreads();

  dispatch_detail::scan_offsets(p, scan_storage, counts, cursor, /*publish=*/true);

  // The scan's last barrier published cursor[] (= the slot offsets) to every thread.
  if (tid == 0) *p.invalid_ids = invalid;

  if (items <= kTinyMaxSelections) {
    // A tiny batch: warp 0 places the selections where the L1 GEMM's CTAs, starting early,
    // expect them (sm90_moe_tiny_schedule.cuh): the expert's offset plus the rank in selection
    // order.
    if (tid < 32) {
      const TinySelection s = tiny_select(cached_id[0], tid < items, p.num_experts);
      if (tid < items) {
        dispatch_detail::store_selection(p, tid, s.valid ? cursor[s.expert] + s.rank : -1, cached_weight[0],
                                         dispatch_detail::workspace_slots(p));
      }
    }
  } else if (kGated && tiny_batch(items, items - invalid)) {
    if (tid < 32) dispatch_detail::place_tiny_compacted(p, items, cursor);
  } else if (items <= kDispatchThreads) {
    // One selection per thread: one round of scattered stores; staging them measured slower
    // (Qwen3-30B T=8, 64 selections: 70.5 -> 71.1 us; neutral at 512).
    if (tid < items) {
      dispatch_detail::place_selection(p, tid, cached_id[0], cached_weight[0], cursor, dispatch_detail::workspace_slots(p));
    }
  } else {
    // The scan's last barrier: counts[] is dead, the staging area free.
#pragma unroll
    for (int j = 0; j < kDispatchCachedPerThread; ++j) {
      const int64_t i = tid + static_cast<int64_t>(j) * kDispatchThreads;
      if (i < items) dispatch_detail::place_selection(p, i, cached_id[j], cached_weight[j], cursor, {stage_token, stage_weight});
    }
    __syncthreads();  // every routed slot staged; cursor[E - 1] is the end of the routed slots
    const int routed_slots = p.num_experts > 0 ? cursor[p.num_experts - 1] : 0;
    for (int s = tid; s < routed_slots; s += kDispatchThreads) {
      p.slot_token[s] = stage_token[s];
      p.slot_weight[s] = stage_weight[s];
    }
  }
  // Shared slices. Their cursors are never advanced by the routed selections above, so cursor[]
  // still holds their offsets.
  dispatch_detail::place_shared(p, 0, T, cursor);
  if (p.zero_first != nullptr) {
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int64_t i = tid; i < p.zero_count / 4; i += kDispatchThreads) reinterpret_cast<float4*>(p.zero_first)[i] = zero;
  }
  // Gated, launched programmatically: this grid completes only after the kernel before it, so
  // the kernels after it that wait for it wait for that one too (the shared expert's output).
  if constexpr (kGated) grid_dependency_wait();
}

// Multi-CTA dispatch, first kernel: each CTA counts the routed selections of its tokens per
// expert into cta_counts[blockIdx.x] (and its invalid ids). The previous run's readers of
// cta_counts have completed: it is launched as an ordinary kernel, or (gated) programmatically
// after the exchange's send, an ordinary launch after them.
template <bool kGated>
__global__ void __launch_bounds__(kDispatchThreads, 1) moe_dispatch_count_kernel(DispatchParams p) {
  __shared__ int32_t counts[kDispatchMaxExperts];
  __shared__ int32_t invalid;
  allow_dependent_launch();  // the place kernel's CTAs may be scheduled now; they wait for this grid
  const int tid = threadIdx.x;
  int32_t T = p.tokens;
  if constexpr (kGated) T = gate_tokens(p.gate, p.tokens);  // every CTA waits; CTA 0 publishes the rows
  for (int e = tid; e < p.num_experts; e += kDispatchThreads) counts[e] = 0;
  if (tid == 0) invalid = 0;
  __syncthreads();
  const int t0 = blockIdx.x * p.tokens_per_cta;
  const int t1 = min(T, t0 + p.tokens_per_cta);
  const int64_t end = static_cast<int64_t>(t1) * p.top_k;
  for (int64_t i = static_cast<int64_t>(t0) * p.top_k + tid; i < end; i += kDispatchThreads) {
    dispatch_detail::count_selection(p, p.topk_ids[i], counts, &invalid);
  }
  __syncthreads();
  int32_t* out = p.cta_counts + static_cast<int64_t>(blockIdx.x) * p.num_experts;
  for (int e = tid; e < p.num_experts; e += kDispatchThreads) out[e] = counts[e];
  if (tid == 0) p.cta_invalid[blockIdx.x] = invalid;
  if constexpr (kGated) grid_dependency_wait();  // as moe_dispatch_kernel's
}

// Multi-CTA dispatch, second kernel (same grid): every CTA sums the per-CTA counts into the
// experts' totals and its own starting point within each expert (the counts of the CTAs before
// it), scans the totals (CTA 0 also publishes the offsets and tile prefixes, the invalid count,
// and zeroes the GEMMs' counters), then places its tokens' selections. Within an expert, slots
// go to the CTAs in token-range order.
template <bool kGated>
__global__ void __launch_bounds__(kDispatchThreads, 1) moe_dispatch_place_kernel(DispatchParams p) {
  __shared__ dispatch_detail::ScanStorage scan_storage;
  __shared__ int32_t counts[kDispatchMaxExperts];
  __shared__ int32_t cursor[kDispatchMaxExperts];
  allow_dependent_launch();  // L1's CTAs may be scheduled now; they wait for this grid's results
  grid_dependency_wait();    // cta_counts are complete from here on
  const int tid = threadIdx.x;
  int32_t T = p.tokens;
  if constexpr (kGated) {
    // The count kernel's gate; none of its rows where any of its CTAs failed (they counted none).
    // The rows are stored back as taken: the gated combine writes that many rows (into peers'
    // memory when ReturnRows is set), and the count kernel's CTA 0 stored its own wait's count.
    // No wait of this rank runs now, so every CTA reads the same failure flag.
    T = signal_failed(p.gate.failure) ? 0 : *reinterpret_cast<const volatile int32_t*>(p.gate.rows);
    if (blockIdx.x == 0 && tid == 0) {
      *p.gate.rows = T;
      publish_gate_rows(p.gate, T);
    }
  }
  const int num_virtual = p.num_experts + p.shared_chunks;
  const bool publish = blockIdx.x == 0;
  int32_t before[2];  // this CTA's start within experts 2 * tid and 2 * tid + 1 (the scan's owners)
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int e = 2 * tid + j;
    before[j] = 0;
    if (e < p.num_experts) {
      int32_t total = 0;
      for (int c = 0; c < static_cast<int>(gridDim.x); ++c) {
        const int32_t v = p.cta_counts[static_cast<int64_t>(c) * p.num_experts + e];
        total += v;
        if (c < static_cast<int>(blockIdx.x)) before[j] += v;
      }
      counts[e] = total;
    } else if (e < num_virtual) {
      counts[e] = T;  // a shared slice: every token
    }
  }
  if (publish) {
    for (int i = tid; i < p.counter_count; i += kDispatchThreads) p.counters[i] = 0;
    if (tid == 0) {
      int32_t invalid = 0;
      for (int c = 0; c < static_cast<int>(gridDim.x); ++c) invalid += p.cta_invalid[c];
      *p.invalid_ids = invalid;
    }
  }
  __syncthreads();
  const int32_t slots = dispatch_detail::scan_offsets(p, scan_storage, counts, cursor, publish);
  const int32_t valid = slots - T * p.shared_chunks;  // the routed selections
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    if (2 * tid + j < p.num_experts) cursor[2 * tid + j] += before[j];
  }
  __syncthreads();
  const int t0 = blockIdx.x * p.tokens_per_cta;
  const int t1 = max(t0, min(T, t0 + p.tokens_per_cta));
  const int64_t items = static_cast<int64_t>(T) * p.top_k;
  // A gated tiny batch: CTA 0 places all of it where the L1 GEMM's early start expects it (every
  // CTA scanned the same counts).
  if (kGated && tiny_batch(items, valid)) {
    if (blockIdx.x == 0 && tid < 32) dispatch_detail::place_tiny_compacted(p, items, cursor);
  } else {
    const int64_t end = static_cast<int64_t>(t1) * p.top_k;
    for (int64_t i = static_cast<int64_t>(t0) * p.top_k + tid; i < end; i += kDispatchThreads) {
      dispatch_detail::place_selection(p, i, p.topk_ids[i], p.topk_weights[i], cursor, dispatch_detail::workspace_slots(p));
    }
  }
  // The shared slices' cursors were not advanced: they hold the slices' offsets.
  dispatch_detail::place_shared(p, t0, t1, cursor);
}

}  // namespace megamoe::kernels::sm90
