// NVFP4 -> bf16 dequantizer for one ModelOpt weight [N, K]: out = bf16(e2m1 * ue4m3 * s2).
// Used to build the bf16 baseline and to test the checkpoint-layout device decoders
// (nvfp4_decode.cuh) bit-for-bit against the CPU codecs. Never used in the MoE path (weights there stay NVFP4).
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

#include "kernels/common/nvfp4_decode.cuh"

namespace megamoe::kernels::sm90 {

// One thread per 16-element block: 8 code bytes (two words) and one scale byte in, 32 bytes out.
// Global memory accesses are 8- and 16-byte vectors, coalesced across the warp.
__global__ void __launch_bounds__(256) nvfp4_dequant_kernel(
    const uint8_t* __restrict__ codes,   // (N, K/2) packed e2m1, element 2j in the low nibble
    const uint8_t* __restrict__ scales,  // (N, K/16) ue4m3
    float global_scale, int64_t num_blocks,
    __nv_bfloat16* __restrict__ out) {   // (N, K)
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= num_blocks) return;
  const uint2 q = reinterpret_cast<const uint2*>(codes)[b];
  const uint8_t s = scales[b];
  const float scale = ue4m3x2_to_float2(s).x;
  const E2m1Tables tab = load_e2m1_tables();
  uint32_t v[2][4];
  decode_e2m1x8(q.x, tab, v[0]);  // v[w][j] = {element 8w + 2j, element 8w + 2j + 1}
  decode_e2m1x8(q.y, tab, v[1]);
  __align__(16) __nv_bfloat16 res[16];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v[w][j]));
      // (e2m1 * scale) is exact in fp32; the one rounding is the multiply by the global scale.
      res[8 * w + 2 * j] = __float2bfloat16_rn((f.x * scale) * global_scale);
      res[8 * w + 2 * j + 1] = __float2bfloat16_rn((f.y * scale) * global_scale);
    }
  }
  uint4* dst = reinterpret_cast<uint4*>(out + b * 16);
  dst[0] = reinterpret_cast<const uint4*>(res)[0];
  dst[1] = reinterpret_cast<const uint4*>(res)[1];
}

}  // namespace megamoe::kernels::sm90
