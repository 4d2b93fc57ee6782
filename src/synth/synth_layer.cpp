// The layer a synthetic checkpoint holds (synth_layer.h).
#include "synth/synth_layer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "megamoe/format.h"
#include "megamoe/presets.h"
#include "megamoe/status.h"
#include "synth/synth_weight.h"

namespace megamoe::synth_detail {

namespace {

// Activation amax behind the static input_scale: post-norm hidden states (the input of gate and
// up, which therefore share it) reach ~16, SwiGLU outputs (the input of down) ~4; each expert
// gets its own log-normal draw.
float input_amax(uint64_t seed, const std::string& expert_prefix, bool down) {
  const std::string what = expert_prefix + (down ? ".down_input" : ".hidden_input");
  return (down ? 4.0f : 16.0f) * std::exp(0.3f * synth_scalar(seed, what, 0));
}

}  // namespace

RoutingConfig routing_for(const ModelPreset& preset, int64_t num_experts) {
  RoutingConfig r = preset.routing;
  if (r.kind == RoutingKind::kNoauxTc) {
    if (r.n_group > 1 && (num_experts % r.n_group != 0 || num_experts / r.n_group < 2)) {
      r.n_group = 1;
      r.topk_group = 1;
    }
    const int64_t candidates = int64_t(r.topk_group) * (num_experts / r.n_group);
    r.top_k = int(std::min<int64_t>(r.top_k, candidates));
  } else {
    r.top_k = int(std::min<int64_t>(r.top_k, num_experts));
  }
  return r;
}

void check_preset(const ModelPreset& p, int64_t num_experts) {
  const std::string who = "model preset '" + p.name + "'";
  MEGAMOE_CHECK(
      p.architecture == "DeepseekV3ForCausalLM" || p.architecture == "Qwen3MoeForCausalLM",
      kInvalidArgument, who, " has architecture '", p.architecture,
      "'; synth writes DeepseekV3ForCausalLM or Qwen3MoeForCausalLM configs.");
  MEGAMOE_CHECK(p.hidden_size > 0 && p.hidden_size % format::kNvfp4BlockSize == 0 &&
                    p.intermediate_size > 0 && p.intermediate_size % format::kNvfp4BlockSize == 0,
                kInvalidArgument, who, " has hidden_size ", p.hidden_size,
                " and intermediate_size ", p.intermediate_size,
                "; both must be positive multiples of 16 (the NVFP4 block size).");
  MEGAMOE_CHECK(num_experts > 0, kInvalidArgument, who, " has ", num_experts,
                " routed experts; at least 1 is required.");
  MEGAMOE_CHECK(p.routing.top_k >= 1, kInvalidArgument, who, " has top_k ", p.routing.top_k,
                "; at least 1 is required.");
  MEGAMOE_CHECK(p.n_shared_experts >= 0, kInvalidArgument, who, " has ", p.n_shared_experts,
                " shared experts; 0 or more are allowed.");
  MEGAMOE_CHECK(p.layer >= 0, kInvalidArgument, who, " has layer ", p.layer,
                "; a layer index is 0 or more.");
  if (p.architecture == "Qwen3MoeForCausalLM") {
    MEGAMOE_CHECK(p.routing.kind == RoutingKind::kSoftmaxTopK && p.n_shared_experts == 0,
                  kInvalidArgument, who,
                  " is a Qwen3MoeForCausalLM model, which routes with softmax top-k and has no "
                  "shared expert.");
  } else {
    MEGAMOE_CHECK(p.routing.kind == RoutingKind::kNoauxTc && p.routing.n_group >= 1 &&
                      p.routing.topk_group >= 1 && p.routing.topk_group <= p.routing.n_group,
                  kInvalidArgument, who,
                  " is a DeepseekV3ForCausalLM model, which routes with noaux_tc and needs "
                  "1 <= topk_group <= n_group.");
  }
}

nlohmann::json model_config_json(const ModelPreset& p, int64_t num_experts,
                                 const RoutingConfig& r) {
  nlohmann::json c;
  c["architectures"] = {p.architecture};
  c["hidden_size"] = p.hidden_size;
  c["moe_intermediate_size"] = p.intermediate_size;
  c["num_experts_per_tok"] = r.top_k;
  c["num_hidden_layers"] = p.layer + 1;
  c["norm_topk_prob"] = r.renormalize;
  c["hidden_act"] = "silu";
  c["torch_dtype"] = "bfloat16";
  if (p.architecture == "DeepseekV3ForCausalLM") {
    c["model_type"] = "deepseek_v3";
    c["n_routed_experts"] = num_experts;
    c["n_shared_experts"] = p.n_shared_experts;
    c["first_k_dense_replace"] = p.layer;  // layers below are dense, so `layer` is the first MoE
    c["moe_layer_freq"] = 1;
    c["scoring_func"] = "sigmoid";
    c["topk_method"] = "noaux_tc";
    c["n_group"] = r.n_group;
    c["topk_group"] = r.topk_group;
    c["routed_scaling_factor"] = r.routed_scaling_factor;
    if (p.swiglu_limit) c["swiglu_limit"] = *p.swiglu_limit;
  } else {
    c["model_type"] = "qwen3_moe";
    c["num_experts"] = num_experts;
    c["decoder_sparse_step"] = 1;
    c["mlp_only_layers"] = nlohmann::json::array();
    if (r.routed_scaling_factor != 1.0f) c["routed_scaling_factor"] = r.routed_scaling_factor;
  }
  c["quantization_config"] = {{"quant_method", "modelopt"}, {"quant_algo", "NVFP4"}};
  return c;
}

std::vector<Projection> layer_projections(const ModelPreset& p, int64_t num_experts,
                                          uint64_t seed) {
  const std::string mlp = moe_prefix(p.layer);
  std::vector<Projection> out;
  auto add_expert = [&](const std::string& expert, int64_t inter) {
    const float hidden_amax = input_amax(seed, expert, false);
    out.push_back({expert + ".gate_proj", inter, p.hidden_size, hidden_amax});
    out.push_back({expert + ".up_proj", inter, p.hidden_size, hidden_amax});
    out.push_back({expert + ".down_proj", p.hidden_size, inter, input_amax(seed, expert, true)});
  };
  for (int64_t e = 0; e < num_experts; ++e) {
    add_expert(mlp + ".experts." + std::to_string(e), p.intermediate_size);
  }
  if (p.n_shared_experts > 0) {
    add_expert(mlp + ".shared_experts", p.n_shared_experts * p.intermediate_size);
  }
  return out;
}

}  // namespace megamoe::synth_detail
