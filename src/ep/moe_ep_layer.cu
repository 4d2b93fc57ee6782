// MoeEpLayer (include/megamoe/ep.h): one rank of the expert-parallel layer. The local work runs
// on the single-GPU pipeline (MoePlan + run, fp32 output); the exchange around it is
// sm90_ep_exchange.cuh over the windows of a transport (ep_transport.h), laid out as
// ep_window_layout.h says.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "ep/ep_transport.h"
#include "ep/ep_transport_loopback.h"
#include "ep/ep_window_layout.h"
#include "kernels/sm90/sm90_ep_exchange.cuh"
#include "megamoe/ep.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "megamoe/gpu.h"
#include "runtime/backend.h"
#include "runtime/moe_device_weights.h"
#include "runtime/sm90/sm90_launch_util.h"

namespace megamoe {

namespace k90 = kernels::sm90;
using gpu::check_cuda;

EpExpertRange ep_expert_range(int64_t num_experts, int world_size, int rank) {
  MEGAMOE_CHECK(world_size >= 1 && world_size <= ep::kMaxRanks && rank >= 0 && rank < world_size,
                kInvalidArgument, "expert parallelism: rank ", rank, " of world size ", world_size,
                " is out of range (world size 1..", ep::kMaxRanks, ")");
  MEGAMOE_CHECK(num_experts >= 1 && num_experts % world_size == 0, kInvalidArgument, "expert parallelism: ",
                num_experts, " routed experts do not split evenly over ", world_size,
                " ranks; the number of experts must be a multiple of the world size");
  const int64_t count = num_experts / world_size;
  return {rank * count, count};
}

MoeLayer ep_local_layer(const MoeLayer& layer, const EpExpertRange& range) {
  MEGAMOE_CHECK(range.first >= 0 && range.count >= 1 && range.first + range.count <= layer.num_experts,
                kInvalidArgument, "ep_local_layer: experts [", range.first, ", ", range.first + range.count,
                ") are not within the layer's ", layer.num_experts);
  MoeLayer local;
  local.hidden_size = layer.hidden_size;
  local.intermediate_size = layer.intermediate_size;
  local.num_experts = range.count;
  local.experts.assign(layer.experts.begin() + range.first, layer.experts.begin() + range.first + range.count);
  local.shared_expert = layer.shared_expert;
  local.swiglu_limit = layer.swiglu_limit;
  // The router (over all E experts) runs where the tokens are, before the dispatch: the local
  // layer only runs given ids, top_k of them per token (its routing is plain top-k).
  MEGAMOE_CHECK(range.count >= layer.routing.top_k, kUnsupported, "expert parallelism: ", range.count,
                " experts per rank is fewer than top_k = ", layer.routing.top_k,
                "; use fewer ranks (each rank's local layer takes a token's k ids)");
  local.routing.top_k = layer.routing.top_k;
  return local;
}

namespace {

// Device allocations, freed together.
struct DeviceAllocs {
  std::vector<void*> ptrs;
  size_t bytes = 0;
  template <class T>
  T* alloc(size_t count) {
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)), "cudaMalloc(expert-parallel layer)");
    ptrs.push_back(p);
    bytes += count * sizeof(T);
    return static_cast<T*>(p);
  }
  ~DeviceAllocs() {
    for (void* p : ptrs) cudaFree(p);
  }
};

// The buffers the layers of a group share, one run at a time: the local experts' workspace, the
// shared expert's and its output, its constant ids and weights.
enum class Scratch { kRoutedWorkspace, kSharedWorkspace, kSharedOut, kSharedIds, kSharedOnes, kCount };

}  // namespace

struct EpGroup::Impl {
  EpConfig cfg;
  int64_t hidden = 0;  // the largest layer's H and top_k: the window's capacity
  int top_k = 0;
  MoeTuning tuning;    // the local plans' (a loopback rank's SM share)
  cudaStream_t required_stream = nullptr;  // a loopback rank's stream; null: any
  std::unique_ptr<ep::EpTransport> transport;  // null for world size 1 (no exchange)
  ep::EpWindowLayout layout{};
  DeviceAllocs mem;
  k90::EpState* state = nullptr;  // the exchange's epochs, counters and failure word
  int32_t* error_host = nullptr;  // host-mapped
  int32_t* error_dev = nullptr;
  // A run() that threw after its send was queued: the ranks' epochs may no longer agree.
  bool broken = false;
  // Per kind, the largest scratch buffer made so far. A layer that needs more gets a new one; the
  // old one stays allocated (earlier layers, and graphs captured with them, still use it).
  std::pair<size_t, void*> scratch[static_cast<int>(Scratch::kCount)] = {};

  void* scratch_at(Scratch kind, size_t bytes) {
    auto& [have, ptr] = scratch[static_cast<int>(kind)];
    if (ptr != nullptr && have >= bytes) return ptr;
    ptr = mem.alloc<uint8_t>(bytes);
    have = bytes;
    if (kind == Scratch::kSharedIds) check_cuda(cudaMemset(ptr, 0, bytes), "cudaMemset");
    if (kind == Scratch::kSharedOnes) {
      const std::vector<float> ones(bytes / sizeof(float), 1.0f);
      check_cuda(cudaMemcpy(ptr, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
    }
    return ptr;
  }
  size_t bytes() const { return mem.bytes + (transport ? transport->window_bytes() : 0); }
  ~Impl() {
    // This rank's work has ended before its buffers are freed (the transport then also waits for
    // every peer's before it frees the window).
    cudaDeviceSynchronize();
    if (error_host) cudaFreeHost(error_host);
  }
};

namespace {

using TransportFactory = std::function<std::unique_ptr<ep::EpTransport>()>;

void check_config(const EpConfig& config) {
  MEGAMOE_CHECK(config.world_size >= 1 && config.world_size <= ep::kMaxRanks && config.rank >= 0 &&
                    config.rank < config.world_size,
                kInvalidArgument, "expert parallelism: rank ", config.rank, " of world size ", config.world_size,
                " is out of range (world size 1..", ep::kMaxRanks, ")");
  MEGAMOE_CHECK(config.max_tokens_per_rank >= 1 && config.max_tokens_per_rank <= (int64_t{1} << 16), kInvalidArgument,
                "expert parallelism: max_tokens_per_rank = ", config.max_tokens_per_rank, " must be in 1..65536");
  MEGAMOE_CHECK(config.timeout_seconds > 0 && config.timeout_seconds <= 3600, kInvalidArgument,
                "expert parallelism: timeout_seconds = ", config.timeout_seconds, " must be in (0, 3600]");
}

std::shared_ptr<EpGroup::Impl> make_group(const EpConfig& config, int64_t hidden_size, int top_k,
                                          const TransportFactory& make_transport, const MoeTuning& tuning) {
  check_config(config);
  MEGAMOE_CHECK(hidden_size >= 64 && hidden_size % 64 == 0, kInvalidArgument, "EpGroup: hidden_size = ",
                hidden_size, " must be a positive multiple of 64 (the largest layer's H)");
  MEGAMOE_CHECK(top_k >= 1 && top_k <= 16, kInvalidArgument, "EpGroup: top_k = ", top_k,
                " must be in 1..16 (the largest layer's top_k)");
  auto g = std::make_shared<EpGroup::Impl>();
  g->cfg = config;
  g->hidden = hidden_size;
  g->top_k = top_k;
  g->tuning = tuning;
  if (!config.early_start) g->tuning.early_start = false;
  check_cuda(cudaSetDevice(config.device), "cudaSetDevice");
  if (config.world_size == 1) return g;  // the single-GPU layer: nothing to exchange

  // Loaded now, not at their first launch: a lazily loaded kernel waits for the running ones,
  // which may be a peer's spin-wait for this very launch (the loopback's ranks share a GPU).
  cudaFuncAttributes attributes{};
  check_cuda(cudaFuncGetAttributes(&attributes, &k90::ep_send_kernel), "load ep_send_kernel");
  check_cuda(cudaFuncGetAttributes(&attributes, &k90::ep_combine_kernel), "load ep_combine_kernel");

  g->state = g->mem.alloc<k90::EpState>(1);
  check_cuda(cudaMemset(g->state, 0, sizeof(k90::EpState)), "cudaMemset");
  check_cuda(cudaHostAlloc(&g->error_host, sizeof(int32_t), cudaHostAllocMapped), "cudaHostAlloc(error word)");
  *g->error_host = 0;
  check_cuda(cudaHostGetDevicePointer(&g->error_dev, g->error_host, 0), "cudaHostGetDevicePointer");
  // The window: the same layout on every rank, for the largest layer.
  g->layout = ep::ep_window_layout(config.world_size, config.max_tokens_per_rank, hidden_size, top_k);
  g->transport = make_transport();
  MEGAMOE_CHECK(g->transport->rank() == config.rank && g->transport->world_size() == config.world_size, kInternal,
                "expert parallelism: the transport is rank ", g->transport->rank(), " of ",
                g->transport->world_size(), ", the group rank ", config.rank, " of ", config.world_size);
  g->transport->allocate_window(static_cast<size_t>(g->layout.bytes), ep::kFlagWords);
  check_cuda(cudaDeviceSynchronize(), "EpGroup::create");
  return g;
}

MoeTuning loopback_tuning(const EpConfig& config, const EpLoopback& loopback) {
  MEGAMOE_CHECK(config.world_size == loopback.world_size() && config.device == loopback.device(), kInvalidArgument,
                "expert parallelism: the config asks for world size ", config.world_size, " on device ", config.device,
                "; the loopback has ", loopback.world_size(), " virtual ranks on device ", loopback.device());
  MoeTuning tuning;
  tuning.num_sms = loopback.sms_per_rank();
  return tuning;
}

}  // namespace

EpGroup EpGroup::create(const EpConfig& config, const EpUniqueId& id, int64_t hidden_size, int top_k) {
  EpGroup g;
  g.impl_ = make_group(config, hidden_size, top_k, [&] { return ep::make_transport(config, id); }, MoeTuning{});
  return g;
}

EpGroup EpGroup::create(const EpConfig& config, const EpLoopback& loopback, int64_t hidden_size, int top_k) {
  const MoeTuning tuning = loopback_tuning(config, loopback);
  EpGroup g;
  g.impl_ = make_group(config, hidden_size, top_k,
                       [&] { return ep::make_loopback_transport(loopback, config.rank); }, tuning);
  g.impl_->required_stream = loopback.stream(config.rank);
  return g;
}

const EpConfig& EpGroup::config() const { return impl_->cfg; }
size_t EpGroup::device_bytes() const { return impl_->bytes(); }

struct MoeEpLayer::Impl {
  std::shared_ptr<EpGroup::Impl> group;
  EpExpertRange range;
  int64_t num_experts = 0, hidden = 0;
  int top_k = 0;
  // World size 1: the single-GPU layer (routed_plan and routed_weights hold the shared expert too),
  // no exchange.
  bool single = false;
  std::optional<MoePlan> routed_plan, shared_plan;
  std::optional<MoeDeviceWeights> routed_weights, shared_weights;
  // In the group's scratch.
  void* routed_ws = nullptr;
  void* shared_ws = nullptr;
  int32_t* shared_ids = nullptr;  // [max_t] zeros: every token to the shared expert
  float* shared_w = nullptr;      // [max_t] ones
  float* shared_out = nullptr;    // [max_t, H]
};

MoeEpLayer::MoeEpLayer() : impl_(std::make_unique<Impl>()) {}
MoeEpLayer::MoeEpLayer(MoeEpLayer&&) noexcept = default;
MoeEpLayer& MoeEpLayer::operator=(MoeEpLayer&&) noexcept = default;
MoeEpLayer::~MoeEpLayer() = default;
const EpConfig& MoeEpLayer::config() const { return impl_->group->cfg; }
EpExpertRange MoeEpLayer::experts() const { return impl_->range; }
EpGroup MoeEpLayer::group() const {
  EpGroup g;
  g.impl_ = impl_->group;
  return g;
}

// What a rank's layer is, whatever holds its weights.
struct MoeEpLayer::Shape {
  int64_t num_experts = 0, hidden = 0, inter = 0, shared_inter = 0;
  int top_k = 0;
  std::optional<float> swiglu_limit;
};

// The plans and the group's scratch of a rank's layer of `shape` (weights set by the caller).
MoeEpLayer MoeEpLayer::make(const EpGroup& group, const Shape& shape, bool deterministic) {
  MEGAMOE_CHECK(group.impl_ != nullptr, kInvalidArgument, "MoeEpLayer::create: the EpGroup was moved from");
  EpGroup::Impl& g = *group.impl_;
  const EpConfig& config = g.cfg;
  const int R = config.world_size;
  const EpExpertRange range = ep_expert_range(shape.num_experts, R, config.rank);
  const int k = shape.top_k;
  const int64_t H = shape.hidden, max_t = config.max_tokens_per_rank;
  MEGAMOE_CHECK(range.count >= k, kUnsupported, "expert parallelism: ", range.count,
                " experts per rank is fewer than top_k = ", k, "; use fewer ranks (each rank's local layer takes a "
                "token's k ids)");
  MEGAMOE_CHECK(H <= g.hidden && k <= g.top_k, kInvalidArgument, "MoeEpLayer: the layer's H = ", H, " and top_k = ",
                k, " exceed its group's window, made for H <= ", g.hidden, " and top_k <= ", g.top_k,
                " (EpGroup::create: give the largest layer's)");
  MoeEpLayer out;
  Impl& m = *out.impl_;
  m.group = group.impl_;
  m.range = range;
  m.num_experts = shape.num_experts;
  m.hidden = H;
  m.top_k = k;
  check_cuda(cudaSetDevice(config.device), "cudaSetDevice");

  if (R == 1) {
    // One rank owns every expert: the single-GPU layer on the rank's tokens, nothing exchanged.
    m.single = true;
    MoeProblem p;
    p.hidden_size = H;
    p.intermediate_size = shape.inter;
    p.num_experts = shape.num_experts;
    p.top_k = k;
    p.shared_intermediate_size = shape.shared_inter;
    p.max_tokens = max_t;
    p.swiglu_limit = shape.swiglu_limit;
    p.deterministic = deterministic;
    p.precision = config.precision;
    m.routed_plan = MoePlan::create(p, g.tuning);
    m.routed_ws = g.scratch_at(Scratch::kRoutedWorkspace, m.routed_plan->workspace_bytes());
    return out;
  }

  MEGAMOE_CHECK(config.precision != Precision::kW4a8, kUnsupported, "MoeEpLayer: precision w4a8 runs on one GPU ",
                "only (world size 1): the w4a8/sm_90 row does not take the exchanged (gated) tokens of ",
                config.world_size, " ranks yet. Use w4a16 (the exact path) or auto with expert parallelism");
  // The rank's own experts, on the rows that arrive from every rank (fp32 out). Gated
  // (run_gated): deterministic, so that no accumulator of R * max_t rows is zeroed per run.
  MoeProblem rp;
  rp.hidden_size = H;
  rp.intermediate_size = shape.inter;
  rp.num_experts = range.count;
  rp.top_k = k;
  rp.max_tokens = R * max_t;
  rp.swiglu_limit = shape.swiglu_limit;
  rp.deterministic = true;
  rp.precision = config.precision;
  m.routed_plan = MoePlan::create(rp, g.tuning);

  // The shared expert on the rank's own tokens: a one-expert layer, every token's weight 1.
  if (shape.shared_inter > 0) {
    MoeProblem sp;
    sp.hidden_size = H;
    sp.intermediate_size = shape.shared_inter;
    sp.num_experts = 1;
    sp.top_k = 1;
    sp.max_tokens = max_t;
    sp.swiglu_limit = shape.swiglu_limit;
    sp.deterministic = deterministic;
    sp.precision = config.precision;
    m.shared_plan = MoePlan::create(sp, g.tuning);
    m.shared_ws = g.scratch_at(Scratch::kSharedWorkspace, m.shared_plan->workspace_bytes());
    m.shared_ids = static_cast<int32_t*>(g.scratch_at(Scratch::kSharedIds, static_cast<size_t>(max_t) * 4));
    m.shared_w = static_cast<float*>(g.scratch_at(Scratch::kSharedOnes, static_cast<size_t>(max_t) * 4));
    m.shared_out = static_cast<float*>(g.scratch_at(Scratch::kSharedOut, static_cast<size_t>(max_t * H) * 4));
  }
  m.routed_ws = g.scratch_at(Scratch::kRoutedWorkspace, m.routed_plan->workspace_bytes());
  return out;
}

MoeEpLayer MoeEpLayer::create(const MoeLayer& local_layer, int64_t num_experts, const EpGroup& group,
                              bool deterministic) {
  MEGAMOE_CHECK(group.impl_ != nullptr, kInvalidArgument, "MoeEpLayer::create: the EpGroup was moved from");
  const EpConfig& config = group.impl_->cfg;
  const EpExpertRange range = ep_expert_range(num_experts, config.world_size, config.rank);
  local_layer.validate();
  MEGAMOE_CHECK(local_layer.num_experts == range.count, kInvalidArgument, "MoeEpLayer: the local layer holds ",
                local_layer.num_experts, " experts; rank ", config.rank, " of ", config.world_size, " owns ",
                range.count, " of the ", num_experts, " (ep_local_layer)");
  Shape shape;
  shape.num_experts = num_experts;
  shape.hidden = local_layer.hidden_size;
  shape.inter = local_layer.intermediate_size;
  shape.shared_inter = local_layer.shared_expert ? local_layer.shared_expert->intermediate_size() : 0;
  shape.top_k = local_layer.routing.top_k;
  shape.swiglu_limit = local_layer.swiglu_limit;
  MoeEpLayer out = make(group, shape, deterministic);
  Impl& m = *out.impl_;
  if (m.single) {
    m.routed_weights = MoeDeviceWeights::upload(local_layer);  // the shared expert included
  } else {
    MoeLayer routed = local_layer;
    routed.shared_expert.reset();
    m.routed_weights = MoeDeviceWeights::upload(routed);
    if (local_layer.shared_expert) {
      MoeLayer shared;
      shared.hidden_size = shape.hidden;
      shared.intermediate_size = shape.shared_inter;
      shared.num_experts = 1;
      shared.experts = {*local_layer.shared_expert};
      shared.routing.top_k = 1;
      shared.swiglu_limit = local_layer.swiglu_limit;
      m.shared_weights = MoeDeviceWeights::upload(shared);
    }
  }
  check_cuda(cudaDeviceSynchronize(), "MoeEpLayer::create");
  return out;
}

MoeEpLayer MoeEpLayer::create(EpLocalWeights weights, const EpLayerOptions& options, const EpGroup& group) {
  MEGAMOE_CHECK(group.impl_ != nullptr, kInvalidArgument, "MoeEpLayer::create: the EpGroup was moved from");
  const EpConfig& config = group.impl_->cfg;
  const MoeProblem& routed = runtime::DeviceWeightsAccess::get(weights.routed).shape;
  MEGAMOE_CHECK(routed.hidden_size > 0 && routed.shared_intermediate_size == 0, kInvalidArgument,
                "MoeEpLayer::create: the routed weights must be the rank's experts alone (",
                routed.shared_intermediate_size > 0 ? "they hold a shared expert: give it as EpLocalWeights::shared"
                                                     : "they are empty", ")");
  const EpExpertRange range = ep_expert_range(options.num_experts, config.world_size, config.rank);
  MEGAMOE_CHECK(routed.num_experts == range.count, kInvalidArgument, "MoeEpLayer::create: the routed weights hold ",
                routed.num_experts, " experts; rank ", config.rank, " of ", config.world_size, " owns ", range.count,
                " of the ", options.num_experts);
  Shape shape;
  shape.num_experts = options.num_experts;
  shape.hidden = routed.hidden_size;
  shape.inter = routed.intermediate_size;
  shape.top_k = options.top_k;
  shape.swiglu_limit = options.swiglu_limit;
  if (weights.shared) {
    const MoeProblem& shared = runtime::DeviceWeightsAccess::get(*weights.shared).shape;
    MEGAMOE_CHECK(shared.num_experts == 1 && shared.shared_intermediate_size == 0 &&
                      shared.hidden_size == routed.hidden_size,
                  kInvalidArgument, "MoeEpLayer::create: the shared weights must be a one-expert layer of hidden "
                  "size ", routed.hidden_size, " (they have ", shared.num_experts, " experts, H = ",
                  shared.hidden_size, ")");
    shape.shared_inter = shared.intermediate_size;
  }
  MEGAMOE_CHECK(config.world_size > 1 || !weights.shared, kInvalidArgument,
                "MoeEpLayer::create: at world size 1 the layer is the single-GPU layer, whose weights hold the "
                "shared expert with the routed ones: give them as one MoeDeviceWeights, or use run()");
  MoeEpLayer out = make(group, shape, options.deterministic);
  Impl& m = *out.impl_;
  m.routed_weights = std::move(weights.routed);
  if (weights.shared) m.shared_weights = std::move(*weights.shared);
  return out;
}

MoeEpLayer MoeEpLayer::create(const MoeLayer& local_layer, int64_t num_experts, const EpConfig& config,
                              const EpUniqueId& id, bool deterministic) {
  return create(local_layer, num_experts,
                EpGroup::create(config, id, local_layer.hidden_size, local_layer.routing.top_k), deterministic);
}

MoeEpLayer MoeEpLayer::create(const MoeLayer& local_layer, int64_t num_experts, const EpConfig& config,
                              const EpLoopback& loopback, bool deterministic) {
  return create(local_layer, num_experts,
                EpGroup::create(config, loopback, local_layer.hidden_size, local_layer.routing.top_k),
                deterministic);
}

size_t MoeEpLayer::device_bytes() const {
  const Impl& m = *impl_;
  return m.routed_weights->device_bytes() + (m.shared_weights ? m.shared_weights->device_bytes() : 0);
}

void MoeEpLayer::run(const MoeRunArgs& args, cudaStream_t stream) { run_stages(args, stream, nullptr); }

void MoeEpLayer::run(const MoeRunArgs& args, cudaStream_t stream, const StageEvents& stages) {
  run_stages(args, stream, &stages);
}

void MoeEpLayer::run_stages(const MoeRunArgs& args, cudaStream_t stream, const StageEvents* stages) {
  Impl& m = *impl_;
  EpGroup::Impl& g = *m.group;
  auto mark = [&](cudaEvent_t StageEvents::*which) {
    if (stages != nullptr) check_cuda(cudaEventRecord(stages->*which, stream), "cudaEventRecord(stage)");
  };
  const int R = g.cfg.world_size;
  const int64_t max_t = g.cfg.max_tokens_per_rank, H = m.hidden;
  MEGAMOE_CHECK(args.tokens >= 0 && args.tokens <= max_t, kInvalidArgument, "MoeEpLayer::run: tokens = ",
                args.tokens, " must be in 0..max_tokens_per_rank = ", max_t);
  MEGAMOE_CHECK(args.tokens == 0 || (args.hidden && args.topk_ids && args.topk_weights && args.output), kInvalidArgument,
                "MoeEpLayer::run: hidden, topk_ids, topk_weights and output must be device pointers, not null");
  MEGAMOE_CHECK(args.output_f32 == nullptr, kInvalidArgument, "MoeEpLayer::run: the output is bf16 (output)");
  MEGAMOE_CHECK(g.required_stream == nullptr || stream == g.required_stream, kInvalidArgument,
                "MoeEpLayer::run: loopback rank ", g.cfg.rank, " runs on its own SMs: pass EpLoopback::stream(",
                g.cfg.rank, ")");
  if (m.single) {
    mark(&StageEvents::start);
    mark(&StageEvents::sent);
    if (args.tokens > 0) {
      MoeRunArgs local = args;
      local.workspace = m.routed_ws;
      megamoe::run(*m.routed_plan, *m.routed_weights, local, stream);
    }
    mark(&StageEvents::computed);
    mark(&StageEvents::done);
    return;
  }
  // Host-mapped, so readable without a synchronisation: a group whose exchange failed is unusable.
  const int32_t failed = *reinterpret_cast<volatile int32_t*>(g.error_host);
  MEGAMOE_CHECK(failed == 0 && !g.broken, kCuda, "MoeEpLayer::run: an earlier run failed (see check()); destroy and "
                "re-create the layers and their group on every rank");
  MEGAMOE_CHECK(reinterpret_cast<uintptr_t>(args.hidden) % 16 == 0 && reinterpret_cast<uintptr_t>(args.output) % 16 == 0,
                kInvalidArgument, "MoeEpLayer::run: hidden and output must be 16-byte aligned");

  k90::EpExchangeParams p{};
  p.peers = g.transport->peers();
  p.layout = g.layout;
  p.max_t = max_t;
  p.hidden = H;
  p.top_k = m.top_k;
  p.experts_per_rank = m.range.count;
  p.num_experts = m.num_experts;
  p.x = reinterpret_cast<const __nv_bfloat16*>(args.hidden);
  p.topk_ids = args.topk_ids;
  p.topk_w = args.topk_weights;
  p.tokens = args.tokens;
  p.shared_out = m.shared_plan && args.tokens > 0 ? m.shared_out : nullptr;
  p.out = reinterpret_cast<__nv_bfloat16*>(args.output);
  p.state = g.state;
  p.failure.timeout_ns = static_cast<uint64_t>(g.cfg.timeout_seconds * 1e9);
  p.failure.failed = &g.state->failed;
  p.failure.error = g.error_dev;
  p.failure.rank = g.cfg.rank;
  for (int d = 0; d < R; ++d) {
    p.failure.targets[p.failure.target_count++] = p.peers.flags[d] + ep::kSentWord + g.cfg.rank;
    p.failure.targets[p.failure.target_count++] = p.peers.flags[d] + ep::kDoneWord + g.cfg.rank;
  }

  mark(&StageEvents::start);
  const unsigned send_blocks = static_cast<unsigned>(std::clamp<int64_t>(args.tokens, 1, 1024));
  k90::ep_send_kernel<<<send_blocks, k90::kExchangeThreads, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "ep_send_kernel launch");
  // From here on the peers count on this run: a host failure leaves the group unusable.
  try {
    mark(&StageEvents::sent);
    // The shared expert on this rank's own tokens, while the peers' rows are on their way.
    if (m.shared_plan && args.tokens > 0) {
      MoeRunArgs shared{};
      shared.hidden = args.hidden;
      shared.topk_ids = m.shared_ids;
      shared.topk_weights = m.shared_w;
      shared.tokens = args.tokens;
      shared.output_f32 = m.shared_out;
      shared.workspace = m.shared_ws;
      megamoe::run(*m.shared_plan, *m.shared_weights, shared, stream);
    }

    // This rank's experts on the rows that arrive: the gated dispatch waits for every source's
    // {epoch, rows} word and takes the rows reserved in the receive count. Configured for as many
    // rows as this rank has tokens (a balanced batch sends each rank about that many selections).
    const char* window = g.transport->local_base();
    MoeRunArgs local{};
    local.hidden = reinterpret_cast<const uint16_t*>(window + g.layout.recv_x);
    local.topk_ids = reinterpret_cast<const int32_t*>(window + g.layout.recv_ids);
    local.topk_weights = reinterpret_cast<const float*>(window + g.layout.recv_w);
    local.tokens = R * max_t;
    local.workspace = m.routed_ws;
    runtime::GatedTokens gated;
    gated.gate.words = g.transport->peers().flags[g.cfg.rank] + ep::kSentWord;
    gated.gate.producers = R;
    gated.gate.stage = k90::EpFailure::kStageDispatch;
    gated.gate.count =
        reinterpret_cast<const unsigned long long*>(g.transport->peers().flags[g.cfg.rank] + ep::kRecvCountWord);
    gated.gate.epoch = &g.state->epoch;
    gated.gate.rows = &g.state->rows;
    gated.gate.published = &g.state->gate_rows;
    gated.gate.stamps = &g.state->stamps[k90::kStampGateBegin];
    // The local combine writes each row's sum straight into its source's return slot.
    for (int d = 0; d < R; ++d) gated.gate.returns.bases[d] = g.transport->peers().base[d];
    gated.gate.returns.offset = g.layout.ret;
    gated.gate.returns.first_row = static_cast<int64_t>(g.cfg.rank) * max_t;
    gated.gate.returns.src = reinterpret_cast<const int32_t*>(window + g.layout.recv_src);
    gated.gate.failure = p.failure;
    gated.hint = std::min<int64_t>(std::max<int64_t>(args.tokens, 1), local.tokens);
    runtime::run_gated(*m.routed_plan, *m.routed_weights, local, gated, stream);
    mark(&StageEvents::computed);

    // The return (publish_return) and the combine, one kernel.
    const unsigned combine_blocks = static_cast<unsigned>(std::clamp<int64_t>(args.tokens, 1, 1024));
    runtime::launch_dependent(&k90::ep_combine_kernel, combine_blocks, k90::kExchangeThreads, 0, stream, p);
    mark(&StageEvents::done);
  } catch (...) {
    g.broken = true;
    (void)cudaGetLastError();  // a call's own error, not a later launch's
    throw;
  }
}

namespace {

const char* stage_name(int32_t stage) {
  return stage == k90::EpFailure::kStageDispatch  ? "for its peers' rows (dispatch)"
         : stage == k90::EpFailure::kStageCombine ? "for its peers' partial sums (combine)"
                                                  : "at an unknown stage";
}

constexpr const char* kOverflowText =
    "more rows than a receive buffer holds: the ranks' groups differ (H, top_k or max_tokens_per_rank) or two "
    "runs of one group overlapped (the layers of a group run one at a time, in stream order)";

}  // namespace

void MoeEpLayer::check(cudaStream_t stream) const {
  const Impl& m = *impl_;
  const EpGroup::Impl& g = *m.group;
  check_cuda(cudaStreamSynchronize(stream), "MoeEpLayer::check");
  if (m.single) return;
  using F = k90::EpFailure;
  MEGAMOE_CHECK(!g.broken, kCuda, "expert parallelism: rank ", g.cfg.rank, ": a run() failed on the host after it had "
                "started the exchange; the outputs since are undefined: destroy and re-create the layers and their group");
  const int32_t e = *reinterpret_cast<volatile int32_t*>(g.error_host);
  MEGAMOE_CHECK(F::kind(e) != F::kOverflow, kCuda, "expert parallelism: rank ", g.cfg.rank, " was sent ", kOverflowText);
  MEGAMOE_CHECK(!(F::kind(e) == F::kPeerGaveUp && F::peer_stage(e) == F::kStageSend), kCuda,
                "expert parallelism: rank ", g.cfg.rank, ": rank ", F::peer_rank(e), " was sent ", kOverflowText);
  MEGAMOE_CHECK(F::kind(e) != F::kPeerGaveUp, kCuda, "expert parallelism: rank ", g.cfg.rank, ": rank ",
                F::peer_rank(e), " gave up waiting ", stage_name(F::peer_stage(e)),
                " (a peer of it never arrived); every rank has stopped exchanging, the outputs since are undefined");
  MEGAMOE_CHECK(e == 0, kCuda, "expert parallelism: rank ", g.cfg.rank, " waited more than ", g.cfg.timeout_seconds,
                " s ", stage_name(F::kind(e)),
                ": a peer rank never arrived (it failed, or does not call run() as often); every rank has "
                "stopped exchanging, the outputs since are undefined");
}

static_assert(runtime::kMaxReturnRanks == ep::kMaxRanks, "ReturnRows holds a base per rank of a host");
static_assert(sizeof(MoeEpLayer::StageStamps) == sizeof(uint64_t) * k90::kStampCount &&
                  offsetof(MoeEpLayer::StageStamps, combine_end) == sizeof(uint64_t) * k90::kStampCombineEnd,
              "MoeEpLayer::StageStamps lists EpState's stamps in EpStamp order: keep the two in step");

MoeEpLayer::StageStamps MoeEpLayer::stage_stamps(cudaStream_t stream) const {
  const Impl& m = *impl_;
  StageStamps out{};
  if (m.single) {
    check_cuda(cudaStreamSynchronize(stream), "MoeEpLayer::stage_stamps");
    return out;
  }
  check_cuda(cudaMemcpyAsync(&out, m.group->state->stamps, sizeof(out), cudaMemcpyDeviceToHost, stream),
             "cudaMemcpyAsync");
  check_cuda(cudaStreamSynchronize(stream), "MoeEpLayer::stage_stamps");
  return out;
}

int64_t MoeEpLayer::invalid_id_count(cudaStream_t stream) const {
  const Impl& m = *impl_;
  if (m.single) return m.routed_plan->invalid_id_count(m.routed_ws, stream);
  k90::EpState state{};
  check_cuda(cudaMemcpyAsync(&state, m.group->state, sizeof(state), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
  check(stream);  // a failed exchange's count means nothing
  return state.invalid[state.epoch & 1];
}

}  // namespace megamoe
