// The (sm_90, w4a16) row's run(): the launches of one layer (sm90_w4a16_run.cu).
#pragma once

#include <cuda_runtime.h>

#include "backends/sm90_w4a16/sm90_w4a16_weights.h"
#include "megamoe/runtime.h"

namespace megamoe::runtime {

// Arguments already checked (check_run_args), T > 0.
void run_sm90_w4a16(const MoePlan& plan, const Sm90PrepackedWeights& weights, const MoeRunArgs& args,
                    cudaStream_t stream);

}  // namespace megamoe::runtime
