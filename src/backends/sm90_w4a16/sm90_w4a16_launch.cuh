// Definitions of the per-tile launchers (sm90_w4a16_launch.h), included only by the
// instantiation translation units under instantiations/: one table entry and GEMM each.
#pragma once

#include <algorithm>
#include <cstdint>

#include "backends/sm90_w4a16/sm90_w4a16_fused_moe_kernel.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_grouped_gemm_kernel.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_tile.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_timeline.cuh"
#include "runtime/sm90/sm90_launch_util.h"
#include "backends/sm90_w4a16/sm90_w4a16_launch.h"

namespace megamoe::runtime {

namespace w4a16_detail {

template <int kTile, bool kIsL1>
struct TileKernel {
  static constexpr W4a16TileEntry kEntry = kW4a16Tiles[kTile];
  static constexpr GemmConfig kT = kEntry.config;
  static_assert(kernels::sm90::detail::kTileStep<kT.block_n> == kT.tile_step(),
                "the kernel's tile step (kTileStep in sm90_w4a16_tile.cuh) must be the table entry's "
                "block_n - last_tile_extra");
  using Smem = kernels::sm90::W4a16SmemLayout<kT.warpgroups, kT.block_n, kT.stages>;
  static constexpr int kThreads = kT.warpgroups * 128;
  static constexpr auto kernel = &kernels::sm90::w4a16_grouped_gemm_kernel<kIsL1, kT.warpgroups, kT.block_n, kT.stages,
                                                                           kEntry.ctas_per_sm, kT.overlapped>;
  // L1 split in K: the same tile's kernel with the last-arriver epilogue (l1_splits tiles only).
  static constexpr bool kSplits = kIsL1 && l1_splits(kEntry);
  static constexpr auto split_kernel =
      &kernels::sm90::w4a16_grouped_gemm_kernel<kIsL1, kT.warpgroups, kT.block_n, kT.stages, kEntry.ctas_per_sm,
                                                kT.overlapped, kSplits>;
};

template <int kTile>
struct FusedKernel {
  static constexpr W4a16TileEntry kEntry = kW4a16Tiles[kTile];
  static constexpr GemmConfig kT = kEntry.config;
  static_assert(kEntry.fusable && kT.warpgroups == 1 && !kT.overlapped,
                "the fused kernel runs the one-warpgroup decode tiles: mark only those fusable");
  using Smem = kernels::sm90::W4a16SmemLayout<1, kT.block_n, kT.stages>;
  static constexpr auto kernel = &kernels::sm90::w4a16_fused_moe_kernel<1, kT.block_n, kT.stages, kEntry.ctas_per_sm>;
  static_assert(l1_splits(kEntry), "every fusable tile has an L1 split kernel");
  static constexpr auto split_kernel =
      &kernels::sm90::w4a16_fused_moe_kernel<1, kT.block_n, kT.stages, kEntry.ctas_per_sm, true>;
};

}  // namespace w4a16_detail

// The L1 split kernels' occupancy, loaded and set up once (w4a16_tile_blocks_per_sm and
// w4a16_fused_blocks_per_sm load them with the unsplit kernels).
template <int kTile>
int w4a16_split_l1_blocks_per_sm() {
  using K = w4a16_detail::TileKernel<kTile, true>;
  static const int blocks_per_sm = prepare_kernel(K::split_kernel, K::kThreads, K::Smem::kAllocBytes);
  return blocks_per_sm;
}
template <int kTile>
int w4a16_split_fused_blocks_per_sm() {
  using K = w4a16_detail::FusedKernel<kTile>;
  static const int blocks_per_sm = prepare_kernel(K::split_kernel, 128, K::Smem::kAllocBytes);
  return blocks_per_sm;
}

template <int kTile, bool kIsL1>
int w4a16_tile_blocks_per_sm() {
  using K = w4a16_detail::TileKernel<kTile, kIsL1>;
  static const int blocks_per_sm = prepare_kernel(K::kernel, K::kThreads, K::Smem::kAllocBytes);
  if constexpr (K::kSplits) w4a16_split_l1_blocks_per_sm<kTile>();
  return blocks_per_sm;
}

template <int kTile>
int w4a16_fused_blocks_per_sm() {
  using K = w4a16_detail::FusedKernel<kTile>;
  static const int blocks_per_sm = prepare_kernel(K::kernel, 128, K::Smem::kAllocBytes);
  w4a16_split_fused_blocks_per_sm<kTile>();
  return blocks_per_sm;
}

template <int kTile, bool kIsL1>
void launch_w4a16_tile(const kernels::sm90::W4a16GemmParams& params, const GemmGrid& grid) {
  using K = w4a16_detail::TileKernel<kTile, kIsL1>;
  const int blocks_per_sm = w4a16_tile_blocks_per_sm<kTile, kIsL1>();
  if constexpr (K::kSplits) {
    if (params.k_splits > 1) {
      const int split_blocks_per_sm = w4a16_split_l1_blocks_per_sm<kTile>();
      const int64_t ctas =
          std::max<int64_t>(1, std::min<int64_t>(int64_t{grid.num_sms} * split_blocks_per_sm, grid.max_work));
      launch_dependent(K::split_kernel, static_cast<unsigned>(ctas), K::kThreads, K::Smem::kAllocBytes, grid.stream,
                       params);
      return;
    }
  }
  const int64_t ctas = std::max<int64_t>(1, std::min<int64_t>(int64_t{grid.num_sms} * blocks_per_sm, grid.max_work));
  launch_dependent(K::kernel, static_cast<unsigned>(ctas), K::kThreads, K::Smem::kAllocBytes, grid.stream, params);
}

template <int kTile>
void launch_w4a16_fused_tile(const kernels::sm90::W4a16FusedParams& params, const GemmGrid& grid) {
  using K = w4a16_detail::FusedKernel<kTile>;
  const bool split = params.l1.k_splits > 1;
  const int occupancy = split ? w4a16_split_fused_blocks_per_sm<kTile>() : w4a16_fused_blocks_per_sm<kTile>();
  const int blocks_per_sm = grid.ctas_per_sm > 0 ? std::min(grid.ctas_per_sm, occupancy) : occupancy;
  // Every CTA must be resident at once (L2 items wait for L1 items held by other CTAs): the grid
  // never exceeds the occupancy of all the device's SMs (see MoeTuning::fused for the limits).
  const int64_t ctas = std::max<int64_t>(1, std::min<int64_t>(int64_t{grid.num_sms} * blocks_per_sm, grid.max_work));
  launch_dependent(split ? K::split_kernel : K::kernel, static_cast<unsigned>(ctas), 128, K::Smem::kAllocBytes,
                   grid.stream, params);
}

#if MEGAMOE_TIMELINE
template <int kTile, W4a16TimelineLaunch kLaunch>
void set_w4a16_tile_timeline(const W4a16TimelineBuffer& buffer) {
  gpu::check_cuda(cudaMemcpyToSymbol(kernels::sm90::timeline::g_buffer, &buffer, sizeof buffer),
                  "cudaMemcpyToSymbol(W4A16 timeline)");
}
#endif

}  // namespace megamoe::runtime

// The explicit instantiations of one table entry's kernels (one per translation unit).
#define MEGAMOE_W4A16_GEMM_INSTANCE(kTile, kIsL1)                                                    \
  template void megamoe::runtime::launch_w4a16_tile<megamoe::kTile, kIsL1>(                           \
      const megamoe::kernels::sm90::W4a16GemmParams&, const megamoe::runtime::GemmGrid&);            \
  template int megamoe::runtime::w4a16_tile_blocks_per_sm<megamoe::kTile, kIsL1>();                  \
  MEGAMOE_W4A16_TIMELINE_INSTANCE(kTile, kIsL1 ? megamoe::runtime::kTimelineLaunchL1                 \
                                               : megamoe::runtime::kTimelineLaunchL2)
#define MEGAMOE_W4A16_FUSED_INSTANCE(kTile)                                                           \
  template void megamoe::runtime::launch_w4a16_fused_tile<megamoe::kTile>(                            \
      const megamoe::kernels::sm90::W4a16FusedParams&, const megamoe::runtime::GemmGrid&);           \
  template int megamoe::runtime::w4a16_fused_blocks_per_sm<megamoe::kTile>();                        \
  MEGAMOE_W4A16_TIMELINE_INSTANCE(kTile, megamoe::runtime::kTimelineLaunchFused)
#if MEGAMOE_TIMELINE
#define MEGAMOE_W4A16_TIMELINE_INSTANCE(kTile, kLaunch)                                              \
  template void megamoe::runtime::set_w4a16_tile_timeline<megamoe::kTile, kLaunch>(                   \
      const megamoe::runtime::W4a16TimelineBuffer&);
#else
#define MEGAMOE_W4A16_TIMELINE_INSTANCE(kTile, kLaunch)
#endif
