// MoE dispatch on the device: from top-k ids and weights [T, k] to per-expert slot lists,
// offsets and the grouped-GEMM tile schedule, with no host synchronisation.
//
// Experts are "virtual": the E routed experts, then the shared expert split into
// `shared_chunks` slices of I columns each (every token selects every slice with weight 1), so
// all experts have the same I and one GEMM launch serves both.
#pragma once

#include <cub/block/block_scan.cuh>
#include <cstdint>

#include "kernels/common/pdl.cuh"

namespace megamoe::kernels::sm90 {

struct DispatchParams {
  const int32_t* topk_ids;       // (T, k)
  const float* topk_weights;     // (T, k)
  int32_t tokens;                // T
  int32_t top_k;                 // k
  int32_t num_experts;           // E routed
  int32_t shared_chunks;         // virtual shared experts (0 if none)
  int32_t l1_m_tiles;            // 64-row tiles of W13 per expert
  int32_t l2_m_tiles;            // 64-row tiles of W2 per expert
  int32_t l1_block_m_tiles;      // tiles per L1 CTA (warpgroups)
  int32_t l2_block_m_tiles;
  int32_t l1_block_n;            // tokens per L1 tile
  int32_t l2_block_n;
  int32_t l2_k_splits;           // K slices per L2 tile (L1 never splits K: SwiGLU needs full sums)
  // outputs (workspace)
  int32_t* expert_offsets;       // (E' + 1) slot offsets
  int32_t* l1_tile_offsets;      // (E' + 1) prefix of L1 work items
  int32_t* l2_tile_offsets;      // (E' + 1)
  int32_t* slot_token;           // (S) token of each slot
  float* slot_weight;            // (S) routing weight of each slot (1 for shared slices)
  int32_t* token_slot;           // (T, k + shared_chunks) slot of each selection, -1 if invalid
  int32_t* invalid_ids;          // (1) number of ids outside [0, E)
  // (counter_count) zeroed here before the GEMMs start: their work-item counters, the fused
  // launch's per-expert L1 progress.
  int32_t* counters;
  int32_t counter_count;
};

inline constexpr int kDispatchThreads = 1024;
inline constexpr int kDispatchMaxExperts = 2 * kDispatchThreads;  // two scan items per thread
// Selections each thread keeps in registers between the two passes (T * k up to 4096, e.g.
// DeepSeek-V3 up to T = 512): the second pass then issues no global load.
inline constexpr int kDispatchCachedPerThread = 4;

// One CTA: the counts live in shared memory, so the whole dispatch is two passes over the ids
// plus three block scans. Slot order inside an expert is whatever the atomics give; results do
// not depend on it (each GEMM column is computed independently, the combine sums in top-k
// order through token_slot). At decode the kernel is a chain of latencies on the critical path
// of the layer (the L1 GEMM waits for it to complete), so it reads each input once, into
// registers, and keeps the slot offsets it needs in shared memory rather than re-reading the
// global results it wrote.
__global__ void __launch_bounds__(kDispatchThreads, 1) moe_dispatch_kernel(DispatchParams p) {
  using Scan = cub::BlockScan<int32_t, kDispatchThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int32_t counts[kDispatchMaxExperts];
  __shared__ int32_t cursor[kDispatchMaxExperts];
  __shared__ int32_t invalid;

  allow_dependent_launch();  // L1's CTAs may be scheduled now; they wait for this grid's results
  const int tid = threadIdx.x;
  const int num_virtual = p.num_experts + p.shared_chunks;
  const int64_t items = static_cast<int64_t>(p.tokens) * p.top_k;
  for (int e = tid; e < num_virtual; e += kDispatchThreads) {
    counts[e] = e < p.num_experts ? 0 : p.tokens;
  }
  if (tid == 0) invalid = 0;
  for (int i = tid; i < p.counter_count; i += kDispatchThreads) p.counters[i] = 0;
  int32_t cached_id[kDispatchCachedPerThread];
  float cached_weight[kDispatchCachedPerThread];
#pragma unroll
  for (int j = 0; j < kDispatchCachedPerThread; ++j) {
    const int64_t i = tid + static_cast<int64_t>(j) * kDispatchThreads;
    cached_id[j] = i < items ? p.topk_ids[i] : 0;
    cached_weight[j] = i < items ? p.topk_weights[i] : 0.0f;
  }
  __syncthreads();

  auto count = [&](int32_t e) {
    if (e >= 0 && e < p.num_experts) {
      atomicAdd(&counts[e], 1);
    } else {
      atomicAdd(&invalid, 1);
    }
  };
  constexpr int64_t kCached = static_cast<int64_t>(kDispatchCachedPerThread) * kDispatchThreads;
#pragma unroll
  for (int j = 0; j < kDispatchCachedPerThread; ++j) {
    if (tid + static_cast<int64_t>(j) * kDispatchThreads < items) count(cached_id[j]);
  }
  for (int64_t i = kCached + tid; i < items; i += kDispatchThreads) count(p.topk_ids[i]);
  __syncthreads();

  // Exclusive scans over (slots, L1 tiles, L2 tiles); each thread owns experts 2*tid, 2*tid+1.
  // `out_shared`, when given, receives the exclusive prefix too (the slot cursors).
  auto scan3 = [&](auto value_of, int32_t* out, int32_t* out_shared) {
    int32_t v[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int e = 2 * tid + j;
      v[j] = e < num_virtual ? value_of(e) : 0;
    }
    int32_t total;
    Scan(scan_storage).ExclusiveSum(v, v, total);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int e = 2 * tid + j;
      if (e < num_virtual) {
        out[e] = v[j];
        if (out_shared != nullptr) out_shared[e] = v[j];
      }
    }
    if (tid == 0) out[num_virtual] = total;
    __syncthreads();
  };
  scan3([&](int e) { return counts[e]; }, p.expert_offsets, cursor);
  scan3([&](int e) {
    const int n_tiles = (counts[e] + p.l1_block_n - 1) / p.l1_block_n;
    return n_tiles * (p.l1_m_tiles / p.l1_block_m_tiles);
  }, p.l1_tile_offsets, nullptr);
  scan3([&](int e) {
    const int n_tiles = (counts[e] + p.l2_block_n - 1) / p.l2_block_n;
    return n_tiles * (p.l2_m_tiles / p.l2_block_m_tiles) * p.l2_k_splits;
  }, p.l2_tile_offsets, nullptr);

  // The scans' last barrier published cursor[] (= the slot offsets) to every thread.
  if (tid == 0) *p.invalid_ids = invalid;

  const int slots_per_token = p.top_k + p.shared_chunks;
  auto place = [&](int64_t i, int32_t e, float weight) {
    const int64_t t = i / p.top_k;
    const int64_t j = i % p.top_k;
    int32_t slot = -1;
    if (e >= 0 && e < p.num_experts) {
      slot = atomicAdd(&cursor[e], 1);
      p.slot_token[slot] = static_cast<int32_t>(t);
      p.slot_weight[slot] = weight;
    }
    p.token_slot[t * slots_per_token + j] = slot;
  };
#pragma unroll
  for (int j = 0; j < kDispatchCachedPerThread; ++j) {
    const int64_t i = tid + static_cast<int64_t>(j) * kDispatchThreads;
    if (i < items) place(i, cached_id[j], cached_weight[j]);
  }
  for (int64_t i = kCached + tid; i < items; i += kDispatchThreads) place(i, p.topk_ids[i], p.topk_weights[i]);
  // Shared slices: slot = offset + token, in token order. Their cursors are never advanced by
  // the routed selections above, so cursor[] still holds their offsets.
  const int64_t shared_items = static_cast<int64_t>(p.tokens) * p.shared_chunks;
  for (int64_t i = tid; i < shared_items; i += kDispatchThreads) {
    const int c = static_cast<int>(i / p.tokens);
    const int32_t t = static_cast<int32_t>(i % p.tokens);
    const int32_t slot = cursor[p.num_experts + c] + t;
    p.slot_token[slot] = t;
    p.slot_weight[slot] = 1.0f;
    p.token_slot[static_cast<int64_t>(t) * slots_per_token + p.top_k + c] = slot;
  }
}

}  // namespace megamoe::kernels::sm90
