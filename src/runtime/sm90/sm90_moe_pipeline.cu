// The dispatch and combine launches every sm90 row shares (sm90_moe_pipeline.h).
#include "runtime/sm90/sm90_moe_pipeline.h"

#include <algorithm>

#include "kernels/sm90/sm90_moe_combine.cuh"
#include "kernels/sm90/sm90_moe_dispatch.cuh"
#include "megamoe/gpu.h"
#include "runtime/sm90/sm90_launch_util.h"

namespace megamoe::runtime {

namespace k90 = kernels::sm90;

PipelineRun PipelineRun::make(const MoeProblem& problem, const MoeRunArgs& args, const WorkspaceLayout& layout,
                              bool early_start, const TokenGate* gate) {
  MEGAMOE_CHECK(gate == nullptr || problem.deterministic, kInternal, "a gated run needs a deterministic plan");
  return PipelineRun{problem,
                     args,
                     layout,
                     args.tokens,
                     runtime::virtual_experts(problem),
                     runtime::slots_per_token(problem),
                     early_start && !problem.deterministic,
                     gate};
}

k90::DispatchParams dispatch_params(const PipelineRun& r, const GemmSchedule& l1, const GemmSchedule& l2) {
  const MoeProblem& p = r.problem;
  void* ws = r.args.workspace;
  const WorkspaceLayout& L = r.layout;
  k90::DispatchParams d{};
  d.topk_ids = r.args.topk_ids;
  d.topk_weights = r.args.topk_weights;
  d.tokens = static_cast<int32_t>(r.tokens);
  d.top_k = p.top_k;
  d.num_experts = static_cast<int32_t>(p.num_experts);
  d.shared_chunks = static_cast<int32_t>(shared_chunks(p));
  d.l1_m_tiles = static_cast<int32_t>(2 * p.intermediate_size / 64);
  d.l2_m_tiles = static_cast<int32_t>(p.hidden_size / 64);
  d.l1_block_m_tiles = l1.block_m_tiles;
  d.l2_block_m_tiles = l2.block_m_tiles;
  d.l1_block_n = l1.block_n;
  d.l2_block_n = l2.block_n;
  d.l1_tile_step = l1.tile_step;
  d.l2_tile_step = l2.tile_step;
  d.l1_k_splits = l1.k_splits;
  d.l2_k_splits = l2.k_splits;
  d.expert_offsets = workspace_at<int32_t>(ws, L.expert_offsets);
  d.l1_tile_offsets = workspace_at<int32_t>(ws, L.l1_tiles);
  d.l2_tile_offsets = workspace_at<int32_t>(ws, L.l2_tiles);
  d.slot_token = workspace_at<int32_t>(ws, L.slot_token);
  d.slot_weight = workspace_at<float>(ws, L.slot_weight);
  d.token_slot = workspace_at<int32_t>(ws, L.token_slot);
  d.invalid_ids = workspace_at<int32_t>(ws, L.invalid);
  d.counters = workspace_at<int32_t>(ws, L.counters);
  // L1 split in K: its arrival counters follow the others, zeroed for this run's slots.
  d.counter_count = static_cast<int32_t>(
      counter_count(p) + (l1.k_splits > 1 ? l1_split_counters(p, r.tokens * r.slots_per_token) : 0));
  MEGAMOE_CHECK(l1.k_splits == 1 || r.tokens * r.slots_per_token <= l1_split_slots(p), kInternal,
                "L1 split in K at ", r.tokens * r.slots_per_token, " slots; the workspace holds ", l1_split_slots(p));
  d.cta_counts = workspace_at<int32_t>(ws, L.cta_counts);
  d.cta_invalid = workspace_at<int32_t>(ws, L.cta_invalid);
  d.zero_first = r.dispatch_zeroes_accumulator ? workspace_at<float>(ws, L.out_acc) : nullptr;
  d.zero_count = r.dispatch_zeroes_accumulator ? r.tokens * p.hidden_size : 0;
  if (r.gate != nullptr) d.gate = *r.gate;
  return d;
}

namespace {

// A gated dispatch is launched programmatically: it reads nothing the kernel before it writes
// (the exchange's send, or the shared expert's kernels, whose workspace is its own) but what its
// gate acquires from the signal words, so it starts its wait while that kernel still runs; it
// waits for that kernel before it ends, so that the kernels after it, which wait for it, also
// wait for that one.
template <bool kGated>
void launch_first_dispatch_kernel(void (*kernel)(k90::DispatchParams), unsigned grid, size_t smem,
                                  const k90::DispatchParams& d, cudaStream_t stream, const char* what) {
  if constexpr (kGated) {
    launch_dependent(kernel, grid, k90::kDispatchThreads, smem, stream, d);
  } else {
    kernel<<<grid, k90::kDispatchThreads, smem, stream>>>(d);
    gpu::check_cuda(cudaGetLastError(), what);
  }
}

template <bool kGated>
void launch_dispatch_kernels(k90::DispatchParams d, int64_t selections, cudaStream_t stream) {
  if (selections <= k90::kDispatchSingleCtaItems) {
    launch_first_dispatch_kernel<kGated>(&k90::moe_dispatch_kernel<kGated>, 1, k90::kDispatchStageBytes, d, stream,
                                         "moe_dispatch_kernel launch");
    return;
  }
  // At least kDispatchThreads selections per CTA, whole tokens, no empty CTA.
  const int64_t T = d.tokens;
  const int64_t want =
      std::min<int64_t>(k90::kDispatchMaxCtas, (selections + k90::kDispatchThreads - 1) / k90::kDispatchThreads);
  const int64_t tokens_per_cta = (T + want - 1) / want;
  const int64_t ctas = (T + tokens_per_cta - 1) / tokens_per_cta;
  d.tokens_per_cta = static_cast<int32_t>(tokens_per_cta);
  launch_first_dispatch_kernel<kGated>(&k90::moe_dispatch_count_kernel<kGated>, static_cast<unsigned>(ctas), 0, d,
                                       stream, "moe_dispatch_count_kernel launch");
  launch_dependent(&k90::moe_dispatch_place_kernel<kGated>, static_cast<unsigned>(ctas), k90::kDispatchThreads, 0,
                   stream, d);
}

}  // namespace

void launch_dispatch(const k90::DispatchParams& d, int64_t selections, cudaStream_t stream) {
  if (d.gate.words != nullptr) return launch_dispatch_kernels<true>(d, selections, stream);
  launch_dispatch_kernels<false>(d, selections, stream);
}

k90::CombineParams combine_params(const PipelineRun& r, const k90::DispatchParams& d) {
  const bool det = r.problem.deterministic;
  void* ws = r.args.workspace;
  k90::CombineParams c{};
  c.out_acc = det ? nullptr : workspace_at<float>(ws, r.layout.out_acc);
  c.y_slot = det ? workspace_at<float>(ws, r.layout.y_slot) : nullptr;
  c.token_slot = d.token_slot;
  c.slot_weight = d.slot_weight;
  c.slots_per_token = static_cast<int32_t>(r.slots_per_token);
  c.tokens = r.tokens;
  c.hidden = r.problem.hidden_size;
  c.out = reinterpret_cast<__nv_bfloat16*>(r.args.output);
  c.out_f32 = r.args.output_f32;
  c.tokens_dev = r.gate != nullptr ? r.gate->rows : nullptr;
  if (r.gate != nullptr) c.returns = r.gate->returns;
  return c;
}

void load_pipeline_kernels() {
  cudaFuncAttributes a{};
  auto load = [&a](const void* kernel, const char* what) { gpu::check_cuda(cudaFuncGetAttributes(&a, kernel), what); };
  load(reinterpret_cast<const void*>(&k90::moe_dispatch_kernel<false>), "load moe_dispatch_kernel");
  load(reinterpret_cast<const void*>(&k90::moe_dispatch_kernel<true>), "load moe_dispatch_kernel<gated>");
  load(reinterpret_cast<const void*>(&k90::moe_dispatch_count_kernel<false>), "load moe_dispatch_count_kernel");
  load(reinterpret_cast<const void*>(&k90::moe_dispatch_count_kernel<true>), "load moe_dispatch_count_kernel<gated>");
  load(reinterpret_cast<const void*>(&k90::moe_dispatch_place_kernel<false>), "load moe_dispatch_place_kernel");
  load(reinterpret_cast<const void*>(&k90::moe_dispatch_place_kernel<true>), "load moe_dispatch_place_kernel<gated>");
  load(reinterpret_cast<const void*>(&k90::moe_combine_kernel<false>), "load moe_combine_kernel");
  load(reinterpret_cast<const void*>(&k90::moe_combine_kernel<true>), "load moe_combine_kernel<gated>");
}

void launch_combine(const k90::CombineParams& c, int num_sms, cudaStream_t stream) {
  const int64_t vecs = c.tokens * c.hidden / 8;
  const int64_t blocks = std::min<int64_t>((vecs + 255) / 256, int64_t{num_sms} * 8);
  if (c.tokens_dev != nullptr) {
    launch_dependent(&k90::moe_combine_kernel<true>, static_cast<unsigned>(blocks), 256, 0, stream, c);
  } else {
    launch_dependent(&k90::moe_combine_kernel<false>, static_cast<unsigned>(blocks), 256, 0, stream, c);
  }
}

}  // namespace megamoe::runtime
