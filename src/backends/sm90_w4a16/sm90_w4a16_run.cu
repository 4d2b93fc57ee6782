// The (sm_90, w4a16) row's launches: the shared dispatch, the two grouped GEMMs (or the fused
// launch) and the shared combine. Each GEMM's parameters are built by a function of their own from
// the run, the configuration for this T and the weights; launches only.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "backends/sm90_w4a16/sm90_w4a16_heuristics.h"
#include "backends/sm90_w4a16/sm90_w4a16_launch.h"
#include "backends/sm90_w4a16/sm90_w4a16_params.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_run.h"
#include "kernels/sm90/sm90_moe_tiny_schedule.cuh"
#include "runtime/sm90/sm90_moe_pipeline.h"

namespace megamoe::runtime {

namespace k90 = kernels::sm90;

namespace {

static_assert(kEarlyStartMaxSelections == k90::kTinyMaxSelections && kEarlyStartMaxSlots == k90::kTinyMaxSlots,
              "the heuristic's early-start limits must be the kernels' (sm90_moe_tiny_schedule.cuh)");

GemmSchedule schedule_of(const GemmConfig& c) { return {c.warpgroups, c.block_n, c.tile_step(), c.k_splits}; }

// Upper bound of a GEMM's work items, which sizes its grid (the exact count is known only on the
// device): at most min(E', slots) experts hold tokens, and an expert with c tokens has at most
// (c + step - 1) / step n-tiles. Tight at one token, so no CTA is launched only to find no work:
// extra CTAs crowd the first SMs the block scheduler fills, and the items then share fewer SMs.
int64_t max_work_items(const PipelineRun& r, const GemmConfig& c, int64_t m_tiles, int64_t tokens) {
  const int64_t slots = tokens * r.slots_per_token, active = std::min(r.virtual_experts, slots);
  const int64_t n_tiles = (slots + active * (c.tile_step() - 1)) / c.tile_step();
  return (m_tiles / c.warpgroups) * c.k_splits * n_tiles;
}

// The n-tiles per routed expert the kernels' pre-wait L2-cache prefetch (prefetch_guessed_item)
// assumes: T * k / E tokens each. Below one token per expert most guessed experts are empty, so
// the prefetch would fetch weights no item reads (and compete with the real loads): none.
int32_t guess_n_tiles(const PipelineRun& r, const GemmConfig& c, int64_t tokens) {
  const double per_expert = static_cast<double>(tokens) * r.problem.top_k / static_cast<double>(r.problem.num_experts);
  if (per_expert < 1.0) return 0;
  return static_cast<int32_t>(std::max<int64_t>(1, std::llround(per_expert / c.tile_step())));
}

// What both GEMMs read of the dispatch: the experts' slot ranges and the slots' tokens and
// routing weights.
void set_slots(k90::W4a16GemmParams& g, const PipelineRun& r, const k90::DispatchParams& d) {
  g.expert_offsets = d.expert_offsets;
  g.num_experts = static_cast<int32_t>(r.virtual_experts);
  g.num_routed = d.num_experts;
  g.slot_token = d.slot_token;
  g.slot_weight = d.slot_weight;
}

// L1: x · W13ᵀ gathered by slot, SwiGLU into act; zeroes the combine accumulator for L2.
k90::W4a16GemmParams l1_params(const PipelineRun& r, const MoeConfig& cfg, const Sm90PrepackedWeights& w,
                               const k90::DispatchParams& d, int64_t tokens) {
  const MoeProblem& p = r.problem;
  void* ws = r.args.workspace;
  k90::W4a16GemmParams g{};
  g.codes = w.w13_codes;
  g.scales = w.w13_scales;
  g.code_expert_stride = w.w13_code_stride;
  g.scale_expert_stride = w.w13_scale_stride;
  g.m_tiles = d.l1_m_tiles;
  g.k_chunks = static_cast<int32_t>(p.hidden_size / 64);
  // L1 split in K (sm90_w4a16_l1_split.h): equal slices (moe_config checks the split divides K).
  g.k_splits = cfg.l1.k_splits;
  g.k_chunks_per_split = g.k_chunks / g.k_splits;
  g.b_src = reinterpret_cast<const __nv_bfloat16*>(r.args.hidden);
  g.b_ld = p.hidden_size;
  g.tile_offsets = d.l1_tile_offsets;
  g.work_counter = d.counters + kL1WorkCounter;
  set_slots(g, r, d);
  // Early start knows its first L1 items exactly: no guess.
  g.guess_n_tiles = cfg.early_start ? 0 : guess_n_tiles(r, cfg.l1, tokens);
  g.s2_gate = w.s2;
  g.s2_up = w.s2 + r.virtual_experts;
  g.act = workspace_at<__nv_bfloat16>(ws, r.layout.act);
  g.act_ld = p.intermediate_size;
  g.swiglu_limit = p.swiglu_limit ? *p.swiglu_limit : std::numeric_limits<float>::infinity();
  g.zero_first = p.deterministic || r.dispatch_zeroes_accumulator ? nullptr : workspace_at<float>(ws, r.layout.out_acc);
  g.zero_count = g.zero_first != nullptr ? r.tokens * p.hidden_size : 0;
  g.topk_ids = cfg.early_start ? r.args.topk_ids : nullptr;
  g.tokens = d.tokens;
  g.top_k = d.top_k;
  g.shared_chunks = d.shared_chunks;
  if (g.k_splits > 1) {
    g.l1_partial = workspace_at<float>(ws, r.layout.l1_partial);
    g.l1_partial_slice = r.layout.l1_partial_slice;
    g.l1_arrivals = d.counters + counter_count(p);
  }
  return g;
}

// L2: act · W2ᵀ, scaled by the routing weight, added into the combine accumulator (or stored per
// slot for the deterministic combine).
k90::W4a16GemmParams l2_params(const PipelineRun& r, const MoeConfig& cfg, const Sm90PrepackedWeights& w,
                               const k90::DispatchParams& d, int64_t tokens) {
  const MoeProblem& p = r.problem;
  void* ws = r.args.workspace;
  k90::W4a16GemmParams g{};
  g.codes = w.w2_codes;
  g.scales = w.w2_scales;
  g.code_expert_stride = w.w2_code_stride;
  g.scale_expert_stride = w.w2_scale_stride;
  g.m_tiles = d.l2_m_tiles;
  g.k_chunks = static_cast<int32_t>(p.intermediate_size / 64);
  g.k_splits = cfg.l2.k_splits;
  g.k_chunks_per_split = (g.k_chunks + g.k_splits - 1) / g.k_splits;
  g.b_src = workspace_at<__nv_bfloat16>(ws, r.layout.act);
  g.b_ld = p.intermediate_size;
  g.tile_offsets = d.l2_tile_offsets;
  g.work_counter = d.counters + kL2WorkCounter;
  set_slots(g, r, d);
  g.guess_n_tiles = guess_n_tiles(r, cfg.l2, tokens);
  g.s2_down = w.s2 + 2 * r.virtual_experts;
  g.out_acc = p.deterministic ? nullptr : workspace_at<float>(ws, r.layout.out_acc);
  g.y_slot = p.deterministic ? workspace_at<float>(ws, r.layout.y_slot) : nullptr;
  g.out_ld = p.hidden_size;
  return g;
}

}  // namespace

void run_sm90_w4a16(const MoePlan& plan, const Sm90PrepackedWeights& w, const MoeRunArgs& args, cudaStream_t stream,
                    const GatedTokens* gated) {
  const MoeProblem& p = plan.problem();
  // Gated: configured for the tokens expected (the hint); the grids and the dispatch path for the
  // bound, args.tokens.
  const int64_t expected = gated != nullptr ? std::max<int64_t>(1, gated->hint) : args.tokens;
  MoeConfig cfg = moe_config(plan, expected);
  // Gated rows start early in the fused launch only (early_schedule_gated), with no shared
  // slices, and where the dispatch publishes its rows.
  if (gated != nullptr && (!cfg.fused || shared_chunks(p) != 0 || gated->gate.published == nullptr)) {
    cfg.early_start = false;
  }
  // A gated run's slots are known only on the device: L1 does not split K (the partial buffer and
  // the arrival counters the dispatch zeroes are sized by slots), and the grids (below) are sized
  // for the bound, args.tokens: sized for the hint, they ran the items of the rows past it in a
  // second wave, and the busiest rank, which the layer waits for, usually receives more. The
  // fused grid keeps the hint's cap on CTAs per SM: lifted, it measured slower
  // (docs/perf/2026-11-29-h200-w4a16-v45.md).
  if (gated != nullptr) cfg.l1.k_splits = 1;
  const WorkspaceLayout layout = workspace_layout(p);
  const PipelineRun r = PipelineRun::make(p, args, layout, cfg.early_start, gated ? &gated->gate : nullptr);

  const k90::DispatchParams d = dispatch_params(r, schedule_of(cfg.l1), schedule_of(cfg.l2));
  launch_dispatch(d, r.tokens * p.top_k, stream);

  const k90::W4a16GemmParams g1 = l1_params(r, cfg, w, d, expected);
  const k90::W4a16GemmParams g2 = l2_params(r, cfg, w, d, expected);
  const int64_t l1_work = max_work_items(r, cfg.l1, d.l1_m_tiles, args.tokens);
  const int64_t l2_work = max_work_items(r, cfg.l2, d.l2_m_tiles, args.tokens);
  if (cfg.fused) {
    k90::W4a16FusedParams f{};
    f.l1 = g1;
    f.l2 = g2;
    f.l1_tiles_done = d.counters + kL1DoneCounters;
    f.ctas_zeroed = d.counters + kCtasZeroedCounter;
    if (gated != nullptr && cfg.early_start) {
      f.gate.published = gated->gate.published;
      f.gate.epoch = gated->gate.epoch;
      // The dispatch publishes within its own bounded wait; twice that and a second more only
      // catch a broken invariant.
      f.gate.timeout_ns = 2 * gated->gate.failure.timeout_ns + 1000000000ull;
    }
    launch_w4a16_fused(cfg, f, {plan.num_sms(), l1_work + l2_work, stream, cfg.fused_ctas_per_sm});
  } else {
    launch_w4a16_gemm<true>(cfg.l1, g1, {plan.num_sms(), l1_work, stream});
    launch_w4a16_gemm<false>(cfg.l2, g2, {plan.num_sms(), l2_work, stream});
  }
  launch_combine(combine_params(r, d), plan.num_sms(), stream);
}

}  // namespace megamoe::runtime
