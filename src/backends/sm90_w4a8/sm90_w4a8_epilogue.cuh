// Epilogues of the sm90 W4A8 grouped GEMM on one warpgroup's (64, kBlockN) accumulators, whose
// units are the e4m3 weights' times the activations' (docs/w4a8.md §4-5):
//   L1: g = acc * s2_gate * 2^k_gate, u likewise; the clamp; a = silu(g) * u in fp32, stored
//       fp32 per (slot, intermediate column) for the quantization pass (§2: never rounded to bf16);
//   L2: y = acc * s2_down * 2^k_down, stored per slot (deterministic) or times the routing weight
//       atomically added to the token's fp32 row, exactly as the W4A16 row's combines.
#pragma once

#include <cstdint>

#include "backends/sm90_w4a16/sm90_w4a16_epilogue.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_layout.h"
#include "backends/sm90_w4a16/sm90_w4a16_scheduler.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_params.cuh"

namespace megamoe::kernels::sm90::detail {

// tid: the thread's index in its warpgroup; w: the warpgroup's (64, kBlockN) part of the item.
template <bool kIsL1, int kBlockN>
__device__ __forceinline__ void w4a8_store_tile(const W4a8GemmParams& p, const float (&acc)[kBlockN / 2],
                                                const WorkItem& w, int tid) {
  using namespace w4a16;
  const W4a16GemmParams& g = p.g;
  const int warp = tid / 32, quad = tid % 32 / 4, t = tid % 4;
  if constexpr (kIsL1) {
    // Rows r0 and r0 + 8 of a W13 tile are the gate and up rows of one intermediate column.
    const float s_gate = g.s2_gate[w.expert], s_up = g.s2_up[w.expert], limit = g.swiglu_limit;
    const int64_t column = w13_intermediate_column(w.m_block, warp * 16 + quad);
    for_each_valid_column<kBlockN>(w, t, [&](int slot, int j_gate, int j_up) {
      const float gate = fminf(acc[j_gate] * s_gate, limit);
      const float up = fminf(fmaxf(acc[j_up] * s_up, -limit), limit);
      p.act_f32[static_cast<int64_t>(slot) * g.act_ld + column] = silu(gate) * up;
    });
  } else {
    const float s_down = g.s2_down[w.expert];
    const int64_t row0 = static_cast<int64_t>(w.m_block) * kTileM + warp * 16 + quad;
    if (g.y_slot != nullptr) {
      store_slots_direct<kBlockN>(g, acc, w, t, s_down, row0);
    } else {
      add_weighted_direct<kBlockN>(g, acc, w, t, s_down, row0);
    }
  }
}

}  // namespace megamoe::kernels::sm90::detail
