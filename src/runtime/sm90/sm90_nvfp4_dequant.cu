// Host launcher of the sm90 NVFP4 dequantizer (kernels/sm90/sm90_nvfp4_dequant.cuh).
#include "kernels/sm90/sm90_nvfp4_dequant.cuh"
#include "megamoe/gpu.h"
#include "megamoe/status.h"

namespace megamoe::gpu {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error for later callers
    return 0;
  }
  return n;
}

void dequantize_nvfp4(const uint8_t* codes, const uint8_t* scales, float global_scale,
                      int64_t rows, int64_t cols, uint16_t* out_bf16, cudaStream_t stream) {
  MEGAMOE_CHECK(rows >= 0 && cols >= 0, kInvalidArgument, "dequantize_nvfp4: shape [", rows, ", ",
                cols, "] has a negative dimension");
  MEGAMOE_CHECK(cols % 16 == 0, kInvalidArgument, "dequantize_nvfp4: cols = ", cols,
                " is not a multiple of the NVFP4 block size 16");
  const int64_t blocks = rows * (cols / 16);
  if (blocks == 0) return;
  MEGAMOE_CHECK(codes && scales && out_bf16, kInvalidArgument,
                "dequantize_nvfp4: null device pointer");
  MEGAMOE_CHECK(reinterpret_cast<uintptr_t>(codes) % 8 == 0 &&
                    reinterpret_cast<uintptr_t>(out_bf16) % 16 == 0,
                kInvalidArgument,
                "dequantize_nvfp4: codes must be 8-byte and out 16-byte aligned");
  constexpr int kThreads = 256;
  const int64_t grid = (blocks + kThreads - 1) / kThreads;
  MEGAMOE_CHECK(grid <= 0x7fffffff, kInvalidArgument, "dequantize_nvfp4: tensor too large");
  kernels::sm90::nvfp4_dequant_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      codes, scales, global_scale, blocks, reinterpret_cast<__nv_bfloat16*>(out_bf16));
  check_cuda(cudaGetLastError(), "nvfp4_dequant_kernel launch");
}

}  // namespace megamoe::gpu
