#include "bench/l2_flush.h"

#include "megamoe/status.h"

namespace megamoe::bench {
namespace {

// Reads every 16 bytes of `data` once (coalesced, grid-stride). The xor of the words is stored
// only if it equals a value the caller's buffer never produces, so the loads cannot be removed
// and nothing is written.
__global__ void read_through_l2(const uint4* data, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const uint4 v = data[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) *sink = acc;  // the buffer is all zero bytes: the xor is 0
}

}  // namespace

L2FlushMode parse_l2_flush_mode(const std::string& name) {
  if (name == "clean") return L2FlushMode::kClean;
  if (name == "dirty") return L2FlushMode::kDirty;
  MEGAMOE_FAIL(kInvalidArgument, "bench: L2 flush '", name, "' is not one of: clean, dirty");
}

const char* to_string(L2FlushMode mode) { return mode == L2FlushMode::kClean ? "clean" : "dirty"; }

L2Flush::L2Flush(L2FlushMode mode, size_t l2_bytes)
    : mode_(mode), written_(2 * l2_bytes), read_(mode == L2FlushMode::kClean ? 2 * l2_bytes : 0), sink_(1) {
  MEGAMOE_CHECK(l2_bytes > 0 && l2_bytes % 16 == 0, kInternal, "bench: L2 size ", l2_bytes,
                " is not a positive multiple of 16");
  read_.poison(0);
  gpu::check_cuda(cudaDeviceSynchronize(), "L2 flush buffer init");
}

void L2Flush::run(cudaStream_t stream, int round) const {
  gpu::check_cuda(cudaMemsetAsync(written_.get(), round & 0xFF, written_.size(), stream), "L2 flush (memset)");
  if (mode_ == L2FlushMode::kDirty) return;
  const size_t n = read_.size() / 16;
  read_through_l2<<<1024, 512, 0, stream>>>(reinterpret_cast<const uint4*>(read_.get()), n, sink_.get());
  gpu::check_cuda(cudaGetLastError(), "L2 flush (read)");
}

}  // namespace megamoe::bench
