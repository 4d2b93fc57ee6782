// megamoe::moe_prepare / moe_release / moe_describe and megamoe::fused_moe_nvfp4.
//
// A prepared layer (MoePlan + prepacked MoeDeviceWeights + workspace) is built once from the
// stacked weights by moe_prepare and lives in a process-wide registry under an integer handle:
// an int is what torch.compile can carry through a graph as a constant, and what a CUDA graph
// replay needs (the workspace and the prepacked weights stay at fixed addresses). The fused op
// takes the stacked weights too, so the call states what it computes; it checks that they are the
// very tensors the handle was prepared from, unchanged, and never re-prepares.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <climits>
#include <cmath>
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

namespace megamoe::torch_ext {
namespace {

constexpr const char* kPrepare = "moe_prepare";
constexpr const char* kFused = "fused_moe_nvfp4";
constexpr const char* kRelease = "moe_release";
constexpr const char* kDescribe = "moe_describe";
constexpr const char* kPrepareInPlace = "moe_prepare_in_place";
constexpr const char* kLayout = "moe_weight_layout";
constexpr const char* kPrepackedLayout = "moe_prepacked_layout";
constexpr const char* kWorkspaceBytes = "moe_workspace_bytes";
constexpr const char* kSetWorkspace = "moe_set_workspace";
constexpr const char* kUnprepack = "moe_unprepack";
constexpr const char* kUnprepackInPlace = "moe_unprepack_in_place";

std::string limit_string(const std::optional<float>& limit) {
  return limit ? std::to_string(*limit) : std::string("None");
}

// Where a prepared layer's weights come from (MoeDeviceWeights): a prepacked copy, the caller's
// tensors rewritten in place, or the caller's tensors already rewritten.
enum class Source { kCopy, kInPlace, kPrepacked };

int64_t prepare(const char* op, Source source, const Stacked& s, int64_t top_k, int64_t max_tokens,
                std::optional<double> swiglu_limit, bool deterministic, const std::string& precision) {
  const LayerShape L = check_stacked(op, s);
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= INT_MAX, "megamoe.", op, ": top_k = ", top_k, " must be >= 1.");
  MoeProblem problem;
  problem.hidden_size = L.hidden;
  problem.intermediate_size = L.inter;
  problem.num_experts = L.experts;
  problem.top_k = static_cast<int>(top_k);
  problem.shared_intermediate_size = L.shared_inter;
  problem.max_tokens = max_tokens;
  if (swiglu_limit) problem.swiglu_limit = static_cast<float>(*swiglu_limit);
  problem.deterministic = deterministic;
  // A bad name is kInvalidArgument (ValueError); a precision that no GPU kernel of this build
  // serves fails in MoePlan::create (kUnsupported: NotImplementedError).
  problem.precision = parse_precision(precision);

  const c10::cuda::CUDAGuard guard(L.device);
  MoePlan plan = MoePlan::create(problem);
  const cudaStream_t stream = current_stream(L.device);
  // Allocated first: nothing after an in-place rewrite may fail but the rewrite itself.
  const int64_t ws_bytes = std::max<int64_t>(static_cast<int64_t>(plan.workspace_bytes()), 256);
  at::Tensor workspace = at::empty({ws_bytes}, at::TensorOptions().dtype(at::kByte).device(L.device));
  MoeDeviceWeights weights = source == Source::kCopy      ? MoeDeviceWeights::from_stacked(device_view(s, L), stream)
                             : source == Source::kInPlace ? MoeDeviceWeights::prepack_in_place(writable_view(s, L), stream)
                                                          : MoeDeviceWeights::view_prepacked(device_view(s, L), stream);
  if (source == Source::kInPlace) mark_written(s.present());
  // Taken after an in-place rewrite: the fused op compares against the tensors as they are now.
  std::vector<Fingerprint> sources;
  for (const auto& [name, t] : s.present()) sources.push_back(Fingerprint::of(name, t));
  return registry().add(std::make_shared<PreparedMoe>(L.device, std::move(plan), std::move(weights),
                                                      std::move(workspace), std::move(sources)));
}

int64_t moe_prepare(const at::Tensor& w13, const at::Tensor& w13_scale,
                    const at::Tensor& w13_scale_2, const at::Tensor& w2, const at::Tensor& w2_scale,
                    const at::Tensor& w2_scale_2, int64_t top_k, int64_t max_tokens,
                    std::optional<double> swiglu_limit, bool deterministic,
                    const std::optional<at::Tensor>& shared_w13,
                    const std::optional<at::Tensor>& shared_w13_scale,
                    const std::optional<at::Tensor>& shared_w13_scale_2,
                    const std::optional<at::Tensor>& shared_w2,
                    const std::optional<at::Tensor>& shared_w2_scale,
                    const std::optional<at::Tensor>& shared_w2_scale_2,
                    const std::string& precision, bool prepacked) {
  return translate_errors(kPrepare, [&] {
    const Stacked s{w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, shared_w13,
                    shared_w13_scale, shared_w13_scale_2, shared_w2, shared_w2_scale,
                    shared_w2_scale_2};
    return prepare(kPrepare, prepacked ? Source::kPrepacked : Source::kCopy, s, top_k, max_tokens, swiglu_limit,
                   deterministic, precision);
  });
}

int64_t moe_prepare_in_place(const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_scale_2,
                             const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_scale_2,
                             int64_t top_k, int64_t max_tokens, std::optional<double> swiglu_limit,
                             bool deterministic, const std::optional<at::Tensor>& shared_w13,
                             const std::optional<at::Tensor>& shared_w13_scale,
                             const std::optional<at::Tensor>& shared_w13_scale_2,
                             const std::optional<at::Tensor>& shared_w2,
                             const std::optional<at::Tensor>& shared_w2_scale,
                             const std::optional<at::Tensor>& shared_w2_scale_2, const std::string& precision) {
  return translate_errors(kPrepareInPlace, [&] {
    const Stacked s{w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, shared_w13,
                    shared_w13_scale, shared_w13_scale_2, shared_w2, shared_w2_scale,
                    shared_w2_scale_2};
    return prepare(kPrepareInPlace, Source::kInPlace, s, top_k, max_tokens, swiglu_limit, deterministic,
                   precision);
  });
}

std::string moe_prepacked_layout(c10::Device device) {
  return translate_errors(kPrepackedLayout, [&] {
    TORCH_CHECK_VALUE(device.is_cuda(), "megamoe.", kPrepackedLayout, ": ", device,
                      " is not a CUDA device; prepacked layouts are the GPU kernels'.");
    const c10::cuda::CUDAGuard guard(device);
    return prepacked_layout();
  });
}

int64_t moe_workspace_bytes(int64_t handle) {
  return translate_errors(kWorkspaceBytes, [&] {
    return std::max<int64_t>(static_cast<int64_t>(registry().get(handle, kWorkspaceBytes)->plan.workspace_bytes()), 256);
  });
}

void moe_set_workspace(int64_t handle, const at::Tensor& workspace) {
  translate_errors(kSetWorkspace, [&] {
    const std::shared_ptr<PreparedMoe> p = registry().get(handle, kSetWorkspace);
    const int64_t need = std::max<int64_t>(static_cast<int64_t>(p->plan.workspace_bytes()), 256);
    arg(kSetWorkspace, "workspace", workspace).on(p->device).dtype({at::kByte})
        .dims(1, "[bytes] uint8").contiguous().aligned(256);
    TORCH_CHECK_VALUE(workspace.numel() >= need, "megamoe.", kSetWorkspace, ": workspace has ", workspace.numel(),
                      " bytes; handle ", handle, " needs ", need, " (moe_workspace_bytes).");
    p->set_workspace(workspace);
  });
}

std::string moe_weight_layout(int64_t handle) {
  return translate_errors(kLayout, [&] { return std::string(registry().get(handle, kLayout)->weights.layout()); });
}

// The stacked tensors of `s` in the checkpoint layout, read from `layout` (unprepack_stacked):
// into new CPU tensors, or back into `s`'s own memory.
std::vector<at::Tensor> unprepack(const char* op, const std::string& layout, const Stacked& s, bool in_place) {
  const LayerShape L = check_stacked(op, s, /*any_device=*/true);
  std::optional<c10::cuda::CUDAGuard> guard;
  if (L.device.is_cuda()) guard.emplace(L.device);
  const cudaStream_t stream = L.device.is_cuda() ? current_stream(L.device) : nullptr;
  if (in_place) {
    unprepack_stacked(layout, device_view(s, L), writable_view(s, L), stream);
    mark_written(s.present());
    return {};
  }
  std::vector<at::Tensor> out;
  auto like = [&](const at::Tensor& t) {
    out.push_back(at::empty(t.sizes(), t.options().device(at::kCPU)));
    return out.back();
  };
  auto like_opt = [&](const std::optional<at::Tensor>& t) -> std::optional<at::Tensor> {
    if (L.shared_inter == 0) return std::nullopt;
    return like(*t);
  };
  const at::Tensor o_w13 = like(s.w13), o_w13_scale = like(s.w13_scale), o_w13_scale_2 = like(s.w13_scale_2);
  const at::Tensor o_w2 = like(s.w2), o_w2_scale = like(s.w2_scale), o_w2_scale_2 = like(s.w2_scale_2);
  const auto o_sw13 = like_opt(s.shared_w13), o_sw13_scale = like_opt(s.shared_w13_scale),
             o_sw13_scale_2 = like_opt(s.shared_w13_scale_2), o_sw2 = like_opt(s.shared_w2),
             o_sw2_scale = like_opt(s.shared_w2_scale), o_sw2_scale_2 = like_opt(s.shared_w2_scale_2);
  const Stacked o{o_w13, o_w13_scale, o_w13_scale_2, o_w2, o_w2_scale, o_w2_scale_2, o_sw13,
                  o_sw13_scale, o_sw13_scale_2, o_sw2, o_sw2_scale, o_sw2_scale_2};
  unprepack_stacked(layout, device_view(s, L), writable_view(o, L), stream);
  return out;
}

std::vector<at::Tensor> moe_unprepack(const std::string& layout, const at::Tensor& w13, const at::Tensor& w13_scale,
                                      const at::Tensor& w13_scale_2, const at::Tensor& w2,
                                      const at::Tensor& w2_scale, const at::Tensor& w2_scale_2,
                                      const std::optional<at::Tensor>& shared_w13,
                                      const std::optional<at::Tensor>& shared_w13_scale,
                                      const std::optional<at::Tensor>& shared_w13_scale_2,
                                      const std::optional<at::Tensor>& shared_w2,
                                      const std::optional<at::Tensor>& shared_w2_scale,
                                      const std::optional<at::Tensor>& shared_w2_scale_2) {
  return translate_errors(kUnprepack, [&] {
    const Stacked s{w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, shared_w13,
                    shared_w13_scale, shared_w13_scale_2, shared_w2, shared_w2_scale,
                    shared_w2_scale_2};
    return unprepack(kUnprepack, layout, s, /*in_place=*/false);
  });
}

void moe_unprepack_in_place(const std::string& layout, const at::Tensor& w13, const at::Tensor& w13_scale,
                            const at::Tensor& w13_scale_2, const at::Tensor& w2, const at::Tensor& w2_scale,
                            const at::Tensor& w2_scale_2, const std::optional<at::Tensor>& shared_w13,
                            const std::optional<at::Tensor>& shared_w13_scale,
                            const std::optional<at::Tensor>& shared_w13_scale_2,
                            const std::optional<at::Tensor>& shared_w2,
                            const std::optional<at::Tensor>& shared_w2_scale,
                            const std::optional<at::Tensor>& shared_w2_scale_2) {
  translate_errors(kUnprepackInPlace, [&] {
    const Stacked s{w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, shared_w13,
                    shared_w13_scale, shared_w13_scale_2, shared_w2, shared_w2_scale,
                    shared_w2_scale_2};
    unprepack(kUnprepackInPlace, layout, s, /*in_place=*/true);
  });
}

void moe_release(int64_t handle) {
  translate_errors(kRelease, [&] {
    std::shared_ptr<PreparedMoe> p = registry().remove(handle, kRelease);
    // Work queued with this layer may still be running (on any stream): let it finish before
    // its weights and workspace are freed. Releasing is rare (a module going away).
    const c10::cuda::CUDAGuard guard(p->device);
    gpu::check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize(before releasing a layer)");
  });
}

std::string moe_describe(int64_t handle, int64_t tokens) {
  return translate_errors(kDescribe, [&] {
    const std::shared_ptr<PreparedMoe> p = registry().get(handle, kDescribe);
    const MoeProblem& pr = p->plan.problem();
    std::ostringstream os;
    os << "megamoe layer " << handle << " on " << p->device << ": H=" << pr.hidden_size
       << " I=" << pr.intermediate_size << " E=" << pr.num_experts << " top_k=" << pr.top_k
       << " shared_I=" << pr.shared_intermediate_size << " max_tokens=" << pr.max_tokens
       << " swiglu_limit=" << limit_string(pr.swiglu_limit)
       << " precision=" << precision_name(pr.precision) << "; "
       << (p->weights.views_caller_memory() ? "weights prepacked in place (layout " : "prepacked copy of the weights (layout ")
       << p->weights.layout() << "), " << p->weights.device_bytes() << " B allocated, workspace "
       << p->workspace().numel() << " B; "
       << p->plan.describe(tokens);
    return os.str();
  });
}

// The source tensors and options of the call must be those the handle was prepared with.
void check_same_layer(const PreparedMoe& p, const Stacked& s, std::optional<double> swiglu_limit,
                      bool deterministic, int64_t handle) {
  check_fingerprints(kFused, handle, p.sources, s.present());
  const MoeProblem& pr = p.plan.problem();
  const std::optional<float> limit =
      swiglu_limit ? std::optional<float>(static_cast<float>(*swiglu_limit)) : std::nullopt;
  TORCH_CHECK_VALUE(limit == pr.swiglu_limit && deterministic == pr.deterministic, "megamoe.",
                    kFused, ": the call asks for swiglu_limit=", limit_string(limit),
                    ", deterministic=", deterministic ? "True" : "False", " but handle ", handle,
                    " was prepared with swiglu_limit=", limit_string(pr.swiglu_limit),
                    ", deterministic=", pr.deterministic ? "True" : "False",
                    "; options are fixed at prepare time.");
}

at::Tensor fused_moe_nvfp4_cuda(
    const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w13_scale,
    const at::Tensor& w13_scale_2, const at::Tensor& w2, const at::Tensor& w2_scale,
    const at::Tensor& w2_scale_2, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
    int64_t handle, std::optional<double> swiglu_limit, bool deterministic,
    const std::optional<at::Tensor>& shared_w13, const std::optional<at::Tensor>& shared_w13_scale,
    const std::optional<at::Tensor>& shared_w13_scale_2,
    const std::optional<at::Tensor>& shared_w2, const std::optional<at::Tensor>& shared_w2_scale,
    const std::optional<at::Tensor>& shared_w2_scale_2, bool check_ids, bool fp32_output) {
  return translate_errors(kFused, [&] {
    const std::shared_ptr<PreparedMoe> p = registry().get(handle, kFused);
    const Stacked s{w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, shared_w13,
                    shared_w13_scale, shared_w13_scale_2, shared_w2, shared_w2_scale,
                    shared_w2_scale_2};
    check_same_layer(*p, s, swiglu_limit, deterministic, handle);
    const MoeProblem& pr = p->plan.problem();
    const int64_t H = pr.hidden_size, E = pr.num_experts, k = pr.top_k;

    arg(kFused, "hidden", hidden).on(p->device).dtype({at::kBFloat16})
        .shape({-1, H}, "[T, H] bf16 tokens").contiguous().aligned(16);
    const int64_t T = hidden.size(0);
    arg(kFused, "topk_ids", topk_ids).on(p->device).dtype({at::kInt, at::kLong})
        .shape({T, k}, "[T, top_k] expert ids, top_k of the prepared layer").contiguous();
    arg(kFused, "topk_weights", topk_weights).on(p->device)
        .dtype({at::kFloat, at::kBFloat16, at::kHalf})
        .shape({T, k}, "[T, top_k] routing weights").contiguous();
    TORCH_CHECK_VALUE(T <= pr.max_tokens, "megamoe.", kFused, ": hidden has T = ", T,
                      " tokens, more than max_tokens = ", pr.max_tokens, " of handle ", handle,
                      "; prepare with a larger max_tokens, or split the batch.");

    const c10::cuda::CUDAGuard guard(p->device);
    at::Tensor out = at::empty({T, H}, hidden.options().dtype(fp32_output ? at::kFloat : at::kBFloat16));
    if (T == 0) return out;
    // int64 ids (torch.topk's) are clamped to [-1, E] first, so that narrowing to int32 cannot
    // wrap an out-of-range id into a valid one; -1 and E are then counted as invalid.
    const at::Tensor ids = topk_ids.scalar_type() == at::kInt
                               ? topk_ids
                               : topk_ids.clamp(-1, E).to(at::kInt);
    const at::Tensor weights = topk_weights.to(at::kFloat);
    const cudaStream_t stream = current_stream(p->device);
    MoeRunArgs a;
    a.hidden = static_cast<const uint16_t*>(hidden.const_data_ptr());
    a.topk_ids = ids.const_data_ptr<int32_t>();
    a.topk_weights = weights.const_data_ptr<float>();
    a.tokens = T;
    if (fp32_output) {
      a.output_f32 = out.data_ptr<float>();
    } else {
      a.output = static_cast<uint16_t*>(out.data_ptr());
    }
    const at::Tensor workspace = p->workspace();  // held for the call
    a.workspace = workspace.data_ptr();
    megamoe::run(p->plan, p->weights, a, stream);
    if (check_ids && !is_capturing(stream)) {
      const int64_t bad = p->plan.invalid_id_count(a.workspace, stream);
      TORCH_CHECK_INDEX(bad == 0, "megamoe.", kFused, ": ", bad, " of the ", T * k,
                        " top-k ids are outside [0, num_experts = ", E,
                        "); their slots were skipped. Pass ids in range (check_ids=False skips "
                        "this check and its host synchronisation; under CUDA-graph capture it "
                        "is always skipped).");
    }
    return out;
  });
}

at::Tensor fused_moe_nvfp4_cpu(
    const at::Tensor& hidden, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, int64_t, std::optional<double>, bool, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, bool, bool) {
  TORCH_CHECK_VALUE(false, "megamoe.", kFused, ": runs on CUDA tensors (a Hopper GPU); hidden "
                    "and the weights are on ", hidden.device(), ".");
}

}  // namespace

TORCH_LIBRARY_IMPL(megamoe, CompositeImplicitAutograd, m) {
  m.impl("moe_prepare", &moe_prepare);
  m.impl("moe_weight_layout", &moe_weight_layout);
  m.impl("moe_prepacked_layout", &moe_prepacked_layout);
  m.impl("moe_workspace_bytes", &moe_workspace_bytes);
  m.impl("moe_set_workspace", &moe_set_workspace);
  m.impl("moe_unprepack", &moe_unprepack);
  m.impl("moe_release", &moe_release);
  m.impl("moe_describe", &moe_describe);
}

// The ops that write their tensor arguments: one kernel for every device (they check it).
TORCH_LIBRARY_IMPL(megamoe, CompositeExplicitAutograd, m) {
  m.impl("moe_prepare_in_place", &moe_prepare_in_place);
  m.impl("moe_unprepack_in_place", &moe_unprepack_in_place);
}

TORCH_LIBRARY_IMPL(megamoe, CUDA, m) { m.impl("fused_moe_nvfp4", &fused_moe_nvfp4_cuda); }

TORCH_LIBRARY_IMPL(megamoe, CPU, m) { m.impl("fused_moe_nvfp4", &fused_moe_nvfp4_cpu); }

}  // namespace megamoe::torch_ext
