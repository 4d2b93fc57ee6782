// fp8 wgmma (sm_90a) wrappers beside the bf16 ones (ptx_wgmma.cuh, whose fence / commit / wait
// and B descriptor these share): m64nNk32 e4m3 x e4m3 -> f32 with A from registers (four e4m3x4
// registers), B K-major in shared memory. A k32 step covers 32 bytes of each B row, as the bf16
// k16 step does, so the bf16 tiles' 128-byte swizzle and descriptor serve it unchanged.
#pragma once

#include <cstdint>

#include <cute/arch/mma_sm90_gmma.hpp>

#include "kernels/common/ptx_wgmma.cuh"

namespace megamoe::kernels::ptx {

template <int N> struct WgmmaRSE4m3;  // defined for the N below: add one to instantiate another width
#define MEGAMOE_WGMMA_RS_E4M3(N)                                                 \
  template <> struct WgmmaRSE4m3<N> {                                            \
    using Op = cute::SM90::GMMA::MMA_64x##N##x32_F32E4M3E4M3_RS_TN<>;            \
  };
MEGAMOE_WGMMA_RS_E4M3(32)
MEGAMOE_WGMMA_RS_E4M3(128)
MEGAMOE_WGMMA_RS_E4M3(160)
#undef MEGAMOE_WGMMA_RS_E4M3

}  // namespace megamoe::kernels::ptx
