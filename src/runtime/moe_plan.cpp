// MoePlan (arch-neutral): the checks every row shares, the choice of backend rows for the device
// and the precision, and what the plan answers through its rows. Host code only.
#include <cctype>
#include <cmath>
#include <sstream>

#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "runtime/backend.h"

namespace megamoe {

MoeProblem MoeProblem::from_layer(const MoeLayer& layer, int64_t max_tokens) {
  MoeProblem p;
  p.hidden_size = layer.hidden_size;
  p.intermediate_size = layer.intermediate_size;
  p.num_experts = layer.num_experts;
  p.top_k = layer.routing.top_k;
  p.shared_intermediate_size = layer.shared_expert ? layer.shared_expert->intermediate_size() : 0;
  p.max_tokens = max_tokens;
  p.swiglu_limit = layer.swiglu_limit;
  return p;
}

namespace runtime {

void validate_problem_common(const MoeProblem& p) {
  MEGAMOE_CHECK(p.top_k >= 1 && p.top_k <= std::min<int64_t>(p.num_experts, 16), kInvalidArgument,
                "MoePlan: top_k = ", p.top_k, " must be in 1..min(num_experts, 16)");
  MEGAMOE_CHECK(p.max_tokens >= 0 && p.max_tokens <= (int64_t{1} << 20), kInvalidArgument,
                "MoePlan: max_tokens = ", p.max_tokens, " must be in 0..1048576");
  MEGAMOE_CHECK(!p.swiglu_limit || (std::isfinite(*p.swiglu_limit) && *p.swiglu_limit > 0),
                kInvalidArgument, "MoePlan: swiglu_limit must be finite and positive");
  const bool known = p.precision == Precision::kW4a16 || p.precision == Precision::kW4a8 ||
                     p.precision == Precision::kAuto;
  MEGAMOE_CHECK(known, kInvalidArgument, "MoePlan: MoeProblem.precision holds ", static_cast<int>(p.precision),
                ", which is not a Precision; allowed: kW4a16, kW4a8, kAuto");
}

std::vector<const MoeBackend*> resolve_backends(const MoeProblem& p, Arch arch, const std::string& device) {
  std::vector<const MoeBackend*> rows;
  for (const MoeBackend* row : backend_table()) {
    if (row->arch() == arch && (p.precision == Precision::kAuto || row->precision() == p.precision)) {
      rows.push_back(row);
    }
  }
  if (rows.empty()) {
    const bool arch_built = find_backend(arch, Precision::kW4a16) != nullptr;
    MEGAMOE_CHECK(arch_built, kUnsupported, "MoePlan: ", device.empty() ? arch_name(arch) : device,
                  " is not supported: this build has kernels for ", built_backends());
    std::string upper = precision_name(p.precision);
    for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    MEGAMOE_FAIL(kUnsupported, "MoePlan: precision ", precision_name(p.precision), " is not supported on ",
                 arch_name(arch), ": this build has no ", upper, " GPU kernel (built: ", built_backends(),
                 "). Use w4a16, the exact path (the default), or auto, which runs the built kernels; the ",
                 upper, " numerics can be computed on the CPU with `megamoe reference --precision ",
                 precision_name(p.precision), "`");
  }
  if (p.precision != Precision::kAuto) {
    rows.front()->validate(p);
    return rows;
  }
  // kAuto keeps the lossy rows that can run the problem and may take some T; the exact row must.
  std::vector<const MoeBackend*> usable;
  for (const MoeBackend* row : rows) {
    if (row->precision() == Precision::kW4a16) {
      row->validate(p);
      usable.push_back(row);
      continue;
    }
    if (!row->auto_may_accept(p)) continue;
    try {
      row->validate(p);
    } catch (const Error&) {
      continue;  // a lossy row that cannot run this problem leaves kAuto to the others
    }
    usable.push_back(row);
  }
  return usable;
}

const MoeBackend& PlanAccess::backend(const MoePlan& plan, int64_t tokens) {
  for (const MoeBackend* row : plan.backends_) {
    if (plan.backends_.size() == 1 || row->auto_accepts(plan.problem(), tokens)) return *row;
  }
  MEGAMOE_FAIL(kInternal, "MoePlan: no backend row accepts T=", tokens, " (the exact row must accept every T)");
}

}  // namespace runtime

MoePlan MoePlan::create(const MoeProblem& problem, const MoeTuning& tuning) {
  // The problem first: a bad shape is reported the same on any device.
  runtime::validate_problem_common(problem);
  const runtime::DeviceInfo device = runtime::current_device();
  MoePlan plan;
  plan.backends_ = runtime::resolve_backends(problem, device.arch,
                                             detail::concat("device ", device.device, " (", device.name, ", ",
                                                            runtime::arch_name(device.arch), ")"));
  plan.problem_ = problem;
  plan.tuning_ = tuning;
  MEGAMOE_CHECK(!tuning.num_sms || (*tuning.num_sms >= 1 && *tuning.num_sms <= device.num_sms), kInvalidArgument,
                "MoeTuning.num_sms = ", tuning.num_sms.value_or(0), " must be in 1..", device.num_sms,
                " (the SMs of device ", device.device, ")");
  plan.num_sms_ = tuning.num_sms.value_or(device.num_sms);
  for (const runtime::MoeBackend* row : plan.backends_) row->load_kernels();
  return plan;
}

size_t MoePlan::workspace_bytes() const {
  size_t bytes = 0;
  for (const runtime::MoeBackend* row : backends_) bytes = std::max(bytes, row->workspace_bytes(problem_));
  return bytes;
}

std::string MoePlan::describe(int64_t tokens) const {
  const runtime::MoeBackend& row = runtime::PlanAccess::backend(*this, tokens);
  std::ostringstream os;
  os << "T=" << tokens << " " << precision_name(row.precision())
     << (problem_.precision == Precision::kAuto ? " (auto)" : "") << " " << row.describe_config(*this, tokens)
     << (problem_.deterministic ? " deterministic" : " atomic-combine");
  return os.str();
}

Precision MoePlan::resolved_precision(int64_t tokens) const {
  return runtime::PlanAccess::backend(*this, tokens).precision();
}

int64_t MoePlan::invalid_id_count(const void* workspace, cudaStream_t stream) const {
  return backends_.front()->invalid_id_count(*this, workspace, stream);
}

}  // namespace megamoe
