// Tensor parallelism (TP) of a MoE layer: rank r of R holds a slice of every expert's intermediate
// dimension and sees every token. For every routed expert (I) and for the shared expert (its own
// Is, sliced the same way) it holds
//   gate_proj, up_proj  rows    [r·I/R, (r+1)·I/R) of [I, H]  (codes [I/R, H/2], scales [I/R, H/16])
//   down_proj           columns [r·I/R, (r+1)·I/R) of [H, I]  (codes [H, I/(2R)], scales [H, I/(16R)])
// with the global scales, input scales, router and routing configuration unchanged, so every rank
// routes every token the same way. A rank's layer gives a partial output, kept in fp32
// (MoeRunArgs::output_f32; reference::moe_forward_f32 on the CPU); the layer's output is the sum
// of the R partials rounded to bf16 once (reference::tp_combine). Summing the partials across
// ranks is the caller's. Why that sum is the layer, and its numerics: docs/design.md §7.1.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "megamoe/moe.h"

namespace megamoe {

// The ranks of one host (as expert parallelism: EpConfig::world_size).
inline constexpr int kTpMaxRanks = 8;
// I/R (and Is/R) must be a multiple of this: MoePlan's rule for intermediate_size (stricter than
// the 16 of the NVFP4 format; docs/design.md §7.1).
inline constexpr int64_t kTpSliceMultiple = 64;

struct TpConfig {
  int world_size = 1;  // R, 1..kTpMaxRanks
  int rank = 0;        // this rank, 0..R-1
};

// The intermediate rows [first, first + count) one rank holds of a dimension of size `size`.
struct TpRange {
  int64_t first = 0;
  int64_t count = 0;
};

// Rank tp.rank's share of an intermediate dimension (I of the routed experts, or Is of the shared
// expert; `what` names it in errors). Throws megamoe::Error(kInvalidArgument) naming the values
// when the world size is outside 1..kTpMaxRanks, the rank outside 0..R-1, `size` is not a multiple
// of R, or size/R is not a multiple of kTpSliceMultiple.
TpRange tp_range(int64_t size, const TpConfig& tp, const char* what = "intermediate_size");

// Rank tp.rank's slice of every expert of `layer` (see the top of this file). intermediate_size
// becomes I/R; router, correction bias, routing and clamp are copied unchanged. gate and up are
// views into `layer`'s bytes (no copy, `owner` shared); down's K slice, strided there, is copied
// into an owned buffer of H·I/(2R) + H·I/(16R) bytes per expert (droppable once uploaded).
// Throws megamoe::Error(kInvalidArgument): an invalid layer (MoeLayer::validate) or tp_range's
// errors for I or the shared expert's Is.
MoeLayer tp_local_layer(const MoeLayer& layer, const TpConfig& tp);

}  // namespace megamoe
