// k per (expert, projection) from the checkpoint-layout block scales on the host.
#include "backends/sm90_w4a8/sm90_w4a8_rescale.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>

#include "megamoe/format.h"
#include "megamoe/status.h"

namespace megamoe::runtime {
namespace {

constexpr const char* kProjections[3] = {"gate", "up", "down"};

// k of one linear. Valid ue4m3 scales are the bytes 0x00..0x7E, ordered like their values, so one
// pass for the largest byte finds S and tells whether any byte is invalid (>= 0x7F).
int rescale_exponent(const Nvfp4Linear& lin, const std::string& expert, int projection) {
  const int64_t blocks_per_row = lin.in_features / format::kNvfp4BlockSize;
  const std::span<const uint8_t> scales(lin.weight_scale, static_cast<size_t>(lin.out_features * blocks_per_row));
  const uint8_t largest = scales.empty() ? 0 : *std::max_element(scales.begin(), scales.end());
  if (!format::ue4m3_is_valid(largest)) {
    const auto bad = std::find_if(scales.begin(), scales.end(), [](uint8_t b) { return !format::ue4m3_is_valid(b); });
    const int64_t i = bad - scales.begin();
    char hex[8];
    std::snprintf(hex, sizeof(hex), "0x%02X", *bad);
    MEGAMOE_FAIL(kInvalidArgument, "w4a8_rescale_exponents: the ", expert, "'s ", kProjections[projection],
                 " block scale [", i / blocks_per_row, ", ", i % blocks_per_row, "] is the byte ", hex,
                 "; ue4m3 block scales must be finite and non-negative (0x00..0x7E).");
  }
  return format::w4a8_weight_rescale_exponent({&largest, 1});
}

std::array<int, 3> expert_exponents(const ExpertWeights& ex, const std::string& expert) {
  return {rescale_exponent(ex.gate, expert, 0), rescale_exponent(ex.up, expert, 1),
          rescale_exponent(ex.down, expert, 2)};
}

}  // namespace

W4a8RescaleExponents w4a8_rescale_exponents(const MoeLayer& layer) {
  W4a8RescaleExponents out;
  out.routed.reserve(layer.experts.size());
  for (size_t e = 0; e < layer.experts.size(); ++e) {
    out.routed.push_back(expert_exponents(layer.experts[e], "expert " + std::to_string(e)));
  }
  if (layer.shared_expert) out.shared = expert_exponents(*layer.shared_expert, "shared expert");
  return out;
}

}  // namespace megamoe::runtime
