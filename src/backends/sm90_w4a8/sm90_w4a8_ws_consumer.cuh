// A consumer warpgroup of the warp-specialized W4A8 tile (sm90_w4a8_ws_layout.cuh): per 128-K
// block, its decoded A fragments loaded from shared memory and four m64n128k32 fp8 wgmmas (B: its
// 128 tokens' rows in shared memory) into a partial P, then the one-warpgroup tile's promotion
// (acc += P * 2^e per token, docs/w4a8.md §4), then the stage goes back to the producer; after the
// item's last block, the one-warpgroup tile's epilogue on its 64 x 128 part.
#pragma once

#include <cstdint>
#include <utility>

#include "backends/sm90_w4a16/sm90_w4a16_scheduler.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_act_quant.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_epilogue.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_mainloop.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_params.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_ws_layout.cuh"
#include "kernels/common/ptx_mbarrier.cuh"
#include "kernels/common/ptx_wgmma_e4m3.cuh"

namespace megamoe::kernels::sm90::detail {

// Consumer c (0 or 1) over the CTA's items (the producer's sequence). acc[4i + 2h + c'] is
// (row r0 + 8h, token column 8i + 2t + c') of its part, r0 = 16 warp + g.
template <bool kIsL1, int kMTiles>
__device__ __forceinline__ void w4a8_ws_consume(const W4a8GemmParams& p, uint8_t* smem, int total, int blocks,
                                                int consumer) {
  using L = W4a8WsLayout<kMTiles>;
  constexpr int kN = kW4a8WsConsumerTokens, kStages = L::kStages;
  const int tid = static_cast<int>(threadIdx.x) % w4a16::kThreadsPerWarpgroup, t = tid % 4;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  // Tall: this consumer's own A tile, all B rows. Wide: the one A tile, its half of the B rows.
  const int a_offset = L::kAOffset + (kMTiles == 2 ? consumer * L::kATileBytes : 0) + tid * 16;
  const int b_offset = kMTiles == 1 ? consumer * kN * w4a8::kActBlock : 0;
  const int token0 = kMTiles == 1 ? consumer * kN : 0;
  int j = 0;
  #pragma unroll 1
  for (int work = static_cast<int>(blockIdx.x); work < total; work += static_cast<int>(gridDim.x)) {
    WorkItem w = decode_work<L::kBlockN>(p.g, work, total);
    float acc[kN / 2];
    #pragma unroll
    for (int i = 0; i < kN / 2; ++i) acc[i] = 0.0f;
    #pragma unroll 1
    for (int kb = 0; kb < blocks; ++kb, ++j) {
      const int s = j % kStages;
      ptx::mbarrier_wait(L::full_bar(base, s), (j / kStages) & 1);
      const uint8_t* st = smem + s * L::kStageBytes;
      uint32_t a[4][4];
      #pragma unroll
      for (int f = 0; f < 4; ++f) {
        *reinterpret_cast<uint4*>(a[f]) = *reinterpret_cast<const uint4*>(st + a_offset + f * w4a16::kThreadsPerWarpgroup * 16);
      }
      const uint64_t desc_b = ptx::make_sw128_desc(st + b_offset);
      float part[kN / 2];
      ptx::wgmma_fence();
      // k32 step f starts 32 bytes further into each swizzled row (16-byte units in the descriptor).
      wgmma_e4m3<kN, false>(a[0], desc_b, part, std::make_index_sequence<kN / 2>{});
      #pragma unroll
      for (int f = 1; f < 4; ++f) {
        wgmma_e4m3<kN, true>(a[f], desc_b + 2 * f, part, std::make_index_sequence<kN / 2>{});
      }
      ptx::wgmma_commit();
      ptx::wgmma_wait_all();
      promote_partial<kN>(part, reinterpret_cast<const float*>(st + L::kActScaleOffset) + token0, t, acc);
      ptx::mbarrier_arrive(L::empty_bar(base, s));
    }
    // This consumer's part as a one-warpgroup item: its 64-row tile, or its 128 tokens.
    if constexpr (kMTiles == 2) {
      w.m_block = w.m_block * 2 + consumer;
    } else {
      w.slot_begin += token0;
    }
    w4a8_store_tile<kIsL1, kN>(p, acc, w, tid);
  }
}

}  // namespace megamoe::kernels::sm90::detail
