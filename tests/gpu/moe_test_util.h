// Random MoE layers and routings for GPU tests: fresh data every run, different scales per
// block, row, projection and expert (uniform data hides layout bugs).
#pragma once

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <random>
#include <vector>

#include "megamoe/dtype.h"
#include "megamoe/format.h"
#include "megamoe/moe.h"
#include "megamoe/reference.h"

namespace megamoe::testing {

// Block scales of a random linear: spread around a per-row level (realistic), or every valid
// ue4m3 byte 0x00..0x7E uniformly (zero blocks with nonzero codes, subnormal scales 0x01..0x07,
// the maximum 448: the scale paths a realistic checkpoint rarely takes).
enum class ScaleCodes { kRealistic, kEveryCode };

// A random NVFP4 linear whose dequantized entries have magnitude ~ 1/sqrt(in): block scales
// spread over 2^-4..2^3 around a per-row level, all 16 codes, and a per-projection global scale.
inline Nvfp4Linear random_linear(std::mt19937& rng, int64_t out, int64_t in,
                                 ScaleCodes scale_codes = ScaleCodes::kRealistic) {
  std::vector<uint8_t> codes(static_cast<size_t>(out * in / 2));
  std::vector<uint8_t> scales(static_cast<size_t>(out * in / 16));
  for (auto& b : codes) b = static_cast<uint8_t>(rng());
  std::uniform_int_distribution<int> row_level(-2, 2), spread(-2, 2);
  for (int64_t r = 0; r < out; ++r) {
    const int level = row_level(rng);
    for (int64_t b = 0; b < in / 16; ++b) {
      const float v = std::ldexp(1.0f + (rng() % 8) / 8.0f, level + spread(rng));
      scales[static_cast<size_t>(r * (in / 16) + b)] =
          scale_codes == ScaleCodes::kEveryCode ? static_cast<uint8_t>(rng() % 0x7F) : format::f32_to_e4m3(v);
    }
  }
  std::uniform_real_distribution<float> s2(0.5f, 2.0f);
  const float global = s2(rng) / (3.0f * std::sqrt(static_cast<float>(in)));
  return make_owned_linear(out, in, std::move(codes), std::move(scales), global);
}

inline MoeLayer random_layer(std::mt19937& rng, int64_t H, int64_t I, int64_t E, int top_k,
                             int64_t shared_I = 0, std::optional<float> limit = std::nullopt,
                             ScaleCodes scale_codes = ScaleCodes::kRealistic) {
  MoeLayer layer;
  layer.hidden_size = H;
  layer.intermediate_size = I;
  layer.num_experts = E;
  layer.routing.top_k = top_k;
  layer.swiglu_limit = limit;
  for (int64_t e = 0; e < E; ++e) {
    layer.experts.push_back({random_linear(rng, I, H, scale_codes), random_linear(rng, I, H, scale_codes),
                             random_linear(rng, H, I, scale_codes)});
  }
  if (shared_I > 0) {
    layer.shared_expert = ExpertWeights{random_linear(rng, shared_I, H), random_linear(rng, shared_I, H),
                                        random_linear(rng, H, shared_I)};
  }
  return layer;
}

inline std::vector<uint16_t> random_hidden(std::mt19937& rng, int64_t T, int64_t H) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<uint16_t> x(static_cast<size_t>(T * H));
  for (auto& v : x) v = f32_to_bf16(n(rng));
  return x;
}

// Distinct random experts per token (or all on `only_expert` when >= 0 and k == 1), with
// positive weights that sum to 1.
inline reference::TopK random_topk(std::mt19937& rng, int64_t T, int64_t E, int k, int only_expert = -1) {
  reference::TopK r;
  r.tokens = T;
  r.k = k;
  std::vector<int32_t> perm(static_cast<size_t>(E));
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    if (only_expert >= 0) {
      std::swap(perm[0], *std::find(perm.begin(), perm.end(), only_expert));
    }
    float sum = 0;
    std::vector<float> w(static_cast<size_t>(k));
    for (auto& v : w) sum += (v = u(rng));
    for (int j = 0; j < k; ++j) {
      r.ids.push_back(perm[static_cast<size_t>(j)]);
      r.weights.push_back(w[static_cast<size_t>(j)] / sum);
    }
  }
  return r;
}

// k = 1 routing with exactly counts[e] tokens on expert e (T = the sum), in random token order.
inline reference::TopK counted_topk(std::mt19937& rng, const std::vector<int>& counts) {
  reference::TopK r;
  r.k = 1;
  for (size_t e = 0; e < counts.size(); ++e) r.ids.insert(r.ids.end(), static_cast<size_t>(counts[e]), static_cast<int32_t>(e));
  std::shuffle(r.ids.begin(), r.ids.end(), rng);
  r.tokens = static_cast<int64_t>(r.ids.size());
  r.weights.assign(r.ids.size(), 1.0f);
  return r;
}

inline std::vector<float> widen(const std::vector<uint16_t>& bf16) {
  std::vector<float> f(bf16.size());
  for (size_t i = 0; i < f.size(); ++i) f[i] = bf16_to_f32(bf16[i]);
  return f;
}

struct ErrorStats {
  double rel_l2 = 0;
  int64_t nans = 0;
};
inline ErrorStats compare(const std::vector<uint16_t>& got, const std::vector<float>& ref) {
  ErrorStats s;
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = bf16_to_f32(got[i]);
    if (!std::isfinite(g)) {
      ++s.nans;
      continue;
    }
    num += (g - ref[i]) * (g - ref[i]);
    den += static_cast<double>(ref[i]) * ref[i];
  }
  s.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return s;
}

}  // namespace megamoe::testing
