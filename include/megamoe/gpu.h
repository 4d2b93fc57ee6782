// GPU utilities over raw device pointers (no allocation, no host synchronisation).
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

#include "megamoe/status.h"

namespace megamoe::gpu {

// Throws megamoe::Error(kCuda) naming `what` and the CUDA error when `err` is not cudaSuccess;
// the library's own check, for callers that want the same errors from their CUDA calls.
void check_cuda(cudaError_t err, const char* what);

// Number of usable CUDA devices (0 when there is no GPU or no driver; never throws).
int device_count();

// Dequantizes one NVFP4 weight [rows, cols] (ModelOpt layout, device pointers) to bf16:
// out[n,k] = bf16(e2m1 * ue4m3 * global_scale). cols % 16 == 0; pointers 16-byte aligned.
// Throws megamoe::Error(kInvalidArgument) on bad shapes or alignment; launches on `stream`.
void dequantize_nvfp4(const uint8_t* codes, const uint8_t* scales, float global_scale,
                      int64_t rows, int64_t cols, uint16_t* out_bf16, cudaStream_t stream);

}  // namespace megamoe::gpu
