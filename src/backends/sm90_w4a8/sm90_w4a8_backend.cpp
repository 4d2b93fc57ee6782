// The (sm_90, w4a8) row of the backend table: NVFP4 weights converted to e4m3 in registers,
// activations quantized to e4m3 per 128 of K, fp8 wgmma (docs/w4a8.md). It reads the W4A16 row's
// prepacked weights (one copy serves both precisions) and shares the sm90 dispatch and combine.
#include <mutex>

#include "backends/sm90_w4a16/sm90_prepacked_backend.h"
#include "backends/sm90_w4a8/sm90_w4a8_run.h"
#include "megamoe/status.h"
#include "runtime/backend.h"
#include "runtime/sm90/sm90_moe_pipeline.h"
#include "runtime/sm90/sm90_moe_workspace.h"

namespace megamoe::runtime {
namespace {

class Sm90W4a8Backend final : public Sm90PrepackedBackend {
 public:
  Precision precision() const override { return Precision::kW4a8; }
  // auto stays exact: this kernel is slower than W4A16 at every T (docs/perf/2026-11-29-h200-w4a8-v37.md).
  bool auto_accepts(const MoeProblem&, int64_t) const override { return false; }
  // So auto plans do not hold this row's larger workspace (the fp32 SwiGLU output and the codes).
  bool auto_may_accept(const MoeProblem&) const override { return false; }
  void validate(const MoeProblem& problem) const override {
    validate_sm90_w4a8_problem(problem);
  }
  size_t workspace_bytes(const MoeProblem& problem) const override { return w4a8_workspace_layout(problem).total; }
  std::string describe_config(const MoePlan& plan, int64_t tokens) const override {
    return w4a8_config(plan, tokens).to_string();
  }
  void run(const MoePlan& plan, const BackendWeights& weights, const MoeRunArgs& args, cudaStream_t stream,
           const GatedTokens* gated) const override {
    MEGAMOE_CHECK(gated == nullptr, kUnsupported,
                  "precision w4a8 does not run expert-parallel (gated) tokens yet; use w4a16 with expert parallelism");
    run_sm90_w4a8(plan, prepacked(weights), args, stream);
  }
  void load_kernels() const override {
    static std::once_flag once;
    std::call_once(once, [] {
      load_pipeline_kernels();
      load_w4a8_kernels();
    });
  }
};

}  // namespace

const MoeBackend& sm90_w4a8_backend() {
  static const Sm90W4a8Backend row;
  return row;
}

}  // namespace megamoe::runtime
