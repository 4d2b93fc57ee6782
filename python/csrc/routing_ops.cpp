// megamoe::route: router logits -> top-k weights and ids. CUDA: the GPU router (route_topk, graph
// capturable); CPU: the reference router (reference::route), which also rejects non-finite logits.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>
#include <optional>
#include <span>
#include <string>
#include <tuple>

#include "megamoe/reference.h"
#include "megamoe/runtime.h"
#include "torch_utils.h"

namespace megamoe::torch_ext {
namespace {

constexpr const char* kRoute = "route";

int to_int(int64_t v, const char* name) {
  TORCH_CHECK_VALUE(v >= INT_MIN && v <= INT_MAX, "megamoe.", kRoute, ": ", name, " = ", v,
                    " is out of range.");
  return static_cast<int>(v);
}

RoutingConfig make_config(int64_t top_k, const std::string& method, bool renormalize,
                          int64_t n_group, int64_t topk_group, double routed_scaling_factor) {
  RoutingConfig cfg;
  if (method == "softmax") {
    cfg.kind = RoutingKind::kSoftmaxTopK;
  } else if (method == "noaux_tc") {
    cfg.kind = RoutingKind::kNoauxTc;
  } else {
    TORCH_CHECK_VALUE(false, "megamoe.", kRoute, ": method '", method,
                      "' is not supported; allowed: 'softmax' (Qwen3, Mixtral) and 'noaux_tc' "
                      "(DeepSeek-V3).");
  }
  cfg.top_k = to_int(top_k, "top_k");
  cfg.renormalize = renormalize;
  cfg.n_group = to_int(n_group, "n_group");
  cfg.topk_group = to_int(topk_group, "topk_group");
  cfg.routed_scaling_factor = static_cast<float>(routed_scaling_factor);
  return cfg;
}

// Checks the tensors and top_k against E (the outputs are sized by it); returns the optional
// bias as a tensor (undefined when absent). The rest of the configuration is checked by the
// router itself.
at::Tensor check_args(const at::Tensor& logits, const std::optional<at::Tensor>& bias,
                      const RoutingConfig& cfg) {
  arg(kRoute, "router_logits", logits).dtype({at::kFloat})
      .dims(2, "[T, E] fp32 router logits; convert with .float()").contiguous();
  TORCH_CHECK_VALUE(cfg.top_k >= 1 && cfg.top_k <= logits.size(1), "megamoe.", kRoute,
                    ": top_k is ", cfg.top_k, "; it must be in [1, num_experts = ",
                    logits.size(1), "].");
  if (!bias) return {};
  arg(kRoute, "e_score_correction_bias", *bias).on(logits.device()).dtype({at::kFloat})
      .shape({logits.size(1)}, "[E] fp32").contiguous();
  return *bias;
}

std::tuple<at::Tensor, at::Tensor> make_outputs(const at::Tensor& logits, int k) {
  const auto opts = logits.options();
  return {at::empty({logits.size(0), k}, opts.dtype(at::kFloat)),
          at::empty({logits.size(0), k}, opts.dtype(at::kInt))};
}

std::tuple<at::Tensor, at::Tensor> route_cuda(const at::Tensor& logits, int64_t top_k,
                                              const std::string& method, bool renormalize,
                                              int64_t n_group, int64_t topk_group,
                                              double routed_scaling_factor,
                                              const std::optional<at::Tensor>& bias) {
  return translate_errors(kRoute, [&] {
    const RoutingConfig cfg =
        make_config(top_k, method, renormalize, n_group, topk_group, routed_scaling_factor);
    const at::Tensor b = check_args(logits, bias, cfg);
    arg(kRoute, "router_logits", logits).cuda();
    const c10::cuda::CUDAGuard guard(logits.device());
    auto [weights, ids] = make_outputs(logits, cfg.top_k);
    RouteArgs a;
    a.logits = logits.const_data_ptr<float>();
    a.bias = b.defined() ? b.const_data_ptr<float>() : nullptr;
    a.tokens = logits.size(0);
    a.num_experts = logits.size(1);
    a.topk_ids = ids.data_ptr<int32_t>();
    a.topk_weights = weights.data_ptr<float>();
    route_topk(cfg, a, current_stream(logits.device()));
    return std::make_tuple(weights, ids);
  });
}

std::tuple<at::Tensor, at::Tensor> route_cpu(const at::Tensor& logits, int64_t top_k,
                                             const std::string& method, bool renormalize,
                                             int64_t n_group, int64_t topk_group,
                                             double routed_scaling_factor,
                                             const std::optional<at::Tensor>& bias) {
  return translate_errors(kRoute, [&] {
    const RoutingConfig cfg =
        make_config(top_k, method, renormalize, n_group, topk_group, routed_scaling_factor);
    const at::Tensor b = check_args(logits, bias, cfg);
    arg(kRoute, "router_logits", logits).cpu();
    const int64_t T = logits.size(0), E = logits.size(1);
    const std::span<const float> l(logits.const_data_ptr<float>(), static_cast<size_t>(T * E));
    const std::span<const float> bs = b.defined()
        ? std::span<const float>(b.const_data_ptr<float>(), static_cast<size_t>(E))
        : std::span<const float>();
    const reference::TopK r = reference::route(cfg, l, T, E, bs);
    auto [weights, ids] = make_outputs(logits, cfg.top_k);
    std::copy(r.weights.begin(), r.weights.end(), weights.data_ptr<float>());
    std::copy(r.ids.begin(), r.ids.end(), ids.data_ptr<int32_t>());
    return std::make_tuple(weights, ids);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(megamoe, CUDA, m) { m.impl("route", &route_cuda); }
TORCH_LIBRARY_IMPL(megamoe, CPU, m) { m.impl("route", &route_cpu); }

}  // namespace megamoe::torch_ext
