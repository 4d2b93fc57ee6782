// Launch helpers shared by the runtime's CUDA translation units (host code).
#pragma once

#include <cuda_runtime.h>
#include <algorithm>
#include <cstddef>

#include "megamoe/gpu.h"

namespace megamoe::runtime {

// Launches `kernel` so that it may start while the previous kernel on the stream still runs
// (programmatic dependent launch); the kernel waits for that one's results itself
// (kernels/common/pdl.cuh).
template <class Params>
void launch_dependent(void (*kernel)(Params), unsigned grid, unsigned block, size_t smem, cudaStream_t stream,
                      const Params& params) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  gpu::check_cuda(cudaLaunchKernelEx(&config, kernel, params), "cudaLaunchKernelEx");
}

// Sets a kernel's shared-memory attributes once and returns its resident CTAs per SM.
template <class Kernel>
int prepare_kernel(Kernel* kernel, int threads, int smem_bytes) {
  gpu::check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes),
                  "cudaFuncSetAttribute(max dynamic shared memory)");
  // All of the unified L1/shared array as shared memory: the kernels stream through
  // shared-memory stages and have no use for a large L1 cache.
  gpu::check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100),
                  "cudaFuncSetAttribute(shared memory carveout)");
  int n = 0;
  gpu::check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem_bytes),
                  "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return std::max(n, 1);
}

}  // namespace megamoe::runtime
