// The configuration heuristic of the sm90 MoE pipeline: a pure function of the problem, the
// token count and the device's SM count (printable with MoeConfig::to_string). Internal to the
// library: users see it through MoePlan::describe and override it with MoeTuning.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "megamoe/runtime.h"
#include "runtime/sm90_w4a16_tiles.h"

namespace megamoe {

struct MoeConfig {
  Precision precision = Precision::kW4a16;  // resolved: never kAuto (resolve_precision)
  GemmConfig l1;             // x · W13ᵀ + SwiGLU
  GemmConfig l2;             // a · W2ᵀ + combine
  bool fused = false;        // L1 and L2 in one persistent launch (needs can_fuse)
  bool early_start = false;  // L1's first items start before the dispatch completes (tiny T)
  std::string to_string() const;  // tiles and launch; MoePlan::describe adds the precision
  // Whether both GEMMs run the same tile (K slices aside) and that tile has a fused kernel
  // (kFusedTile or kFusedTile32), so that they may run fused.
  bool can_fuse() const;
};

// The precision a run of `tokens` tokens uses: the one place the choice is made. MoePlan::create
// calls it to validate the problem, choose_moe_config to fill MoeConfig::precision (which run()
// and MoePlan::describe read). kW4a16 as asked. kW4a8 throws megamoe::Error(kUnsupported) at
// every T: this build has no W4A8 kernel. kAuto resolves to kW4a16 at every T until that kernel
// and its measured per-T rule (issue 38) plug in here; it never throws for a valid problem.
// A value outside the enum throws kInvalidArgument.
Precision resolve_precision(const MoeProblem& problem, int64_t tokens);

// Early start (a tiny batch's L1 CTAs compute their first work item from the top-k ids and run it
// while the dispatch kernel still runs) holds up to this many routed selections (T * k: one per
// lane of a warp) and slots (T * (k + shared slices)).
inline constexpr int64_t kEarlyStartMaxSelections = 32;
inline constexpr int64_t kEarlyStartMaxSlots = 64;

// Whether a batch of `tokens` is small enough for early start.
bool can_start_early(const MoeProblem& problem, int64_t tokens);

// Whether both GEMMs can run the absorbing tile (kAbsorbingTile): 2I and H multiples of its
// 256-row blocks.
bool can_absorb(const MoeProblem& problem);

// The heuristic. `fused`, where set, replaces its choice of launch (MoeTuning::fused) before the
// tiles that depend on it are chosen: two launches may take a wider decode tile than the fused
// launch's. `absorbing_tile` (MoeTuning::absorbing_tile): true runs both GEMMs on the absorbing
// tile where can_absorb (moe_config rejects the rest); false leaves it out, for the tile the
// heuristic picks without it.
MoeConfig choose_moe_config(const MoeProblem& problem, int64_t tokens, int num_sms = 132,
                            std::optional<bool> fused = std::nullopt,
                            std::optional<bool> absorbing_tile = std::nullopt);

// The configuration run() uses for T tokens under `plan`: the heuristic's, with the plan's tuning
// overrides. Throws megamoe::Error(kInvalidArgument) when an override cannot run at this T.
MoeConfig moe_config(const MoePlan& plan, int64_t tokens);

}  // namespace megamoe
