// MoeDeviceWeights as the runtime sees it: the layer's shape and the weights a backend row
// uploaded in its layout. Internal to the runtime.
#pragma once

#include <memory>

#include "megamoe/runtime.h"
#include "runtime/backend.h"

namespace megamoe {

struct MoeDeviceWeights::Impl {
  MoeProblem shape;  // hidden, intermediate, experts, shared (max_tokens unused)
  runtime::Arch arch = 0;
  std::unique_ptr<runtime::BackendWeights> data;
};

namespace runtime {

// The runtime's access to the private Impl (a friend of MoeDeviceWeights).
struct DeviceWeightsAccess {
  using Impl = MoeDeviceWeights::Impl;
  static const Impl& get(const MoeDeviceWeights& w) { return *w.impl_; }
  static Impl& get(MoeDeviceWeights& w) { return *w.impl_; }
  static MoeDeviceWeights make() { return MoeDeviceWeights(); }
};

}  // namespace runtime
}  // namespace megamoe
