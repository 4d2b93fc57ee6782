// w4a8_grouped_gemm_kernel: the sm90 W4A8 grouped GEMM, one GEMM (L1 or L2) per launch, over the
// W4A16 row's schedule and prepacked weights (docs/w4a8.md §8). Its parts:
//   sm90_w4a8_params.cuh    parameters (the W4A16 ones plus the fp8 operands and constants)
//   sm90_w4a8_mainloop.cuh  the K loop: fp8 decode in registers, cp.async B stages, per-128-K promotion
//   sm90_w4a8_epilogue.cuh  L1's SwiGLU to fp32, L2's combines
// One warpgroup per CTA, 64 weight rows x kBlockN tokens per work item; persistent CTAs take
// items from the dispatch's list, the first gridDim.x by index, the rest from its atomic counter
// (the W4A16 scheduler's decode_work and claim_work). The activations arrive quantized (the
// hidden states by a pass after the dispatch, a by a pass after L1: sm90_w4a8_act_quant.cuh).
#pragma once

#include <algorithm>
#include <cstdint>

#include "backends/sm90_w4a16/sm90_w4a16_scheduler.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_tile.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_epilogue.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_mainloop.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_params.cuh"
#include "kernels/common/pdl.cuh"

namespace megamoe::kernels::sm90 {

namespace detail {

// The absorbing tile (kBlockN > kTileStep<kBlockN>): items tile_step wide but an expert's last,
// which may take up to kBlockN. The narrow items run the tile_step-wide loop (overlapped where
// kOverlap), the wide ones the kBlockN-wide loop without overlap (overlapped, 160 tokens need
// every register and spill): a 160-wide MMA and promotion on every item cost more than the
// remainder items they save at 512 slots per expert (docs/perf/2026-11-29-h200-w4a8-v43.md).
template <int kBlockN>
inline constexpr bool kW4a8Absorbing = kBlockN > kTileStep<kBlockN>;

// Dynamic shared memory of a kernel: the larger of its loops' layouts.
template <int kBlockN, bool kOverlap>
inline constexpr int kW4a8KernelSmem =
    kW4a8Absorbing<kBlockN> ? std::max(W4a8SmemLayout<kBlockN, false>::kAllocBytes,
                                       W4a8SmemLayout<kTileStep<kBlockN>, kOverlap>::kAllocBytes)
                            : W4a8SmemLayout<kBlockN, kOverlap>::kAllocBytes;

// One item of kN tokens at most: its K loop, the next item's claim, its epilogue.
template <bool kIsL1, int kN, bool kOverlap>
__device__ __forceinline__ void w4a8_run_item(const W4a8GemmParams& p, const WorkItem& w, uint8_t* smem,
                                              int* next_work) {
  float acc[kN / 2];
  w4a8_item_mainloop<kIsL1, kN, kOverlap>(p, w, smem, acc);
  if (threadIdx.x == 0) *next_work = claim_work(p.g.work_counter);
  w4a8_store_tile<kIsL1, kN>(p, acc, w, static_cast<int>(threadIdx.x));
}

}  // namespace detail

template <bool kIsL1, int kBlockN, bool kOverlap = false>
__global__ void __launch_bounds__(detail::kW4a8Threads) w4a8_grouped_gemm_kernel(const W4a8GemmParams p) {
  uint8_t* smem = detail::aligned_dynamic_smem();
  __shared__ int next_work_shared;
  allow_dependent_launch();
  grid_dependency_wait();  // the quantized activations (and through them the dispatch) are complete
  const int total_work = p.g.tile_offsets[p.g.num_experts];
  for (int work = blockIdx.x; work < total_work;) {
    const detail::WorkItem w = detail::decode_work<kBlockN>(p.g, work, total_work);
    if constexpr (detail::kW4a8Absorbing<kBlockN>) {
      constexpr int kStep = detail::kTileStep<kBlockN>;
      if (w.slot_end - w.slot_begin <= kStep) {
        detail::w4a8_run_item<kIsL1, kStep, kOverlap>(p, w, smem, &next_work_shared);
      } else {
        detail::w4a8_run_item<kIsL1, kBlockN, false>(p, w, smem, &next_work_shared);
      }
    } else {
      detail::w4a8_run_item<kIsL1, kBlockN, kOverlap>(p, w, smem, &next_work_shared);
    }
    __syncthreads();  // next_work_shared; every thread read the previous one before the K loop's barriers
    work = next_work_shared;
  }
}

}  // namespace megamoe::kernels::sm90
