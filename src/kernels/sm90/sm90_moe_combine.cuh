// Final combine: fp32 [T, H] -> bf16 output, one rounding (or the fp32 sums themselves, for a
// caller that adds partial layers: expert parallelism). Atomic mode reads the accumulator the
// L2 epilogue added into; deterministic mode sums the per-slot results in top-k order (then the
// shared-expert slices), so runs are bitwise identical.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

#include "kernels/common/pdl.cuh"
#include "kernels/common/ptx_atomics.cuh"
#include "kernels/sm90/sm90_moe_pipeline_params.cuh"

namespace megamoe::kernels::sm90 {

// One thread per 8 consecutive outputs (32-byte fp32 reads, 16-byte bf16 writes).
// kGated: the tokens are those the dispatch's gate let through (CombineParams::tokens_dev), and
// with CombineParams::returns each row's fp32 sum goes to the rank it came from.
template <bool kGated>
__global__ void __launch_bounds__(256) moe_combine_kernel(CombineParams p) {
  grid_dependency_wait();  // the L2 results are complete from here on
  int64_t tokens = p.tokens;
  if constexpr (kGated) tokens = min(tokens, static_cast<int64_t>(*p.tokens_dev));
  const int64_t vecs_per_row = p.hidden / 8;
  const int64_t total = tokens * vecs_per_row;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = v / vecs_per_row;
    const int64_t h = (v % vecs_per_row) * 8;
    float sum[8];
    if (p.y_slot == nullptr) {
      const float4* src = reinterpret_cast<const float4*>(p.out_acc + t * p.hidden + h);
      const float4 a = src[0], b = src[1];
      sum[0] = a.x; sum[1] = a.y; sum[2] = a.z; sum[3] = a.w;
      sum[4] = b.x; sum[5] = b.y; sum[6] = b.z; sum[7] = b.w;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) sum[i] = 0.0f;
      for (int j = 0; j < p.slots_per_token; ++j) {
        const int32_t slot = p.token_slot[t * p.slots_per_token + j];
        if (slot < 0) continue;  // an invalid expert id: skipped (and counted by dispatch)
        const float w = p.slot_weight[slot];
        const float4* src = reinterpret_cast<const float4*>(p.y_slot + static_cast<int64_t>(slot) * p.hidden + h);
        const float4 a = src[0], b = src[1];
        sum[0] += a.x * w; sum[1] += a.y * w; sum[2] += a.z * w; sum[3] += a.w * w;
        sum[4] += b.x * w; sum[5] += b.y * w; sum[6] += b.z * w; sum[7] += b.w * w;
      }
    }
    if constexpr (kGated) {
      if (p.returns.src != nullptr) {
        const int32_t from = p.returns.src[t];
        float4* dst = reinterpret_cast<float4*>(
            reinterpret_cast<float*>(p.returns.bases[from >> 24] + p.returns.offset) +
            (p.returns.first_row + (from & 0xffffff)) * p.hidden + h);
        dst[0] = make_float4(sum[0], sum[1], sum[2], sum[3]);
        dst[1] = make_float4(sum[4], sum[5], sum[6], sum[7]);
        continue;
      }
    }
    if (p.out_f32 != nullptr) {
      float4* dst = reinterpret_cast<float4*>(p.out_f32 + t * p.hidden + h);
      dst[0] = make_float4(sum[0], sum[1], sum[2], sum[3]);
      dst[1] = make_float4(sum[4], sum[5], sum[6], sum[7]);
      continue;
    }
    __align__(16) __nv_bfloat16 res[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) res[i] = __float2bfloat16_rn(sum[i]);
    *reinterpret_cast<uint4*>(p.out + t * p.hidden + h) = *reinterpret_cast<const uint4*>(res);
  }
  if constexpr (kGated) {
    // The rows' sums in peers' memory are performed for every GPU before this grid completes: the
    // return's done words, released once it has, then order them for the peers that read them.
    if (p.returns.src != nullptr) {
      __syncthreads();
      if (threadIdx.x == 0) ptx::fence_acq_rel_sys();
    }
  }
}

}  // namespace megamoe::kernels::sm90
