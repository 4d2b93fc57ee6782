// k per (expert, projection) from a layer's prepacked block scales on the device: one pass over
// the scale bytes for each tensor's largest and smallest nonzero encoded scale.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <vector>

#include "backends/sm90_w4a16/sm90_w4a16_layout.h"
#include "backends/sm90_w4a16/sm90_w4a16_prepack.h"
#include "backends/sm90_w4a8/sm90_w4a8_rescale.h"
#include "megamoe/format.h"
#include "megamoe/gpu.h"
#include "megamoe/status.h"
#include "runtime/sm90/sm90_moe_workspace.h"

namespace megamoe::runtime {
namespace {

using gpu::check_cuda;
namespace w4a16 = kernels::sm90::w4a16;

// Per (virtual expert, projection): the largest encoded scale byte, and 256 minus the smallest
// nonzero one (0 where every scale is 0), so that both reduce with atomicMax.
constexpr int kExtrema = 2;
constexpr int kThreads = 256;

// A 16-bit half of a prepacked scale word holds the encoded scales E_a (bits 4..11) and E_b
// (bits 12..15 low nibble, 0..3 high nibble) of two k16 steps of one row.
__device__ __forceinline__ void scan_half(uint32_t half, uint32_t& largest, uint32_t& inverse_smallest) {
  const uint32_t ea = (half >> 4) & 0xFFu;
  const uint32_t eb = ((half >> 12) & 0xFu) | ((half & 0xFu) << 4);
  largest = max(largest, max(ea, eb));
  inverse_smallest = max(inverse_smallest, max(ea ? 256u - ea : 0u, eb ? 256u - eb : 0u));
}

// blockIdx.y: the virtual expert. W13 words hold the gate row in their low half and the up row in
// the high half (rows 16w + g and 16w + g + 8 of a tile: w13_is_up_row); W2 words two down rows.
__global__ void __launch_bounds__(kThreads)
    prepacked_scale_extrema_kernel(const uint4* scales, int64_t vectors_per_expert, bool w13, uint32_t* out) {
  const uint4* expert = scales + static_cast<int64_t>(blockIdx.y) * vectors_per_expert;
  uint32_t largest[2] = {0, 0}, inverse_smallest[2] = {0, 0};
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < vectors_per_expert;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const uint4 v = expert[i];
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
    for (const uint32_t word : words) {
      scan_half(word & 0xFFFFu, largest[0], inverse_smallest[0]);
      scan_half(word >> 16, largest[1], inverse_smallest[1]);
    }
  }
  uint32_t* dst = out + static_cast<int64_t>(blockIdx.y) * 3 * kExtrema;
  for (int h = 0; h < 2; ++h) {
    const int projection = w13 ? h : 2;
    const uint32_t l = __reduce_max_sync(0xFFFFFFFFu, largest[h]);
    const uint32_t s = __reduce_max_sync(0xFFFFFFFFu, inverse_smallest[h]);
    if (threadIdx.x % 32 == 0) {
      atomicMax(dst + projection * kExtrema, l);
      atomicMax(dst + projection * kExtrema + 1, s);
    }
  }
}

struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};

// The ue4m3 byte of a tensor's largest encoded scale; throws where a byte is no encoded scale.
uint8_t largest_scale(uint32_t largest, uint32_t inverse_smallest, const char* kind, int64_t expert,
                      int64_t routed, int projection) {
  constexpr const char* kProjections[3] = {"gate", "up", "down"};
  const uint32_t smallest = inverse_smallest ? 256 - inverse_smallest : 0;
  // encode_scale gives 0 or (x + 21) << 3 | mmm with x in [-9, 8].
  constexpr uint32_t kLowest = 12u << 3, kHighest = 29u << 3 | 7u;
  const uint32_t bad = largest > kHighest ? largest : (smallest != 0 && smallest < kLowest) ? smallest : 0;
  if (bad != 0) {
    char hex[8];
    std::snprintf(hex, sizeof(hex), "0x%02X", bad);
    const bool shared = expert >= routed;
    MEGAMOE_FAIL(kInvalidArgument, "w4a8_rescale_exponents_prepacked: the ", kind, " scales of ",
                 shared ? "the shared expert's slice " : "expert ", shared ? expert - routed : expert, " (",
                 kProjections[projection], " rows) hold the byte ", hex,
                 ", which no ue4m3 scale encodes to (sm90_w4a16_layout.h, encode_scale): these are not "
                 "prepacked weights.");
  }
  return w4a16::decode_scale(static_cast<uint8_t>(largest));
}

}  // namespace

W4a8RescaleExponents w4a8_rescale_exponents_prepacked(const MoeProblem& shape, const uint8_t* w13_scales,
                                                      const uint8_t* w2_scales, cudaStream_t stream) {
  constexpr const char* kFn = "w4a8_rescale_exponents_prepacked";
  const int64_t H = shape.hidden_size, I = shape.intermediate_size, E = shape.num_experts;
  const int64_t EV = virtual_experts(shape);
  MEGAMOE_CHECK(H > 0 && I > 0 && E > 0 && H % w4a16::kChunkK == 0 && I % w4a16::kChunkK == 0, kInvalidArgument,
                kFn, ": (H, I, E) = (", H, ", ", I, ", ", E,
                ") is not the shape of a prepacked layer (H and I multiples of 64, E > 0).");
  for (const uint8_t* p : {w13_scales, w2_scales}) {
    MEGAMOE_CHECK(p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 == 0, kInvalidArgument, kFn,
                  ": the scale pointer ", static_cast<const void*>(p), " is null or not 16-byte aligned.");
  }
  MEGAMOE_CHECK(EV <= 65535, kInvalidArgument, kFn, ": ", EV, " virtual experts; at most 65535.");
  const int64_t bytes13 = prepacked_scale_bytes(2 * I, H), bytes2 = prepacked_scale_bytes(H, I);

  uint32_t* raw = nullptr;
  const size_t out_bytes = static_cast<size_t>(EV * 3 * kExtrema) * sizeof(uint32_t);
  check_cuda(cudaMalloc(&raw, out_bytes), "cudaMalloc(w4a8 rescale exponents)");
  const std::unique_ptr<uint32_t, CudaFree> extrema(raw);
  check_cuda(cudaMemsetAsync(raw, 0, out_bytes, stream), "cudaMemsetAsync(w4a8 rescale exponents)");
  for (const bool w13 : {true, false}) {
    const int64_t vectors = (w13 ? bytes13 : bytes2) / 16;
    const int64_t blocks = std::min<int64_t>((vectors + kThreads - 1) / kThreads, 64);
    prepacked_scale_extrema_kernel<<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(EV)), kThreads, 0,
                                     stream>>>(reinterpret_cast<const uint4*>(w13 ? w13_scales : w2_scales), vectors,
                                               w13, raw);
    check_cuda(cudaGetLastError(), "prepacked_scale_extrema_kernel launch");
  }
  std::vector<uint32_t> host(static_cast<size_t>(EV * 3 * kExtrema));
  check_cuda(cudaMemcpyAsync(host.data(), raw, out_bytes, cudaMemcpyDeviceToHost, stream),
             "cudaMemcpyAsync(w4a8 rescale exponents)");
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize(w4a8 rescale exponents)");

  W4a8RescaleExponents out;
  out.routed.resize(static_cast<size_t>(E));
  std::array<uint8_t, 3> shared_largest{};
  for (int64_t v = 0; v < EV; ++v) {
    for (int p = 0; p < 3; ++p) {
      const uint32_t* x = host.data() + (v * 3 + p) * kExtrema;
      const uint8_t largest = largest_scale(x[0], x[1], p < 2 ? "w13" : "w2", v, E, p);
      if (v < E) {
        out.routed[static_cast<size_t>(v)][static_cast<size_t>(p)] =
            format::w4a8_weight_rescale_exponent({&largest, 1});
      } else {
        shared_largest[static_cast<size_t>(p)] = std::max(shared_largest[static_cast<size_t>(p)], largest);
      }
    }
  }
  if (EV > E) {
    for (size_t p = 0; p < 3; ++p) out.shared[p] = format::w4a8_weight_rescale_exponent({&shared_largest[p], 1});
  }
  return out;
}

}  // namespace megamoe::runtime
