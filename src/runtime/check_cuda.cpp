#include "megamoe/gpu.h"

#include "megamoe/status.h"

namespace megamoe::gpu {

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    MEGAMOE_FAIL(kCuda, what, " failed: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  }
}

}  // namespace megamoe::gpu
