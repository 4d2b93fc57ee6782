// The arithmetic of a MoE layer's expert GEMMs: an option of every API (MoeProblem::precision,
// EpConfig::precision, the CLI's --precision, the torch op's and NVFP4MoE's `precision`), named
// the same way everywhere. W4A16 is defined in docs/design.md §2, W4A8 in docs/w4a8.md. A
// precision that no GPU kernel of the build serves is refused when the plan is made
// (MoePlan::create throws kUnsupported); README "Precision" says what a build runs.
#pragma once

#include <string_view>

namespace megamoe {

enum class Precision {
  kW4a16,  // bf16 activations, NVFP4 weights decoded exactly, bf16 MMA: the exact path (default)
  kW4a8,   // e4m3 activations and weights rounded to e4m3, fp8 MMA: lossy, for prefill
  kAuto,   // per token count, W4A8 where the build has it and the plan's heuristic finds it
           // faster, else W4A16 (MoePlan::resolved_precision); the CPU reference runs W4A16
};

// Every value, in the order messages and help texts list them.
inline constexpr Precision kPrecisions[] = {Precision::kW4a16, Precision::kW4a8, Precision::kAuto};

// "w4a16", "w4a8" or "auto": the names every API takes. Never throws (a value outside the enum,
// reachable only through a cast, gets "invalid").
const char* precision_name(Precision precision);

// The inverse of precision_name: exactly "w4a16", "w4a8" or "auto" (lowercase). Throws
// megamoe::Error(kInvalidArgument) quoting `name` and listing the allowed values.
Precision parse_precision(std::string_view name);

}  // namespace megamoe
