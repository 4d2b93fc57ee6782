// The baselines of `megamoe bench --ep` (ep_bench_baselines.h).
#if MEGAMOE_HAS_EP

#include "bench/ep_bench_baselines.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "bench/ep_baseline.h"
#include "megamoe/format.h"
#include "megamoe/gpu.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"

namespace megamoe::bench {
namespace {

// The shared expert as a one-expert layer, every token's weight 1 (as MoeEpLayer runs it).
MoeLayer shared_expert_layer(const MoeLayer& layer) {
  MoeLayer shared;
  shared.hidden_size = layer.hidden_size;
  shared.intermediate_size = layer.shared_expert->intermediate_size();
  shared.num_experts = 1;
  shared.experts = {*layer.shared_expert};
  shared.routing.top_k = 1;
  shared.swiglu_limit = layer.swiglu_limit;
  return shared;
}

}  // namespace

UnfusedBaseline::UnfusedBaseline(const MoeLayer& local_layer, const EpShape& shape, int rank, int64_t max_t,
                                 bool deterministic, cudaStream_t stream)
    : shape_(shape), rank_(rank), max_rows_(shape.world * max_t), max_t_(max_t),
      send_x_(rows_h()), recv_x_(rows_h()), send_ids_(rows_k()), recv_ids_(rows_k()), send_w_(rows_k()),
      recv_w_(rows_k()), partial_(rows_h()), ret_(rows_h()), out_(static_cast<size_t>(max_t * shape.hidden)),
      row_token_(static_cast<size_t>(max_rows_)), row_dest_(static_cast<size_t>(max_rows_)),
      slots_(static_cast<size_t>(max_t * shape.world)) {
  MoeLayer routed = local_layer;
  routed.shared_expert.reset();
  MoeProblem rp;
  rp.hidden_size = shape.hidden;
  rp.intermediate_size = shape.intermediate;
  rp.num_experts = shape.num_experts / shape.world;
  rp.top_k = shape.top_k;
  rp.max_tokens = max_rows_;
  rp.swiglu_limit = local_layer.swiglu_limit;
  rp.deterministic = deterministic;
  routed_plan_.emplace(MoePlan::create(rp));
  routed_weights_.emplace(MoeDeviceWeights::upload(routed, stream));
  routed_ws_.emplace(routed_plan_->workspace_bytes());
  if (local_layer.shared_expert) {
    const MoeLayer shared = shared_expert_layer(local_layer);
    MoeProblem sp = MoeProblem::from_layer(shared, max_t);
    sp.deterministic = deterministic;
    shared_plan_.emplace(MoePlan::create(sp));
    shared_weights_.emplace(MoeDeviceWeights::upload(shared, stream));
    shared_ws_.emplace(shared_plan_->workspace_bytes());
    shared_ids_.emplace(std::vector<int32_t>(static_cast<size_t>(max_t), 0));
    shared_w_.emplace(std::vector<float>(static_cast<size_t>(max_t), 1.0f));
    shared_out_.emplace(static_cast<size_t>(max_t * shape.hidden));
  }
}

void UnfusedBaseline::prepare(const std::vector<std::vector<int64_t>>& counts, const std::vector<int32_t>& ids,
                              int64_t tokens) {
  const int R = shape_.world;
  const int64_t per_rank = shape_.num_experts / R;
  tokens_ = tokens;
  counts_ = counts;
  std::vector<int32_t> row_token, row_dest, slots(static_cast<size_t>(tokens * R), -1);
  send_off_.assign(static_cast<size_t>(R) + 1, 0);
  for (int d = 0; d < R; ++d) {
    for (int64_t t = 0; t < tokens; ++t) {
      bool to_d = false;
      for (int j = 0; j < shape_.top_k; ++j) {
        const int32_t id = ids[static_cast<size_t>(t * shape_.top_k + j)];
        to_d = to_d || (id >= d * per_rank && id < (d + 1) * per_rank);
      }
      if (!to_d) continue;
      slots[static_cast<size_t>(t * R + d)] = static_cast<int32_t>(row_token.size());
      row_token.push_back(static_cast<int32_t>(t));
      row_dest.push_back(d);
    }
    send_off_[static_cast<size_t>(d) + 1] = static_cast<int64_t>(row_token.size());
    MEGAMOE_CHECK(send_off_[static_cast<size_t>(d) + 1] - send_off_[static_cast<size_t>(d)] ==
                      counts[static_cast<size_t>(rank_)][static_cast<size_t>(d)],
                  kInternal, "bench --ep: baseline (a)'s rows to rank ", d, " disagree with ep_row_counts");
  }
  recv_off_.assign(static_cast<size_t>(R) + 1, 0);
  for (int s = 0; s < R; ++s) {
    recv_off_[static_cast<size_t>(s) + 1] =
        recv_off_[static_cast<size_t>(s)] + counts[static_cast<size_t>(s)][static_cast<size_t>(rank_)];
  }
  send_rows_ = send_off_.back();
  recv_rows_ = recv_off_.back();
  row_token.resize(static_cast<size_t>(max_rows_), 0);
  row_dest.resize(static_cast<size_t>(max_rows_), 0);
  slots.resize(static_cast<size_t>(max_t_ * R), -1);
  row_token_.upload(row_token);
  row_dest_.upload(row_dest);
  slots_.upload(slots);
}

void UnfusedBaseline::run(const BenchComm& comm, const uint16_t* x, const int32_t* ids, const float* w,
                          cudaStream_t stream) const {
  const int R = shape_.world, k = shape_.top_k;
  const int64_t H = shape_.hidden;
  EpPackArgs pack;
  pack.hidden = x;
  pack.topk_ids = ids;
  pack.topk_weights = w;
  pack.row_token = row_token_.get();
  pack.row_dest = row_dest_.get();
  pack.rows = send_rows_;
  pack.hidden_size = H;
  pack.top_k = k;
  pack.experts_per_rank = shape_.num_experts / R;
  pack.send_hidden = send_x_.get();
  pack.send_ids = send_ids_.get();
  pack.send_weights = send_w_.get();
  ep_pack_rows(pack, stream);
  // Dispatch: rows, local ids and weights to every rank that owns any of a row's experts.
  check_nccl(ncclGroupStart(), "ncclGroupStart");
  for (int d = 0; d < R; ++d) {
    const int64_t off = send_off_[static_cast<size_t>(d)], n = send_off_[static_cast<size_t>(d) + 1] - off;
    if (n == 0) continue;
    check_nccl(ncclSend(send_x_.get() + off * H, static_cast<size_t>(n * H * 2), ncclUint8, d, comm.get(), stream), "ncclSend");
    check_nccl(ncclSend(send_ids_.get() + off * k, static_cast<size_t>(n * k * 4), ncclUint8, d, comm.get(), stream), "ncclSend");
    check_nccl(ncclSend(send_w_.get() + off * k, static_cast<size_t>(n * k * 4), ncclUint8, d, comm.get(), stream), "ncclSend");
  }
  for (int s = 0; s < R; ++s) {
    const int64_t off = recv_off_[static_cast<size_t>(s)], n = recv_off_[static_cast<size_t>(s) + 1] - off;
    if (n == 0) continue;
    check_nccl(ncclRecv(recv_x_.get() + off * H, static_cast<size_t>(n * H * 2), ncclUint8, s, comm.get(), stream), "ncclRecv");
    check_nccl(ncclRecv(recv_ids_.get() + off * k, static_cast<size_t>(n * k * 4), ncclUint8, s, comm.get(), stream), "ncclRecv");
    check_nccl(ncclRecv(recv_w_.get() + off * k, static_cast<size_t>(n * k * 4), ncclUint8, s, comm.get(), stream), "ncclRecv");
  }
  check_nccl(ncclGroupEnd(), "ncclGroupEnd");
  compute(stream);
  // Return: each received row's fp32 partial sum to its source.
  check_nccl(ncclGroupStart(), "ncclGroupStart");
  for (int s = 0; s < R; ++s) {
    const int64_t off = recv_off_[static_cast<size_t>(s)], n = recv_off_[static_cast<size_t>(s) + 1] - off;
    if (n == 0) continue;
    check_nccl(ncclSend(partial_.get() + off * H, static_cast<size_t>(n * H * 4), ncclUint8, s, comm.get(), stream), "ncclSend");
  }
  for (int d = 0; d < R; ++d) {
    const int64_t off = send_off_[static_cast<size_t>(d)], n = send_off_[static_cast<size_t>(d) + 1] - off;
    if (n == 0) continue;
    check_nccl(ncclRecv(ret_.get() + off * H, static_cast<size_t>(n * H * 4), ncclUint8, d, comm.get(), stream), "ncclRecv");
  }
  check_nccl(ncclGroupEnd(), "ncclGroupEnd");
  EpCombineArgs combine;
  combine.partial = ret_.get();
  combine.slots = slots_.get();
  combine.world = R;
  combine.shared = shared_plan_ ? shared_out_->get() : nullptr;
  combine.tokens = tokens_;
  combine.hidden_size = H;
  combine.out = out_.get();
  ep_combine_rows(combine, stream);
}

void UnfusedBaseline::compute(cudaStream_t stream) const {
  if (recv_rows_ > 0) {
    MoeRunArgs local{};
    local.hidden = recv_x_.get();
    local.topk_ids = recv_ids_.get();
    local.topk_weights = recv_w_.get();
    local.tokens = recv_rows_;
    local.output_f32 = partial_.get();
    local.workspace = routed_ws_->get();
    megamoe::run(*routed_plan_, *routed_weights_, local, stream);
  }
  if (shared_plan_ && tokens_ > 0) {
    MoeRunArgs shared{};
    shared.hidden = shared_x_;
    shared.topk_ids = shared_ids_->get();
    shared.topk_weights = shared_w_->get();
    shared.tokens = tokens_;
    shared.output_f32 = shared_out_->get();
    shared.workspace = shared_ws_->get();
    megamoe::run(*shared_plan_, *shared_weights_, shared, stream);
  }
}

void prepare_single_gpu_baseline(SingleGpuBaseline& single, const MoeLayer& layer, const EpShape& shape,
                                 int64_t single_max_t, bool deterministic, cudaStream_t stream) {
  const int64_t H = shape.hidden, E = shape.num_experts;
  const int k = shape.top_k;
  single.bytes_needed = format::kNvfp4BytesPerWeight * 3.0 * static_cast<double>(H) *
                            (static_cast<double>(E) * shape.intermediate + shape.shared_intermediate) +
                        static_cast<double>(single_max_t) * (4.0 * H + 8.0 * k);
  size_t free_bytes = 0, total = 0;
  gpu::check_cuda(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo");
  std::optional<MoePlan> plan;
  if (single_max_t > 65536) {
    single.skipped = "R * max tokens per rank = " + std::to_string(single_max_t) + " is above one plan's 65536";
  } else {
    MoeProblem problem = MoeProblem::from_layer(layer, single_max_t);
    problem.deterministic = deterministic;
    try {
      plan.emplace(MoePlan::create(problem));
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kInvalidArgument && e.code() != ErrorCode::kUnsupported) throw;
      single.skipped = std::string("the single-GPU plan for all tokens is refused: ") + e.what();
    }
  }
  if (plan) {
    single.bytes_needed += static_cast<double>(plan->workspace_bytes());
    // 2 GiB stay free for the flush buffers, the inputs and the CUDA graphs.
    if (single.bytes_needed + 2.0 * (1u << 30) > static_cast<double>(free_bytes)) {
      char why[256];
      std::snprintf(why, sizeof why, "does not fit: the whole layer on one GPU needs %.2f GB, %.2f GB free on GPU 0",
                    single.bytes_needed / 1e9, free_bytes / 1e9);
      single.skipped = why;
    } else {
      single.weights.emplace(MoeDeviceWeights::upload(layer, stream));
      single.workspace.emplace(plan->workspace_bytes());
      single.plan.emplace(*plan);
    }
  }
}

}  // namespace megamoe::bench

#endif  // MEGAMOE_HAS_EP
