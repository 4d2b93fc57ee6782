// run(): one MoE layer on the device, dispatch -> L1 grouped GEMM (+SwiGLU) -> L2 grouped GEMM
// (+combine) -> bf16 output. Each kernel's parameters are built by a function of its own from the
// plan's problem, the configuration for this T, the weights and the workspace; launches only.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/sm90/sm90_moe_combine.cuh"
#include "kernels/sm90/sm90_moe_dispatch.cuh"
#include "kernels/sm90/sm90_moe_tiny_schedule.cuh"
#include "kernels/sm90/sm90_w4a16_params.cuh"
#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "megamoe/gpu.h"
#include "runtime/sm90_launch_util.h"
#include "runtime/sm90_moe_device_weights.h"
#include "runtime/sm90_moe_heuristics.h"
#include "runtime/sm90_moe_workspace.h"
#include "runtime/sm90_w4a16_launch.h"

namespace megamoe {

namespace k90 = kernels::sm90;
using gpu::check_cuda;

namespace {

using runtime::workspace_at;

static_assert(kEarlyStartMaxSelections == k90::kTinyMaxSelections && kEarlyStartMaxSlots == k90::kTinyMaxSlots,
              "the heuristic's early-start limits must be the kernels' (sm90_moe_tiny_schedule.cuh)");

// Everything the parameter builders read.
struct RunContext {
  const MoeProblem& p;
  const MoeConfig& cfg;
  const DeviceWeightsAccess::Impl& w;
  const MoeRunArgs& args;
  const runtime::WorkspaceLayout& layout;
  int64_t T, EV, slots_per_token;
  // With early start the dispatch is off the critical path, and zeroes the combine accumulator
  // itself: the fused launch's L2 items then need no hand-off from every CTA's zeroing (which
  // early start would delay to each CTA's first wait for the dispatch).
  bool dispatch_zeroes;
};

k90::DispatchParams dispatch_params(const RunContext& r) {
  const MoeProblem& p = r.p;
  void* ws = r.args.workspace;
  const auto& L = r.layout;
  k90::DispatchParams d{};
  d.topk_ids = r.args.topk_ids;
  d.topk_weights = r.args.topk_weights;
  d.tokens = static_cast<int32_t>(r.T);
  d.top_k = p.top_k;
  d.num_experts = static_cast<int32_t>(p.num_experts);
  d.shared_chunks = static_cast<int32_t>(runtime::shared_chunks(p));
  d.l1_m_tiles = static_cast<int32_t>(2 * p.intermediate_size / 64);
  d.l2_m_tiles = static_cast<int32_t>(p.hidden_size / 64);
  d.l1_block_m_tiles = r.cfg.l1.warpgroups;
  d.l2_block_m_tiles = r.cfg.l2.warpgroups;
  d.l1_block_n = r.cfg.l1.block_n;
  d.l2_block_n = r.cfg.l2.block_n;
  d.l1_tile_step = r.cfg.l1.tile_step();
  d.l2_tile_step = r.cfg.l2.tile_step();
  d.l2_k_splits = r.cfg.l2.k_splits;
  d.expert_offsets = workspace_at<int32_t>(ws, L.expert_offsets);
  d.l1_tile_offsets = workspace_at<int32_t>(ws, L.l1_tiles);
  d.l2_tile_offsets = workspace_at<int32_t>(ws, L.l2_tiles);
  d.slot_token = workspace_at<int32_t>(ws, L.slot_token);
  d.slot_weight = workspace_at<float>(ws, L.slot_weight);
  d.token_slot = workspace_at<int32_t>(ws, L.token_slot);
  d.invalid_ids = workspace_at<int32_t>(ws, L.invalid);
  d.counters = workspace_at<int32_t>(ws, L.counters);
  d.counter_count = static_cast<int32_t>(runtime::counter_count(p));
  d.cta_counts = workspace_at<int32_t>(ws, L.cta_counts);
  d.cta_invalid = workspace_at<int32_t>(ws, L.cta_invalid);
  d.zero_first = r.dispatch_zeroes ? workspace_at<float>(ws, L.out_acc) : nullptr;
  d.zero_count = r.dispatch_zeroes ? r.T * p.hidden_size : 0;
  return d;
}

// The dispatch is launched without programmatic serialization: it starts once everything before
// it on the stream has completed. The L1 GEMM relies on it to zero the combine accumulator before
// its own dependency wait (the previous run's combine reads it).
void launch_dispatch(k90::DispatchParams d, int64_t selections, cudaStream_t stream) {
  if (selections <= k90::kDispatchSingleCtaItems) {
    k90::moe_dispatch_kernel<<<1, k90::kDispatchThreads, k90::kDispatchStageBytes, stream>>>(d);
    check_cuda(cudaGetLastError(), "moe_dispatch_kernel launch");
    return;
  }
  // At least kDispatchThreads selections per CTA, whole tokens, no empty CTA.
  const int64_t T = d.tokens;
  const int64_t want =
      std::min<int64_t>(k90::kDispatchMaxCtas, (selections + k90::kDispatchThreads - 1) / k90::kDispatchThreads);
  const int64_t tokens_per_cta = (T + want - 1) / want;
  const int64_t ctas = (T + tokens_per_cta - 1) / tokens_per_cta;
  d.tokens_per_cta = static_cast<int32_t>(tokens_per_cta);
  k90::moe_dispatch_count_kernel<<<static_cast<unsigned>(ctas), k90::kDispatchThreads, 0, stream>>>(d);
  check_cuda(cudaGetLastError(), "moe_dispatch_count_kernel launch");
  runtime::launch_dependent(&k90::moe_dispatch_place_kernel, static_cast<unsigned>(ctas), k90::kDispatchThreads, 0,
                            stream, d);
}

// Upper bound of a GEMM's work items, which sizes its grid (the exact count is known only on the
// device): at most min(E', slots) experts hold tokens, and an expert with c tokens has at most
// (c + step - 1) / step n-tiles. Tight at one token, so no CTA is launched only to find no work:
// extra CTAs crowd the first SMs the block scheduler fills, and the items then share fewer SMs.
int64_t max_work_items(const RunContext& r, const GemmConfig& c, int64_t m_tiles) {
  const int64_t slots = r.T * r.slots_per_token, active = std::min(r.EV, slots);
  const int64_t n_tiles = (slots + active * (c.tile_step() - 1)) / c.tile_step();
  return (m_tiles / c.warpgroups) * c.k_splits * n_tiles;
}

// The n-tiles per routed expert the kernels' pre-wait L2-cache prefetch (prefetch_guessed_item)
// assumes: T * k / E tokens each. Below one token per expert most guessed experts are empty, so
// the prefetch would fetch weights no item reads (and compete with the real loads): none.
int32_t guess_n_tiles(const RunContext& r, const GemmConfig& c) {
  const double per_expert = static_cast<double>(r.T) * r.p.top_k / static_cast<double>(r.p.num_experts);
  if (per_expert < 1.0) return 0;
  return static_cast<int32_t>(std::max<int64_t>(1, std::llround(per_expert / c.tile_step())));
}

// L1: x · W13ᵀ gathered by slot, SwiGLU into act; zeroes the combine accumulator for L2.
k90::W4a16GemmParams l1_params(const RunContext& r, const k90::DispatchParams& d) {
  const MoeProblem& p = r.p;
  void* ws = r.args.workspace;
  k90::W4a16GemmParams g{};
  g.codes = r.w.w13_codes;
  g.scales = r.w.w13_scales;
  g.code_expert_stride = r.w.w13_code_stride;
  g.scale_expert_stride = r.w.w13_scale_stride;
  g.m_tiles = d.l1_m_tiles;
  g.k_chunks = static_cast<int32_t>(p.hidden_size / 64);
  g.k_splits = 1;
  g.k_chunks_per_split = g.k_chunks;
  g.s2_a = r.w.s2;
  g.s2_b = r.w.s2 + r.EV;
  g.b_src = reinterpret_cast<const __nv_bfloat16*>(r.args.hidden);
  g.b_ld = p.hidden_size;
  g.expert_offsets = d.expert_offsets;
  g.tile_offsets = d.l1_tile_offsets;
  g.work_counter = d.counters + runtime::kL1WorkCounter;
  g.num_experts = static_cast<int32_t>(r.EV);
  g.slot_token = d.slot_token;
  g.slot_weight = d.slot_weight;
  g.act = workspace_at<__nv_bfloat16>(ws, r.layout.act);
  g.act_ld = p.intermediate_size;
  g.swiglu_limit = p.swiglu_limit ? *p.swiglu_limit : std::numeric_limits<float>::infinity();
  g.zero_first = p.deterministic || r.dispatch_zeroes ? nullptr : workspace_at<float>(ws, r.layout.out_acc);
  g.zero_count = g.zero_first != nullptr ? r.T * p.hidden_size : 0;
  g.topk_ids = r.cfg.early_start ? r.args.topk_ids : nullptr;
  g.tokens = d.tokens;
  g.top_k = d.top_k;
  g.num_routed = d.num_experts;
  g.shared_chunks = d.shared_chunks;
  // Early start knows its first L1 items exactly: no guess.
  g.guess_n_tiles = r.cfg.early_start ? 0 : guess_n_tiles(r, r.cfg.l1);
  return g;
}

// L2: act · W2ᵀ, scaled by the routing weight, added into the combine accumulator (or stored per
// slot for the deterministic combine).
k90::W4a16GemmParams l2_params(const RunContext& r, const k90::DispatchParams& d, const k90::W4a16GemmParams& l1) {
  const MoeProblem& p = r.p;
  void* ws = r.args.workspace;
  k90::W4a16GemmParams g = l1;  // the schedule, slots and routing fields are shared
  g.codes = r.w.w2_codes;
  g.scales = r.w.w2_scales;
  g.code_expert_stride = r.w.w2_code_stride;
  g.scale_expert_stride = r.w.w2_scale_stride;
  g.m_tiles = d.l2_m_tiles;
  g.k_chunks = static_cast<int32_t>(p.intermediate_size / 64);
  g.k_splits = r.cfg.l2.k_splits;
  g.k_chunks_per_split = (g.k_chunks + g.k_splits - 1) / g.k_splits;
  g.s2_a = r.w.s2 + 2 * r.EV;
  g.s2_b = nullptr;
  g.b_src = workspace_at<__nv_bfloat16>(ws, r.layout.act);
  g.b_ld = p.intermediate_size;
  g.tile_offsets = d.l2_tile_offsets;
  g.work_counter = d.counters + runtime::kL2WorkCounter;
  g.act = nullptr;
  g.out_acc = p.deterministic ? nullptr : workspace_at<float>(ws, r.layout.out_acc);
  g.y_slot = p.deterministic ? workspace_at<float>(ws, r.layout.y_slot) : nullptr;
  g.out_ld = p.hidden_size;
  g.zero_first = nullptr;
  g.zero_count = 0;
  g.topk_ids = nullptr;
  g.guess_n_tiles = guess_n_tiles(r, r.cfg.l2);
  return g;
}

// The combine: the fp32 accumulator (or the per-slot outputs in top-k order) to bf16.
k90::CombineParams combine_params(const RunContext& r, const k90::DispatchParams& d, const k90::W4a16GemmParams& l2) {
  k90::CombineParams c{};
  c.out_acc = l2.out_acc;
  c.y_slot = l2.y_slot;
  c.token_slot = d.token_slot;
  c.slot_weight = d.slot_weight;
  c.slots_per_token = static_cast<int32_t>(r.slots_per_token);
  c.tokens = r.T;
  c.hidden = r.p.hidden_size;
  c.out = reinterpret_cast<__nv_bfloat16*>(r.args.output);
  c.out_f32 = r.args.output_f32;
  return c;
}

void check_run_args(const MoePlan& plan, const DeviceWeightsAccess::Impl& w, const MoeRunArgs& args) {
  const MoeProblem& p = plan.problem();
  MEGAMOE_CHECK(w.shape.hidden_size == p.hidden_size && w.shape.intermediate_size == p.intermediate_size &&
                    w.shape.num_experts == p.num_experts &&
                    w.shape.shared_intermediate_size == p.shared_intermediate_size,
                kInvalidArgument, "run: the weights (H=", w.shape.hidden_size, ", I=",
                w.shape.intermediate_size, ", E=", w.shape.num_experts, ", shared I=",
                w.shape.shared_intermediate_size, ") do not match the plan (H=", p.hidden_size,
                ", I=", p.intermediate_size, ", E=", p.num_experts, ", shared I=",
                p.shared_intermediate_size, ")");
  MEGAMOE_CHECK(args.tokens >= 0 && args.tokens <= p.max_tokens, kInvalidArgument, "run: tokens = ",
                args.tokens, " must be in 0..max_tokens = ", p.max_tokens);
  if (args.tokens == 0) return;
  MEGAMOE_CHECK(args.hidden && args.topk_ids && args.topk_weights && args.workspace, kInvalidArgument,
                "run: hidden, topk_ids, topk_weights and workspace must be device pointers, not null");
  MEGAMOE_CHECK((args.output != nullptr) != (args.output_f32 != nullptr), kInvalidArgument,
                "run: give exactly one of output (bf16) and output_f32 (fp32)");
  const void* out = args.output != nullptr ? static_cast<const void*>(args.output) : args.output_f32;
  MEGAMOE_CHECK(reinterpret_cast<uintptr_t>(args.hidden) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(args.workspace) % 256 == 0,
                kInvalidArgument, "run: hidden and output must be 16-byte aligned, workspace 256-byte aligned");
}

}  // namespace

void run(const MoePlan& plan, const MoeDeviceWeights& weights, const MoeRunArgs& args, cudaStream_t stream) {
  const MoeProblem& p = plan.problem();
  const auto& w = DeviceWeightsAccess::get(weights);
  check_run_args(plan, w, args);
  if (args.tokens == 0) return;

  const MoeConfig cfg = moe_config(plan, args.tokens);
  // Every launch below is W4A16's; resolve_precision gives nothing else until a W4A8 kernel exists.
  MEGAMOE_CHECK(cfg.precision == Precision::kW4a16, kInternal, "run: precision ", precision_name(cfg.precision),
                " has no launcher in this build");
  const runtime::WorkspaceLayout layout = runtime::workspace_layout(p);
  const RunContext r{p,
                     cfg,
                     w,
                     args,
                     layout,
                     args.tokens,
                     runtime::virtual_experts(p),
                     runtime::slots_per_token(p),
                     cfg.early_start && !p.deterministic};

  const k90::DispatchParams d = dispatch_params(r);
  launch_dispatch(d, r.T * p.top_k, stream);

  const k90::W4a16GemmParams g1 = l1_params(r, d);
  const k90::W4a16GemmParams g2 = l2_params(r, d, g1);
  const int64_t l1_work = max_work_items(r, cfg.l1, d.l1_m_tiles), l2_work = max_work_items(r, cfg.l2, d.l2_m_tiles);
  if (cfg.fused) {
    k90::W4a16FusedParams f{};
    f.l1 = g1;
    f.l2 = g2;
    f.l1_tiles_done = d.counters + runtime::kL1DoneCounters;
    f.ctas_zeroed = d.counters + runtime::kCtasZeroedCounter;
    runtime::launch_w4a16_fused(cfg, f, {plan.num_sms(), l1_work + l2_work, stream});
  } else {
    runtime::launch_w4a16_gemm<true>(cfg.l1, g1, {plan.num_sms(), l1_work, stream});
    runtime::launch_w4a16_gemm<false>(cfg.l2, g2, {plan.num_sms(), l2_work, stream});
  }

  const k90::CombineParams c = combine_params(r, d, g2);
  const int64_t vecs = r.T * p.hidden_size / 8;
  const int64_t blocks = std::min<int64_t>((vecs + 255) / 256, int64_t{plan.num_sms()} * 8);
  runtime::launch_dependent(&k90::moe_combine_kernel, static_cast<unsigned>(blocks), 256, 0, stream, c);
}

}  // namespace megamoe
