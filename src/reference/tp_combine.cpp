// The reference combine of tensor-parallel partial outputs (include/megamoe/reference.h,
// include/megamoe/tp.h): Σ over ranks in double, in rank order, one rounding.

#include <cstdint>
#include <span>
#include <vector>

#include "megamoe/reference.h"
#include "megamoe/status.h"

namespace megamoe::reference {
namespace {

// Σ_r partials[r][i] in double, r = 0, 1, ..., R-1.
template <class Out, class Round>
std::vector<Out> combine(std::span<const std::vector<float>> partials, Round round) {
  MEGAMOE_CHECK(!partials.empty(), kInvalidArgument,
                "tp_combine: no partial outputs; expected one per tensor-parallel rank");
  const size_t n = partials[0].size();
  for (size_t r = 1; r < partials.size(); ++r) {
    MEGAMOE_CHECK(partials[r].size() == n, kInvalidArgument, "tp_combine: rank ", r,
                  "'s partial output has ", partials[r].size(), " values; rank 0's has ", n,
                  " (every rank's is [T, H] of the same tokens)");
  }
  std::vector<Out> out(n);
  for (size_t i = 0; i < n; ++i) {
    double sum = 0.0;
    for (const std::vector<float>& p : partials) sum += static_cast<double>(p[i]);
    out[i] = round(sum);
  }
  return out;
}

}  // namespace

std::vector<uint16_t> tp_combine(std::span<const std::vector<float>> partials) {
  return combine<uint16_t>(partials, [](double v) { return f64_to_bf16(v); });
}

std::vector<float> tp_combine_f32(std::span<const std::vector<float>> partials) {
  return combine<float>(partials, [](double v) { return static_cast<float>(v); });
}

}  // namespace megamoe::reference
