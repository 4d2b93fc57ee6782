// The layer a synthetic checkpoint holds, derived from a model preset: its routing, its
// config.json and the NVFP4 projections to generate (internal to src/synth).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "megamoe/presets.h"

namespace megamoe::synth_detail {

// The routing of a preset with `num_experts` routed experts. A reduced expert count (small test
// layers) keeps the preset's routing where it still fits and otherwise shrinks it to the nearest
// valid one: ungrouped noaux_tc when the groups no longer divide the experts into groups of at
// least two (a group's score is the sum of its top-2), and top_k capped at the experts that the
// chosen groups can offer.
RoutingConfig routing_for(const ModelPreset& preset, int64_t num_experts);

// Throws megamoe::Error(kInvalidArgument) naming the preset where synth cannot write it with
// `num_experts` routed experts.
void check_preset(const ModelPreset& p, int64_t num_experts);

// config.json with HF's field names for the preset's architecture, describing a model whose layer
// `preset.layer` is the (first) MoE layer.
nlohmann::json model_config_json(const ModelPreset& p, int64_t num_experts,
                                 const RoutingConfig& r);

// One NVFP4 projection of an expert: the unit of generation work.
struct Projection {
  std::string prefix;  // e.g. model.layers.3.mlp.experts.17.up_proj
  int64_t rows = 0;    // out features
  int64_t cols = 0;    // in features
  float input_amax = 0.0f;
};

// Every NVFP4 projection of the layer, in the order they are written: each routed expert's gate,
// up and down, then the shared expert's.
std::vector<Projection> layer_projections(const ModelPreset& p, int64_t num_experts,
                                          uint64_t seed);

}  // namespace megamoe::synth_detail
