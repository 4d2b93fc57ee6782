// The pack and combine kernels of `megamoe bench --ep`'s unfused baseline (ep_baseline.h).
#include "bench/ep_baseline.h"

#include <cuda_bf16.h>

#include <algorithm>

#include "megamoe/gpu.h"

namespace megamoe::bench {
namespace {

// One CTA per send row.
__global__ void pack_rows_kernel(EpPackArgs a) {
  for (int64_t i = blockIdx.x; i < a.rows; i += gridDim.x) {
    const int64_t t = a.row_token[i];
    const int32_t d = a.row_dest[i];
    const uint4* src = reinterpret_cast<const uint4*>(a.hidden + t * a.hidden_size);
    uint4* dst = reinterpret_cast<uint4*>(a.send_hidden + i * a.hidden_size);
    for (int64_t v = threadIdx.x; v < a.hidden_size / 8; v += blockDim.x) dst[v] = src[v];
    if (threadIdx.x < a.top_k) {
      const int32_t id = a.topk_ids[t * a.top_k + threadIdx.x];
      const int64_t first = static_cast<int64_t>(d) * a.experts_per_rank;
      const bool mine = id >= first && id < first + a.experts_per_rank;
      a.send_ids[i * a.top_k + threadIdx.x] = mine ? static_cast<int32_t>(id - first) : -1;
      a.send_weights[i * a.top_k + threadIdx.x] = a.topk_weights[t * a.top_k + threadIdx.x];
    }
  }
}

// One CTA per token.
__global__ void combine_rows_kernel(EpCombineArgs a) {
  for (int64_t t = blockIdx.x; t < a.tokens; t += gridDim.x) {
    for (int64_t v = threadIdx.x; v < a.hidden_size / 4; v += blockDim.x) {
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int d = 0; d < a.world; ++d) {
        const int32_t slot = a.slots[t * a.world + d];
        if (slot < 0) continue;
        const float4 y = reinterpret_cast<const float4*>(a.partial + static_cast<int64_t>(slot) * a.hidden_size)[v];
        sum.x += y.x; sum.y += y.y; sum.z += y.z; sum.w += y.w;
      }
      if (a.shared != nullptr) {
        const float4 y = reinterpret_cast<const float4*>(a.shared + t * a.hidden_size)[v];
        sum.x += y.x; sum.y += y.y; sum.z += y.z; sum.w += y.w;
      }
      __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(a.out + t * a.hidden_size + 4 * v);
      o[0] = __floats2bfloat162_rn(sum.x, sum.y);
      o[1] = __floats2bfloat162_rn(sum.z, sum.w);
    }
  }
}

}  // namespace

void ep_pack_rows(const EpPackArgs& args, cudaStream_t stream) {
  if (args.rows == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(args.rows, 2048));
  pack_rows_kernel<<<blocks, 256, 0, stream>>>(args);
  gpu::check_cuda(cudaGetLastError(), "ep_pack_rows launch");
}

void ep_combine_rows(const EpCombineArgs& args, cudaStream_t stream) {
  if (args.tokens == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(args.tokens, 2048));
  combine_rows_kernel<<<blocks, 256, 0, stream>>>(args);
  gpu::check_cuda(cudaGetLastError(), "ep_combine_rows launch");
}

}  // namespace megamoe::bench
