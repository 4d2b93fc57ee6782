// The stacked MoE layer tensors as the megamoe torch ops receive them: their checks, and the view
// of them that the runtime prepares the layer from.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "megamoe/runtime.h"

namespace megamoe::torch_ext {

// The stacked layer tensors as the ops receive them (docs/design.md §2 engine layout).
struct Stacked {
  at::Tensor w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2;
  std::optional<at::Tensor> shared_w13, shared_w13_scale, shared_w13_scale_2, shared_w2,
      shared_w2_scale, shared_w2_scale_2;

  std::vector<std::pair<const char*, const std::optional<at::Tensor>*>> shared() const {
    return {{"shared_w13", &shared_w13},     {"shared_w13_scale", &shared_w13_scale},
            {"shared_w13_scale_2", &shared_w13_scale_2}, {"shared_w2", &shared_w2},
            {"shared_w2_scale", &shared_w2_scale}, {"shared_w2_scale_2", &shared_w2_scale_2}};
  }
  // Every tensor given, routed first, with its argument name.
  std::vector<std::pair<const char*, at::Tensor>> present() const {
    std::vector<std::pair<const char*, at::Tensor>> out = {
        {"w13", w13}, {"w13_scale", w13_scale}, {"w13_scale_2", w13_scale_2},
        {"w2", w2},   {"w2_scale", w2_scale},   {"w2_scale_2", w2_scale_2}};
    for (const auto& [name, t] : shared()) {
      if (t->has_value()) out.emplace_back(name, **t);
    }
    return out;
  }
};

struct LayerShape {
  int64_t hidden = 0, inter = 0, experts = 0, shared_inter = 0;
  at::Device device = at::kCPU;
};

// Validates dtypes, shapes, devices and layout of the stacked tensors; returns H, I, E, Is. The
// tensors must be CUDA tensors unless `any_device` (then all on w13's device).
LayerShape check_stacked(const char* op, const Stacked& s, bool any_device = false);

// The tensors' data as the runtime takes them (MoeDeviceWeights::from_stacked), with the shape
// check_stacked returned.
StackedNvfp4Weights device_view(const Stacked& s, const LayerShape& L);
// The same, writable (MoeDeviceWeights::prepack_in_place, unprepack_stacked).
StackedNvfp4Buffers writable_view(const Stacked& s, const LayerShape& L);

}  // namespace megamoe::torch_ext
