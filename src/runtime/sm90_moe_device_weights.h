// The prepacked expert weights on the device, as the runtime sees them (MoeDeviceWeights keeps
// them private to users). Internal to the runtime.
#pragma once

#include <cstddef>
#include <cstdint>

#include "megamoe/runtime.h"

namespace megamoe {

struct MoeDeviceWeights::Impl {
  MoeProblem shape;  // hidden, intermediate, experts, shared (max_tokens unused)
  // Virtual experts (routed, then the shared expert's slices) one after another, each
  // *_stride bytes (src/runtime/sm90_w4a16_prepack.h: the kernels' layout).
  uint8_t* w13_codes = nullptr;
  uint8_t* w13_scales = nullptr;
  uint8_t* w2_codes = nullptr;
  uint8_t* w2_scales = nullptr;
  float* s2 = nullptr;  // [3][E']: gate, up, down
  int64_t w13_code_stride = 0, w13_scale_stride = 0, w2_code_stride = 0, w2_scale_stride = 0;
  size_t bytes = 0;
  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl();
};

// The runtime's access to the private Impl (a friend of MoeDeviceWeights).
struct DeviceWeightsAccess {
  using Impl = MoeDeviceWeights::Impl;
  static const MoeDeviceWeights::Impl& get(const MoeDeviceWeights& w) { return *w.impl_; }
  static MoeDeviceWeights::Impl& get(MoeDeviceWeights& w) { return *w.impl_; }
  static MoeDeviceWeights make() { return MoeDeviceWeights(); }
};

}  // namespace megamoe
