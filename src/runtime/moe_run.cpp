// run() (arch-neutral): the argument checks every row shares, then the plan's row for this T.
#include <algorithm>
#include <optional>
#include <string_view>

#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "runtime/backend.h"
#include "runtime/moe_device_weights.h"

namespace megamoe {
namespace {

// `returned`: a gated run whose combine writes the rows' sums where they came from (ReturnRows):
// it takes neither output.
void check_run_args(const MoePlan& plan, const runtime::DeviceWeightsAccess::Impl& w, const MoeRunArgs& args,
                    bool returned) {
  const MoeProblem& p = plan.problem();
  MEGAMOE_CHECK(w.shape.hidden_size == p.hidden_size && w.shape.intermediate_size == p.intermediate_size &&
                    w.shape.num_experts == p.num_experts &&
                    w.shape.shared_intermediate_size == p.shared_intermediate_size,
                kInvalidArgument, "run: the weights (H=", w.shape.hidden_size, ", I=",
                w.shape.intermediate_size, ", E=", w.shape.num_experts, ", shared I=",
                w.shape.shared_intermediate_size, ") do not match the plan (H=", p.hidden_size,
                ", I=", p.intermediate_size, ", E=", p.num_experts, ", shared I=",
                p.shared_intermediate_size, ")");
  MEGAMOE_CHECK(args.tokens >= 0 && args.tokens <= p.max_tokens, kInvalidArgument, "run: tokens = ",
                args.tokens, " must be in 0..max_tokens = ", p.max_tokens);
  if (args.tokens == 0) return;
  MEGAMOE_CHECK(args.hidden && args.topk_ids && args.topk_weights && args.workspace, kInvalidArgument,
                "run: hidden, topk_ids, topk_weights and workspace must be device pointers, not null");
  if (returned) {
    MEGAMOE_CHECK(args.output == nullptr && args.output_f32 == nullptr, kInternal,
                  "run_gated: the rows' sums go to their sources' return buffers: no output is taken");
  } else {
    MEGAMOE_CHECK((args.output != nullptr) != (args.output_f32 != nullptr), kInvalidArgument,
                  "run: give exactly one of output (bf16) and output_f32 (fp32)");
  }
  const void* out = args.output != nullptr ? static_cast<const void*>(args.output) : args.output_f32;  // null: returned
  MEGAMOE_CHECK(reinterpret_cast<uintptr_t>(args.hidden) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(args.workspace) % 256 == 0,
                kInvalidArgument, "run: hidden and output must be 16-byte aligned, workspace 256-byte aligned");
}

}  // namespace

namespace {

void run_checked(const MoePlan& plan, const MoeDeviceWeights& weights, const MoeRunArgs& args, cudaStream_t stream,
                 const runtime::GatedTokens* gated) {
  const auto& w = runtime::DeviceWeightsAccess::get(weights);
  check_run_args(plan, w, args, gated != nullptr && gated->gate.returns.src != nullptr);
  if (args.tokens == 0) return;
  // kAuto's row for the tokens expected.
  const runtime::MoeBackend& row = runtime::PlanAccess::backend(plan, gated ? std::max<int64_t>(1, gated->hint) : args.tokens);
  MEGAMOE_CHECK(w.data != nullptr && std::string_view(w.data->layout()) == row.weight_layout(), kInvalidArgument,
                "run: the weights were prepared in layout ", w.data ? w.data->layout() : "(none: moved from)",
                " for ", runtime::arch_name(w.arch), "; this plan's kernels (", row.name(), ") read ",
                row.weight_layout());
  row.run(plan, *w.data, args, stream, gated);
}

}  // namespace

void run(const MoePlan& plan, const MoeDeviceWeights& weights, const MoeRunArgs& args, cudaStream_t stream) {
  run_checked(plan, weights, args, stream, nullptr);
}

namespace runtime {

void run_gated(const MoePlan& plan, const MoeDeviceWeights& weights, const MoeRunArgs& args, const GatedTokens& gated,
               cudaStream_t stream) {
  const MoeProblem& p = plan.problem();
  MEGAMOE_CHECK(p.deterministic, kInternal, "run_gated: the plan must be deterministic");
  MEGAMOE_CHECK(gated.gate.words != nullptr && gated.gate.count != nullptr && gated.gate.epoch != nullptr &&
                    gated.gate.rows != nullptr && gated.gate.failure.failed != nullptr,
                kInternal, "run_gated: an incomplete token gate");
  MEGAMOE_CHECK(gated.hint >= 0 && gated.hint <= args.tokens, kInternal, "run_gated: hint ", gated.hint,
                " outside 0..", args.tokens);
  run_checked(plan, weights, args, stream, &gated);
}

}  // namespace runtime

}  // namespace megamoe
