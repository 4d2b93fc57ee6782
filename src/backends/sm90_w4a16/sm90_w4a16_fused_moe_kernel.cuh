// The fused sm90 W4A16 MoE kernel (decode): L1's work items and then L2's in one persistent
// launch, each L2 item starting as soon as its expert's L1 tiles are complete (no grid-wide
// barrier, no launch between the GEMMs; CTAs that finish L1 early start L2). Built on the
// pipelined mainloop of the one-warpgroup decode tiles.
#pragma once

#include <cstdint>

#include "kernels/common/pdl.cuh"
#include "kernels/common/ptx_atomics.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_epilogue.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_mainloop_pipelined.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_params.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_scheduler.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_tile.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_timeline.cuh"

namespace megamoe::kernels::sm90 {

// L1's work items, then L2's, from one counter. An L2 item of expert e waits until all of e's L1
// tiles are complete (and the combine accumulator is zeroed). No deadlock: items are claimed in
// index order by running CTAs (the first gridDim.x by blockIdx, and the grid never exceeds what
// is resident at once), an L2 item only waits on items of smaller index, and L1 items wait on
// nothing but the dispatch kernel (early start), which was running before this grid launched.
// kL1Split: L1 split in K (p.l1.k_splits slices, sm90_w4a16_l1_split.h). Its items wait on nothing
// either: the tile's last-arriving item runs the SwiGLU, none waits for another. Every L1 item,
// last or not, counts on l1_tiles_done after its stores, so an expert's count is complete only
// once every last arriver has written act.
template <int kWarpgroups, int kBlockN, int kStages, int kMinBlocksPerSm, bool kL1Split = false>
__global__ void __launch_bounds__(kWarpgroups * w4a16::kThreadsPerWarpgroup, kMinBlocksPerSm)
w4a16_fused_moe_kernel(const W4a16FusedParams p) {
  uint8_t* smem = detail::aligned_dynamic_smem();
  const int tid = threadIdx.x;
  // The item counts and the first item pass through shared memory rather than staying live in
  // registers across the two inlined mainloops. ptxas's uniform-register allocation of those
  // loops is sensitive to what surrounds them: variants of this prologue and of the L2 wait below
  // made ptxas add descriptor copies (UMOV) to every K group of the L2 mainloop, without a
  // warning, and slowed decode (docs/perf/2026-11-21-h200-w4a16-v7.md). tests/sass/check_sass.sh
  // prints the group sizes: compare them before and after changing this kernel.
  __shared__ int work_bounds[2];  // L1 items; L1 + L2 items
  __shared__ int next_work_shared;
  __shared__ detail::EarlyStart early;
  allow_dependent_launch();
  const bool early_start = p.l1.topk_ids != nullptr;
  const bool zeroes = p.l1.zero_first != nullptr;
  // With early start the dispatch zeroes the accumulator (run(), src/backends/sm90_w4a16/sm90_w4a16_run.cu): a
  // CTA's zeroing here could be
  // published only after it waits for the dispatch (which zeroes ctas_zeroed), and L2 items would
  // wait for every CTA's first mainloop. The host's invariant: past it, L2 items could hang.
  if (early_start && zeroes) __trap();
  if (early_start && p.gate.published != nullptr) {
    detail::early_schedule_gated<kWarpgroups, kBlockN, kL1Split>(p.l1, p.l2, p.gate, early);
  } else if (early_start) {
    detail::early_schedule<kWarpgroups, kBlockN, kL1Split>(p.l1, p.l2.m_tiles, p.l2.k_splits, early);
  } else if (tid == 0) {
    detail::prefetch_guessed_item<kWarpgroups, kBlockN, kStages>(p.l1, blockIdx.x);
  }
  // Before the wait (see w4a16_grouped_gemm_kernel, sm90_w4a16_grouped_gemm_kernel.cuh);
  // published after it, below.
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
  if (zeroes && tid == 0) ptx::red_release_add(p.ctas_zeroed, 1);

  for (int work = next_work_shared; work < work_bounds[1];) {
    MEGAMOE_W4A16_TIMELINE_ITEM_START(work == static_cast<int>(blockIdx.x));
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
      MEGAMOE_W4A16_TIMELINE_ITEM(true, kWarpgroups, kBlockN, p.l1, w, work);
      detail::gemm_item<true, kWarpgroups, kBlockN, kStages, kL1Split>(p.l1, w, smem, claim);
    } else {
      grid_dependency_wait();  // early start: a CTA's first item may be an L2 item
      const detail::WorkItem w = detail::decode_work<kBlockN>(p.l2, work - l1_work, work_bounds[1] - l1_work);
      expert = w.expert;
      MEGAMOE_W4A16_TIMELINE_ITEM(false, kWarpgroups, kBlockN, p.l2, w, work - l1_work);
      if (tid == 0) {
        // The item's weights do not depend on L1: start the DRAM reads of its first chunks (as
        // many as the pipeline's prologue copies) into the L2 cache before waiting, so they land
        // from the L2 cache once the item's B rows exist.
        detail::prefetch_item_weights<kWarpgroups, kStages - detail::kChunksPerGroup<kBlockN>>(p.l2, w);
        const int e = w.expert;
        ptx::wait_at_least(p.l1_tiles_done + e, p.l1.tile_offsets[e + 1] - p.l1.tile_offsets[e]);
        if (p.l1.zero_first != nullptr) ptx::wait_at_least(p.ctas_zeroed, static_cast<int32_t>(gridDim.x));
        MEGAMOE_W4A16_TIMELINE_ITEM_WAITED();
      }
      __syncthreads();
      detail::gemm_item<false, kWarpgroups, kBlockN, kStages>(p.l2, w, smem, claim);
    }
    if (tid == 0) next_work_shared = next_work;
    __syncthreads();  // also orders the item's act stores before the release
    if (is_l1 && tid == 0) ptx::red_release_add(p.l1_tiles_done + expert, 1);
    MEGAMOE_W4A16_TIMELINE_ITEM_END(runtime::kTimelineLaunchFused);
    work = next_work_shared;
  }
  // Early start: a CTA that ran no item still completes only after the dispatch (the combine
  // kernel waits for this grid alone).
  grid_dependency_wait();
  MEGAMOE_W4A16_TIMELINE_CTA_END(runtime::kTimelineLaunchFused, static_cast<int>(blockIdx.x) < work_bounds[1]);
}

}  // namespace megamoe::kernels::sm90
