// CUDA runtime error checking for the library's host code, its tools and tests (not a public API).
#pragma once

#include <cuda_runtime.h>

namespace megamoe::gpu {

// Throws megamoe::Error(kCuda) naming `what` when `err` is not cudaSuccess.
void check_cuda(cudaError_t err, const char* what);

}  // namespace megamoe::gpu
