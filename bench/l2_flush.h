// Emptying the L2 of the layer's data between timed replays, as when other layers run in between.
//
// Two ways, and they differ in what the L2 holds when the timed layer starts:
//   * dirty: memset a buffer twice the L2's size (the usual "cache.zero_()" flush). The L2 then
//     holds up to its size in dirty lines, and the layer's misses evict them: the timed layer
//     also pays for writing back the memset's data (up to 50 MB on an H100, ~17 us of DRAM time).
//   * clean: the same memset, then a read of a second buffer twice the L2's size. The memset
//     evicts the layer's lines whatever the replacement policy; the read leaves the L2 holding
//     clean lines, as after the weight reads of the layers that run in between (their writes are
//     activations, a few MB). The layer's misses then evict lines that need no write-back.
// The previous replay's own writes (output, workspace) are written back by either, outside the
// timing.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "megamoe/gpu.h"
#include "support/device_buffer.h"

namespace megamoe::bench {

enum class L2FlushMode { kClean, kDirty };

// "clean" or "dirty" (the `--flush` values); anything else is an error that names them.
L2FlushMode parse_l2_flush_mode(const std::string& name);
const char* to_string(L2FlushMode mode);

class L2Flush {
 public:
  L2Flush(L2FlushMode mode, size_t l2_bytes);
  // Enqueues the flush on `stream`; `round` varies the memset's byte.
  void run(cudaStream_t stream, int round) const;
  L2FlushMode mode() const { return mode_; }

 private:
  L2FlushMode mode_;
  support::DeviceBuffer<uint8_t> written_;  // memset by both modes
  support::DeviceBuffer<uint8_t> read_;     // read by the clean mode (all zero bytes)
  support::DeviceBuffer<uint32_t> sink_;    // keeps the clean flush's loads alive
};

}  // namespace megamoe::bench
