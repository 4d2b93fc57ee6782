// MoePlan: the problem's validation, the workspace it sizes for max_tokens, and the configuration
// each run uses (the heuristic with the plan's tuning overrides). Host code only.
#include <cmath>
#include <limits>
#include <sstream>

#include "kernels/sm90/sm90_moe_dispatch_limits.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "megamoe/gpu.h"
#include "runtime/sm90_moe_heuristics.h"
#include "runtime/sm90_moe_workspace.h"

namespace megamoe {

using gpu::check_cuda;

MoeProblem MoeProblem::from_layer(const MoeLayer& layer, int64_t max_tokens) {
  MoeProblem p;
  p.hidden_size = layer.hidden_size;
  p.intermediate_size = layer.intermediate_size;
  p.num_experts = layer.num_experts;
  p.top_k = layer.routing.top_k;
  p.shared_intermediate_size = layer.shared_expert ? layer.shared_expert->intermediate_size() : 0;
  p.max_tokens = max_tokens;
  p.swiglu_limit = layer.swiglu_limit;
  return p;
}

namespace runtime {

void validate_problem(const MoeProblem& p) {
  MEGAMOE_CHECK(p.hidden_size > 0 && p.hidden_size % 64 == 0, kUnsupported,
                "MoePlan: hidden_size = ", p.hidden_size,
                " is not supported; the sm90 kernels need a positive multiple of 64");
  MEGAMOE_CHECK(p.intermediate_size > 0 && p.intermediate_size % 64 == 0, kUnsupported,
                "MoePlan: intermediate_size = ", p.intermediate_size,
                " is not supported; the sm90 kernels need a positive multiple of 64");
  MEGAMOE_CHECK(p.num_experts >= 1 && p.num_experts <= 1024, kUnsupported,
                "MoePlan: num_experts = ", p.num_experts, " is outside the supported 1..1024");
  MEGAMOE_CHECK(p.top_k >= 1 && p.top_k <= std::min<int64_t>(p.num_experts, 16), kInvalidArgument,
                "MoePlan: top_k = ", p.top_k, " must be in 1..min(num_experts, 16)");
  MEGAMOE_CHECK(p.shared_intermediate_size >= 0 &&
                    p.shared_intermediate_size % p.intermediate_size == 0 &&
                    shared_chunks(p) <= 8,
                kUnsupported, "MoePlan: shared_intermediate_size = ", p.shared_intermediate_size,
                " must be 0 or a multiple (at most 8x) of intermediate_size = ",
                p.intermediate_size);
  MEGAMOE_CHECK(p.max_tokens >= 0 && p.max_tokens <= (int64_t{1} << 20), kInvalidArgument,
                "MoePlan: max_tokens = ", p.max_tokens, " must be in 0..1048576");
  MEGAMOE_CHECK(p.max_tokens * slots_per_token(p) < std::numeric_limits<int32_t>::max(),
                kInvalidArgument, "MoePlan: max_tokens * (top_k + shared slices) overflows int32");
  MEGAMOE_CHECK(!p.swiglu_limit || (std::isfinite(*p.swiglu_limit) && *p.swiglu_limit > 0),
                kInvalidArgument, "MoePlan: swiglu_limit must be finite and positive");
  // A precision this build cannot run fails here, at plan time, whatever T (kAuto never does).
  (void)resolve_precision(p, p.max_tokens);
}

WorkspaceLayout workspace_layout(const MoeProblem& p) {
  WorkspaceLayout w{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += (bytes + 255) / 256 * 256;
    return at;
  };
  const size_t ev = static_cast<size_t>(virtual_experts(p)) + 1;
  const size_t slots = static_cast<size_t>(p.max_tokens * slots_per_token(p));
  w.expert_offsets = take(ev * 4);
  w.l1_tiles = take(ev * 4);
  w.l2_tiles = take(ev * 4);
  w.invalid = take(4);
  w.counters = take(static_cast<size_t>(counter_count(p)) * 4);
  // The multi-CTA dispatch's per-CTA expert counts (large T only).
  w.cta_counts = take(static_cast<size_t>(kernels::sm90::kDispatchMaxCtas) * static_cast<size_t>(p.num_experts) * 4);
  w.cta_invalid = take(static_cast<size_t>(kernels::sm90::kDispatchMaxCtas) * 4);
  w.slot_token = take(slots * 4);
  w.slot_weight = take(slots * 4);
  w.token_slot = take(slots * 4);
  w.act = take(slots * static_cast<size_t>(p.intermediate_size) * 2);
  w.out_acc = p.deterministic ? off : take(static_cast<size_t>(p.max_tokens * p.hidden_size) * 4);
  w.y_slot = p.deterministic ? take(slots * static_cast<size_t>(p.hidden_size) * 4) : off;
  w.total = off;
  return w;
}

}  // namespace runtime

MoePlan MoePlan::create(const MoeProblem& problem, const MoeTuning& tuning) {
  runtime::validate_problem(problem);
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  MEGAMOE_CHECK(prop.major == 9 && prop.minor == 0, kUnsupported, "MoePlan: device ", device, " (",
                prop.name, ", sm_", prop.major, prop.minor,
                ") is not supported; this build runs on Hopper (sm_90: H100/H200) only");
  MoePlan plan;
  plan.problem_ = problem;
  plan.tuning_ = tuning;
  plan.num_sms_ = prop.multiProcessorCount;
  return plan;
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
  // The heuristic applies tuning.fused and tuning.absorbing_tile itself (its tile choice
  // depends on the launch; without the absorbing tile it picks another prefill tile).
  MoeConfig cfg = choose_moe_config(p, tokens, plan.num_sms(), tuning.fused, tuning.absorbing_tile);
  MEGAMOE_CHECK(!tuning.fused || !*tuning.fused || cfg.fused, kInvalidArgument,
                "MoeTuning.fused: the fused launch is built for the 16- and 32-token decode tiles (",
                kFusedTile.to_string(), ", ", kFusedTile32.to_string(), ") in both GEMMs, up to 24 tokens per expert; at T=",
                tokens, " the heuristic picks ", cfg.to_string());
  if (tuning.early_start) {
    MEGAMOE_CHECK(!*tuning.early_start || can_start_early(p, tokens), kInvalidArgument,
                  "MoeTuning.early_start: early start holds up to ", kEarlyStartMaxSelections,
                  " routed selections (T * top_k) and ", kEarlyStartMaxSlots,
                  " slots (T * (top_k + shared slices)); T=", tokens, " has more");
    cfg.early_start = *tuning.early_start;
  }
  return cfg;
}

size_t MoePlan::workspace_bytes() const { return runtime::workspace_layout(problem_).total; }

std::string MoePlan::describe(int64_t tokens) const {
  const MoeConfig cfg = moe_config(*this, tokens);
  std::ostringstream os;
  os << "T=" << tokens << " " << precision_name(cfg.precision)
     << (problem_.precision == Precision::kAuto ? " (auto)" : "") << " " << cfg.to_string()
     << (problem_.deterministic ? " deterministic" : " atomic-combine");
  return os.str();
}

Precision MoePlan::resolved_precision(int64_t tokens) const { return resolve_precision(problem_, tokens); }

int64_t MoePlan::invalid_id_count(const void* workspace, cudaStream_t stream) const {
  int32_t count = 0;
  const auto layout = runtime::workspace_layout(problem_);
  check_cuda(cudaMemcpyAsync(&count, static_cast<const uint8_t*>(workspace) + layout.invalid, 4,
                             cudaMemcpyDeviceToHost, stream),
             "cudaMemcpyAsync(invalid id count)");
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return count;
}

}  // namespace megamoe
