// The C API's layer on the GPU runtime: a MoePlan, its MoeDeviceWeights, the router's bias and a
// workspace, all owned; run() over the caller's device pointers.
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "capi/capi_internal.h"
#include "megamoe/gpu.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"

namespace megamoe::capi {

using gpu::check_cuda;

// An owned device allocation (none for 0 bytes).
class DeviceAlloc {
 public:
  DeviceAlloc() = default;
  explicit DeviceAlloc(size_t bytes) {
    if (bytes) check_cuda(cudaMalloc(&ptr_, bytes), "cudaMalloc");
  }
  DeviceAlloc(DeviceAlloc&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)) {}
  DeviceAlloc& operator=(DeviceAlloc&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    return *this;
  }
  ~DeviceAlloc() {
    if (ptr_) cudaFree(ptr_);
  }
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

// Makes `device` current for the guard's lifetime and restores the caller's device after: the C
// API runs on the layer's device whatever the calling thread had selected.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device_) check_cuda(cudaSetDevice(device_), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int previous_ = 0;
};

constexpr size_t kAlign = 256;
inline size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

namespace {

void check_device(int device) {
  const int count = gpu::device_count();
  MEGAMOE_CHECK(count > 0, kUnsupported, "no CUDA device found: a layer needs a GPU (Hopper, sm_90) "
                "and its driver; checkpoints can be opened and checked without one.");
  MEGAMOE_CHECK(device < count, kInvalidArgument, "options.device is ", device,
                "; this process sees ", count, " CUDA device", count == 1 ? "" : "s", " (0..", count - 1, ").");
}

}  // namespace
}  // namespace megamoe::capi

struct megamoe_layer {
  megamoe::capi::LayerOptions options;
  megamoe::MoePlan plan;
  megamoe::MoeDeviceWeights weights;
  std::optional<megamoe::RoutingConfig> routing;
  megamoe::capi::DeviceAlloc bias;  // [E] fp32, or none
  // The workspace: the plan's, then (with a router) the routed ids [max_T, k] and weights
  // [max_T, k], each part 256-byte aligned.
  size_t ids_offset = 0;
  size_t weights_offset = 0;
  size_t workspace_size = 0;
  megamoe::capi::DeviceAlloc own_workspace;
  int routing_kind = MEGAMOE_ROUTING_NONE;

  // `workspace`: workspace_bytes(plan, routing) bytes of the layer's own, or none (external).
  megamoe_layer(const megamoe::capi::LayerOptions& o, megamoe::MoePlan p, megamoe::MoeDeviceWeights w,
                std::optional<megamoe::RoutingConfig> r, megamoe::capi::DeviceAlloc workspace,
                megamoe::capi::DeviceAlloc bias_on_device)
      : options(o), plan(std::move(p)), weights(std::move(w)), routing(std::move(r)), bias(std::move(bias_on_device)),
        own_workspace(std::move(workspace)) {
    const size_t routed = static_cast<size_t>(plan.problem().max_tokens) * plan.problem().top_k;
    ids_offset = megamoe::capi::align_up(plan.workspace_bytes());
    weights_offset = ids_offset + (routing ? megamoe::capi::align_up(routed * sizeof(int32_t)) : 0);
    workspace_size = workspace_bytes(plan, routing);
    if (routing) {
      routing_kind = routing->kind == megamoe::RoutingKind::kNoauxTc ? MEGAMOE_ROUTING_NOAUX_TC
                                                                     : MEGAMOE_ROUTING_SOFTMAX_TOPK;
    }
  }
  // The plan's workspace, then (with a router) the routed ids and weights.
  static size_t workspace_bytes(const megamoe::MoePlan& plan, const std::optional<megamoe::RoutingConfig>& routing) {
    using megamoe::capi::align_up;
    const size_t routed = static_cast<size_t>(plan.problem().max_tokens) * plan.problem().top_k;
    return align_up(plan.workspace_bytes()) +
           (routing ? align_up(routed * sizeof(int32_t)) + align_up(routed * sizeof(float)) : 0);
  }
};

namespace megamoe::capi {

int device_count() { return gpu::device_count(); }

megamoe_layer* create_layer(const MoeLayer& layer, const LayerOptions& options) {
  check_device(options.device);
  DeviceGuard guard(options.device);
  MoeProblem problem = MoeProblem::from_layer(layer, options.max_tokens);
  problem.deterministic = options.deterministic;
  problem.precision = options.precision;
  MoePlan plan = MoePlan::create(problem);
  DeviceAlloc workspace(options.external_workspace ? 0 : megamoe_layer::workspace_bytes(plan, layer.routing));
  DeviceAlloc bias(layer.e_score_correction_bias.size() * sizeof(float));
  if (!layer.e_score_correction_bias.empty()) {
    check_cuda(cudaMemcpy(bias.get(), layer.e_score_correction_bias.data(), layer.e_score_correction_bias.size() * sizeof(float),
                          cudaMemcpyHostToDevice),
               "cudaMemcpy(correction bias)");
  }
  MoeDeviceWeights weights = MoeDeviceWeights::upload(layer);
  return std::make_unique<megamoe_layer>(options, std::move(plan), std::move(weights), layer.routing,
                                         std::move(workspace), std::move(bias))
      .release();
}

megamoe_layer* create_layer_stacked(const StackedLayer& s, const LayerOptions& options, megamoe_stream stream) {
  check_device(options.device);
  DeviceGuard guard(options.device);
  MoeProblem problem;
  problem.hidden_size = s.hidden_size;
  problem.intermediate_size = s.intermediate_size;
  problem.num_experts = s.num_experts;
  problem.top_k = s.top_k;
  problem.shared_intermediate_size = s.shared_intermediate_size;
  problem.max_tokens = options.max_tokens;
  problem.swiglu_limit = s.swiglu_limit;
  problem.deterministic = options.deterministic;
  problem.precision = options.precision;
  // The plan first: it refuses shapes the kernels cannot run before anything is copied.
  MoePlan plan = MoePlan::create(problem);
  // The C descriptors carry const pointers; in place, the caller has said the memory is theirs
  // to rewrite (megamoe_stacked_layer.in_place).
  auto rw = [](const auto* p) { return const_cast<std::remove_const_t<std::remove_pointer_t<decltype(p)>>*>(p); };
  StackedNvfp4Buffers b;
  b.hidden_size = s.hidden_size;
  b.intermediate_size = s.intermediate_size;
  b.num_experts = s.num_experts;
  b.w13 = rw(s.w13);
  b.w13_scale = rw(s.w13_scale);
  b.w13_scale_2 = rw(s.w13_scale_2);
  b.w2 = rw(s.w2);
  b.w2_scale = rw(s.w2_scale);
  b.w2_scale_2 = rw(s.w2_scale_2);
  b.shared_intermediate_size = s.shared_intermediate_size;
  b.shared_w13 = rw(s.shared_w13);
  b.shared_w13_scale = rw(s.shared_w13_scale);
  b.shared_w13_scale_2 = rw(s.shared_w13_scale_2);
  b.shared_w2 = rw(s.shared_w2);
  b.shared_w2_scale = rw(s.shared_w2_scale);
  b.shared_w2_scale_2 = rw(s.shared_w2_scale_2);
  std::optional<RoutingConfig> routing = s.routing;
  if (routing) routing->top_k = s.top_k;
  // Everything that can fail but the weights first: an in-place rewrite must be the last step.
  DeviceAlloc workspace(options.external_workspace ? 0 : megamoe_layer::workspace_bytes(plan, routing));
  DeviceAlloc bias(s.correction_bias ? static_cast<size_t>(s.num_experts) * sizeof(float) : 0);
  if (s.correction_bias) {
    check_cuda(cudaMemcpyAsync(bias.get(), s.correction_bias, static_cast<size_t>(s.num_experts) * sizeof(float),
                               cudaMemcpyDeviceToDevice, stream),
               "cudaMemcpyAsync(correction bias)");
    check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize(correction bias)");
  }
  MoeDeviceWeights weights = s.in_place ? MoeDeviceWeights::prepack_in_place(b, stream)
                                        : MoeDeviceWeights::from_stacked(b.as_const(), stream);
  return std::make_unique<megamoe_layer>(options, std::move(plan), std::move(weights), routing, std::move(workspace),
                                         std::move(bias))
      .release();
}

void destroy_layer(megamoe_layer* layer) noexcept {
  if (!layer) return;
  // Frees on the layer's device; a failure to select it leaves nothing better to do than free.
  try {
    DeviceGuard guard(layer->options.device);
    delete layer;
  } catch (...) {
    delete layer;
  }
}

void layer_info(const megamoe_layer& layer, megamoe_layer_info& info) {
  const MoeProblem& p = layer.plan.problem();
  info.device = layer.options.device;
  info.hidden_size = p.hidden_size;
  info.intermediate_size = p.intermediate_size;
  info.num_experts = p.num_experts;
  info.shared_intermediate_size = p.shared_intermediate_size;
  info.top_k = p.top_k;
  info.routing_kind = layer.routing_kind;
  info.max_tokens = p.max_tokens;
  info.precision = static_cast<int32_t>(std::find(std::begin(kPrecisions), std::end(kPrecisions), p.precision) -
                                        std::begin(kPrecisions));
  info.deterministic = p.deterministic ? 1 : 0;
  info.external_workspace = layer.options.external_workspace ? 1 : 0;
  info.workspace_size = layer.workspace_size;
  info.weight_bytes = layer.weights.device_bytes();
}

std::string describe_layer(const megamoe_layer& layer, int64_t tokens) {
  const int64_t max = layer.plan.problem().max_tokens;
  MEGAMOE_CHECK(tokens >= 0 && tokens <= max, kInvalidArgument, "tokens is ", tokens,
                "; it must be in 0..max_tokens = ", max, ".");
  return layer.plan.describe(tokens);
}

namespace {

void* workspace_of(const megamoe_layer& layer, void* given, size_t given_size) {
  if (given == nullptr) {
    MEGAMOE_CHECK(!layer.options.external_workspace, kInvalidArgument, "workspace is NULL, but the layer "
                  "was created with options.external_workspace = 1: pass a workspace of ",
                  layer.workspace_size, " bytes (megamoe_layer_workspace_size).");
    return layer.own_workspace.get();
  }
  MEGAMOE_CHECK(given_size >= layer.workspace_size, kInvalidArgument, "workspace_size is ", given_size,
                " bytes; this layer needs ", layer.workspace_size, " (megamoe_layer_workspace_size).");
  MEGAMOE_CHECK(reinterpret_cast<uintptr_t>(given) % kAlign == 0, kInvalidArgument, "workspace ", given,
                " is not 256-byte aligned.");
  return given;
}

}  // namespace

void run_layer(megamoe_layer& layer, const RunArgs& a, megamoe_stream stream) {
  const MoeProblem& p = layer.plan.problem();
  MEGAMOE_CHECK(a.tokens >= 0 && a.tokens <= p.max_tokens, kInvalidArgument, "args.tokens is ", a.tokens,
                "; it must be in 0..max_tokens = ", p.max_tokens, " (options.max_tokens at creation).");
  // An empty batch launches nothing, as run() does; its pointers may be NULL.
  if (a.tokens == 0) return;
  const bool given_topk = a.topk_ids != nullptr || a.topk_weights != nullptr;
  if (a.router_logits) {
    MEGAMOE_CHECK(!given_topk, kInvalidArgument, "args gives both router_logits and topk_ids/topk_weights; "
                  "give one routing.");
    MEGAMOE_CHECK(layer.routing.has_value(), kInvalidArgument, "args.router_logits is given, but this layer "
                  "has no router (megamoe_stacked_layer.routing.kind was MEGAMOE_ROUTING_NONE): pass "
                  "topk_ids and topk_weights.");
  } else {
    MEGAMOE_CHECK(a.topk_ids != nullptr && a.topk_weights != nullptr, kInvalidArgument,
                  "args.topk_ids is ", a.topk_ids ? "given" : "NULL", " and args.topk_weights is ",
                  a.topk_weights ? "given" : "NULL", "; give both", layer.routing ? ", or router_logits" : "",
                  ".");
  }
  MEGAMOE_CHECK(a.hidden != nullptr, kInvalidArgument, "args.hidden is NULL; expected [T, H] bf16 on the device.");
  MEGAMOE_CHECK((a.output != nullptr) != (a.output_f32 != nullptr), kInvalidArgument, "args.output is ",
                a.output ? "given" : "NULL", " and args.output_f32 is ", a.output_f32 ? "given" : "NULL",
                "; give exactly one.");
  auto* workspace = static_cast<uint8_t*>(workspace_of(layer, a.workspace, a.workspace_size));
  DeviceGuard guard(layer.options.device);
  MoeRunArgs args;
  args.hidden = static_cast<const uint16_t*>(a.hidden);
  args.topk_ids = a.topk_ids;
  args.topk_weights = a.topk_weights;
  args.tokens = a.tokens;
  args.output = static_cast<uint16_t*>(a.output);
  args.output_f32 = a.output_f32;
  args.workspace = workspace;
  if (a.router_logits) {
    RouteArgs route;
    route.logits = a.router_logits;
    route.bias = static_cast<const float*>(layer.bias.get());
    route.tokens = a.tokens;
    route.num_experts = p.num_experts;
    route.topk_ids = reinterpret_cast<int32_t*>(workspace + layer.ids_offset);
    route.topk_weights = reinterpret_cast<float*>(workspace + layer.weights_offset);
    if (a.tokens > 0) route_topk(*layer.routing, route, stream);
    args.topk_ids = route.topk_ids;
    args.topk_weights = route.topk_weights;
  }
  run(layer.plan, layer.weights, args, stream);
}

int64_t invalid_id_count(const megamoe_layer& layer, const void* workspace, megamoe_stream stream) {
  const void* ws = workspace ? workspace : layer.own_workspace.get();
  MEGAMOE_CHECK(ws != nullptr, kInvalidArgument, "workspace is NULL, but the layer was created with "
                "options.external_workspace = 1 and has none of its own: pass the workspace of the run.");
  DeviceGuard guard(layer.options.device);
  return layer.plan.invalid_id_count(ws, stream);
}

}  // namespace megamoe::capi
