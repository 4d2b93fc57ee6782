// The overlapped mainloop of the sm90 W4A16 grouped GEMM (the prefill tiles: the 128-token tile
// and the absorbing tile): each warpgroup decodes k16 step s while step s - 1's wgmma runs, with
// the shared-memory stages passed either by a CTA barrier per chunk or by per-stage mbarriers.
#pragma once

#include <cstdint>
#include <utility>

#include "kernels/common/ptx_cp_async.cuh"
#include "kernels/common/ptx_mbarrier.cuh"
#include "kernels/common/ptx_wgmma.cuh"
#include "kernels/common/static_for.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_decode.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_epilogue.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_operands.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_params.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_scheduler.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_tile.cuh"

namespace megamoe::kernels::sm90 {

namespace detail {

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
      ptx::mbarrier_init(base + 8 * s, kThreads);
      ptx::mbarrier_init(base + 8 * (kStages + s), kThreads);
    }
    ptx::fence_mbarrier_init();
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
  static_for<kStages>([&](auto s) {
    constexpr int kS = decltype(s)::value;
    ptx::mbarrier_wait(empty + 8 * kS, ((bars.phases >> kS) & 1) ^ 1);
  });
}

// The K loop of the overlapped tiles. Per chunk and k16 step s: decode into A buffer s % 2 while
// step s - 1's wgmma reads the other, issue step s's wgmma, wait until it is the only one in
// flight (so chunk c - 1 is done after chunk c's first step). Two steps of A (8 registers)
// instead of two chunks (32): next to 80 accumulators, two chunks make ptxas serialise the
// wgmmas (C7512; docs/perf/2026-11-21-h100-w4a16-v14.md). A round of kStages chunks is unrolled,
// so stage indices are compile-time
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
//   chunks ahead of the slowest, where a CTA barrier per chunk (or per two) makes all sixteen
//   warps decode, then wait, in lock-step, so no warpgroup's wgmmas cover another's decode
//   (docs/perf/2026-11-21-h100-w4a16-v17.md).
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
  static_for<kAhead>([&](auto s) {
    constexpr int kS = decltype(s)::value;
    if constexpr (kMbar) {
      if (kS < n) {
        load(s);
        ptx::cp_async_mbarrier_arrive(full + 8 * kS);
      }
    } else {
      if (kS < n) load(s);
      ptx::cp_async_commit();
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
      ptx::cp_async_wait<kStages - 3>();  // this thread's copies of chunk c have landed
      __syncthreads();
      if (c + kStages - 2 < n) load(std::integral_constant<int, kStage + kStages - 2>{});
      ptx::cp_async_commit();  // one group per chunk, empty at the end of K
      next_weights();
    } else if constexpr (kMbar) {
      // Refill: chunk c + kAhead into the stage of chunk c + kAhead - kStages, once every thread
      // has released that chunk (none before the item's first kStages chunks).
      constexpr int kRefill = kStage + kAhead;  // < 2 * kStages
      constexpr int kRefillStage = kRefill % kStages;
      if (c + kAhead < n) {
        if constexpr (kRefill >= kStages) {
          ptx::mbarrier_wait(empty + 8 * kRefillStage, (phases >> kRefillStage) & 1);  // this round's use
        } else {
          if (base > 0) ptx::mbarrier_wait(empty + 8 * kRefillStage, ((phases >> kRefillStage) & 1) ^ 1);
        }
        load(std::integral_constant<int, kRefill>{});
        ptx::cp_async_mbarrier_arrive(full + 8 * kRefillStage);
      }
      next_weights();
      ptx::mbarrier_wait(full + 8 * kStage, (phases >> kStage) & 1);  // every thread's copies of chunk c
    }
    const uint4 q = *reinterpret_cast<const uint4*>(code_lds + kStage * Smem::kCodeStageBytes);
    const uint2 sc = *reinterpret_cast<const uint2*>(scale_lds + kStage * Smem::kScaleStageBytes);
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
    const uint32_t scale_words[2] = {sc.x, sc.y};  // steps (0, 1) and (2, 3)
    const uint64_t desc = b_desc0 + static_cast<uint64_t>(kStage * Smem::kBTileBytes / 16);
    // Step s decodes into buffer s % 2 while step s - 1's wgmma (the previous chunk's last step,
    // for s = 0) reads the other, then waits until only its own wgmma is in flight.
    static_for<kStepsPerChunk>([&](auto step) __attribute__((always_inline)) {
      constexpr int s = decltype(step)::value;
      decode_step<s % 2>(words[s], scale_words[s / 2], a[s % 2]);
      ptx::wgmma_fence();
      // k16 step s starts 32 bytes further along the swizzled 128-byte rows.
      ptx::wgmma_rs<Op>(a[s % 2], desc + static_cast<uint64_t>(s * 2), acc, std::make_index_sequence<kAcc>{});
      ptx::wgmma_commit();
      ptx::wgmma_wait_one();
      if constexpr (kMbar && s == 0) {
        // Chunk c - 1's wgmmas are done: this thread releases its stage.
        constexpr int kPrevStage = (kStage + kStages - 1) % kStages;
        if (kStage != 0 || base > 0) ptx::mbarrier_arrive(empty + 8 * kPrevStage);
      }
    });
  };
  // Whole rounds with no exit between their chunks, then a nested tail: a loop round that can be
  // left early makes ptxas serialise every wgmma of an overlapped kernel (C7513;
  // docs/perf/2026-11-21-h100-w4a16-v8.md).
  for (; base + kStages <= n; base += kStages) {
    static_for<kStages>(chunk);
    next_round();
    phases ^= kAllStages;
  }
  // The last n - base < kStages chunks, nested so that chunk i runs only after chunk i - 1.
  tail_chunks<0, kStages>(n - base, chunk);
  ptx::wgmma_wait_all();
  #pragma unroll
  for (int i = 0; i < kAcc; ++i) ptx::keep_in_register(acc[i]);
  if constexpr (kMbar) {
    // Release the last chunk, and carry the parities: the tail's stages completed one more phase.
    ptx::mbarrier_arrive(empty + 8 * ((n - 1) % kStages));
    bars.phases = phases ^ ((1u << (n - base)) - 1);
  }
}

// Token widths of the overlapped tiles: kNarrow or kBlockN. With wgmmas in flight across the K
// loop's back edge, ptxas gives each width registers of its own; past two widths it runs out
// (C7512; docs/perf/2026-11-21-h100-w4a16-v8.md).
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
//   expert has 128 +- 11 tokens, and a remainder of a few tokens as an item of its own decodes
//   every weight again (docs/perf/2026-11-21-h100-w4a16-v14.md). Widths 128 and 160.
// - the 128-token tile (two warpgroups, two CTAs per SM) for experts of many tokens: widths 64
//   and 128 (src/backends/sm90_w4a16/sm90_w4a16_heuristics.cpp).
// The warpgroups share one (BLOCK_N, 64) B stage. The copy state is set up once for all BLOCK_N
// rows, outside the token width (per-width copy state cost registers per width). Rows past the
// item's slots are zero-filled (src-size 0, no global read).
// bars: the stage barriers (kOverlappedSync == kMbarriers), set up once per CTA by
// init_stage_barriers and carried from item to item. kEpilogue = false leaves the epilogue out
// (megamoe_mainloop_probe: what the item boundary costs without it; the accumulators' sum is
// stored in out_acc only where it is exactly -1, so that the K loop stays). after_first_copies: see
// overlapped_k_loop.
template <bool kIsL1, int kWarpgroups, int kBlockN, int kStages, bool kEpilogue = true, class AfterMainloop,
          class AfterFirstCopies = NoHook>
__device__ __forceinline__ void gemm_item_overlapped(const W4a16GemmParams& p, const WorkItem& w, uint8_t* smem,
                                                     StageBarriers& bars, AfterMainloop&& after_mainloop,
                                                     AfterFirstCopies after_first_copies = {}) {
  using namespace w4a16;
  static_assert(kEpilogue || !kIsL1, "the probe's items without their epilogue are L2's (they write out_acc)");
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
  const uint64_t b_desc0 = ptx::make_sw128_desc(smem + Smem::kBOffset);
  // The absorbing L2's slot table (Smem::kSlotTableOffset, buffer items % 2): the item's tokens
  // and routing weights, copied with its first chunk, so that the combine reads them from shared
  // memory. Loaded from global memory in the epilogue, each of its passes waits one round trip
  // for them: a red.add may alias them, so they cannot be hoisted above the previous pass's adds
  // (docs/perf/2026-11-22-h100-w4a16-v27.md). The buffer is free again two items later: this
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
        ptx::cp_async_4(dst, p.slot_token + (valid ? slot : 0), valid);
        ptx::cp_async_4(dst + kBlockN * 4, p.slot_weight + (valid ? slot : 0), valid);
      }
    }
    ptx::cp_async_16(ws.code_dst + kStage * Smem::kCodeStageBytes, ws.code_src, true);
    if (ws.copies_scales) ptx::cp_async_16(ws.scale_dst + kStage * Smem::kScaleStageBytes, ws.scale_src, true);
    #pragma unroll
    for (int j = 0; j < kPieces; ++j) {
      if (j + 1 < kPieces || copies_last_piece)
        ptx::cp_async_16(b.dst[j] + kStage * Smem::kBTileBytes, b.src[j] + kOffset * kChunkK * 2, b.valid[j]);
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
    overlapped_k_loop<Smem, typename ptx::WgmmaRS<kWidth>::Op, kStages, kOverlappedSync<kWarpgroups>>(
        n, acc, a, ws.code_lds, ws.scale_lds, b_desc0, bars, load, next_weights, next_round, after_first_copies);
    // Every copy of this thread has landed (the stage barriers' loop commits no cp.async groups:
    // wait_all, not wait_group 0).
    ptx::cp_async_wait_all();
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

}  // namespace megamoe::kernels::sm90
