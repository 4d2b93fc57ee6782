// The MoE layer description shared by the loader, the CPU reference and the GPU runtime: owned
// NVFP4 buffers and the consistency check every consumer runs before trusting the pointers.

#include "megamoe/moe.h"

#include <cmath>
#include <string>
#include <utility>

#include "megamoe/status.h"

namespace megamoe {
namespace {

std::string shape2(int64_t rows, int64_t cols) {
  return detail::concat("[", rows, ", ", cols, "]");
}

void validate_linear(const Nvfp4Linear& w, const std::string& what, int64_t rows, int64_t cols) {
  MEGAMOE_CHECK(w.out_features == rows && w.in_features == cols, kInvalidArgument, "MoeLayer: ",
                what, " has shape ", shape2(w.out_features, w.in_features), "; expected ",
                shape2(rows, cols), ".");
  MEGAMOE_CHECK(w.weight != nullptr && w.weight_scale != nullptr, kInvalidArgument, "MoeLayer: ",
                what, " has a null ", w.weight == nullptr ? "weight" : "weight_scale",
                " pointer.");
  MEGAMOE_CHECK(std::isfinite(w.weight_scale_2) && w.weight_scale_2 > 0.0f, kInvalidArgument,
                "MoeLayer: ", what, " has weight_scale_2 ", w.weight_scale_2,
                "; global scales must be finite and > 0.");
  MEGAMOE_CHECK(std::isfinite(w.input_scale) && w.input_scale >= 0.0f, kInvalidArgument,
                "MoeLayer: ", what, " has input_scale ", w.input_scale,
                "; it must be finite and > 0, or 0 when absent.");
}

void validate_expert(const ExpertWeights& x, const std::string& what, int64_t hidden,
                     int64_t inter) {
  validate_linear(x.gate, what + " gate_proj", inter, hidden);
  validate_linear(x.up, what + " up_proj", inter, hidden);
  validate_linear(x.down, what + " down_proj", hidden, inter);
}

// H and I are the K dimensions of the two expert GEMMs, so both must be whole NVFP4 blocks.
void validate_dim(const char* name, int64_t v) {
  MEGAMOE_CHECK(v >= 1 && v % format::kNvfp4BlockSize == 0, kInvalidArgument, "MoeLayer: ", name,
                " is ", v, "; it must be a positive multiple of ", format::kNvfp4BlockSize, ".");
}

}  // namespace

const char* routing_kind_name(RoutingKind k) {
  switch (k) {
    case RoutingKind::kSoftmaxTopK: return "softmax_topk";
    case RoutingKind::kNoauxTc: return "noaux_tc";
  }
  return "unknown";
}

Nvfp4Linear make_owned_linear(int64_t out_features, int64_t in_features,
                              std::vector<uint8_t> weight, std::vector<uint8_t> weight_scale,
                              float weight_scale_2, float input_scale) {
  MEGAMOE_CHECK(out_features >= 1 && in_features >= 1 &&
                    in_features % format::kNvfp4BlockSize == 0,
                kInvalidArgument, "make_owned_linear: shape ", shape2(out_features, in_features),
                " is invalid; both dimensions must be >= 1 and in_features a multiple of ",
                format::kNvfp4BlockSize, ".");
  const uint64_t codes = uint64_t(out_features) * uint64_t(in_features / 2);
  const uint64_t scales = uint64_t(out_features) * uint64_t(in_features / format::kNvfp4BlockSize);
  MEGAMOE_CHECK(weight.size() == codes, kInvalidArgument, "make_owned_linear: weight has ",
                weight.size(), " bytes; shape ", shape2(out_features, in_features), " needs ",
                codes, " (out x in/2).");
  MEGAMOE_CHECK(weight_scale.size() == scales, kInvalidArgument,
                "make_owned_linear: weight_scale has ", weight_scale.size(), " bytes; shape ",
                shape2(out_features, in_features), " needs ", scales, " (out x in/16).");
  MEGAMOE_CHECK(std::isfinite(weight_scale_2) && weight_scale_2 > 0.0f, kInvalidArgument,
                "make_owned_linear: weight_scale_2 is ", weight_scale_2,
                "; it must be finite and > 0.");
  MEGAMOE_CHECK(std::isfinite(input_scale) && input_scale >= 0.0f, kInvalidArgument,
                "make_owned_linear: input_scale is ", input_scale,
                "; it must be finite and > 0, or 0 when absent.");

  struct Buffers {
    std::vector<uint8_t> weight;
    std::vector<uint8_t> scale;
  };
  // Moving the vectors keeps their heap storage, so the pointers taken below stay valid.
  auto owned = std::make_shared<const Buffers>(Buffers{std::move(weight), std::move(weight_scale)});
  Nvfp4Linear lin;
  lin.out_features = out_features;
  lin.in_features = in_features;
  lin.weight = owned->weight.data();
  lin.weight_scale = owned->scale.data();
  lin.weight_scale_2 = weight_scale_2;
  lin.input_scale = input_scale;
  lin.owner = std::move(owned);
  return lin;
}

void MoeLayer::validate() const {
  validate_dim("hidden_size", hidden_size);
  validate_dim("intermediate_size", intermediate_size);
  MEGAMOE_CHECK(num_experts >= 1, kInvalidArgument, "MoeLayer: num_experts is ", num_experts,
                "; it must be >= 1.");
  MEGAMOE_CHECK(experts.size() == static_cast<size_t>(num_experts), kInvalidArgument,
                "MoeLayer: has ", experts.size(), " experts; num_experts is ", num_experts, ".");
  for (size_t e = 0; e < experts.size(); ++e) {
    validate_expert(experts[e], "expert " + std::to_string(e), hidden_size, intermediate_size);
  }
  if (shared_expert) {
    const int64_t shared_i = shared_expert->intermediate_size();
    MEGAMOE_CHECK(shared_i >= 1 && shared_i % format::kNvfp4BlockSize == 0, kInvalidArgument,
                  "MoeLayer: the shared expert's intermediate size is ", shared_i,
                  "; it must be a positive multiple of ", format::kNvfp4BlockSize, ".");
    validate_expert(*shared_expert, "shared expert", hidden_size, shared_i);
  }
  MEGAMOE_CHECK(router_weight.empty() ||
                    router_weight.size() == static_cast<size_t>(num_experts * hidden_size),
                kInvalidArgument, "MoeLayer: router_weight has ", router_weight.size(),
                " values; expected ", num_experts * hidden_size, " ([E, H] = ",
                shape2(num_experts, hidden_size), ") or none.");
  MEGAMOE_CHECK(e_score_correction_bias.empty() ||
                    e_score_correction_bias.size() == static_cast<size_t>(num_experts),
                kInvalidArgument, "MoeLayer: e_score_correction_bias has ",
                e_score_correction_bias.size(), " values; expected ", num_experts, " or none.");

  const RoutingConfig& r = routing;
  MEGAMOE_CHECK(r.top_k >= 1 && r.top_k <= num_experts, kInvalidArgument, "MoeLayer: top_k is ",
                r.top_k, "; it must be in [1, num_experts = ", num_experts, "].");
  MEGAMOE_CHECK(std::isfinite(r.routed_scaling_factor) && r.routed_scaling_factor > 0.0f,
                kInvalidArgument, "MoeLayer: routed_scaling_factor is ", r.routed_scaling_factor,
                "; it must be finite and > 0.");
  if (r.kind == RoutingKind::kNoauxTc) {
    MEGAMOE_CHECK(r.n_group >= 1 && num_experts % r.n_group == 0, kInvalidArgument,
                  "MoeLayer: noaux_tc n_group is ", r.n_group,
                  "; it must be >= 1 and divide num_experts (", num_experts, ").");
    MEGAMOE_CHECK(r.topk_group >= 1 && r.topk_group <= r.n_group, kInvalidArgument,
                  "MoeLayer: noaux_tc topk_group is ", r.topk_group, "; it must be in [1, n_group = ",
                  r.n_group, "].");
    const int64_t selectable = int64_t(r.topk_group) * (num_experts / r.n_group);
    MEGAMOE_CHECK(r.top_k <= selectable, kInvalidArgument, "MoeLayer: noaux_tc top_k (", r.top_k,
                  ") exceeds the ", selectable, " experts of the topk_group (", r.topk_group,
                  ") best groups.");
  }
  MEGAMOE_CHECK(!swiglu_limit || (std::isfinite(*swiglu_limit) && *swiglu_limit > 0.0f),
                kInvalidArgument, "MoeLayer: swiglu_limit is ", swiglu_limit.value_or(0.0f),
                "; when set it must be finite and > 0.");
}

}  // namespace megamoe
