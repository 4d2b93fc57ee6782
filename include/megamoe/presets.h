// Model presets (docs/design.md §4) and the synthetic-layer generator used by `megamoe synth`, the
// benchmark and the tests.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "megamoe/moe.h"

namespace megamoe {

struct ModelPreset {
  std::string name;           // "deepseek-v3", "deepseek-v4-flash", "kimi-k2", "qwen3-235b-a22b", "qwen3-30b-a3b"
  std::string architecture;   // "DeepseekV3ForCausalLM" / "Qwen3MoeForCausalLM"
  int64_t hidden_size;
  int64_t intermediate_size;  // per routed expert
  int64_t num_experts;
  int top_k;
  int n_shared_experts;       // 0 or 1
  RoutingConfig routing;
  std::optional<float> swiglu_limit;
  int64_t layer;              // the MoE layer index synth writes (first MoE layer of the model)
};

const std::vector<ModelPreset>& model_presets();
// Throws megamoe::Error(kInvalidArgument) listing the valid names.
const ModelPreset& find_preset(const std::string& name);

struct SynthOptions {
  uint64_t seed = 0x5eed;
  int64_t num_experts = 0;  // 0: the preset's; smaller values make small test layers
  // -1: the preset's shared experts; 0 drops them (the routed-only layer of docs/design.md §4's
  // floors and peer figures); a positive count replaces them.
  int64_t shared_experts = -1;
  int threads = 0;          // 0: hardware concurrency
  bool progress = false;    // progress lines on stderr
};

// The unquantized weights of tensor `name` (rows x cols), a pure function of (seed, name):
// Gaussian rows with per-row and per-block magnitude variation and rare outliers, rounded to
// bf16. Synth quantizes exactly these, so the benchmark can recompute them to measure the
// accuracy of the quantized layer.
std::vector<float> synth_weight(uint64_t seed, const std::string& name, int64_t rows, int64_t cols);

// Writes OUT_DIR/{config.json, hf_quant_config.json, model.safetensors} holding one MoE layer
// model.layers.{preset.layer}.mlp of the preset in ModelOpt NVFP4 (router gate in BF16, the
// correction bias in F32 for noaux_tc presets). Gate and up get different global scales.
void synth_checkpoint(const ModelPreset& preset, const std::string& out_dir,
                      const SynthOptions& opt = {});

// The name prefix of the synthesized layer: "model.layers.{L}.mlp".
std::string moe_prefix(int64_t layer);

}  // namespace megamoe
