#include "bench/stream_hold.h"

#include "megamoe/gpu.h"

namespace megamoe::bench {
namespace {

__global__ void hold_kernel(uint64_t ns) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

}  // namespace

void hold_stream(cudaStream_t stream, uint64_t ns) {
  hold_kernel<<<1, 1, 0, stream>>>(ns);
  gpu::check_cuda(cudaGetLastError(), "hold_kernel launch");
}

}  // namespace megamoe::bench
