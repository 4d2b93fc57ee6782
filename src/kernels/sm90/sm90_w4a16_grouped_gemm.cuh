// Hopper W4A16 grouped GEMM over MoE experts: NVFP4 weights decoded in registers feed bf16
// `wgmma` (A from registers), tokens stream through a cp.async multi-stage shared-memory
// pipeline (B, K-major, 128-byte swizzle). Two epilogues:
//   L1: acc = x · W13ᵀ, gate/up rows interleaved per thread -> s2 scales, clamp, SwiGLU, bf16
//       intermediate a[slot, I];
//   L2: acc = a · W2ᵀ -> s2 * routing weight, atomically added to an fp32 [T, H] accumulator,
//       or (deterministic) stored per slot for a fixed-order combine.
// Persistent CTAs claim (expert, m-block, k-slice, n-tile) work items of the list built by the
// dispatch kernel from an atomic counter; each item runs at the narrowest token width that holds
// its slots. The weights' decode (sm90_w4a16_decode.cuh) bounds the narrow-N (decode) tiles, so
// the K loop is unrolled over its stages to keep every address an immediate.
//
// Two kernels run these items: w4a16_grouped_gemm_kernel runs one GEMM (L1 or L2) per launch;
// w4a16_fused_moe_kernel runs L1's items and then L2's in one persistent launch, each L2 item
// starting as soon as its expert's L1 tiles are complete (decode: no grid-wide barrier, no
// launch between the GEMMs, and the CTAs that finish L1 early start L2).
//
// Before its grid dependency wait, each CTA prefetches into L2 the weights of the first item it
// would get under uniform routing (prefetch_guessed_item), and L1 zeroes the combine
// accumulator: DRAM works while the dispatch kernel (one SM) or the previous GEMM's tail runs.
//
// Early start (tiny batches, T * k <= 32): the L1 CTAs do not wait for the dispatch kernel
// before their first work item. Each computes that item from the top-k ids itself
// (sm90_moe_tiny_schedule.cuh: the schedule the dispatch publishes), and waits for the dispatch
// (griddepcontrol.wait) only after that item's mainloop, before anything that reads the
// dispatch's results or counters: claiming the next item, the fused launch's hand-off counters,
// any later item.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/arch/mma_sm90_gmma_ext.hpp>  // N = 48

#include "kernels/common/pdl.cuh"
#include "kernels/sm90/sm90_moe_tiny_schedule.cuh"
#include "kernels/sm90/sm90_w4a16_decode.cuh"
#include "kernels/sm90/sm90_w4a16_layout.h"

namespace megamoe::kernels::sm90 {

struct W4a16GemmParams {
  // Prepacked weights of all (virtual) experts: expert e starts at e * *_expert_stride bytes.
  const uint8_t* codes;
  const uint8_t* scales;
  int64_t code_expert_stride;
  int64_t scale_expert_stride;
  int32_t m_tiles;    // 64-row tiles per expert
  int32_t k_chunks;   // 64-wide K chunks (K / 64)
  int32_t k_splits;   // K slices per tile, each added into the output (L2 atomic mode only)
  int32_t k_chunks_per_split;
  const float* s2_a;  // per expert: L1 gate global scale; L2 down global scale
  const float* s2_b;  // per expert: L1 up global scale (unused in L2)
  // B operand source rows: L1 gathers hidden[slot_token[slot]], L2 reads act[slot].
  const __nv_bfloat16* b_src;
  int64_t b_ld;       // elements per row (= K)
  // Schedule from the dispatch kernel.
  const int32_t* expert_offsets;  // (E' + 1)
  const int32_t* tile_offsets;    // (E' + 1)
  // Work items past the first gridDim.x are handed out by this counter (zeroed by the dispatch
  // kernel) as CTAs finish their items' mainloops: items differ in cost (token widths, ragged K
  // slices), and a static stride left up to 17% of the SMs' time idle at the end of a prefill
  // GEMM (ncu, DeepSeek-V3 T=4096).
  int32_t* work_counter;
  int32_t num_experts;            // E' (virtual)
  const int32_t* slot_token;
  const float* slot_weight;
  // L1 output: act (S, I) bf16; L2 outputs: out_acc (T, H) fp32 or y_slot (S, H) fp32.
  __nv_bfloat16* act;
  int64_t act_ld;
  float* out_acc;
  float* y_slot;
  int64_t out_ld;
  float swiglu_limit;  // +inf when there is no clamp
  // L1 only: the atomic-combine accumulator (T, H) fp32 that L2 adds into, zeroed here so the run
  // needs no separate memset (L2 starts after this grid has completed; in the fused kernel, L2
  // items wait until every CTA has zeroed its part).
  float* zero_first;
  int64_t zero_count;  // floats, a multiple of 4
  // L1 only, early start (see the top of this file): the top-k ids (T, k), or null to wait for
  // the dispatch before the first item. Set only where T * k <= kTinyMaxSelections and
  // T * (k + shared_chunks) <= kTinyMaxSlots.
  const int32_t* topk_ids;
  int32_t tokens;         // T
  int32_t top_k;          // k
  int32_t num_routed;     // E (num_experts counts the shared slices as well)
  int32_t shared_chunks;
  // Pre-wait prefetch (see prefetch_guessed_item): the n-tiles per routed expert the host
  // expects from T * k / E, or 0 for none.
  int32_t guess_n_tiles;
};

namespace detail {

// wgmma m64nNk16 bf16 -> f32 with A from registers, B K-major in shared memory.
template <int N> struct WgmmaRS;
#define MEGAMOE_WGMMA_RS(N)                                                                  \
  template <> struct WgmmaRS<N> {                                                            \
    using Op = cute::SM90::GMMA::MMA_64x##N##x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K,  \
                                                                 cute::SM90::GMMA::Major::K>; \
  };
MEGAMOE_WGMMA_RS(16)
MEGAMOE_WGMMA_RS(32)
MEGAMOE_WGMMA_RS(48)
MEGAMOE_WGMMA_RS(64)
MEGAMOE_WGMMA_RS(96)
MEGAMOE_WGMMA_RS(128)
MEGAMOE_WGMMA_RS(160)
#undef MEGAMOE_WGMMA_RS

template <class Op, size_t... I>
__device__ __forceinline__ void wgmma_rs(const uint32_t (&a)[4], uint64_t desc_b,
                                         float (&d)[sizeof...(I)], std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], desc_b, d[I]...);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_one() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
template <class T>
__device__ __forceinline__ void keep_in_register(T& r) {
  if constexpr (sizeof(T) == 4) asm volatile("" : "+r"(*reinterpret_cast<uint32_t*>(&r)) :: "memory");
}
__device__ __forceinline__ void keep_in_register(float& r) { asm volatile("" : "+f"(r) :: "memory"); }

// Shared-memory matrix descriptor for a K-major bf16 tile with 128-byte swizzle: rows of 64
// elements (128 B), 8-row atoms of 1024 B stacked along N (stride byte offset 1024).
__device__ __forceinline__ uint64_t make_sw128_desc(const void* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);  // start address, 16-byte units
  desc |= static_cast<uint64_t>(1) << 16;                 // leading byte offset (unused: SW128 K-major)
  desc |= static_cast<uint64_t>(1024 >> 4) << 32;         // stride byte offset: next 8-row atom
  desc |= static_cast<uint64_t>(1) << 62;                 // layout: 128-byte swizzle
  return desc;
}

__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(smem_addr), "l"(gmem), "r"(valid ? 16 : 0) : "memory");
}
// 4 bytes, through L1 (.cg takes 16 only); zero-filled where !valid.
__device__ __forceinline__ void cp_async_4(uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
               :: "r"(smem_addr), "l"(gmem), "r"(valid ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }

// Calls f(std::integral_constant<int, i>) for i = 0 .. N-1 (compile-time indices).
template <int N, class F, int... I>
__device__ __forceinline__ void static_for_impl(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, class F>
__device__ __forceinline__ void static_for(F&& f) {
  static_for_impl<N>(f, std::make_integer_sequence<int, N>{});
}

// Token widths a tile of kBlockN tokens may run at: multiples of the step up to kBlockN. The
// step is 32 from the 64-token tile up (fewer mainloop instantiations; a two-warpgroup tile
// copies B in 256-thread rounds of 32 rows) and 16 below.
template <int kBlockN>
inline constexpr int kTokenWidthStep = kBlockN >= 64 ? 32 : 16;

// Calls f(std::integral_constant<int, width>) with the narrowest allowed width >= rows, or
// kBlockN when rows exceeds it (a tile that is not its expert's last). Each width is its own
// mainloop instantiation: a branch between wgmmas would make ptxas serialise them.
template <int kBlockN, int kWidth = kTokenWidthStep<kBlockN>, class F>
__device__ __forceinline__ void with_token_width(int rows, F&& f) {
  static_assert(kBlockN % kTokenWidthStep<kBlockN> == 0, "BLOCK_N must be a multiple of the token width step");
  if constexpr (kWidth >= kBlockN) {
    f(std::integral_constant<int, kBlockN>{});
  } else {
    if (rows <= kWidth) {
      f(std::integral_constant<int, kWidth>{});
    } else {
      with_token_width<kBlockN, kWidth + kTokenWidthStep<kBlockN>>(rows, f);
    }
  }
}

// K chunks per pipeline group of a tile of kBlockN tokens (see gemm_item).
template <int kBlockN>
inline constexpr int kChunksPerGroup = kBlockN <= 64 ? 2 : 1;

// silu(x) = x * sigmoid(x), the sigmoid from the SFU's approximate ex2 and rcp (flush to zero):
// five instructions. x / (1 + __expf(-x)) compiled to ~16 (the IEEE division's FCHK, Newton
// steps and slow-path call, ex2's subnormal fix-ups), a fifth of the L1 epilogue's instructions.
// The result is within a few fp32 ulps of the exact one before its single rounding to bf16
// (DESIGN.md §2). Limits: x -> -inf gives -0 (rcp(inf) = 0), x -> +inf gives x.
__device__ __forceinline__ float silu(float x) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(e) : "f"(x * -1.4426950408889634f));  // exp(-x)
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(1.0f + e));
  return x * r;
}

// Zeroes `count` floats (a multiple of 4) with the whole grid. Kept out of line so its registers
// do not add to the mainloop's.
__device__ __noinline__ void zero_grid_stride(float* dst, int64_t count) {
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count / 4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    reinterpret_cast<float4*>(dst)[i] = zero;
  }
}

// Zeroes slice `work` of `total` of `count` floats (a multiple of 4) with the calling CTA: the
// absorbing tile's L1 zeroes the combine accumulator one slice per work item, as the item starts
// (see w4a16_grouped_gemm_kernel).
__device__ __forceinline__ void zero_item_slice(float* dst, int64_t count, int work, int total) {
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  const int64_t vecs = count / 4, per = (vecs + total - 1) / total;
  const int64_t end = min(vecs, (static_cast<int64_t>(work) + 1) * per);
  for (int64_t i = static_cast<int64_t>(work) * per + threadIdx.x; i < end; i += blockDim.x) {
    reinterpret_cast<float4*>(dst)[i] = zero;
  }
}

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
// weights) across n-tiles, so CTAs that run together hit the same weight bytes in L2.
__device__ __forceinline__ int split_expert_work(const W4a16GemmParams& p, int local, int n_tiles, WorkItem& w) {
  w.k_split = (local / n_tiles) % p.k_splits;
  w.m_block = local / n_tiles / p.k_splits;
  return local % n_tiles;
}
// Tokens per tile but an expert's last (expert_token_tiles): the 160-token tile is the absorbing
// tile (128-token tiles, the last up to 160: kAbsorbingTile on the host), every other tile its
// own width.
template <int kBlockN>
inline constexpr int kTileStep = kBlockN == 160 ? 128 : kBlockN;

// Decodes work item `work` (0 <= work < tile_offsets[num_experts] = total). The items are
// expert-major, and under balanced routing every expert holds about total / E of them: the
// expert is guessed from the item's share of the total and checked, with its two neighbours, in
// one round of independent loads (the window's item and slot offsets); where the guess misses
// (skewed routing) a binary search over the rest follows. A binary search alone was 7-8
// dependent loads at the start of every item, and then the slot offsets' round trip: ncu had
// them among the absorbing L1 kernel's largest stalls. `total` only picks where the search
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

// Tiles that may see an early start: T * k <= 32 puts at most 32 tokens on an expert, which the
// heuristic runs on a one-warpgroup tile of at most 48 tokens. The others do not carry its code
// (it cost the 128-token L1 kernel 120 bytes of spills).
template <bool kIsL1, int kWarpgroups, int kBlockN>
inline constexpr bool kMayStartEarly = kIsL1 && kWarpgroups == 1 && kBlockN <= 48;

// Early start's shared memory: the tiny batch's slot -> token map, the CTA's first work item and
// the work-item counts.
struct EarlyStart {
  int32_t slot_token[kTinyMaxSlots];
  WorkItem first;  // expert -1: the CTA's first item is not an L1 item
  int32_t l1_items, l2_items;
};

// The tiny batch's schedule from the top-k ids, exactly as the dispatch kernel publishes it
// (virtual experts in id order; an expert of c slots has ceil(c / kBlockN) * (m_tiles /
// kWarpgroups) * k_splits items), and this CTA's first item (blockIdx.x). l2_m_tiles = 0 where
// no L2 items follow (the two-launch L1 kernel). Every thread calls it: each warp computes the
// same schedule and warp 0 stores it. (Run by warp 0 alone, behind a tid < 32 branch, it made
// ptxas build the L1 mainloop's wgmma descriptors in ordinary registers: 44 more instructions
// per K group of the 16-token kernel.)
template <int kWarpgroups, int kBlockN>
__device__ __forceinline__ void early_schedule(const W4a16GemmParams& l1, int l2_m_tiles, int l2_k_splits,
                                               EarlyStart& es) {
  const int lane = threadIdx.x % 32;
  const int selections = l1.tokens * l1.top_k, T = l1.tokens, chunks = l1.shared_chunks;
  // The host's invariant (MoePlan::config), not an input check: past it the map would overflow.
  if (selections > kTinyMaxSelections || T * (l1.top_k + chunks) > kTinyMaxSlots) __trap();
  const bool in_range = lane < selections;
  const TinySelection s = tiny_select(in_range ? l1.topk_ids[lane] : -1, in_range, l1.num_routed);
  auto items = [](int count, int m_tiles, int k_splits) {
    return (count + kBlockN - 1) / kBlockN * (m_tiles / kWarpgroups) * k_splits;
  };
  const int32_t v[3] = {s.count, items(s.count, l1.m_tiles, 1), items(s.count, l2_m_tiles, l2_k_splits)};
  int32_t before[3], total[3];  // (slots, L1 items, L2 items) of the routed experts
  tiny_sum_before(s, v, before, total);
  const bool writer = threadIdx.x < 32;
  if (writer && s.valid) es.slot_token[before[0] + s.rank] = lane / l1.top_k;
  // Shared slice c holds every token in order: slots total[0] + c * T + t.
  for (int i = lane; writer && i < T * chunks; i += 32) es.slot_token[total[0] + i] = i % T;
  const int shared_l1 = items(T, l1.m_tiles, 1);

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
    es.first = WorkItem{expert, local / n_tiles, 0, slot0 + local % n_tiles * kBlockN, slot0 + count, es.slot_token};
    es.l1_items = l1_items;
    es.l2_items = total[2] + chunks * items(T, l2_m_tiles, l2_k_splits);
  }
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
// item started fixed each CTA's next item one item ahead: a CTA on a crowded SM took an item
// that a CTA finishing earlier could have run, and in the fused launch, where most CTAs run one
// to three items, the second wave was then as uneven as the block scheduler's placement (L2
// items waited 1.5-6 us each for their experts' last L1 items at DeepSeek-V3 T=2, H200).
__device__ __forceinline__ int claim_work(int32_t* counter) {
  return static_cast<int>(gridDim.x) + atomicAdd(counter, 1);
}

// Prefetches [ptr, ptr + bytes) into L2 (one thread; bytes a multiple of 16, ptr 16-byte aligned).
__device__ __forceinline__ void prefetch_l2(const void* ptr, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" :: "l"(ptr), "r"(bytes) : "memory");
}

// Prefetches the codes and scales of a work item's first kChunks K chunks into L2: both are
// contiguous along K per 64-row tile (sm90_w4a16_layout.h).
template <int kWarpgroups, int kChunks>
__device__ __forceinline__ void prefetch_item_weights(const W4a16GemmParams& p, const WorkItem& w) {
  using namespace w4a16;
  const auto [k_begin, item_n] = item_chunks(p, w);
  const int n = min(kChunks, item_n);
#pragma unroll
  for (int wg = 0; wg < kWarpgroups; ++wg) {
    const int64_t tile0 = static_cast<int64_t>(w.m_block * kWarpgroups + wg) * p.k_chunks + k_begin;
    prefetch_l2(p.codes + w.expert * p.code_expert_stride + tile0 * kCodeBytesPerTile, n * kCodeBytesPerTile);
    prefetch_l2(p.scales + w.expert * p.scale_expert_stride + tile0 * kScaleBytesPerTile, n * kScaleBytesPerTile);
  }
}

// Before its grid dependency wait (the dispatch for L1, L1 for the two-launch L2), a CTA's
// first item is unknown but its weights are not: the item schedule is expert-major, so with
// every routed expert holding guess_n_tiles n-tiles, item blockIdx.x is a fixed (expert,
// m-block, k-slice). Prefetching that item's first chunks into L2 puts DRAM to work while the
// dispatch runs (one SM, DRAM idle) or while the previous GEMM's tail drains. A wrong guess
// (empty or fuller experts) shifts the experts, but the guessed first wave is still mostly the
// real one's weights, fetched by other CTAs. One thread calls it. Inlined: as a call (out of
// line) it changed the register allocation of every mainloop after it (230 instead of 188
// instructions per K group of the 32-token tile; tests/sass/check_sass.sh).
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

// The fused kernel's L1 -> L2 hand-off through global counters, as CUTLASS's split-K semaphores
// do it. The writer CTA: a CTA barrier after its stores, then one thread publishes with a release
// add (cumulative over the stores the barrier ordered before it); the reader: one thread
// acquires, then a CTA barrier. The data is read through L2 (cp.async.cg): another SM wrote it.
__device__ __forceinline__ void red_release_add(int32_t* counter, int32_t v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" :: "l"(counter), "r"(v) : "memory");
}
__device__ __forceinline__ int32_t ld_acquire(const int32_t* counter) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(counter) : "memory");
  return v;
}
// Spins (one thread) until *counter >= target.
__device__ __forceinline__ void wait_at_least(const int32_t* counter, int32_t target) {
  int ns = 32;
  while (ld_acquire(counter) < target) {
    __nanosleep(ns);
    ns = min(2 * ns, 512);
  }
}

// Calls f(slot, acc index of row r0, acc index of row r0 + 8) for each of this thread's columns
// that holds a slot of the item: acc[4i + 2h + c] = (row r0 + 8h, column 8i + 2t + c).
template <int kBlockN, class F>
__device__ __forceinline__ void for_each_valid_column(const WorkItem& w, int t, F&& f) {
#pragma unroll
  for (int i = 0; i < kBlockN / 8; ++i) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int slot = w.slot_begin + 8 * i + 2 * t + c;
      if (slot < w.slot_end) f(slot, 4 * i + c, 4 * i + 2 + c);
    }
  }
}

// y += (x, y, z, w) for 4 consecutive floats (16-byte aligned), one vector reduction (sm_90).
__device__ __forceinline__ void red_add_v4(float* dst, float x, float y, float z, float w) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" :: "l"(dst), "f"(x), "f"(y), "f"(z), "f"(w)
               : "memory");
}

// The L2 combine's staging in shared memory (store_tile, both combines): per warpgroup,
// kStagedColumns tokens of its 64 rows, kStagedStride floats apart. 68 (not 64) puts the scalar
// stores of a warp's (4 tokens, 8 rows) on 32 distinct banks and keeps each token's rows 16-byte
// aligned (272 B apart).
inline constexpr int kStagedColumns = 32;
inline constexpr int kStagedStride = 68;

// Epilogue of one warpgroup's (64, BLOCK_N) tile m_tile, r0 = 16 * warp + g.
// staging: the L2 combine's staging in shared memory (Smem::kStagingOffset); kOwnStaging: it is
// not the B stages, so no CTA barrier before it.
// table_token, table_weight (kOwnStaging, L2): the item's tokens and routing weights in shared
// memory, indexed from w.slot_begin; the other tiles read them from p.
template <bool kIsL1, int kWarpgroups, int kBlockN, bool kOwnStaging = false>
__device__ __forceinline__ void store_tile(const W4a16GemmParams& p, const float (&acc)[kBlockN / 2],
                                           const WorkItem& w, int m_tile, int warp, int g, int t, uint8_t* staging_smem,
                                           const int32_t* table_token = nullptr, const float* table_weight = nullptr) {
  using namespace w4a16;
  const int e = w.expert;
  if constexpr (kIsL1) {
    // The A operand carries 2^-8 (sm90_w4a16_layout.h); scaling s2 by 2^8 is exact and gives the
    // same rounding as unscaling the accumulator first.
    const float s2_gate = p.s2_a[e] * kAccumulatorUnscale, s2_up = p.s2_b[e] * kAccumulatorUnscale;
    auto swiglu = [&](float gate_acc, float up_acc) {
      const float gate = fminf(gate_acc * s2_gate, p.swiglu_limit);
      const float up = fminf(fmaxf(up_acc * s2_up, -p.swiglu_limit), p.swiglu_limit);
      return __float2bfloat16_rn(silu(gate) * up);
    };
    if constexpr (kWarpgroups == 1) {
      // The one-warpgroup (decode) tiles store element by element (their items are narrow; see
      // the L2 branch).
      const int64_t col_j = w13_intermediate_column(m_tile, warp * 16 + g);
      for_each_valid_column<kBlockN>(w, t, [&](int slot, int j_gate, int j_up) {
        p.act[static_cast<int64_t>(slot) * p.act_ld + col_j] = swiglu(acc[j_gate], acc[j_up]);
      });
    } else {
      // Through shared memory, per warp. A warp's gate / up row pairs are 8 consecutive act
      // columns (w13_intermediate_column), 16 bytes of each token's row, spread over the 8 lanes
      // of a quad column (g); element by element, each 2-byte store cost an address of its own
      // (ptxas spilled the 64-bit addresses to local memory), 22% of the absorbing L1 kernel's
      // instructions at Qwen3-30B T=16384 (ncu). Staged as (kStagedColumns tokens, 8 columns),
      // lane L writes token L's 16 bytes with one store. The warp's region (512 bytes) is its
      // own: __syncwarp orders it.
      static_assert(kBlockN % kStagedColumns == 0, "the staged epilogue passes kStagedColumns tokens at a time");
      static_assert(kStagedColumns == 32, "one token per lane in a pass");
      static_assert(kStagedColumns * 8 * 2 * 4 <= kStagedColumns * kStagedStride * 4,
                    "a warpgroup's four (kStagedColumns, 8) bf16 regions must fit its staging");
      const int lane = threadIdx.x % 32;
      const int wg = threadIdx.x / kThreadsPerWarpgroup;
      __nv_bfloat16* const stage = reinterpret_cast<__nv_bfloat16*>(staging_smem + wg * kStagedColumns * kStagedStride * 4) +
                                   warp * kStagedColumns * 8;  // (kStagedColumns, 8)
      __nv_bfloat16* const act_cols = p.act + w13_intermediate_column(m_tile, warp * 16);
      if constexpr (!kOwnStaging) __syncthreads();  // the B stages are free once every wgmma is done
      #pragma unroll
      for (int first = 0; first < kBlockN; first += kStagedColumns) {
        #pragma unroll
        for (int i = first / 8; i < (first + kStagedColumns) / 8; ++i) {
          #pragma unroll
          for (int c = 0; c < 2; ++c) stage[(8 * i - first + 2 * t + c) * 8 + g] = swiglu(acc[4 * i + c], acc[4 * i + 2 + c]);
        }
        __syncwarp();
        const int slot = w.slot_begin + first + lane;
        if (slot < w.slot_end) {
          *reinterpret_cast<uint4*>(act_cols + static_cast<int64_t>(slot) * p.act_ld) =
              *reinterpret_cast<const uint4*>(stage + lane * 8);
        }
        __syncwarp();  // the next pass overwrites the region
      }
    }
  } else {
    const float s2 = p.s2_a[e] * kAccumulatorUnscale;  // exact, see the L1 branch
    const int64_t row0 = static_cast<int64_t>(m_tile) * kTileM + warp * 16 + g;
    if constexpr (kWarpgroups == 1) {
      // The one-warpgroup (decode) tiles store element by element: the staged path below added
      // 6-8 instructions per K group to their issue-bound L2 mainloops (register allocation;
      // tests/sass/check_sass.sh), and their items are narrow, so the epilogue is small.
      if (p.y_slot != nullptr) {
        for_each_valid_column<kBlockN>(w, t, [&](int slot, int j0, int j1) {
          float* y = p.y_slot + static_cast<int64_t>(slot) * p.out_ld + row0;
          y[0] = acc[j0] * s2;
          y[8] = acc[j1] * s2;
        });
        return;
      }
      // Atomic combine. The columns' tokens and routing weights are loaded in batches of 16 ahead
      // of their atomics: a load after an atomic add to a float* that may alias slot_weight
      // cannot move above it, so loading per column made one global-load round trip per column
      // in sequence (docs/perf/2026-11-21-h100-w4a16-v15.md).
      constexpr int kColumns = kBlockN / 4;  // this thread's columns 8i + 2t + c: index 2i + c
      constexpr int kBatch = 16;
      #pragma unroll
      for (int first = 0; first < kColumns; first += kBatch) {
        int32_t token[kBatch];
        float weight[kBatch];
        #pragma unroll
        for (int j = 0; j < kBatch && first + j < kColumns; ++j) {
          const int col = first + j;
          const int slot = w.slot_begin + 8 * (col / 2) + 2 * t + col % 2;
          const bool valid = slot < w.slot_end;
          token[j] = valid ? p.slot_token[slot] : 0;
          weight[j] = valid ? p.slot_weight[slot] : 0.0f;
        }
        #pragma unroll
        for (int j = 0; j < kBatch && first + j < kColumns; ++j) {
          const int col = first + j, i = col / 2, c = col % 2;
          if (w.slot_begin + 8 * i + 2 * t + c < w.slot_end) {
            // Same order as the semantics: y = acc * s2, then times the routing weight.
            float* o = p.out_acc + static_cast<int64_t>(token[j]) * p.out_ld + row0;
            atomicAdd(o, (acc[4 * i + c] * s2) * weight[j]);
            atomicAdd(o + 8, (acc[4 * i + 2 + c] * s2) * weight[j]);
          }
        }
      }
      return;
    } else {
      // Both combines go through a transpose in shared memory. The accumulators give a thread two
      // rows (r0, r0 + 8) of many tokens, so storing them as they lie takes one 4-byte access per
      // element (a warp's instruction: 4 tokens x 8 rows). Staged per warpgroup as (token, 64 rows)
      // columns, a lane holds 4 consecutive rows of one token and writes them with one 16-byte
      // access: a quarter of the instructions, and a warp's instruction covers two tokens' 64 rows,
      // i.e. whole 128-byte lines. Atomic combine: red.global.add.v4.f32 (sm_90) into
      // out_acc[token]; deterministic: a store to y_slot[slot] (the combine kernel sums the slots in
      // a fixed order). On items of K = 2048 (megamoe_mainloop_probe, H100) the 128-token tile ran
      // at 54% of the tensor rate with per-element atomics and 64% with per-warp staging (each
      // token's 16 rows of a warp: 64-byte pieces); the absorbing tile went from 65.3% to 71.2%
      // with whole lines (docs/perf/2026-11-22-h100-w4a16-v19.md): the combine's cost follows the
      // number of requests that leave the SM, not only its bytes.
      // The staging reuses the B stages, free once every warpgroup is past its last wgmma (the
      // barrier below), unless the tile has its own (kOwnStaging); the caller's barrier after the
      // item hands the B stages back to the next item. Within a pass the warpgroup's warps meet at a
      // named barrier (id 1 + warpgroup; id 0 is __syncthreads).
      static_assert(kBlockN % kStagedColumns == 0, "the staged combine passes kStagedColumns tokens at a time");
      const int lane = threadIdx.x % 32;
      const int wg = threadIdx.x / kThreadsPerWarpgroup;
      float* const staging = reinterpret_cast<float*>(staging_smem) + wg * kStagedColumns * kStagedStride;
      const int half = lane / 16;                                             // which of two tokens
      const int64_t rows = static_cast<int64_t>(m_tile) * kTileM + 4 * (lane % 16);  // this lane's 4 rows
      const bool to_slots = p.y_slot != nullptr;
      auto warpgroup_barrier = [wg] { asm volatile("bar.sync %0, 128;\n" :: "r"(1 + wg) : "memory"); };
      if constexpr (!kOwnStaging) __syncthreads();
      #pragma unroll
      for (int first = 0; first < kBlockN; first += kStagedColumns) {
        // This lane's tokens in the pass: columns first + 8 warp + 2 j + half, their destination row
        // (token or slot, -1 past the item's slots) and routing weight: from the absorbing tile's
        // slot table in shared memory, or from global memory before the staging stores, so that
        // their round trip overlaps them.
        int32_t dst_row[kStagedColumns / 8];
        float weight[kStagedColumns / 8];
        #pragma unroll
        for (int j = 0; j < kStagedColumns / 8; ++j) {
          const int column = first + 8 * warp + 2 * j + half;
          const int slot = w.slot_begin + column;
          const bool valid = slot < w.slot_end;
          if constexpr (kOwnStaging) {
            // The absorbing tile: its item's slot table (gemm_item_overlapped).
            dst_row[j] = !valid ? -1 : (to_slots ? slot : table_token[column]);
            weight[j] = valid && !to_slots ? table_weight[column] : 0.0f;
          } else {
            dst_row[j] = !valid ? -1 : (to_slots ? slot : p.slot_token[slot]);
            weight[j] = valid && !to_slots ? p.slot_weight[slot] : 0.0f;
          }
        }
        // Same order as the semantics: y = acc * s2 here, times the routing weight below.
        #pragma unroll
        for (int i = first / 8; i < (first + kStagedColumns) / 8; ++i) {
          #pragma unroll
          for (int c = 0; c < 2; ++c) {
            float* col = staging + (8 * i - first + 2 * t + c) * kStagedStride + 16 * warp;
            col[g] = acc[4 * i + c] * s2;
            col[g + 8] = acc[4 * i + 2 + c] * s2;
          }
        }
        warpgroup_barrier();
        #pragma unroll
        for (int j = 0; j < kStagedColumns / 8; ++j) {
          if (dst_row[j] >= 0) {
            const float4 y =
                *reinterpret_cast<const float4*>(staging + (8 * warp + 2 * j + half) * kStagedStride + 4 * (lane % 16));
            const int64_t offset = static_cast<int64_t>(dst_row[j]) * p.out_ld + rows;
            if (to_slots) {
              *reinterpret_cast<float4*>(p.y_slot + offset) = y;
            } else {
              red_add_v4(p.out_acc + offset, y.x * weight[j], y.y * weight[j], y.z * weight[j], y.w * weight[j]);
            }
          }
        }
        warpgroup_barrier();  // the next pass overwrites the staging
      }
    }
  }
}

}  // namespace detail

// Shared-memory footprint of one configuration (host and device agree through this).
template <int kWarpgroups, int kBlockN, int kStages>
struct W4a16SmemLayout {
  static constexpr int kBTileBytes = kBlockN * w4a16::kChunkK * 2;  // (BLOCK_N, 64) bf16
  static constexpr int kCodeStageBytes = kWarpgroups * w4a16::kCodeBytesPerTile;
  static constexpr int kScaleStageBytes = kWarpgroups * w4a16::kScaleBytesPerTile;
  static constexpr int kBOffset = 0;
  static constexpr int kCodeOffset = kBOffset + kStages * kBTileBytes;
  static constexpr int kScaleOffset = kCodeOffset + kStages * kCodeStageBytes;
  // The L2 combine's staging (store_tile): in the B stages, free once every warpgroup is past its
  // last wgmma (a CTA barrier); the absorbing tile (four warpgroups), whose warpgroups run their
  // epilogues while others still compute (no CTA barrier between items), has its own.
  static constexpr bool kOwnStaging = kWarpgroups == 4;
  static constexpr int kStagingBytes = kWarpgroups * detail::kStagedColumns * detail::kStagedStride * 4;
  static constexpr int kStagingOffset = kOwnStaging ? kScaleOffset + kStages * kScaleStageBytes : kBOffset;
  // The absorbing tile's slot table (store_tile): per item, its slots' tokens (int32) and routing
  // weights (fp32), kBlockN each, in two buffers (items alternate).
  static constexpr int kSlotTableBufferBytes = kBlockN * 8;
  static constexpr int kSlotTableBytes = kOwnStaging ? 2 * kSlotTableBufferBytes : 0;
  static constexpr int kSlotTableOffset = kScaleOffset + kStages * kScaleStageBytes + (kOwnStaging ? kStagingBytes : 0);
  static constexpr int kBytes = kSlotTableOffset + kSlotTableBytes;
  static constexpr int kAllocBytes = kBytes + 1024;  // room to align the base to 1024 B
  static_assert(kBTileBytes % 1024 == 0,
                "BLOCK_N must be a multiple of 8 so each B stage is whole 1024-byte swizzle atoms");
  static_assert(kOwnStaging || kStagingBytes <= kStages * kBTileBytes,
                "the L2 combine's staging (store_tile) must fit in the B stages: add stages or tokens");
};

namespace detail {

// Aligns the dynamic shared memory to 1024 B (the 128-byte swizzle atom) by offsetting the array
// itself, so the compiler still knows the pointer is shared memory and emits LDS rather than
// generic loads.
__device__ __forceinline__ uint8_t* aligned_dynamic_smem() {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t smem_misalign = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 1023u;
  return smem_raw + ((1024u - smem_misalign) & 1023u);
}

// Piece i of a work item's B tile, 16 bytes of (row i / 8, K chunk columns 8 * (i % 8) ..): its
// global source at chunk k_begin (the slot's token row in L1, the slot's activation row in L2),
// its shared-memory destination in stage 0 (piece c of row r lands at c ^ (r % 8): 128-byte
// swizzle), and whether the row holds a slot of the item (otherwise the copy zero-fills).
template <bool kIsL1, class Smem>
__device__ __forceinline__ void b_piece(const W4a16GemmParams& p, const WorkItem& w, int k_begin, uint32_t smem_u32,
                                        int i, const char*& src, uint32_t& dst, bool& valid) {
  const int r = i / 8, c = i % 8;
  const int slot = w.slot_begin + r;
  valid = slot < w.slot_end;
  const int64_t src_row = !valid ? 0 : (kIsL1 ? w.slot_token[slot] : slot);
  src = reinterpret_cast<const char*>(p.b_src + src_row * p.b_ld + k_begin * w4a16::kChunkK + c * 8);
  dst = smem_u32 + Smem::kBOffset + r * 128 + ((c ^ (r & 7)) * 16);
}

// A thread's pieces of a work item's B tile, tid, tid + kThreads, ... (b_piece at chunk k_begin):
// gemm_item and gemm_item_overlapped copy their B stages from these.
template <int kPieces>
struct BPieces {
  const char* src[kPieces];
  uint32_t dst[kPieces];
  bool valid[kPieces];
};
template <bool kIsL1, class Smem, int kPieces, int kThreads>
__device__ __forceinline__ BPieces<kPieces> b_pieces(const W4a16GemmParams& p, const WorkItem& w, int k_begin,
                                                     uint32_t smem_u32, int tid) {
  BPieces<kPieces> b;
  #pragma unroll
  for (int j = 0; j < kPieces; ++j) b_piece<kIsL1, Smem>(p, w, k_begin, smem_u32, tid + j * kThreads, b.src[j], b.dst[j], b.valid[j]);
  return b;
}

// A thread's weight streams for one work item: its 16 code bytes (and, for 16 threads of the
// warpgroup, 16 scale bytes) of 64-row tile a_tile0's first chunk, their shared-memory
// destinations, and the consumer reads of its A fragments' codes and scales, all at stage 0 (a
// stage adds a constant). code_bias offsets the code source (gemm_item's chunk pairs).
struct WeightStreams {
  const uint8_t* code_src;
  const uint8_t* scale_src;
  uint32_t code_dst, scale_dst;
  const uint8_t* code_lds;
  const uint8_t* scale_lds;
  bool copies_scales;
};
template <class Smem>
__device__ __forceinline__ WeightStreams weight_streams(const W4a16GemmParams& p, int expert, int64_t a_tile0,
                                                        uint8_t* smem, int wg, int wtid, int code_bias) {
  using namespace w4a16;
  const int warp = wtid / 32, g = wtid % 32 / 4;
  const uint32_t smem_u32 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  WeightStreams s;
  s.code_src = p.codes + expert * p.code_expert_stride + a_tile0 * kCodeBytesPerTile + wtid * 16 + code_bias;
  s.scale_src = p.scales + expert * p.scale_expert_stride + a_tile0 * kScaleBytesPerTile + wtid * 16;
  s.code_dst = smem_u32 + Smem::kCodeOffset + wg * kCodeBytesPerTile + wtid * 16;
  s.scale_dst = smem_u32 + Smem::kScaleOffset + wg * kScaleBytesPerTile + wtid * 16;
  s.code_lds = smem + Smem::kCodeOffset + wg * kCodeBytesPerTile + wtid * 16;
  s.scale_lds = smem + Smem::kScaleOffset + wg * kScaleBytesPerTile + (warp * 8 + g) * 8;
  s.copies_scales = wtid < kScaleBytesPerTile / 16;
  return s;
}

// Runs one work item with the whole CTA: mainloop over its K slice, then after_mainloop() (every
// thread; the schedulers claim their next item there), then the epilogue. The caller's barrier
// after it hands the shared-memory stages to the next item.
template <bool kIsL1, int kWarpgroups, int kBlockN, int kStages, class AfterMainloop>
__device__ __forceinline__ void gemm_item(const W4a16GemmParams& p, const WorkItem& w, uint8_t* smem,
                                          AfterMainloop&& after_mainloop) {
  using namespace w4a16;
  using Smem = W4a16SmemLayout<kWarpgroups, kBlockN, kStages>;
  static_assert(kStages >= 2, "the cp.async pipeline needs at least 2 stages");
  static_assert(!kIsL1 || kBlockN % 8 == 0, "");
  constexpr int kThreads = kWarpgroups * kThreadsPerWarpgroup;
  const uint32_t smem_u32 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int tid = threadIdx.x;
  // Which 64-row tile of the block, and the thread in its warpgroup. Constant for one warpgroup:
  // ptxas cannot know tid < 128 and would carry wg's multiples through every copy address.
  const int wg = kWarpgroups == 1 ? 0 : tid / kThreadsPerWarpgroup;
  const int wtid = kWarpgroups == 1 ? tid : tid % kThreadsPerWarpgroup;
  const int warp = wtid / 32, lane = wtid % 32;
  const int g = lane / 4, t = lane % 4;
  // The tile's token width for this work item: the narrowest allowed width that holds its
  // slots. An expert's last tile is usually partly empty (uniform routing puts 128 +- 11 tokens
  // on an expert at DeepSeek-V3 T=4096); wgmma time is linear in N, so a narrower wgmma on
  // that tile saves tensor time without changing the schedule, the shared-memory stages or
  // the arithmetic of any valid column.
  with_token_width<kBlockN>(w.slot_end - w.slot_begin, [&](auto width) {
    constexpr int kWidth = decltype(width)::value;
    using Op = typename detail::WgmmaRS<kWidth>::Op;
    constexpr int kAcc = kWidth / 2;  // fp32 accumulators per thread: (64, width) / 128
    // Chunks per pipeline group (see the pipeline below).
    // Tiles up to N = 64 pair chunks: the A fragments of two chunks (32 registers) fit next to
    // their accumulators, while the 128-token tile needs those registers for its 64
    // accumulators. (Four chunks per group at N = 16 measured 3-8% slower: 123-140 registers
    // cost a CTA per SM.)
    constexpr int kGroup = kChunksPerGroup<kBlockN>;
    static_assert(kGroup <= 2, "the tail handles at most one leftover chunk");
    static_assert(kStages >= 2 * kGroup && kStages % kGroup == 0,
                  "need kStages >= 2 * kGroup (a group computing, a group landing), a multiple of kGroup");
    const int e = w.expert, m_block = w.m_block;
    const int m_tile = m_block * kWarpgroups + wg;

    // Per-thread copy streams. The K loop below is unrolled over the kStages stages, so every
    // stage index is a compile-time constant: shared-memory addresses and the global offsets of
    // chunks within a round of kStages are immediates, and the only per-round arithmetic is one
    // pointer advance per stream (the integer pipes bound this loop; recomputing addresses per
    // chunk cost ~35 instructions per chunk).
    //   A: each thread copies its own 16 code bytes of the (64, 64) tile; 16 threads per
    //      warpgroup copy the tile's 256 scale bytes.
    //   B: (width rows, 8 x 16 bytes) pieces, a fixed set per thread; piece c of row r lands at
    //      c ^ (r % 8) (128-byte swizzle). Rows past the expert's slots are zero-filled (src-size 0).
    constexpr int kPieces = kWidth * 8 / kThreads;
    static_assert(kWidth * 8 % kThreads == 0, "every token width * 8 must be a multiple of the thread count");
    const auto [k_begin, n] = item_chunks(p, w);  // chunks of this work item
    const int64_t a_tile0 = static_cast<int64_t>(m_block * kWarpgroups + wg) * p.k_chunks + k_begin;
    // Weight sources of the next group of chunks to copy (advanced by one group per group of
    // copies). The code pointer sits half a group past the group's first chunk so the chunks'
    // offsets, -1 KiB and +1 KiB, fit the LDGSTS immediate; two chunks further (4 KiB) made
    // ptxas add a 64-bit offset per copy.
    constexpr int kCodeBias = (kGroup - 1) * kCodeBytesPerTile / 2;
    WeightStreams ws = weight_streams<Smem>(p, e, a_tile0, smem, wg, wtid, kCodeBias);
    BPieces<kPieces> b = b_pieces<kIsL1, Smem, kPieces, kThreads>(p, w, k_begin, smem_u32, tid);
    const uint64_t b_desc0 = detail::make_sw128_desc(smem + Smem::kBOffset);  // stage 0

    // Copies chunk (round base + kOffset) into stage kOffset % kStages; kOffset < 2 * kStages.
    // Its weights are chunk kOffset % kGroup of the group the weight pointers stand at.
    auto load = [&](auto offset) {
      constexpr int kOffset = decltype(offset)::value;
      constexpr int kStage = kOffset % kStages;
      constexpr int kInGroup = kOffset % kGroup;
      detail::cp_async_16(ws.code_dst + kStage * Smem::kCodeStageBytes,
                          ws.code_src + kInGroup * kCodeBytesPerTile - kCodeBias, true);
      if (ws.copies_scales) {
        detail::cp_async_16(ws.scale_dst + kStage * Smem::kScaleStageBytes, ws.scale_src + kInGroup * kScaleBytesPerTile, true);
      }
      #pragma unroll
      for (int j = 0; j < kPieces; ++j) {
        detail::cp_async_16(b.dst[j] + kStage * Smem::kBTileBytes, b.src[j] + kOffset * kChunkK * 2, b.valid[j]);
      }
    };

    float acc[kAcc];
    #pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;

    // Pipeline: chunks are consumed kGroup at a time per barrier (amortising the barrier, the
    // waits and the wgmma round trip), with kStages - kGroup chunks of copies in flight
    // ahead of the group being computed. Every group of chunks is one cp.async group (empty
    // at the end of K), so the number allowed to stay pending is a constant.
    detail::static_for<kStages - kGroup>([&](auto s) {
      if (static_cast<int>(decltype(s)::value) < n) load(s);
      if constexpr ((decltype(s)::value + 1) % kGroup == 0) {
        detail::cp_async_commit();
        ws.code_src += kGroup * kCodeBytesPerTile;
        ws.scale_src += kGroup * kScaleBytesPerTile;
      }
    });

    // Decodes kChunks consecutive chunks from stages kFirstStage.. (all landed), then issues
    // their wgmmas and waits once: one wgmma round trip per group instead of per chunk. No
    // control flow between the wgmmas and no A producer overlapping an in-flight group, either
    // of which makes ptxas serialise or inject warpgroup arrives (C7513/C7519).
    auto compute_chunks = [&](auto chunk_count, auto first_stage) {
      constexpr int kChunks = decltype(chunk_count)::value;
      constexpr int kFirstStage = decltype(first_stage)::value;
      uint32_t a[kChunks][kStepsPerChunk][4];
      #pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const uint4 q = *reinterpret_cast<const uint4*>(ws.code_lds + (kFirstStage + j) * Smem::kCodeStageBytes);
        const uint2 sc = *reinterpret_cast<const uint2*>(ws.scale_lds + (kFirstStage + j) * Smem::kScaleStageBytes);
        const uint32_t words[4] = {q.x, q.y, q.z, q.w};
        const uint32_t scale_words[2] = {sc.x, sc.y};  // steps (0, 1) and (2, 3)
        detail::static_for<kStepsPerChunk>([&](auto step) {
          constexpr int s = decltype(step)::value;
          // Scales (row r0, row r0 + 8) of k-block s of this chunk: scale word s / 2.
          decode_step<s % 2>(words[s], scale_words[s / 2], a[j][s]);
        });
      }
      detail::wgmma_fence();
      #pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        // The descriptor's address field counts 16-byte units: a stage offset is a constant add.
        const uint64_t desc = b_desc0 + static_cast<uint64_t>((kFirstStage + j) * Smem::kBTileBytes / 16);
        #pragma unroll
        for (int s = 0; s < kStepsPerChunk; ++s) {
          // k16 step s starts 32 bytes further along the swizzled 128-byte rows.
          detail::wgmma_rs<Op>(a[j][s], desc + static_cast<uint64_t>(s * 2), acc,
                               std::make_index_sequence<kAcc>{});
        }
      }
      detail::wgmma_commit();
      detail::wgmma_wait_all();
      // wgmma reads its A registers asynchronously: keep them alive until it has completed.
      #pragma unroll
      for (int j = 0; j < kChunks; ++j)
        #pragma unroll
        for (int s = 0; s < kStepsPerChunk; ++s)
          #pragma unroll
          for (int i = 0; i < 4; ++i) detail::keep_in_register(a[j][s][i]);
      #pragma unroll
      for (int i = 0; i < kAcc; ++i) detail::keep_in_register(acc[i]);
    };

    // Rounds of kStages chunks; group q of a round computes stages [q * kGroup, (q + 1) * kGroup).
    for (int base = 0; base < n; base += kStages) {
      bool done = false;
      detail::static_for<kStages / kGroup>([&](auto q) {
        constexpr int kFirst = decltype(q)::value * kGroup;
        const int c = base + kFirst;  // first chunk of this group
        if (done || c >= n) {
          done = true;
          return;
        }
        if (kGroup == 2 && c + 1 == n) {  // an odd chunk count: the last chunk is in flight
          detail::cp_async_wait<0>();
          __syncthreads();
          compute_chunks(std::integral_constant<int, 1>{}, std::integral_constant<int, kFirst>{});
          done = true;
          return;
        }
        detail::cp_async_wait<(kStages - 2 * kGroup) / kGroup>();
        // Completion of this thread's copies + the barrier publish the group to every thread and
        // to wgmma. No proxy fence: it lowers to MEMBAR.ALL.CTA, which waits for every cp.async
        // in flight and collapses the pipeline; CUTLASS's cp.async GMMA mainloops likewise hand
        // cp.async stages to wgmma through a barrier alone.
        __syncthreads();  // this group visible to all; everyone is done with the previous group
        // The group's refills: chunks base + kFirst + kStages - kGroup .. + kStages - 1. One
        // range test for the whole group away from the end of K (a test and a branch per chunk,
        // each branch target starting a new block that ptxas pads before its first LDGSTS, cost
        // ~8 issue slots per chunk in a loop that is issue-bound at the narrow tiles).
        constexpr int kRefill = kFirst + kStages - kGroup;  // < 2 * kStages
        if (base + kRefill + kGroup <= n) {
          detail::static_for<kGroup>([&](auto j) { load(std::integral_constant<int, kRefill + decltype(j)::value>{}); });
        } else {
          detail::static_for<kGroup>([&](auto j) {
            if (base + kRefill + decltype(j)::value < n) load(std::integral_constant<int, kRefill + decltype(j)::value>{});
          });
        }
        detail::cp_async_commit();
        ws.code_src += kGroup * kCodeBytesPerTile;
        ws.scale_src += kGroup * kScaleBytesPerTile;
        compute_chunks(std::integral_constant<int, kGroup>{}, std::integral_constant<int, kFirst>{});
      });
      #pragma unroll
      for (int j = 0; j < kPieces; ++j) b.src[j] += kStages * kChunkK * 2;
    }
    detail::cp_async_wait<0>();

    after_mainloop();
    detail::store_tile<kIsL1, kWarpgroups, kWidth>(p, acc, w, m_tile, warp, g, t, smem + Smem::kStagingOffset);
  });
}

// Calls f(integral_constant<kI>), f(integral_constant<kI + 1>), ... for the first `count - kI`
// indices below kEnd, each call nested inside the previous one's branch (see overlapped_k_loop).
template <int kI, int kEnd, class F>
__device__ __forceinline__ void tail_chunks(int count, F&& f) {
  if constexpr (kI < kEnd) {
    if (kI < count) {
      f(std::integral_constant<int, kI>{});
      tail_chunks<kI + 1, kEnd>(count, f);
    }
  }
}

// How the overlapped K loop hands shared-memory stages between threads (overlapped_k_loop).
enum class StageSync {
  kBarrier,    // one CTA barrier per chunk
  kMbarriers,  // per-stage full/empty mbarriers (StageBarriers), no CTA barrier
};

// mbarrier primitives (shared::cta addresses).
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// Arrives on bar once every cp.async this thread issued before it has landed; .noinc: the
// arrival counts towards the barrier's expected count.
__device__ __forceinline__ void cp_async_mbarrier_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}
// Waits until the phase of parity `parity` of bar has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "MEGAMOE_MBARRIER_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra MEGAMOE_MBARRIER_WAIT;\n"
      "}\n" :: "r"(bar), "r"(parity) : "memory");
}

// The stage barriers of StageSync::kMbarriers: full[s] completes when every thread's copies of
// the chunk in stage s have landed (one cp.async arrival per thread), empty[s] when every thread
// has finished that chunk (its reads of the codes and scales, its warpgroup's wgmmas). Every
// thread arrives on empty[s] itself: one arrival per warp after __syncwarp is as correct under
// the memory model, but compute-sanitizer's racecheck does not follow it and reports each
// refill as a hazard. `phases`: bit s is the parity of
// stage s's current phase, the same for full[s] and empty[s] between work items (every phase an
// item starts completes within it); each thread carries it from item to item.
struct StageBarriers {
  uint32_t base;    // shared address of full[0]; full[s] at + 8 s, empty[s] at + 8 (kStages + s)
  uint32_t phases;
  uint32_t items;   // items this CTA has run (kMbarriers only): the slot table's buffer is items % 2
};
template <int kStages>
__device__ __forceinline__ uint32_t stage_barrier_storage() {
  __shared__ alignas(8) uint64_t barriers[2 * kStages];
  return static_cast<uint32_t>(__cvta_generic_to_shared(barriers));
}
// Every thread calls it; the caller's CTA barrier publishes the initialisation before first use.
template <int kThreads, int kStages>
__device__ __forceinline__ StageBarriers init_stage_barriers() {
  const uint32_t base = stage_barrier_storage<kStages>();
  if (threadIdx.x == 0) {
    #pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(base + 8 * s, kThreads);
      mbarrier_init(base + 8 * (kStages + s), kThreads);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  return {base, 0u, 0u};
}

// After an item: waits until every thread has released every stage (each stage's last completed
// phase). The next item's copies may then overwrite any stage, without a CTA barrier; and no
// thread arrives on a barrier whose previous phase it has not waited for (compute-sanitizer's
// synccheck flags that). The waits complete the acquire side of every thread's releases of the
// item: what a thread wrote to shared memory before its last arrivals is visible past them.
template <int kStages>
__device__ __forceinline__ void wait_stages_released(const StageBarriers& bars) {
  const uint32_t empty = bars.base + 8 * kStages;
  detail::static_for<kStages>([&](auto s) {
    constexpr int kS = decltype(s)::value;
    mbarrier_wait(empty + 8 * kS, ((bars.phases >> kS) & 1) ^ 1);
  });
}

// The K loop of the overlapped tiles. Per chunk and k16 step s: decode into A buffer s % 2 while
// step s - 1's wgmma reads the other, issue step s's wgmma, wait until it is the only one in
// flight (so chunk c - 1 is done after chunk c's first step). Two steps of A (8 registers)
// instead of two chunks (32): next to 80 accumulators, two chunks made ptxas serialise the
// wgmmas (C7512). A round of kStages chunks is unrolled, so stage indices are compile-time
// constants. How the stages pass between threads (every thread copies a share of each B stage,
// each warpgroup its own weights):
// - kBarrier (the 128-token tile, two CTAs per SM): iteration c waits for this thread's copies
//   of chunk c and passes a CTA barrier (chunk c visible to every thread; every warpgroup has
//   passed iteration c - 1's waits, so chunk c - 2 is done and its stage takes chunk
//   c + kStages - 2). Copies run kStages - 2 chunks ahead.
// - kMbarriers (the absorbing tile: four warpgroups in one CTA, no second CTA whose wgmmas fill
//   the tensor pipe while these decode): no CTA barrier. Iteration c waits for full[chunk c's
//   stage] after refilling the stage of chunk c + kStages / 2 - kStages with chunk
//   c + kStages / 2 once every thread has released that chunk (empty), and after its first step
//   each thread releases chunk c - 1. The warpgroups drift apart: one may run up to kStages / 2
//   chunks ahead of the slowest, where a CTA barrier per chunk (or per two, v17) made all
//   sixteen warps decode, then wait, in step (the loop's time per chunk did not depend on the
//   token width, docs/perf/2026-11-21-h100-w4a16-v17.md).
//   Copies run kStages / 2 chunks ahead.
//   load(offset):   copies chunk (round base + offset) into stage offset % kStages;
//   next_weights(): advances the weight sources by one chunk (after each chunk's copies);
//   next_round():   advances the B sources by kStages chunks.
//   after_first_copies(): every thread, once it has issued its copies of the first chunks and
//                   before it waits for any (the absorbing tile's thread 0 claims its next item).
template <class Smem, class Op, int kStages, StageSync kSync, int kAcc, class Load, class NextWeights, class NextRound,
          class AfterFirstCopies>
__device__ __forceinline__ void overlapped_k_loop(int n, float (&acc)[kAcc],
                                                  uint32_t (&a)[2][4],
                                                  const uint8_t* code_lds, const uint8_t* scale_lds,
                                                  uint64_t b_desc0, StageBarriers& bars, Load&& load,
                                                  NextWeights&& next_weights, NextRound&& next_round,
                                                  AfterFirstCopies&& after_first_copies) {
  using namespace w4a16;
  static_assert(kStages >= 4, "the overlapped K loop needs kStages >= 4: two stages are held by the wgmmas in flight");
  static_assert(kSync != StageSync::kMbarriers || kStages <= 16, "the phase bits hold up to 16 stages");
  constexpr bool kMbar = kSync == StageSync::kMbarriers;
  constexpr int kAhead = kMbar ? kStages / 2 : kStages - 2;
  constexpr uint32_t kAllStages = (1u << kStages) - 1;
  const uint32_t full = bars.base, empty = bars.base + 8 * kStages;
  uint32_t phases = bars.phases;  // this round's parities (flipped every round)
  detail::static_for<kAhead>([&](auto s) {
    constexpr int kS = decltype(s)::value;
    if constexpr (kMbar) {
      if (kS < n) {
        load(s);
        cp_async_mbarrier_arrive(full + 8 * kS);
      }
    } else {
      if (kS < n) load(s);
      detail::cp_async_commit();
    }
    next_weights();
  });
  after_first_copies();
  int base = 0;  // first chunk of the current round
  // Chunk base + kStage: stage kStage. always_inline: a lambda NVVM leaves
  // out of line is a call to ptxas, and it serialises wgmma pipelines across calls (C7510).
  auto chunk = [&](auto stage) __attribute__((always_inline)) {
    constexpr int kStage = decltype(stage)::value;
    const int c = base + kStage;
    if constexpr (kSync == StageSync::kBarrier) {
      detail::cp_async_wait<kStages - 3>();  // this thread's copies of chunk c have landed
      __syncthreads();
      if (c + kStages - 2 < n) load(std::integral_constant<int, kStage + kStages - 2>{});
      detail::cp_async_commit();  // one group per chunk, empty at the end of K
      next_weights();
    } else if constexpr (kMbar) {
      // Refill: chunk c + kAhead into the stage of chunk c + kAhead - kStages, once every thread
      // has released that chunk (none before the item's first kStages chunks).
      constexpr int kRefill = kStage + kAhead;  // < 2 * kStages
      constexpr int kRefillStage = kRefill % kStages;
      if (c + kAhead < n) {
        if constexpr (kRefill >= kStages) {
          mbarrier_wait(empty + 8 * kRefillStage, (phases >> kRefillStage) & 1);  // this round's use
        } else {
          if (base > 0) mbarrier_wait(empty + 8 * kRefillStage, ((phases >> kRefillStage) & 1) ^ 1);
        }
        load(std::integral_constant<int, kRefill>{});
        cp_async_mbarrier_arrive(full + 8 * kRefillStage);
      }
      next_weights();
      mbarrier_wait(full + 8 * kStage, (phases >> kStage) & 1);  // every thread's copies of chunk c
    }
    const uint4 q = *reinterpret_cast<const uint4*>(code_lds + kStage * Smem::kCodeStageBytes);
    const uint2 sc = *reinterpret_cast<const uint2*>(scale_lds + kStage * Smem::kScaleStageBytes);
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
    const uint32_t scale_words[2] = {sc.x, sc.y};  // steps (0, 1) and (2, 3)
    const uint64_t desc = b_desc0 + static_cast<uint64_t>(kStage * Smem::kBTileBytes / 16);
    // Step s decodes into buffer s % 2 while step s - 1's wgmma (the previous chunk's last step,
    // for s = 0) reads the other, then waits until only its own wgmma is in flight.
    detail::static_for<kStepsPerChunk>([&](auto step) __attribute__((always_inline)) {
      constexpr int s = decltype(step)::value;
      decode_step<s % 2>(words[s], scale_words[s / 2], a[s % 2]);
      detail::wgmma_fence();
      // k16 step s starts 32 bytes further along the swizzled 128-byte rows.
      detail::wgmma_rs<Op>(a[s % 2], desc + static_cast<uint64_t>(s * 2), acc, std::make_index_sequence<kAcc>{});
      detail::wgmma_commit();
      detail::wgmma_wait_one();
      if constexpr (kMbar && s == 0) {
        // Chunk c - 1's wgmmas are done: this thread releases its stage.
        constexpr int kPrevStage = (kStage + kStages - 1) % kStages;
        if (kStage != 0 || base > 0) mbarrier_arrive(empty + 8 * kPrevStage);
      }
    });
  };
  // Whole rounds with no exit between their chunks, then a nested tail: a loop round that can be
  // left early made ptxas serialise every wgmma of an overlapped kernel (C7513, v8).
  for (; base + kStages <= n; base += kStages) {
    detail::static_for<kStages>(chunk);
    next_round();
    phases ^= kAllStages;
  }
  // The last n - base < kStages chunks, nested so that chunk i runs only after chunk i - 1.
  tail_chunks<0, kStages>(n - base, chunk);
  detail::wgmma_wait_all();
  #pragma unroll
  for (int i = 0; i < kAcc; ++i) detail::keep_in_register(acc[i]);
  if constexpr (kMbar) {
    // Release the last chunk, and carry the parities: the tail's stages completed one more phase.
    mbarrier_arrive(empty + 8 * ((n - 1) % kStages));
    bars.phases = phases ^ ((1u << (n - base)) - 1);
  }
}

// Token widths of the overlapped tiles: kNarrow or kBlockN. With wgmmas in flight across the K
// loop's back edge, ptxas gives each width registers of its own; past two widths it runs out
// (C7512, v8).
template <int kNarrow, int kBlockN, class F>
__device__ __forceinline__ void with_two_token_widths(int rows, F&& f) {
  static_assert(kNarrow < kBlockN, "two distinct token widths");
  if (rows <= kNarrow) {
    f(std::integral_constant<int, kNarrow>{});
  } else {
    f(std::integral_constant<int, kBlockN>{});
  }
}

// How each overlapped tile passes its stages (overlapped_k_loop): the absorbing tile with stage
// mbarriers, the 128-token tile (two CTAs per SM) with one CTA barrier per chunk.
template <int kWarpgroups>
inline constexpr StageSync kOverlappedSync = kWarpgroups == 4 ? StageSync::kMbarriers : StageSync::kBarrier;

struct NoHook {
  __device__ __forceinline__ void operator()() const {}
};

// gemm_item for the overlapped tiles: each warpgroup overlaps its decode with its wgmmas
// (overlapped_k_loop) at two token widths (with_two_token_widths). Two tiles:
// - the absorbing tile (four warpgroups, BLOCK_M = 256, one CTA per SM, where no other CTA's
//   wgmmas fill the tensor pipe while its warpgroups decode): items of 128 tokens, but an
//   expert's last takes up to 32 tokens more (expert_token_tiles): at DeepSeek-V3 T=4096 an
//   expert has 128 +- 11 tokens, and a remainder of a few tokens as an item of its own decoded
//   every weight again (ncu: the remainder items took ~20% of L1's time). Widths 128 and 160.
// - the 128-token tile (two warpgroups, two CTAs per SM) for experts of many tokens: widths 64
//   and 128 (sm90_moe_heuristics.cpp).
// The warpgroups share one (BLOCK_N, 64) B stage. The copy state is set up once for all BLOCK_N
// rows, outside the token width (per-width copy state cost registers per width). Rows past the
// item's slots are zero-filled (src-size 0, no global read).
// bars: the stage barriers (kOverlappedSync == kMbarriers), set up once per CTA by
// init_stage_barriers and carried from item to item. kEpilogue = false leaves the epilogue out
// (megamoe_mainloop_probe: what the item boundary costs without it; the accumulators' sum is
// stored only where it is exactly -1, so that the K loop stays). after_first_copies: see
// overlapped_k_loop.
template <bool kIsL1, int kWarpgroups, int kBlockN, int kStages, bool kEpilogue = true, class AfterMainloop,
          class AfterFirstCopies = NoHook>
__device__ __forceinline__ void gemm_item_overlapped(const W4a16GemmParams& p, const WorkItem& w, uint8_t* smem,
                                                     StageBarriers& bars, AfterMainloop&& after_mainloop,
                                                     AfterFirstCopies after_first_copies = {}) {
  using namespace w4a16;
  using Smem = W4a16SmemLayout<kWarpgroups, kBlockN, kStages>;
  constexpr int kThreads = kWarpgroups * kThreadsPerWarpgroup;
  // The absorbing tile's items are 128 tokens, its experts' last up to 160; the 128-token tile's
  // last items run at 64 tokens where they hold that few.
  constexpr int kNarrow = kBlockN == 160 ? 128 : kBlockN / 2;
  static_assert(kBlockN == 160 || kBlockN == 128, "the overlapped tiles: the absorbing tile and the 128-token tile");
  const uint32_t smem_u32 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int tid = threadIdx.x;
  const int wg = tid / kThreadsPerWarpgroup, wtid = tid % kThreadsPerWarpgroup;
  const int warp = wtid / 32, lane = wtid % 32;
  const int g = lane / 4, t = lane % 4;
  const int m_tile = w.m_block * kWarpgroups + wg;
  // Copy streams as in gemm_item (one chunk per pipeline group).
  constexpr int kPieces = (kBlockN * 8 + kThreads - 1) / kThreads;
  // The last round of pieces may be partial: its threads past BLOCK_N rows copy nothing.
  const bool copies_last_piece = tid + (kPieces - 1) * kThreads < kBlockN * 8;
  const auto [k_begin, n] = item_chunks(p, w);
  const int64_t a_tile0 = static_cast<int64_t>(m_tile) * p.k_chunks + k_begin;
  WeightStreams ws = weight_streams<Smem>(p, w.expert, a_tile0, smem, wg, wtid, 0);
  BPieces<kPieces> b = b_pieces<kIsL1, Smem, kPieces, kThreads>(p, w, k_begin, smem_u32, tid);
  const uint64_t b_desc0 = detail::make_sw128_desc(smem + Smem::kBOffset);
  // The absorbing L2's slot table (Smem::kSlotTableOffset, buffer items % 2): the item's tokens
  // and routing weights, copied with its first chunk, so that the combine reads them from shared
  // memory. Loaded from global memory in the epilogue, each of its passes waited one round trip
  // for them (a red.add may alias them: they cannot be hoisted above the previous pass's adds):
  // ncu, Qwen3-30B T=16384, 15% of the L2 kernel's stall samples, long scoreboard, in the
  // combine. From shared memory: Qwen3-30B T=4096 -3.0%, DeepSeek-V3 T=16384 -1.0% (H100,
  // docs/perf/2026-11-22-h100-w4a16-v27.md). The buffer is free again two items later: this
  // item's copies follow the previous item's wait_stages_released, i.e. every thread's epilogue
  // of the item before.
  constexpr bool kSlotTable = !kIsL1 && Smem::kOwnStaging && kEpilogue;
  uint8_t* const slot_table = smem + Smem::kSlotTableOffset + (bars.items & 1) * Smem::kSlotTableBufferBytes;
  auto load = [&](auto offset) {
    constexpr int kOffset = decltype(offset)::value;
    constexpr int kStage = kOffset % kStages;
    if constexpr (kSlotTable && kOffset == 0) {
      if (tid < kBlockN) {
        const int slot = w.slot_begin + tid;
        const bool valid = slot < w.slot_end;
        const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(slot_table)) + tid * 4;
        detail::cp_async_4(dst, p.slot_token + (valid ? slot : 0), valid);
        detail::cp_async_4(dst + kBlockN * 4, p.slot_weight + (valid ? slot : 0), valid);
      }
    }
    detail::cp_async_16(ws.code_dst + kStage * Smem::kCodeStageBytes, ws.code_src, true);
    if (ws.copies_scales) detail::cp_async_16(ws.scale_dst + kStage * Smem::kScaleStageBytes, ws.scale_src, true);
    #pragma unroll
    for (int j = 0; j < kPieces; ++j) {
      if (j + 1 < kPieces || copies_last_piece)
        detail::cp_async_16(b.dst[j] + kStage * Smem::kBTileBytes, b.src[j] + kOffset * kChunkK * 2, b.valid[j]);
    }
  };
  auto next_weights = [&] {
    ws.code_src += kCodeBytesPerTile;
    ws.scale_src += kScaleBytesPerTile;
  };
  auto next_round = [&] {
    #pragma unroll
    for (int j = 0; j < kPieces; ++j) b.src[j] += kStages * kChunkK * 2;
  };
  // One set of accumulators and A buffers for both token widths (the narrow wgmma uses the first
  // registers of the set).
  float acc_all[kBlockN / 2];
  uint32_t a[2][4];  // two k16 steps of A fragments, (64, 16) per warpgroup each
  with_two_token_widths<kNarrow, kBlockN>(w.slot_end - w.slot_begin, [&](auto width) __attribute__((always_inline)) {
    constexpr int kWidth = decltype(width)::value;
    constexpr int kAcc = kWidth / 2;  // fp32 accumulators per thread: (64, width) / 128
    float (&acc)[kAcc] = *reinterpret_cast<float(*)[kAcc]>(acc_all);
    #pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
    overlapped_k_loop<Smem, typename detail::WgmmaRS<kWidth>::Op, kStages, kOverlappedSync<kWarpgroups>>(
        n, acc, a, ws.code_lds, ws.scale_lds, b_desc0, bars, load, next_weights, next_round, after_first_copies);
    // Every copy of this thread has landed (the stage barriers' loop commits no cp.async groups:
    // wait_all, not wait_group 0).
    detail::cp_async_wait_all();
    after_mainloop();
    if constexpr (kEpilogue) {
      detail::store_tile<kIsL1, kWarpgroups, kWidth, Smem::kOwnStaging>(p, acc, w, m_tile, warp, g, t,
                                                                        smem + Smem::kStagingOffset,
                                                                        reinterpret_cast<const int32_t*>(slot_table),
                                                                        reinterpret_cast<const float*>(slot_table) + kBlockN);
    } else {
      // Consume the accumulators, or ptxas drops the decode that feeds the (then dead) wgmmas.
      float sum = 0.0f;
      #pragma unroll
      for (int i = 0; i < kAcc; ++i) sum += acc[i];
      if (sum == -1.0f) p.out_acc[threadIdx.x] = sum;
    }
  });
  if constexpr (kOverlappedSync<kWarpgroups> == StageSync::kMbarriers) {
    wait_stages_released<kStages>(bars);
    ++bars.items;
  }
}

}  // namespace detail

// kOverlapped: the items run the overlapped K loop (gemm_item_overlapped), else gemm_item's.
template <bool kIsL1, int kWarpgroups, int kBlockN, int kStages, int kMinBlocksPerSm, bool kOverlapped>
__global__ void __launch_bounds__(kWarpgroups * w4a16::kThreadsPerWarpgroup, kMinBlocksPerSm)
w4a16_grouped_gemm_kernel(const W4a16GemmParams p) {
  static_assert(!kOverlapped || kWarpgroups >= 2, "the overlapped K loop is built for the two- and four-warpgroup tiles");
  uint8_t* smem = detail::aligned_dynamic_smem();
  const int tid = threadIdx.x;
  __shared__ detail::EarlyStart early;
  __shared__ int next_work_shared;
  allow_dependent_launch();
  const bool early_start = detail::kMayStartEarly<kIsL1, kWarpgroups, kBlockN> && p.topk_ids != nullptr;
  int total_work;
  if (early_start) {
    if constexpr (detail::kMayStartEarly<kIsL1, kWarpgroups, kBlockN>) {
      detail::early_schedule<kWarpgroups, kBlockN>(p, 0, 0, early);
    }
  } else {
    if (tid == 0) detail::prefetch_guessed_item<kWarpgroups, kBlockN, kStages>(p, blockIdx.x);
  }
  // L1 zeroes the combine accumulator (zero_first; with early start the dispatch does, and it is
  // null). The zeroing need not wait for the dispatch: the accumulator is this run's own, the
  // previous run's combine, its last reader, completed before the dispatch started (run() launches
  // the dispatch without programmatic serialization), and L2 adds into it only after this grid has
  // completed. The absorbing tile zeroes one slice per work item as the item starts (below): up
  // front, each of its CTAs sent 1-3.6 MB of zeros (DeepSeek-V3 T=16384: 470 MB) ahead of its first
  // item's copies; spread over the items, DeepSeek-V3 T=16384 ran 0.6-1.0% faster (H100, three
  // rounds; ncu: L1 11.69 -> 11.63 ms). The other tiles zero up front: zero_item_slice in their
  // item loop changed their K loops (184 -> 228 instructions per group of the 16-token tile,
  // tests/sass/check_sass.sh).
  // The absorbing tile: its stages pass by mbarriers and its item loop is the one below.
  constexpr bool kAbsorbing = kOverlapped && detail::kOverlappedSync<kWarpgroups> == detail::StageSync::kMbarriers;
  if constexpr (kIsL1 && !kAbsorbing) {
    if (p.zero_first != nullptr) detail::zero_grid_stride(p.zero_first, p.zero_count);
  }
  if (!early_start) grid_dependency_wait();  // the dispatch (L1) or L1 (L2) results are complete from here on
  if (early_start) {
    __syncthreads();  // early
    total_work = early.l1_items;
  } else {
    total_work = p.tile_offsets[p.num_experts];
  }
  // The absorbing tile without items (every id invalid): the grid zeroes the accumulator here.
  if constexpr (kIsL1 && kAbsorbing) {
    if (p.zero_first != nullptr && total_work == 0) detail::zero_grid_stride(p.zero_first, p.zero_count);
  }

  if constexpr (kAbsorbing) {
    // The absorbing tile: no CTA barrier between items. Its stages pass between threads through
    // the stage barriers, within an item and from one item to the next (gemm_item_overlapped
    // returns once every thread has released every stage); each warpgroup runs its epilogue
    // while the others finish their K loops, and starts the next item's copies as soon as every
    // stage is free. Thread 0 claims the item after the current one (item i of this CTA) once it
    // has issued its first copies of item i (after_first_copies; claimed before them, warp 0's
    // copies went out an atomic round trip after the other warps' and the item's first stage
    // waited for them: Qwen3-30B 0.6-0.9% faster, docs/perf/2026-11-22-h100-w4a16-v22.md) and
    // publishes it in next_work_ring[i % 2]: every thread reads it after item i's stage waits,
    // which acquire thread 0's arrivals made after the write (its first arrival of item i
    // follows its first chunk). Thread 0 writes the slot again in item i + 2, past the waits
    // after item i + 1, i.e. after every thread has started item i + 1, having read the slot.
    // (Claiming one item ahead: the prefill GEMMs this tile runs have tens of items per CTA.)
    __shared__ int next_work_ring[2];
    detail::StageBarriers bars = detail::init_stage_barriers<kWarpgroups * w4a16::kThreadsPerWarpgroup, kStages>();
    if (tid == 0) next_work_ring[0] = detail::claim_work(p.work_counter);
    __syncthreads();  // the barriers' initialisation, the first claim
    int work = blockIdx.x;
    for (int i = 0; work < total_work; ++i) {
      const detail::WorkItem w = detail::decode_work<kBlockN>(p, work, total_work);
      if constexpr (kIsL1) {
        // Before the item: after it, `work` stayed live across the K loops and the 160-token
        // width's took 7 instructions more per chunk.
        if (p.zero_first != nullptr) detail::zero_item_slice(p.zero_first, p.zero_count, work, total_work);
      }
      detail::gemm_item_overlapped<kIsL1, kWarpgroups, kBlockN, kStages>(p, w, smem, bars, [] {}, [&] {
        if (tid == 0 && i > 0) next_work_ring[i % 2] = detail::claim_work(p.work_counter);
      });
      work = next_work_ring[i % 2];
    }
    grid_dependency_wait();
    return;
  }
  detail::StageBarriers bars{};  // unused by the CTA-barrier tiles

  for (int work = blockIdx.x; work < total_work;) {
    int next_work = 0;
    const detail::WorkItem w =
        early_start && work == static_cast<int>(blockIdx.x) ? early.first : detail::decode_work<kBlockN>(p, work, total_work);
    auto claim = [&] {
      grid_dependency_wait();  // early start: the dispatch's counter and schedule from here on
      if (tid == 0) next_work = detail::claim_work(p.work_counter);
    };
    if constexpr (kOverlapped) {
      detail::gemm_item_overlapped<kIsL1, kWarpgroups, kBlockN, kStages>(p, w, smem, bars, claim);
    } else {
      detail::gemm_item<kIsL1, kWarpgroups, kBlockN, kStages>(p, w, smem, claim);
    }
    // This barrier also hands the stages to the next item: every thread has finished this item's
    // wgmmas and copies. Every thread read the previous next_work_shared before this item's
    // first mainloop barrier (every item has at least one chunk).
    if (tid == 0) next_work_shared = next_work;
    __syncthreads();
    work = next_work_shared;
  }
  // Early start: a CTA that ran no item still completes only after the dispatch (the kernels
  // after this one wait for this grid alone).
  grid_dependency_wait();
}

// Parameters of the fused L1 + L2 launch.
struct W4a16FusedParams {
  W4a16GemmParams l1, l2;     // l1.work_counter hands out the items of both; L1 never splits K
  int32_t* l1_tiles_done;     // (E') L1 items completed per expert, zeroed by the dispatch kernel
  int32_t* ctas_zeroed;       // (1) CTAs done zeroing l1.zero_first, zeroed by the dispatch kernel
};

// L1's work items, then L2's, from one counter. An L2 item of expert e waits until all of e's L1
// tiles are complete (and the combine accumulator is zeroed). No deadlock: items are claimed in
// index order by running CTAs (the first gridDim.x by blockIdx, and the grid never exceeds what
// is resident at once), an L2 item only waits on items of smaller index, and L1 items wait on
// nothing but the dispatch kernel (early start), which was running before this grid launched.
template <int kWarpgroups, int kBlockN, int kStages, int kMinBlocksPerSm>
__global__ void __launch_bounds__(kWarpgroups * w4a16::kThreadsPerWarpgroup, kMinBlocksPerSm)
w4a16_fused_moe_kernel(const W4a16FusedParams p) {
  uint8_t* smem = detail::aligned_dynamic_smem();
  const int tid = threadIdx.x;
  // The item counts and the first item pass through shared memory rather than staying live in
  // registers across the two inlined mainloops. ptxas's uniform-register allocation of those
  // loops is sensitive to what surrounds them: variants of this prologue and of the L2 wait below
  // added 16 descriptor copies (UMOV) to every K group of the L2 mainloop (224 instead of 208
  // instructions; 14% slower at DeepSeek-V3 T=2, H200). tests/sass/check_sass.sh prints the
  // group sizes: compare them before and after changing this kernel.
  __shared__ int work_bounds[2];  // L1 items; L1 + L2 items
  __shared__ int next_work_shared;
  __shared__ detail::EarlyStart early;
  allow_dependent_launch();
  const bool early_start = p.l1.topk_ids != nullptr;
  const bool zeroes = p.l1.zero_first != nullptr;
  // With early start the dispatch zeroes the accumulator (run()): a CTA's zeroing here could be
  // published only after it waits for the dispatch (which zeroes ctas_zeroed), and L2 items would
  // wait for every CTA's first mainloop. The host's invariant: past it, L2 items could hang.
  if (early_start && zeroes) __trap();
  if (early_start) {
    detail::early_schedule<kWarpgroups, kBlockN>(p.l1, p.l2.m_tiles, p.l2.k_splits, early);
  } else if (tid == 0) {
    detail::prefetch_guessed_item<kWarpgroups, kBlockN, kStages>(p.l1, blockIdx.x);
  }
  // Before the wait (see w4a16_grouped_gemm_kernel); published after it, below.
  if (zeroes) detail::zero_grid_stride(p.l1.zero_first, p.l1.zero_count);
  if (!early_start) grid_dependency_wait();  // the dispatch results are complete from here on
  if (tid == 0) {
    // (early start: thread 0 wrote early's counts itself)
    const int l1_items = early_start ? early.l1_items : p.l1.tile_offsets[p.l1.num_experts];
    work_bounds[0] = l1_items;
    work_bounds[1] = l1_items + (early_start ? early.l2_items : p.l2.tile_offsets[p.l2.num_experts]);
    next_work_shared = static_cast<int>(blockIdx.x);
  }
  __syncthreads();  // work_bounds, next_work_shared, early; this CTA's zeroing done
  if (zeroes && tid == 0) detail::red_release_add(p.ctas_zeroed, 1);

  for (int work = next_work_shared; work < work_bounds[1];) {
    int next_work = 0;
    auto claim = [&] {
      grid_dependency_wait();  // early start: the dispatch's counters and schedule from here on
      if (tid == 0) next_work = detail::claim_work(p.l1.work_counter);
    };
    const int l1_work = work_bounds[0];
    const bool is_l1 = work < l1_work;
    int expert;
    if (is_l1) {
      const detail::WorkItem w = early_start && work == static_cast<int>(blockIdx.x)
                                     ? early.first
                                     : detail::decode_work<kBlockN>(p.l1, work, l1_work);
      expert = w.expert;
      detail::gemm_item<true, kWarpgroups, kBlockN, kStages>(p.l1, w, smem, claim);
    } else {
      grid_dependency_wait();  // early start: a CTA's first item may be an L2 item
      const detail::WorkItem w = detail::decode_work<kBlockN>(p.l2, work - l1_work, work_bounds[1] - l1_work);
      expert = w.expert;
      if (tid == 0) {
        // The item's weights do not depend on L1: start the DRAM reads of its first chunks (as
        // many as the pipeline's prologue copies) into L2 before waiting, so they land from L2
        // once the item's B rows exist.
        detail::prefetch_item_weights<kWarpgroups, kStages - detail::kChunksPerGroup<kBlockN>>(p.l2, w);
        const int e = w.expert;
        detail::wait_at_least(p.l1_tiles_done + e, p.l1.tile_offsets[e + 1] - p.l1.tile_offsets[e]);
        if (p.l1.zero_first != nullptr) detail::wait_at_least(p.ctas_zeroed, static_cast<int32_t>(gridDim.x));
      }
      __syncthreads();
      detail::gemm_item<false, kWarpgroups, kBlockN, kStages>(p.l2, w, smem, claim);
    }
    if (tid == 0) next_work_shared = next_work;
    __syncthreads();  // also orders the item's act stores before the release
    if (is_l1 && tid == 0) detail::red_release_add(p.l1_tiles_done + expert, 1);
    work = next_work_shared;
  }
  // Early start: a CTA that ran no item still completes only after the dispatch (the combine
  // kernel waits for this grid alone).
  grid_dependency_wait();
}

}  // namespace megamoe::kernels::sm90
