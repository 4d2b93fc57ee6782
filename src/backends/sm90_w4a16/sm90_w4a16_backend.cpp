// The (sm_90, w4a16) row of the backend table: bf16 activations, NVFP4 weights decoded exactly
// in registers, bf16 wgmma (docs/design.md §3.1).
#include <mutex>

#include "backends/sm90_w4a16/sm90_w4a16_heuristics.h"
#include "backends/sm90_w4a16/sm90_w4a16_launch.h"
#include "backends/sm90_w4a16/sm90_w4a16_run.h"
#include "backends/sm90_w4a16/sm90_prepacked_backend.h"
#include "runtime/backend.h"
#include "runtime/sm90/sm90_moe_pipeline.h"
#include "runtime/sm90/sm90_moe_workspace.h"

namespace megamoe::runtime {
namespace {

class Sm90W4a16Backend final : public Sm90PrepackedBackend {
 public:
  Precision precision() const override { return Precision::kW4a16; }
  // The exact row: kAuto's last resort at every T.
  bool auto_accepts(const MoeProblem&, int64_t) const override { return true; }
  bool auto_may_accept(const MoeProblem&) const override { return true; }
  void validate(const MoeProblem& problem) const override { validate_sm90_problem(problem); }
  size_t workspace_bytes(const MoeProblem& problem) const override { return workspace_layout(problem).total; }
  std::string describe_config(const MoePlan& plan, int64_t tokens) const override {
    return moe_config(plan, tokens).to_string();
  }
  void run(const MoePlan& plan, const BackendWeights& weights, const MoeRunArgs& args, cudaStream_t stream,
           const GatedTokens* gated) const override {
    run_sm90_w4a16(plan, prepacked(weights), args, stream, gated);
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
