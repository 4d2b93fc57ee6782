// w4a16_grouped_gemm_kernel, the one-GEMM-per-launch kernel, and the overview of the whole sm90
// W4A16 grouped GEMM, whose parts live in:
//   sm90_w4a16_params.cuh              kernel parameters (filled by the host)
//   sm90_w4a16_tile.cuh                tile shapes, token widths, shared-memory layout
//   sm90_w4a16_scheduler.cuh           work items, claiming, the L2-cache prefetch, early start
//   sm90_w4a16_operands.cuh            the B-tile and weight copy streams
//   sm90_w4a16_mainloop_pipelined.cuh  gemm_item: the decode tiles' K loop (and the 128-token tile's)
//   sm90_w4a16_mainloop_overlapped.cuh gemm_item_overlapped: the prefill tiles' K loop
//   sm90_w4a16_epilogue.cuh            the L1 and L2 epilogues, the accumulator's zeroing
//   sm90_w4a16_fused_moe_kernel.cuh    w4a16_fused_moe_kernel (L1 and L2 in one launch)
//
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
// Before its grid dependency wait, each CTA prefetches into the L2 cache the weights of the
// first item it would get under uniform routing (prefetch_guessed_item), and L1 zeroes the combine
// accumulator: DRAM works while the dispatch kernel (one SM) or the previous GEMM's tail runs.
//
// Early start (tiny batches, T * k <= 32): the L1 CTAs do not wait for the dispatch kernel
// before their first work item. Each computes that item from the top-k ids itself
// (sm90_moe_tiny_schedule.cuh: the schedule the dispatch publishes), and waits for the dispatch
// (griddepcontrol.wait) only after that item's mainloop, before anything that reads the
// dispatch's results or counters: claiming the next item, the fused launch's hand-off counters,
// any later item.
#pragma once

#include <cstdint>

#include "kernels/common/pdl.cuh"
#include "kernels/common/ptx_atomics.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_epilogue.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_mainloop_overlapped.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_mainloop_pipelined.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_params.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_scheduler.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_tile.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_timeline.cuh"

namespace megamoe::kernels::sm90 {

// kOverlapped: the items run the overlapped K loop (gemm_item_overlapped), else gemm_item's.
// kL1Split: L1 split in K (p.k_splits slices, sm90_w4a16_l1_split.h), a kernel of its own so that
// the unsplit kernels' code stays what it was.
template <bool kIsL1, int kWarpgroups, int kBlockN, int kStages, int kMinBlocksPerSm, bool kOverlapped,
          bool kL1Split = false>
__global__ void __launch_bounds__(kWarpgroups * w4a16::kThreadsPerWarpgroup, kMinBlocksPerSm)
w4a16_grouped_gemm_kernel(const W4a16GemmParams p) {
  static_assert(!kOverlapped || kWarpgroups >= 2, "the overlapped K loop is built for the two- and four-warpgroup tiles");
  static_assert(!kL1Split || (kIsL1 && kWarpgroups == 1 && !kOverlapped), "L1 splits K on the one-warpgroup tiles only");
  uint8_t* smem = detail::aligned_dynamic_smem();
  const int tid = threadIdx.x;
  __shared__ detail::EarlyStart early;
  __shared__ int next_work_shared;
  allow_dependent_launch();
  const bool early_start = detail::starts_early<kIsL1, kWarpgroups, kBlockN>(p);
  int total_work;
  if (early_start) {
    if constexpr (detail::kMayStartEarly<kIsL1, kWarpgroups, kBlockN>) {
      detail::early_schedule<kWarpgroups, kBlockN, kL1Split>(p, 0, 0, early);
    }
  } else {
    if (tid == 0) detail::prefetch_guessed_item<kWarpgroups, kBlockN, kStages>(p, blockIdx.x);
  }
  // L1 zeroes the combine accumulator (zero_first; with early start the dispatch does, and it is
  // null). The zeroing need not wait for the dispatch: the accumulator is this run's own, the
  // previous run's combine, its last reader, completed before the dispatch started (run() launches
  // the dispatch without programmatic serialization), and L2 adds into it only after this grid has
  // completed. The absorbing tile zeroes one slice per work item as the item starts (below): up
  // front, each of its CTAs sends megabytes of zeros ahead of its first item's copies, which wait
  // behind them (docs/perf/2026-11-22-h100-w4a16-v26.md). The other tiles zero up front:
  // zero_item_slice in their item loop changes ptxas's allocation of their K loops and grows
  // every group (same record; compare tests/sass/check_sass.sh's counts).
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
    // copies go out an atomic round trip after the other warps' and the item's first stage
    // waits for them: docs/perf/2026-11-22-h100-w4a16-v22.md) and
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
      MEGAMOE_W4A16_TIMELINE_ITEM_START(i == 0);
      const detail::WorkItem w = detail::decode_work<kBlockN>(p, work, total_work);
      if constexpr (kIsL1) {
        // Before the item: after it, `work` stays live across the K loops and ptxas grows the
        // 160-token width's loop (docs/perf/2026-11-22-h100-w4a16-v26.md;
        // tests/sass/check_sass.sh).
        if (p.zero_first != nullptr) detail::zero_item_slice(p.zero_first, p.zero_count, work, total_work);
      }
      detail::gemm_item_overlapped<kIsL1, kWarpgroups, kBlockN, kStages>(p, w, smem, bars, [] {}, [&] {
        if (tid == 0 && i > 0) next_work_ring[i % 2] = detail::claim_work(p.work_counter);
      });
      // After the item here: before it, ptxas adds ~100 descriptor copies to the L2 kernel's K loop.
      MEGAMOE_W4A16_TIMELINE_ITEM(kIsL1, kWarpgroups, kBlockN, p, w, work);
      MEGAMOE_W4A16_TIMELINE_ITEM_END(timeline::kGemmLaunch<kIsL1>);
      work = next_work_ring[i % 2];
    }
    grid_dependency_wait();
    MEGAMOE_W4A16_TIMELINE_CTA_END(timeline::kGemmLaunch<kIsL1>, static_cast<int>(blockIdx.x) < total_work);
    return;
  }
  detail::StageBarriers bars{};  // unused by the CTA-barrier tiles

  for (int work = blockIdx.x; work < total_work;) {
    MEGAMOE_W4A16_TIMELINE_ITEM_START(work == static_cast<int>(blockIdx.x));
    int next_work = 0;
    const detail::WorkItem w =
        early_start && work == static_cast<int>(blockIdx.x) ? early.first : detail::decode_work<kBlockN>(p, work, total_work);
    MEGAMOE_W4A16_TIMELINE_ITEM(kIsL1, kWarpgroups, kBlockN, p, w, work);
    auto claim = [&] {
      grid_dependency_wait();  // early start: the dispatch's counter and schedule from here on
      if (tid == 0) next_work = detail::claim_work(p.work_counter);
    };
    if constexpr (kOverlapped) {
      detail::gemm_item_overlapped<kIsL1, kWarpgroups, kBlockN, kStages>(p, w, smem, bars, claim);
    } else {
      detail::gemm_item<kIsL1, kWarpgroups, kBlockN, kStages, kL1Split>(p, w, smem, claim);
    }
    // This barrier also hands the stages to the next item: every thread has finished this item's
    // wgmmas and copies. Every thread read the previous next_work_shared before this item's
    // first mainloop barrier (every item has at least one chunk).
    if (tid == 0) next_work_shared = next_work;
    __syncthreads();
    MEGAMOE_W4A16_TIMELINE_ITEM_END(timeline::kGemmLaunch<kIsL1>);
    work = next_work_shared;
  }
  // Early start: a CTA that ran no item still completes only after the dispatch (the kernels
  // after this one wait for this grid alone).
  grid_dependency_wait();
  MEGAMOE_W4A16_TIMELINE_CTA_END(timeline::kGemmLaunch<kIsL1>, static_cast<int>(blockIdx.x) < total_work);
}

}  // namespace megamoe::kernels::sm90
