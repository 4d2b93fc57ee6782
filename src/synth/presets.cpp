// Model presets of docs/design.md §4: the MoE-layer shapes and routing of the models this library
// targets, used by `megamoe synth`, the benchmark and the tests.
#include "megamoe/presets.h"

#include <string>
#include <vector>

#include "megamoe/status.h"

namespace megamoe {

namespace {

constexpr const char* kDeepseekArch = "DeepseekV3ForCausalLM";
constexpr const char* kQwen3MoeArch = "Qwen3MoeForCausalLM";

RoutingConfig noaux_tc(int top_k, int n_group, int topk_group, float routed_scaling_factor) {
  RoutingConfig r;
  r.kind = RoutingKind::kNoauxTc;
  r.top_k = top_k;
  r.renormalize = true;  // norm_topk_prob of every DeepSeek-style preset here
  r.n_group = n_group;
  r.topk_group = topk_group;
  r.routed_scaling_factor = routed_scaling_factor;
  return r;
}

RoutingConfig softmax_renormalized(int top_k) {
  RoutingConfig r;
  r.kind = RoutingKind::kSoftmaxTopK;
  r.top_k = top_k;
  r.renormalize = true;
  return r;
}

std::vector<ModelPreset> make_presets() {
  std::vector<ModelPreset> p;
  // DeepSeek-V3/R1: layers 0-2 are dense (first_k_dense_replace = 3), so layer 3 is the first MoE.
  p.push_back({"deepseek-v3", kDeepseekArch, 7168, 2048, 256, 8, 1, noaux_tc(8, 8, 4, 2.5f),
               std::nullopt, 3});
  // DeepSeek-V4-Flash: V4's real router is not V3's noaux_tc, and its checkpoints are not
  // DeepseekV3ForCausalLM. The preset models V4's MoE *shapes* (and its SwiGLU clamp) inside a
  // V3-style config with `swiglu_limit`, routed with ungrouped noaux_tc, which is what the
  // kernels need to be measured and checked on.
  p.push_back({"deepseek-v4-flash", kDeepseekArch, 4096, 2048, 256, 6, 1, noaux_tc(6, 1, 1, 1.5f),
               10.0f, 3});
  // Kimi-K2 ships a DeepseekV3ForCausalLM config: ungrouped noaux_tc, one dense layer.
  p.push_back({"kimi-k2", kDeepseekArch, 7168, 2048, 384, 8, 1, noaux_tc(8, 1, 1, 2.827f),
               std::nullopt, 1});
  // Qwen3-MoE: softmax top-k with renormalisation (norm_topk_prob), every layer sparse.
  p.push_back({"qwen3-235b-a22b", kQwen3MoeArch, 4096, 1536, 128, 8, 0, softmax_renormalized(8),
               std::nullopt, 0});
  p.push_back({"qwen3-30b-a3b", kQwen3MoeArch, 2048, 768, 128, 8, 0, softmax_renormalized(8),
               std::nullopt, 0});
  return p;
}

}  // namespace

const std::vector<ModelPreset>& model_presets() {
  static const std::vector<ModelPreset> presets = make_presets();
  return presets;
}

const ModelPreset& find_preset(const std::string& name) {
  std::string valid;
  for (const ModelPreset& p : model_presets()) {
    if (p.name == name) return p;
    valid += (valid.empty() ? "" : ", ") + p.name;
  }
  MEGAMOE_FAIL(kInvalidArgument, "unknown model preset '", name,
               "'; the valid presets are: ", valid, ".");
}

std::string moe_prefix(int64_t layer) { return "model.layers." + std::to_string(layer) + ".mlp"; }

}  // namespace megamoe
