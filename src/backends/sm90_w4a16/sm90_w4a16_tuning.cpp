// MoeTuning's overrides of the (sm_90, w4a16) heuristic: tuned_moe_config runs the heuristic's
// steps with the overridden choices fixed, moe_config rejects an override that cannot run.
#include "backends/sm90_w4a16/sm90_w4a16_heuristics.h"
#include "megamoe/status.h"

namespace megamoe {

MoeConfig tuned_moe_config(const MoeProblem& problem, int64_t tokens, int num_sms, const MoeTuning& tuning) {
  MoeConfig cfg = heuristic::width_tiles(problem, tokens);
  DecodeTileCounts tiles(problem, tokens);
  if (tuning.fused) {
    // On the tile width_tiles chose; a fused launch keeps the 16-token tile.
    cfg.fused = *tuning.fused && cfg.can_fuse();
    heuristic::widen_unfused_decode(cfg, tiles);
  } else {
    cfg.fused = heuristic::fuse_decode16(problem, num_sms, cfg, tiles);
    heuristic::widen_unfused_decode(cfg, tiles);
    if (!cfg.fused) cfg.fused = heuristic::fuse_decode32(problem, num_sms, cfg, tiles);
  }
  cfg.l2.k_splits = heuristic::l2_k_splits(problem, tokens);
  cfg.early_start = can_start_early(problem, tokens);
  if (!tuning.absorbing_tile && heuristic::absorbing_pays(problem, tokens, cfg)) {
    cfg.l1 = kAbsorbingTile;
    cfg.l2 = kAbsorbingTile;
  }
  heuristic::overlap_prefill(problem, tokens, cfg);
  // The absorbing tile at any T: two launches, no early start; L2 keeps its K slices.
  if (tuning.absorbing_tile && *tuning.absorbing_tile && can_absorb(problem)) {
    const int l2_k_splits = cfg.l2.k_splits;
    cfg.l1 = kAbsorbingTile;
    cfg.l2 = kAbsorbingTile;
    cfg.l2.k_splits = l2_k_splits;
    cfg.fused = false;
    cfg.early_start = false;
  }
  if (tuning.early_start) cfg.early_start = *tuning.early_start;
  return cfg;
}

MoeConfig moe_config(const MoePlan& plan, int64_t tokens) {
  const MoeProblem& p = plan.problem();
  const MoeTuning& tuning = plan.tuning();
  if (tuning.absorbing_tile && *tuning.absorbing_tile) {
    MEGAMOE_CHECK(can_absorb(p), kInvalidArgument, "MoeTuning.absorbing_tile: its 256-row blocks need 2I and H multiples of 256; "
                  "this layer has I=", p.intermediate_size, ", H=", p.hidden_size);
    MEGAMOE_CHECK(!tuning.fused || !*tuning.fused, kInvalidArgument,
                  "MoeTuning.absorbing_tile runs two launches: it cannot be set with MoeTuning.fused = true");
    MEGAMOE_CHECK(!tuning.early_start || !*tuning.early_start, kInvalidArgument,
                  "MoeTuning.absorbing_tile has no early start: it cannot be set with MoeTuning.early_start = true");
  }
  const MoeConfig cfg = tuned_moe_config(p, tokens, plan.num_sms(), tuning);
  MEGAMOE_CHECK(!tuning.fused || !*tuning.fused || cfg.fused, kInvalidArgument,
                "MoeTuning.fused: the fused launch is built for the 16- and 32-token decode tiles (",
                kFusedTile.to_string(), ", ", kFusedTile32.to_string(), ") in both GEMMs, up to 24 tokens per expert; at T=",
                tokens, " the heuristic picks ", cfg.to_string());
  MEGAMOE_CHECK(!tuning.early_start || !*tuning.early_start || can_start_early(p, tokens), kInvalidArgument,
                "MoeTuning.early_start: early start holds up to ", kEarlyStartMaxSelections,
                " routed selections (T * top_k) and ", kEarlyStartMaxSlots,
                " slots (T * (top_k + shared slices)); T=", tokens, " has more");
  return cfg;
}

}  // namespace megamoe
