// The MoE layer as the library sees it: NVFP4 projections (views over checkpoint bytes or owned
// buffers), router parameters and activation options. Shared by the loader, the CPU reference
// and the GPU runtime.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "megamoe/format.h"

namespace megamoe {

enum class RoutingKind {
  kSoftmaxTopK,  // Qwen3-MoE, Mixtral: softmax over experts, top-k, optional renormalise
  kNoauxTc,      // DeepSeek-V3: sigmoid, grouped top-k on score + correction bias
};
const char* routing_kind_name(RoutingKind k);

struct RoutingConfig {
  RoutingKind kind = RoutingKind::kSoftmaxTopK;
  int top_k = 8;
  bool renormalize = true;             // softmax: divide the top-k weights by their sum
                                       // noaux_tc: norm_topk_prob (true for DeepSeek-V3)
  int n_group = 1;                     // noaux_tc only
  int topk_group = 1;                  // noaux_tc only
  float routed_scaling_factor = 1.0f;  // multiplies the final weights (both kinds)
};

// One NVFP4 linear layer y = x · Wᵀ with W [out_features, in_features].
struct Nvfp4Linear {
  int64_t out_features = 0;
  int64_t in_features = 0;               // a multiple of 16
  const uint8_t* weight = nullptr;       // [out, in/2] packed e2m1
  const uint8_t* weight_scale = nullptr; // [out, in/16] ue4m3
  float weight_scale_2 = 1.0f;           // fp32 global scale (ModelOpt meaning: multiply)
  float input_scale = 0.0f;              // static activation calibration; 0 when absent
  std::shared_ptr<const void> owner;     // keeps the bytes alive (a mapped file or a buffer)

  format::Nvfp4View view() const {
    return {out_features, in_features, weight, weight_scale, weight_scale_2};
  }
};

// Owns freshly made NVFP4 bytes (quantize, synth, tests) and exposes them as an Nvfp4Linear.
Nvfp4Linear make_owned_linear(int64_t out_features, int64_t in_features,
                              std::vector<uint8_t> weight, std::vector<uint8_t> weight_scale,
                              float weight_scale_2, float input_scale = 0.0f);

struct ExpertWeights {
  Nvfp4Linear gate;  // [I, H]
  Nvfp4Linear up;    // [I, H]
  Nvfp4Linear down;  // [H, I]
  int64_t intermediate_size() const { return gate.out_features; }
};

struct MoeLayer {
  int64_t hidden_size = 0;        // H
  int64_t intermediate_size = 0;  // I of each routed expert
  int64_t num_experts = 0;        // E (routed)
  std::vector<ExpertWeights> experts;          // E entries
  std::optional<ExpertWeights> shared_expert;  // every token, weight 1; its I may differ
  std::vector<float> router_weight;            // [E, H], widened exactly; empty if absent
  std::vector<float> e_score_correction_bias;  // [E]; empty if absent
  RoutingConfig routing;
  std::optional<float> swiglu_limit;  // clamp: gate <= limit, |up| <= limit, before SwiGLU

  // Throws megamoe::Error(kInvalidArgument) naming the first inconsistency (shapes, counts,
  // null pointers, non-finite or non-positive global scales).
  void validate() const;
};

}  // namespace megamoe
