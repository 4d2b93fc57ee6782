// The (sm_90, w4a8) row's host side (sm90_w4a8_run.cu): its validation, workspace, tile choice and
// launches.
#pragma once

#include <cuda_runtime.h>
#include <cstddef>
#include <cstdint>
#include <string>

#include "backends/sm90_w4a16/sm90_w4a16_weights.h"
#include "backends/sm90_w4a8/sm90_w4a8_tiles.h"
#include "megamoe/runtime.h"
#include "runtime/backend.h"
#include "runtime/sm90/sm90_moe_workspace.h"

namespace megamoe::runtime {

// The sm90 pipeline's limits, then W4A8's: H and I multiples of 128 (one activation scale per 128
// of K, docs/w4a8.md §1-2). Throws megamoe::Error(kUnsupported) naming the value and the rule.
void validate_sm90_w4a8_problem(const MoeProblem& p);

// The W4A16 row's workspace (dispatch, combine) followed by W4A8's regions.
struct W4a8WorkspaceLayout {
  WorkspaceLayout base;
  size_t x_codes, x_scales;  // the hidden states quantized: [T, H] e4m3, [T, H / 128] fp32 2^e
  size_t act_f32;               // L1's output a: [S, I] fp32
  size_t a_codes, a_scales;  // a quantized: [S, I] e4m3, [S, I / 128] fp32 2^e
  size_t total;
};
W4a8WorkspaceLayout w4a8_workspace_layout(const MoeProblem& p);

// Both GEMMs' tiles (indices into kW4a8Tiles).
struct W4a8Config {
  int l1 = kW4a8TileNarrow32, l2 = kW4a8TileNarrow32;
  std::string to_string() const;
};
// The heuristic's choice at T tokens, from the slots per routed expert under uniform routing.
W4a8Config w4a8_heuristic(const MoeProblem& p, int64_t tokens);
// The heuristic's, or the tiles MoeTuning::l1_tile / l2_tile name (this row's names; any other
// is refused with kInvalidArgument listing them).
W4a8Config w4a8_config(const MoeProblem& p, const MoeTuning& tuning, int64_t tokens);
W4a8Config w4a8_config(const MoePlan& plan, int64_t tokens);

// Arguments already checked (check_run_args), T > 0, not gated.
void run_sm90_w4a8(const MoePlan& plan, const Sm90PrepackedWeights& weights, const MoeRunArgs& args,
                   cudaStream_t stream);
void load_w4a8_kernels();

}  // namespace megamoe::runtime
