#include "tests/common/test_util.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <system_error>

#include "megamoe/dtype.h"
#include "megamoe/format.h"

namespace megamoe::testing {

uint64_t fresh_seed() {
  std::random_device rd;
  return (uint64_t{rd()} << 32) | rd();
}

SeedTrace::SeedTrace(const char* file, int line) : SeedTrace(fresh_seed(), file, line) {}

SeedTrace::SeedTrace(uint64_t seed, const char* file, int line)
    : value_(seed), trace_(file, line, "seed " + std::to_string(seed)) {}

// ---- random data

namespace {

void fill_scales(Rng& rng, std::vector<uint8_t>& scales, int64_t out, int64_t in, ScaleCodes codes) {
  switch (codes) {
    case ScaleCodes::kRealistic: {
      const int64_t blocks = in / format::kNvfp4BlockSize;
      for (int64_t r = 0; r < out; ++r) {
        const int level = rng.uniform_int(-2, 2);
        for (int64_t b = 0; b < blocks; ++b) {
          const float v = std::ldexp(1.0f + static_cast<float>(rng.uniform_int(0, 7)) / 8.0f,
                                     level + rng.uniform_int(-2, 2));
          scales[static_cast<size_t>(r * blocks + b)] = format::f32_to_e4m3(v);
        }
      }
      return;
    }
    case ScaleCodes::kEveryCode:
      for (uint8_t& s : scales) s = static_cast<uint8_t>(rng.uniform_int(0, 0x7E));
      return;
    case ScaleCodes::kUpToRandomTop: {
      const int top = rng.uniform_int(0x30, 0x7E);
      for (uint8_t& s : scales) s = static_cast<uint8_t>(rng.uniform_int(0, top));
      return;
    }
  }
  throw std::invalid_argument("random_linear: unknown ScaleCodes " + std::to_string(static_cast<int>(codes)));
}

float draw_global(Rng& rng, int64_t in, GlobalScale global) {
  switch (global) {
    case GlobalScale::kUnitGain:
      return static_cast<float>(rng.uniform(0.5, 2.0)) / (3.0f * std::sqrt(static_cast<float>(in)));
    case GlobalScale::kAnyExponent:
      return static_cast<float>(std::ldexp(rng.uniform(1.0, 2.0), rng.uniform_int(-12, -4)));
  }
  throw std::invalid_argument("random_linear: unknown GlobalScale " + std::to_string(static_cast<int>(global)));
}

}  // namespace

Nvfp4Linear random_linear(Rng& rng, int64_t out, int64_t in, LinearDraw draw) {
  std::vector<uint8_t> codes(static_cast<size_t>(out * in / 2));
  std::vector<uint8_t> scales(static_cast<size_t>(out * in / format::kNvfp4BlockSize));
  for (uint8_t& c : codes) c = static_cast<uint8_t>(rng());
  fill_scales(rng, scales, out, in, draw.scales);
  const float global = draw_global(rng, in, draw.global);
  return make_owned_linear(out, in, std::move(codes), std::move(scales), global);
}

ExpertWeights random_expert(Rng& rng, int64_t H, int64_t I, LinearDraw draw) {
  ExpertWeights w;
  w.gate = random_linear(rng, I, H, draw);
  w.up = random_linear(rng, I, H, draw);
  w.down = random_linear(rng, H, I, draw);
  return w;
}

MoeLayer random_layer(Rng& rng, int64_t H, int64_t I, int64_t E, int top_k, int64_t shared_I,
                      std::optional<float> limit, LinearDraw draw) {
  MoeLayer layer;
  layer.hidden_size = H;
  layer.intermediate_size = I;
  layer.num_experts = E;
  layer.routing.top_k = top_k;
  layer.swiglu_limit = limit;
  for (int64_t e = 0; e < E; ++e) layer.experts.push_back(random_expert(rng, H, I, draw));
  if (shared_I > 0) layer.shared_expert = random_expert(rng, H, shared_I, draw);
  return layer;
}

std::vector<uint16_t> random_hidden(Rng& rng, int64_t T, int64_t H, HiddenValues values) {
  std::vector<uint16_t> x(static_cast<size_t>(T * H));
  switch (values) {
    case HiddenValues::kNormal:
      for (uint16_t& v : x) v = f32_to_bf16(static_cast<float>(rng.normal()));
      return x;
    case HiddenValues::kWideExponents:
      for (uint16_t& v : x) v = f32_to_bf16(static_cast<float>(std::ldexp(rng.normal(), rng.uniform_int(-4, 4))));
      return x;
    case HiddenValues::kScaledBlocks:
      for (size_t b = 0; b < x.size(); b += 128) {
        const bool zero = rng.uniform_int(0, 9) == 0;
        const int exponent = rng.uniform_int(-6, 6);
        for (size_t i = b; i < std::min(b + 128, x.size()); ++i) {
          x[i] = zero ? 0 : f32_to_bf16(static_cast<float>(std::ldexp(rng.normal(), exponent)));
        }
      }
      return x;
  }
  throw std::invalid_argument("random_hidden: unknown HiddenValues " + std::to_string(static_cast<int>(values)));
}

reference::TopK make_topk(int64_t tokens, int k, std::vector<int32_t> ids, std::vector<float> weights) {
  reference::TopK t;
  t.tokens = tokens;
  t.k = k;
  t.ids = std::move(ids);
  t.weights = std::move(weights);
  return t;
}

reference::TopK random_topk(Rng& rng, int64_t T, int64_t E, int k, int only_expert) {
  reference::TopK r;
  r.tokens = T;
  r.k = k;
  std::vector<int32_t> perm(static_cast<size_t>(E));
  std::vector<float> w(static_cast<size_t>(k));
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    if (only_expert >= 0) std::swap(perm[0], *std::find(perm.begin(), perm.end(), only_expert));
    float sum = 0;
    for (float& v : w) sum += (v = static_cast<float>(rng.uniform(0.05, 1.0)));
    for (int j = 0; j < k; ++j) {
      r.ids.push_back(perm[static_cast<size_t>(j)]);
      r.weights.push_back(w[static_cast<size_t>(j)] / sum);
    }
  }
  return r;
}

reference::TopK counted_topk(Rng& rng, const std::vector<int>& counts) {
  reference::TopK r;
  r.k = 1;
  for (size_t e = 0; e < counts.size(); ++e) {
    r.ids.insert(r.ids.end(), static_cast<size_t>(counts[e]), static_cast<int32_t>(e));
  }
  std::shuffle(r.ids.begin(), r.ids.end(), rng);
  r.tokens = static_cast<int64_t>(r.ids.size());
  r.weights.assign(r.ids.size(), 1.0f);
  return r;
}

reference::TopK arbitrary_topk(Rng& rng, int64_t T, int64_t E, int k) {
  reference::TopK r = make_topk(T, k, std::vector<int32_t>(static_cast<size_t>(T * k)),
                                std::vector<float>(static_cast<size_t>(T * k)));
  for (size_t i = 0; i < r.ids.size(); ++i) {
    r.ids[i] = rng.uniform_int(0, static_cast<int>(E) - 1);
    r.weights[i] = static_cast<float>(rng.uniform(-0.5, 1.5));
  }
  if (k >= 2 && T >= 1) r.ids[1] = r.ids[0];
  return r;
}

// ---- errors

namespace {

template <class Got, class Want, class Value>
ErrorStats compare_values(std::span<const Got> got, std::span<const Want> want, Value value) {
  if (got.size() != want.size()) {
    throw std::invalid_argument("compare: got holds " + std::to_string(got.size()) + " values, want " +
                                std::to_string(want.size()));
  }
  ErrorStats s;
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = value(got[i]), w = static_cast<double>(want[i]);
    if (!std::isfinite(g)) {
      ++s.nonfinite;
      continue;
    }
    num += (g - w) * (g - w);
    den += w * w;
  }
  s.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return s;
}

double as_double(float v) { return v; }
double bf16_as_double(uint16_t v) { return bf16_to_f32(v); }

double rel_l2_of(const ErrorStats& s) {
  return s.nonfinite > 0 ? std::numeric_limits<double>::quiet_NaN() : s.rel_l2;
}

}  // namespace

ErrorStats compare(std::span<const float> got, std::span<const float> want) {
  return compare_values(got, want, as_double);
}

ErrorStats compare(std::span<const uint16_t> got_bf16, std::span<const float> want) {
  return compare_values(got_bf16, want, bf16_as_double);
}

double rel_l2(std::span<const float> got, std::span<const float> want) {
  return rel_l2_of(compare_values(got, want, as_double));
}

double rel_l2(std::span<const float> got, std::span<const double> want) {
  return rel_l2_of(compare_values(got, want, as_double));
}

std::vector<float> widen(std::span<const uint16_t> bf16) {
  std::vector<float> f(bf16.size());
  for (size_t i = 0; i < f.size(); ++i) f[i] = bf16_to_f32(bf16[i]);
  return f;
}

// ---- files

ScratchDir::ScratchDir(std::string_view prefix) {
  std::string name(prefix);
  if (const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info()) {
    name += std::string("_") + info->test_suite_name() + "_" + info->name();
  }
  // Parameterized tests' names hold '/'.
  std::replace_if(name.begin(), name.end(), [](char c) { return !std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-'; }, '_');
  name += "_" + std::to_string(::getpid()) + "_" + std::to_string(fresh_seed() % 1000000000);
  path_ = std::filesystem::temp_directory_path() / name;
  std::filesystem::create_directories(path_);
}

ScratchDir::~ScratchDir() {
  std::error_code ec;  // a destructor must not throw; a leftover directory is harmless
  std::filesystem::remove_all(path_, ec);
}

}  // namespace megamoe::testing
