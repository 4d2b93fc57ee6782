// What every sm90 row of the backend table that reads the W4A16 prepacked layout shares (the
// w4a16 row, and the w4a8 row over the same bytes): the layout, its upload, view and unprepack,
// and the shared dispatch's invalid-id count. A row derives from it and adds its precision, its
// checks, its workspace and its launches.
#pragma once

#include <memory>

#include "backends/sm90_w4a16/sm90_w4a16_weights.h"
#include "runtime/backend.h"
#include "runtime/sm90/sm90_moe_workspace.h"

namespace megamoe::runtime {

class Sm90PrepackedBackend : public MoeBackend {
 public:
  Arch arch() const override { return 90; }
  const char* weight_layout() const override { return Sm90PrepackedWeights::kLayout; }
  std::unique_ptr<BackendWeights> upload(const MoeLayer& layer, cudaStream_t stream) const override {
    return upload_sm90_prepacked(layer, stream);
  }
  std::unique_ptr<BackendWeights> upload_into(const MoeLayer& layer, const WeightStorage& into,
                                              cudaStream_t stream) const override {
    return upload_sm90_prepacked(layer, stream, &into);
  }
  std::unique_ptr<BackendWeights> view(const MoeProblem& shape, const WeightStorage& at, const GlobalScales& scales,
                                       cudaStream_t stream) const override {
    return view_sm90_prepacked(shape, at, scales, stream);
  }
  void unprepack(const MoeProblem& shape, const HostPrepacked& in, const StackedNvfp4Buffers& out) const override {
    unprepack_sm90(shape, in, out);
  }
  int64_t invalid_id_count(const MoePlan& plan, const void* workspace, cudaStream_t stream) const override {
    return read_invalid_id_count(plan.problem(), workspace, stream);
  }

 protected:
  // run()'s weights are in weight_layout(), which only this type carries (checked by run()).
  static const Sm90PrepackedWeights& prepacked(const BackendWeights& weights) {
    return static_cast<const Sm90PrepackedWeights&>(weights);
  }
};

}  // namespace megamoe::runtime
