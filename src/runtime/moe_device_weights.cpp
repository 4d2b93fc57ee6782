// MoeDeviceWeights (arch-neutral): the current device's architecture picks the row whose layout
// every row of that architecture reads; the row prepacks and uploads.
#include "runtime/moe_device_weights.h"

#include "megamoe/runtime.h"
#include "runtime/backend.h"

namespace megamoe {

MoeDeviceWeights::MoeDeviceWeights() : impl_(std::make_unique<Impl>()) {}
MoeDeviceWeights::MoeDeviceWeights(MoeDeviceWeights&&) noexcept = default;
MoeDeviceWeights& MoeDeviceWeights::operator=(MoeDeviceWeights&&) noexcept = default;
MoeDeviceWeights::~MoeDeviceWeights() = default;
size_t MoeDeviceWeights::device_bytes() const { return impl_->data ? impl_->data->device_bytes() : 0; }
const char* MoeDeviceWeights::layout() const { return impl_->data ? impl_->data->layout() : ""; }
bool MoeDeviceWeights::views_caller_memory() const { return impl_->data && impl_->data->views_caller_memory(); }

MoeDeviceWeights MoeDeviceWeights::upload(const MoeLayer& layer, cudaStream_t stream) {
  layer.validate();
  const runtime::Arch arch = runtime::current_device().arch;
  const runtime::MoeBackend& row = runtime::weights_backend(arch);
  MoeDeviceWeights out;
  Impl& w = *out.impl_;
  w.shape = MoeProblem::from_layer(layer, 0);
  runtime::validate_problem_common(w.shape);
  row.validate(w.shape);
  w.arch = arch;
  w.data = row.upload(layer, stream);
  return out;
}

}  // namespace megamoe
