// Holds a stream on the GPU for a while: work that other streams queue behind an event recorded
// after the hold starts together once it ends, whatever the host's enqueue latency.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace megamoe::bench {

// One thread spins on %globaltimer for `ns` nanoseconds on `stream`.
void hold_stream(cudaStream_t stream, uint64_t ns);

}  // namespace megamoe::bench
