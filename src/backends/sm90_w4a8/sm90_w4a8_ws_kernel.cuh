// w4a8_ws_gemm_kernel: the warp-specialized sm90 W4A8 grouped GEMM (docs/w4a8.md §8.2), one GEMM
// (L1 or L2) per launch over the W4A16 row's schedule (block_m_tiles = kMTiles, kBlockN tokens)
// and prepacked weights. Its parts:
//   sm90_w4a8_ws_layout.cuh    the item shapes, the stages and their barriers
//   sm90_w4a8_ws_producer.cuh  warpgroup 0: copies and the decode into e4m3 A fragments
//   sm90_w4a8_ws_consumer.cuh  warpgroups 1, 2: RS fp8 wgmmas, the promotion, the epilogue
// One CTA per SM (the stages take the shared memory); the epilogues are the one-warpgroup tile's.
#pragma once

#include <cstdint>

#include "backends/sm90_w4a16/sm90_w4a16_layout.h"
#include "backends/sm90_w4a16/sm90_w4a16_tile.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_params.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_ws_consumer.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_ws_layout.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_ws_producer.cuh"
#include "kernels/common/pdl.cuh"
#include "kernels/common/ptx_mbarrier.cuh"

namespace megamoe::kernels::sm90 {

template <bool kIsL1, int kMTiles>
__global__ void __launch_bounds__(detail::kW4a8WsThreads, 1) w4a8_ws_gemm_kernel(const W4a8GemmParams p) {
  using L = detail::W4a8WsLayout<kMTiles>;
  uint8_t* smem = detail::aligned_dynamic_smem();
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if (threadIdx.x == 0) {
    #pragma unroll
    for (int s = 0; s < L::kStages; ++s) {
      ptx::mbarrier_init(L::full_bar(base, s), L::kFullArrivals);
      ptx::mbarrier_init(L::empty_bar(base, s), detail::kW4a8WsConsumers * w4a16::kThreadsPerWarpgroup);
    }
    ptx::fence_mbarrier_init();
  }
  __syncthreads();
  allow_dependent_launch();
  grid_dependency_wait();  // the quantized activations (and through them the dispatch) are complete
  const int total = p.g.tile_offsets[p.g.num_experts];
  const int K = p.g.k_chunks * w4a16::kChunkK, blocks = K / w4a8::kActBlock;
  const int role = static_cast<int>(threadIdx.x) / w4a16::kThreadsPerWarpgroup;
  if (role == 0) {
    detail::w4a8_ws_produce<kIsL1, kMTiles>(p, smem, total, blocks, K);
  } else {
    detail::w4a8_ws_consume<kIsL1, kMTiles>(p, smem, total, blocks, role - 1);
  }
}

}  // namespace megamoe::kernels::sm90
