// The (sm_90, w4a16) row's run(): the launches of one layer (sm90_w4a16_run.cu).
#pragma once

#include <cuda_runtime.h>

#include "backends/sm90_w4a16/sm90_w4a16_weights.h"
#include "megamoe/runtime.h"
#include "runtime/backend.h"

namespace megamoe::runtime {

// Arguments already checked (check_run_args), T > 0; `gated` as MoeBackend::run.
void run_sm90_w4a16(const MoePlan& plan, const Sm90PrepackedWeights& weights, const MoeRunArgs& args,
                    cudaStream_t stream, const GatedTokens* gated = nullptr);

}  // namespace megamoe::runtime
