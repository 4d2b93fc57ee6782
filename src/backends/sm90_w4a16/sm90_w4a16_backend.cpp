// The (sm_90, w4a16) row of the backend table: bf16 activations, NVFP4 weights decoded exactly
// in registers, bf16 wgmma (docs/design.md §3.1).
#include <mutex>

#include "backends/sm90_w4a16/sm90_w4a16_heuristics.h"
#include "backends/sm90_w4a16/sm90_w4a16_launch.h"
#include "backends/sm90_w4a16/sm90_w4a16_run.h"
#include "backends/sm90_w4a16/sm90_w4a16_weights.h"
#include "runtime/backend.h"
#include "runtime/sm90/sm90_moe_pipeline.h"
#include "runtime/sm90/sm90_moe_workspace.h"

namespace megamoe::runtime {
namespace {

class Sm90W4a16Backend final : public MoeBackend {
 public:
  Arch arch() const override { return 90; }
  Precision precision() const override { return Precision::kW4a16; }
  // The exact row: kAuto's last resort at every T.
  bool auto_accepts(const MoeProblem&, int64_t) const override { return true; }
  void validate(const MoeProblem& problem) const override { validate_sm90_problem(problem); }
  size_t workspace_bytes(const MoeProblem& problem) const override { return workspace_layout(problem).total; }
  std::string describe_config(const MoePlan& plan, int64_t tokens) const override {
    return moe_config(plan, tokens).to_string();
  }
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
  void run(const MoePlan& plan, const BackendWeights& weights, const MoeRunArgs& args, cudaStream_t stream,
           const GatedTokens* gated) const override {
    // run() has checked that the weights are in weight_layout(), which only this type carries.
    run_sm90_w4a16(plan, static_cast<const Sm90PrepackedWeights&>(weights), args, stream, gated);
  }
  int64_t invalid_id_count(const MoePlan& plan, const void* workspace, cudaStream_t stream) const override {
    return read_invalid_id_count(plan.problem(), workspace, stream);
  }
  void load_kernels() const override {
    static std::once_flag once;
    std::call_once(once, [] {
      load_pipeline_kernels();
      load_w4a16_kernels();
    });
  }
};

}  // namespace

const MoeBackend& sm90_w4a16_backend() {
  static const Sm90W4a16Backend row;
  return row;
}

}  // namespace megamoe::runtime
