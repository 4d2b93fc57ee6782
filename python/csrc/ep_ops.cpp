// megamoe::ep_* ops: expert parallelism from PyTorch (include/megamoe/ep.h). A process makes one
// EpGroup per model (its NCCL communicator, or a virtual rank of an EpLoopback, and one window);
// each MoE layer prepares its rank's experts over the module's own tensors, rewritten in place
// (MoeDeviceWeights::prepack_in_place: the weights are held once), and fused_moe_nvfp4_ep runs it.
// Groups, loopbacks and layers live in registries under integer handles, as prepared layers do.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "megamoe/gpu.h"
#include "megamoe/precision.h"
#include "megamoe/runtime.h"
#include "moe_registry.h"
#include "moe_stacked.h"
#include "torch_utils.h"

#if MEGAMOE_HAS_EP
#include "megamoe/ep.h"
#endif

namespace megamoe::torch_ext {
namespace {

constexpr const char* kUniqueId = "ep_unique_id";
constexpr const char* kLoopbackCreate = "ep_loopback_create";
constexpr const char* kLoopbackStream = "ep_loopback_stream";
constexpr const char* kGroupCreate = "ep_group_create";
constexpr const char* kPrepare = "ep_prepare";
constexpr const char* kFused = "fused_moe_nvfp4_ep";
constexpr const char* kRelease = "ep_release";
constexpr const char* kDescribe = "ep_describe";

#if MEGAMOE_HAS_EP

struct LoopbackEntry {
  EpLoopback loopback;
};

struct GroupEntry {
  EpGroup group;
  at::Device device;
  cudaStream_t required_stream = nullptr;  // a loopback rank's stream; null for NCCL groups
};

struct PreparedEp {
  PreparedEp(at::Device dev, MoeEpLayer l, int64_t k, std::vector<Fingerprint> src)
      : device(dev), layer(std::move(l)), top_k(k), sources(std::move(src)) {}
  at::Device device;
  MoeEpLayer layer;
  int64_t top_k;
  std::vector<Fingerprint> sources;
};

// Never destroyed, as registry() (moe_registry.h): objects live at exit must not be freed after
// the CUDA runtime has shut down.
HandleRegistry<LoopbackEntry>& loopbacks() {
  static auto* r = new HandleRegistry<LoopbackEntry>("expert-parallel loopback", "megamoe.ep_loopback_create");
  return *r;
}
HandleRegistry<GroupEntry>& groups() {
  static auto* r = new HandleRegistry<GroupEntry>("expert-parallel group", "megamoe.ep_group_create");
  return *r;
}
HandleRegistry<PreparedEp>& layers() {
  static auto* r = new HandleRegistry<PreparedEp>("expert-parallel layer", "megamoe.ep_prepare");
  return *r;
}

int device_index(const c10::Device& device, const char* op) {
  TORCH_CHECK_VALUE(device.is_cuda(), "megamoe.", op, ": ", device, " is not a CUDA device.");
  return device.has_index() ? device.index() : static_cast<int>(c10::cuda::current_device());
}

std::string ep_unique_id() {
  return translate_errors(kUniqueId, [] { return EpUniqueId::create().to_hex(); });
}

int64_t ep_loopback_create(int64_t world_size, c10::Device device) {
  return translate_errors(kLoopbackCreate, [&] {
    TORCH_CHECK_VALUE(world_size >= 1 && world_size <= 8, "megamoe.", kLoopbackCreate, ": world_size = ",
                      world_size, " must be in 1..8.");
    const int index = device_index(device, kLoopbackCreate);
    const c10::cuda::CUDAGuard guard(index);
    return loopbacks().add(std::make_shared<LoopbackEntry>(
        LoopbackEntry{EpLoopback::create(static_cast<int>(world_size), index)}));
  });
}

// Rank `rank`'s stream as an integer (torch.cuda.ExternalStream takes it), and its SM count.
std::tuple<int64_t, int64_t> ep_loopback_stream(int64_t loopback, int64_t rank) {
  return translate_errors(kLoopbackStream, [&] {
    const auto lb = loopbacks().get(loopback, kLoopbackStream);
    TORCH_CHECK_VALUE(rank >= 0 && rank < lb->loopback.world_size(), "megamoe.", kLoopbackStream, ": rank ", rank,
                      " is out of range for a loopback of ", lb->loopback.world_size(), " ranks.");
    const auto stream = reinterpret_cast<intptr_t>(lb->loopback.stream(static_cast<int>(rank)));
    return std::make_tuple(static_cast<int64_t>(stream), static_cast<int64_t>(lb->loopback.sms_per_rank()));
  });
}

int64_t ep_group_create(const std::string& unique_id, int64_t rank, int64_t world_size, c10::Device device,
                        int64_t max_tokens_per_rank, int64_t hidden_size, int64_t top_k, double timeout_seconds,
                        const std::string& precision, int64_t loopback) {
  return translate_errors(kGroupCreate, [&] {
    TORCH_CHECK_VALUE(world_size >= 1 && world_size <= 8 && rank >= 0 && rank < world_size, "megamoe.",
                      kGroupCreate, ": rank ", rank, " of world size ", world_size,
                      " is out of range (world size 1..8).");
    TORCH_CHECK_VALUE(max_tokens_per_rank >= 1 && max_tokens_per_rank <= (int64_t{1} << 20), "megamoe.",
                      kGroupCreate, ": max_tokens_per_rank = ", max_tokens_per_rank, " must be in 1..1048576.");
    TORCH_CHECK_VALUE(top_k >= 1 && top_k <= 16 && hidden_size >= 1 && hidden_size <= INT_MAX, "megamoe.",
                      kGroupCreate, ": hidden_size = ", hidden_size, ", top_k = ", top_k,
                      "; top_k must be in 1..16.");
    TORCH_CHECK_VALUE(timeout_seconds > 0, "megamoe.", kGroupCreate, ": timeout_seconds = ", timeout_seconds,
                      " must be > 0.");
    const int index = device_index(device, kGroupCreate);
    EpConfig cfg;
    cfg.world_size = static_cast<int>(world_size);
    cfg.rank = static_cast<int>(rank);
    cfg.device = index;
    cfg.max_tokens_per_rank = max_tokens_per_rank;
    cfg.timeout_seconds = timeout_seconds;
    cfg.precision = parse_precision(precision);
    const c10::cuda::CUDAGuard guard(index);
    if (loopback > 0) {
      const auto lb = loopbacks().get(loopback, kGroupCreate);
      TORCH_CHECK_VALUE(lb->loopback.world_size() == world_size && lb->loopback.device() == index, "megamoe.",
                        kGroupCreate, ": loopback ", loopback, " has ", lb->loopback.world_size(),
                        " ranks on device ", lb->loopback.device(), "; the group asks for ", world_size,
                        " on device ", index, ".");
      EpGroup group = EpGroup::create(cfg, lb->loopback, hidden_size, static_cast<int>(top_k));
      return groups().add(std::make_shared<GroupEntry>(
          GroupEntry{std::move(group), at::Device(at::kCUDA, index), lb->loopback.stream(static_cast<int>(rank))}));
    }
    EpGroup group = EpGroup::create(cfg, EpUniqueId::from_hex(unique_id), hidden_size, static_cast<int>(top_k));
    return groups().add(
        std::make_shared<GroupEntry>(GroupEntry{std::move(group), at::Device(at::kCUDA, index), nullptr}));
  });
}

// The shared expert's tensors viewed as a one-expert stacked layer ([1, 2Is, H/2], ...).
Stacked shared_as_layer(const Stacked& s) {
  auto one = [](const at::Tensor& t) {
    std::vector<int64_t> sizes{1};
    for (int64_t d : t.sizes()) sizes.push_back(d);
    return t.view(sizes);
  };
  return Stacked{one(*s.shared_w13), one(*s.shared_w13_scale), s.shared_w13_scale_2->view({1, 2}),
                 one(*s.shared_w2), one(*s.shared_w2_scale), s.shared_w2_scale_2->view({1}),
                 std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt};
}

int64_t ep_prepare(int64_t group, const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_scale_2,
                   const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_scale_2,
                   const std::optional<at::Tensor>& shared_w13, const std::optional<at::Tensor>& shared_w13_scale,
                   const std::optional<at::Tensor>& shared_w13_scale_2, const std::optional<at::Tensor>& shared_w2,
                   const std::optional<at::Tensor>& shared_w2_scale, const std::optional<at::Tensor>& shared_w2_scale_2,
                   int64_t num_experts, int64_t top_k, std::optional<double> swiglu_limit, bool deterministic,
                   bool prepacked) {
  return translate_errors(kPrepare, [&] {
    const auto g = groups().get(group, kPrepare);
    const Stacked s{w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, shared_w13,
                    shared_w13_scale, shared_w13_scale_2, shared_w2, shared_w2_scale, shared_w2_scale_2};
    const LayerShape L = check_stacked(kPrepare, s);
    TORCH_CHECK_VALUE(L.device == g->device, "megamoe.", kPrepare, ": the weights are on ", L.device,
                      "; group ", group, " runs on ", g->device, ".");
    TORCH_CHECK_VALUE(top_k >= 1 && top_k <= 16, "megamoe.", kPrepare, ": top_k = ", top_k, " must be in 1..16.");
    const c10::cuda::CUDAGuard guard(L.device);
    const cudaStream_t stream = current_stream(L.device);
    const Stacked routed{w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, std::nullopt, std::nullopt,
                         std::nullopt, std::nullopt, std::nullopt, std::nullopt};
    LayerShape routed_shape = L;
    routed_shape.shared_inter = 0;
    // The shared expert runs on the rank's own tokens as a one-expert layer of its own I.
    auto weights_of = [&](const Stacked& t, const LayerShape& shape) {
      return prepacked ? MoeDeviceWeights::view_prepacked(device_view(t, shape), stream)
                       : MoeDeviceWeights::prepack_in_place(writable_view(t, shape), stream);
    };
    EpLayerOptions o;
    o.num_experts = num_experts;
    o.top_k = static_cast<int>(top_k);
    if (swiglu_limit) o.swiglu_limit = static_cast<float>(*swiglu_limit);
    o.deterministic = deterministic;
    // What the EP layer would refuse, refused before anything is rewritten.
    const EpConfig& cfg = g->group.config();
    const EpExpertRange range = ep_expert_range(num_experts, cfg.world_size, cfg.rank);
    TORCH_CHECK_VALUE(L.experts == range.count, "megamoe.", kPrepare, ": w13 holds ", L.experts,
                      " experts; rank ", cfg.rank, " of ", cfg.world_size, " owns ", range.count, " of the ",
                      num_experts, ".");
    TORCH_CHECK_VALUE(range.count >= top_k, "megamoe.", kPrepare, ": ", range.count,
                      " experts per rank is fewer than top_k = ", top_k, "; use fewer ranks.");
    TORCH_CHECK_VALUE(cfg.world_size > 1, "megamoe.", kPrepare, ": a group of one rank is the single-GPU layer: "
                      "prepare it with moe_prepare_in_place (NVFP4MoE does so by itself).");
    std::optional<MoeDeviceWeights> shared_weights, routed_weights;
    std::optional<LayerShape> shared_shape;
    if (L.shared_inter > 0) {
      shared_shape = L;
      shared_shape->experts = 1;
      shared_shape->inter = L.shared_inter;
      shared_shape->shared_inter = 0;
      shared_weights.emplace(weights_of(shared_as_layer(s), *shared_shape));
    }
    try {
      routed_weights.emplace(weights_of(routed, routed_shape));
    } catch (const Error& e) {
      // A refused routed layer leaves the tensors as they were: give the shared expert its
      // checkpoint layout back.
      if (!prepacked && shared_shape && e.code() == ErrorCode::kInvalidArgument) {
        const Stacked one = shared_as_layer(s);
        unprepack_stacked(shared_weights->layout(), device_view(one, *shared_shape),
                          writable_view(one, *shared_shape), stream);
      }
      throw;
    }
    if (!prepacked) mark_written(s.present());
    MoeEpLayer layer = MoeEpLayer::create(EpLocalWeights{std::move(*routed_weights), std::move(shared_weights)}, o,
                                          g->group);
    std::vector<Fingerprint> sources;
    for (const auto& [name, t] : s.present()) sources.push_back(Fingerprint::of(name, t));
    return layers().add(std::make_shared<PreparedEp>(L.device, std::move(layer), top_k, std::move(sources)));
  });
}

at::Tensor fused_moe_nvfp4_ep_cuda(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w13_scale,
                                   const at::Tensor& w13_scale_2, const at::Tensor& w2, const at::Tensor& w2_scale,
                                   const at::Tensor& w2_scale_2, const at::Tensor& topk_weights,
                                   const at::Tensor& topk_ids, int64_t handle,
                                   const std::optional<at::Tensor>& shared_w13,
                                   const std::optional<at::Tensor>& shared_w13_scale,
                                   const std::optional<at::Tensor>& shared_w13_scale_2,
                                   const std::optional<at::Tensor>& shared_w2,
                                   const std::optional<at::Tensor>& shared_w2_scale,
                                   const std::optional<at::Tensor>& shared_w2_scale_2, bool check_ids) {
  return translate_errors(kFused, [&] {
    const std::shared_ptr<PreparedEp> p = layers().get(handle, kFused);
    const Stacked s{w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, shared_w13,
                    shared_w13_scale, shared_w13_scale_2, shared_w2, shared_w2_scale, shared_w2_scale_2};
    check_fingerprints(kFused, handle, p->sources, s.present());
    MoeEpLayer& layer = p->layer;
    const EpConfig& cfg = layer.config();
    const int64_t H = w13.size(2) * 2, E = layer.experts().count * cfg.world_size;
    arg(kFused, "hidden", hidden).on(p->device).dtype({at::kBFloat16})
        .shape({-1, H}, "[T, H] bf16 tokens of this rank").contiguous().aligned(16);
    const int64_t T = hidden.size(0), k = p->top_k;
    arg(kFused, "topk_ids", topk_ids).on(p->device).dtype({at::kInt, at::kLong})
        .shape({T, k}, "[T, top_k] global expert ids, top_k of the prepared layer").contiguous();
    arg(kFused, "topk_weights", topk_weights).on(p->device).dtype({at::kFloat, at::kBFloat16, at::kHalf})
        .shape({T, k}, "[T, top_k] routing weights").contiguous();
    TORCH_CHECK_VALUE(T <= cfg.max_tokens_per_rank, "megamoe.", kFused, ": hidden has T = ", T,
                      " tokens, more than the group's max_tokens_per_rank = ", cfg.max_tokens_per_rank,
                      "; every rank must run the layer the same number of times, so the batch is not split "
                      "here: make the group with a larger max_tokens_per_rank.");
    const c10::cuda::CUDAGuard guard(p->device);
    at::Tensor out = at::empty({T, H}, hidden.options());
    const at::Tensor ids = topk_ids.scalar_type() == at::kInt ? topk_ids : topk_ids.clamp(-1, E).to(at::kInt);
    const at::Tensor weights = topk_weights.to(at::kFloat);
    const cudaStream_t stream = current_stream(p->device);
    MoeRunArgs a;
    a.tokens = T;
    if (T > 0) {
      a.hidden = static_cast<const uint16_t*>(hidden.const_data_ptr());
      a.topk_ids = ids.const_data_ptr<int32_t>();
      a.topk_weights = weights.const_data_ptr<float>();
      a.output = static_cast<uint16_t*>(out.data_ptr());
    }
    layer.run(a, stream);
    if (check_ids && !is_capturing(stream)) {
      layer.check(stream);
      const int64_t bad = layer.invalid_id_count(stream);
      TORCH_CHECK_INDEX(bad == 0, "megamoe.", kFused, ": ", bad, " top-k ids of the group's last run are outside "
                        "[0, num_experts = ", E, "); their slots were skipped. Pass ids in range (check_ids=False "
                        "skips this check and its host synchronisation).");
    }
    return out;
  });
}

void ep_release(int64_t handle, const std::string& kind) {
  translate_errors(kRelease, [&] {
    if (kind == "layer") {
      const auto p = layers().remove(handle, kRelease);
      // Work queued with this layer may still run (on any stream): let it end before its
      // workspaces go.
      const c10::cuda::CUDAGuard guard(p->device);
      gpu::check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize(before releasing an EP layer)");
    } else if (kind == "group") {
      groups().remove(handle, kRelease);  // its layers keep it alive as long as they live
    } else if (kind == "loopback") {
      loopbacks().remove(handle, kRelease);
    } else {
      TORCH_CHECK_VALUE(false, "megamoe.", kRelease, ": kind ", kind, " is not one of layer, group, loopback.");
    }
  });
}

std::string ep_describe(int64_t handle, const std::string& kind) {
  return translate_errors(kDescribe, [&] {
    std::ostringstream os;
    if (kind == "group") {
      const auto g = groups().get(handle, kDescribe);
      const EpConfig& c = g->group.config();
      os << "megamoe expert-parallel group " << handle << ": rank " << c.rank << " of " << c.world_size << " on "
         << g->device << (g->required_stream ? " (loopback)" : " (NCCL)") << ", max_tokens_per_rank "
         << c.max_tokens_per_rank << ", window and scratch " << g->group.device_bytes() << " B";
      return os.str();
    }
    TORCH_CHECK_VALUE(kind == "layer", "megamoe.", kDescribe, ": kind ", kind, " is not one of layer, group.");
    const auto p = layers().get(handle, kDescribe);
    const EpConfig& c = p->layer.config();
    const EpExpertRange r = p->layer.experts();
    os << "megamoe expert-parallel layer " << handle << ": rank " << c.rank << " of " << c.world_size
       << ", experts [" << r.first << ", " << r.first + r.count << "), weights held in place ("
       << p->layer.device_bytes() << " B allocated), group window and scratch " << p->layer.group().device_bytes()
       << " B";
    return os.str();
  });
}

#else  // !MEGAMOE_HAS_EP

[[noreturn]] void no_ep(const char* op) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "megamoe.", op, ": this build has no expert parallelism (configured with "
                              "MEGAMOE_EP=OFF, or without NCCL 2.28.9).");
}
std::string ep_unique_id() { no_ep(kUniqueId); }
int64_t ep_loopback_create(int64_t, c10::Device) { no_ep(kLoopbackCreate); }
std::tuple<int64_t, int64_t> ep_loopback_stream(int64_t, int64_t) { no_ep(kLoopbackStream); }
int64_t ep_group_create(const std::string&, int64_t, int64_t, c10::Device, int64_t, int64_t, int64_t, double,
                        const std::string&, int64_t) {
  no_ep(kGroupCreate);
}
int64_t ep_prepare(int64_t, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                   const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                   const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                   const std::optional<at::Tensor>&, int64_t, int64_t, std::optional<double>, bool, bool) {
  no_ep(kPrepare);
}
at::Tensor fused_moe_nvfp4_ep_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, int64_t, const std::optional<at::Tensor>&,
                                   const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                   const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                   const std::optional<at::Tensor>&, bool) {
  no_ep(kFused);
}
void ep_release(int64_t, const std::string&) { no_ep(kRelease); }
std::string ep_describe(int64_t, const std::string&) { no_ep(kDescribe); }

#endif  // MEGAMOE_HAS_EP

}  // namespace

TORCH_LIBRARY_IMPL(megamoe, CompositeImplicitAutograd, m) {
  m.impl("ep_unique_id", &ep_unique_id);
  m.impl("ep_loopback_create", &ep_loopback_create);
  m.impl("ep_loopback_stream", &ep_loopback_stream);
  m.impl("ep_group_create", &ep_group_create);
  m.impl("ep_release", &ep_release);
  m.impl("ep_describe", &ep_describe);
}

TORCH_LIBRARY_IMPL(megamoe, CompositeExplicitAutograd, m) { m.impl("ep_prepare", &ep_prepare); }

TORCH_LIBRARY_IMPL(megamoe, CUDA, m) { m.impl("fused_moe_nvfp4_ep", &fused_moe_nvfp4_ep_cuda); }

}  // namespace megamoe::torch_ext
