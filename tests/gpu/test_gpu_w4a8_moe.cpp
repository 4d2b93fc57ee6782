// The w4a8/sm_90 row against its exact CPU emulation (reference::moe_forward_w4a8), stage by
// stage (docs/w4a8.md §4.1), on fresh random layers, hidden states and routings every run.
// Outputs and the workspace are poisoned before each run (GpuMoe::run); after it the workspace
// still holds the row's intermediates, read back here:
//   1. the hidden states' codes and block scales 2^e: bit for bit the emulation's;
//   2. L1's fp32 a per element: within the bound of the fp8 MMA's accumulation (kMmaEps);
//   3. L2's input codes and block scales: bit for bit the quantization of that fp32 a;
//   4. the output (fp32 and bf16): the emulation's L2 and combine applied to those codes, within
//      the MMA's bound per element and in RMS.
// What 2 and 3 allow, a code that differs from the emulation's where its a lies near an e4m3
// rounding boundary, is counted and printed with the relative L2 against the plain emulation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "backends/sm90_w4a8/sm90_w4a8_layout.h"
#include "backends/sm90_w4a8/sm90_w4a8_run.h"
#include "gpu_test_util.h"
#include "megamoe/dtype.h"
#include "megamoe/format.h"
#include "megamoe/reference.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "runtime/sm90/sm90_moe_workspace.h"
#include "tests/common/test_util.h"

namespace megamoe {
namespace {

using testing::GpuMoe;
using reference::W4a8Projection;

// docs/w4a8.md §4.1: a projection's output computed by the fp8 MMA (products aligned and
// truncated to 13 fraction bits per k32 step, 4 steps per block) is within kMmaEps times the sum
// of its terms' magnitudes of the exact value: the truncation model allows 136·2^-13 ≈ 0.0166 per
// element. Over a whole output the RMS of that ratio stays within kMmaRmsEps (the H200 measured
// RMS up to 3.3e-5 for L1's a and 1.2e-4 for the output; per element up to 2.3e-4 and 1.1e-3).
constexpr double kMmaEps = 0x1p-5;
constexpr double kMmaRmsEps = 0x1p-10;
// |silu'(x)| <= 1.0998 for every x.
constexpr double kSiluLipschitz = 1.1;

struct Case {
  const char* name;
  int64_t H, I, E;
  int k;
  int64_t T;
  int64_t shared_I = 0;
  std::optional<float> limit = std::nullopt;
  int only_expert = -1;
  std::vector<int> expert_tokens = {};  // if set: k = 1 and exactly this many tokens per expert
  const char* tile = nullptr;           // both GEMMs' tile (MoeTuning::l1_tile / l2_tile); unset: the heuristic's
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

MoePlan w4a8_plan(const MoeLayer& layer, int64_t max_tokens, bool deterministic, const char* tile = nullptr) {
  MoeProblem p = MoeProblem::from_layer(layer, max_tokens);
  p.precision = Precision::kW4a8;
  p.deterministic = deterministic;
  MoeTuning tuning;
  if (tile != nullptr) tuning.l1_tile = tuning.l2_tile = std::string(tile);
  return MoePlan::create(p, tuning);
}

template <class F>
void parallel_for(int64_t n, F&& f) {
  const int64_t workers = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, 32);
  std::vector<std::thread> pool;
  for (int64_t w = 0; w < std::min(workers, n); ++w) {
    pool.emplace_back([&, w] {
      for (int64_t i = w; i < n; i += workers) f(i);
    });
  }
  for (std::thread& t : pool) t.join();
}

// The row's intermediates, read back from the workspace after a run.
struct Intermediates {
  std::vector<int32_t> token_slot;
  std::vector<uint8_t> x_codes, a_codes;
  std::vector<float> x_scales, a_scales;  // 2^e per token (or slot) and block
  std::vector<float> act;

  Intermediates(const GpuMoe& gpu, int64_t T) {
    const MoeProblem& p = gpu.plan.problem();
    const runtime::W4a8WorkspaceLayout L = runtime::w4a8_workspace_layout(p);
    EXPECT_GE(gpu.workspace.size(), L.total);
    const std::vector<uint8_t> ws = gpu.workspace.download();
    const int64_t H = p.hidden_size, I = p.intermediate_size, S = T * runtime::slots_per_token(p);
    auto take = [&](auto& v, size_t offset, int64_t count) {
      v.resize(static_cast<size_t>(count));
      std::memcpy(v.data(), ws.data() + offset, v.size() * sizeof(v[0]));
    };
    take(token_slot, L.base.token_slot, S);
    take(x_codes, L.x_codes, T * H);
    take(x_scales, L.x_scales, T * H / 128);
    take(act, L.act_f32, S * I);
    take(a_codes, L.a_codes, S * I);
    take(a_scales, L.a_scales, S * I / 128);
  }
};

// What one token's check found.
struct TokenCheck {
  std::vector<double> conditioned, bound;  // the expected output (fp32 sums in double) and its bound
  int64_t x_code_mismatches = 0, a_out_of_bound = 0, a_code_mismatches = 0, flipped_codes = 0, a_values = 0;
  double max_a_eps = 0;                    // max |δa| over the bound at eps = 1
  double a_err2 = 0, a_ref2 = 0, a_unit2 = 0;
  std::string first_failure;
};

void note(TokenCheck& c, const std::string& what) {
  if (c.first_failure.empty()) c.first_failure = what;
}

// Codes stored in the MMA's K order (sm90_w4a8_layout.h) against codes in natural order.
int64_t code_mismatches(const uint8_t* stored, const std::vector<uint8_t>& natural) {
  int64_t n = 0;
  for (size_t p = 0; p < natural.size(); ++p) {
    n += stored[p] != natural[kernels::sm90::w4a8::k_of_position(static_cast<int>(p))];
  }
  return n;
}

std::vector<double> dequantize(const uint8_t* stored, const float* scales, int64_t n) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t p = 0; p < n; ++p) {
    v[kernels::sm90::w4a8::k_of_position(static_cast<int>(p))] =
        static_cast<double>(format::e4m3_to_f32(stored[p])) * static_cast<double>(scales[p / 128]);
  }
  return v;
}

TokenCheck check_token(const MoeLayer& layer, const std::vector<uint16_t>& hidden, const reference::TopK& topk,
                       const Intermediates& m, int64_t t, int64_t slots_per_token) {
  TokenCheck c;
  const int64_t H = layer.hidden_size, I = layer.intermediate_size;
  std::vector<double> x(H);
  for (int64_t h = 0; h < H; ++h) x[h] = bf16_to_f32(hidden[t * H + h]);

  // 1. The hidden states' codes and block scales.
  std::vector<uint8_t> codes(H);
  std::vector<int32_t> exps(H / 128);
  format::quantize_activation_w4a8(x, 1, H, codes, exps);
  c.x_code_mismatches = code_mismatches(m.x_codes.data() + t * H, codes);
  for (int64_t b = 0; b < H / 128; ++b) c.x_code_mismatches += m.x_scales[t * H / 128 + b] != std::ldexp(1.0f, exps[b]);
  const std::vector<double> x_hat = reference::w4a8_quantize_dequantize(x);

  c.conditioned.assign(H, 0.0);
  c.bound.assign(H, 0.0);
  const int64_t shared_chunks = slots_per_token - topk.k;
  std::vector<double> shared_a_hat(shared_chunks * I);
  std::optional<reference::W4a8ProjectionOutput> shared_g, shared_u;
  if (shared_chunks > 0) {
    shared_g = reference::w4a8_project(layer, reference::kW4a8SharedExpert, W4a8Projection::kGate, x_hat);
    shared_u = reference::w4a8_project(layer, reference::kW4a8SharedExpert, W4a8Projection::kUp, x_hat);
  }
  for (int64_t j = 0; j < slots_per_token; ++j) {
    const int32_t slot = m.token_slot[t * slots_per_token + j];
    if (slot < 0) {
      note(c, "selection " + std::to_string(j) + " has no slot");
      continue;
    }
    const bool routed = j < topk.k;
    const int expert = routed ? topk.ids[t * topk.k + j] : reference::kW4a8SharedExpert;
    const int64_t col0 = routed ? 0 : (j - topk.k) * I;  // this slot's columns of its expert's I
    reference::W4a8ProjectionOutput g, u;
    if (routed) {
      g = reference::w4a8_project(layer, expert, W4a8Projection::kGate, x_hat);
      u = reference::w4a8_project(layer, expert, W4a8Projection::kUp, x_hat);
    }
    const reference::W4a8ProjectionOutput& G = routed ? g : *shared_g;
    const reference::W4a8ProjectionOutput& U = routed ? u : *shared_u;
    const std::vector<double> a_ref = reference::w4a8_swiglu(
        layer, std::span(G.value).subspan(col0, I), std::span(U.value).subspan(col0, I));

    // 2. L1's fp32 a per element. The clamp is 1-Lipschitz; silu's slope is at most 1.1.
    const float* a = m.act.data() + static_cast<int64_t>(slot) * I;
    std::vector<double> a_kernel(I);
    for (int64_t i = 0; i < I; ++i) {
      const double dg = G.magnitude[col0 + i], du = U.magnitude[col0 + i];
      double gc = G.value[col0 + i], uc = U.value[col0 + i];
      if (layer.swiglu_limit) {
        gc = std::min<double>(gc, *layer.swiglu_limit);
        uc = std::clamp<double>(uc, -*layer.swiglu_limit, *layer.swiglu_limit);
      }
      const double silu_g = gc / (1.0 + std::exp(-gc));
      const double unit =
          kSiluLipschitz * (std::fabs(uc) + kMmaEps * du) * dg + (std::fabs(silu_g) + kSiluLipschitz * kMmaEps * dg) * du;
      const double err = std::fabs(static_cast<double>(a[i]) - a_ref[i]);
      a_kernel[i] = a[i];
      c.a_err2 += err * err;
      c.a_ref2 += a_ref[i] * a_ref[i];
      c.a_unit2 += unit * unit;
      if (unit > 0) c.max_a_eps = std::max(c.max_a_eps, err / unit);
      if (!(err <= kMmaEps * unit + 0x1p-18 * std::fabs(a_ref[i]) + 1e-30)) {
        if (c.a_out_of_bound++ == 0) {
          std::ostringstream s;
          s << "a of token " << t << " slot " << j << " column " << col0 + i << ": kernel " << a[i] << ", emulation "
            << a_ref[i] << ", bound " << kMmaEps * unit;
          note(c, s.str());
        }
      }
    }
    c.a_values += I;

    // 3. L2's input codes: the quantization of the kernel's fp32 a, bit for bit; and how many
    // differ from the emulation's own (allowed by 2).
    std::vector<uint8_t> a_codes(I), ref_codes(I);
    std::vector<int32_t> a_exps(I / 128), ref_exps(I / 128);
    format::quantize_activation_w4a8(a_kernel, 1, I, a_codes, a_exps);
    format::quantize_activation_w4a8(a_ref, 1, I, ref_codes, ref_exps);
    const uint8_t* stored = m.a_codes.data() + static_cast<int64_t>(slot) * I;
    const float* stored_scales = m.a_scales.data() + static_cast<int64_t>(slot) * (I / 128);
    c.a_code_mismatches += code_mismatches(stored, a_codes);
    c.flipped_codes += code_mismatches(stored, ref_codes);
    for (int64_t b = 0; b < I / 128; ++b) c.a_code_mismatches += stored_scales[b] != std::ldexp(1.0f, a_exps[b]);
    const std::vector<double> a_hat = dequantize(stored, stored_scales, I);

    // 4. The emulation's L2 and combine on those codes; the shared expert's chunks as one input.
    if (routed) {
      const auto y = reference::w4a8_project(layer, expert, W4a8Projection::kDown, a_hat);
      const double w = topk.weights[t * topk.k + j];
      for (int64_t h = 0; h < H; ++h) {
        c.conditioned[h] += w * y.value[h];
        c.bound[h] += std::fabs(w) * y.magnitude[h];
      }
    } else {
      std::copy(a_hat.begin(), a_hat.end(), shared_a_hat.begin() + col0);
    }
  }
  if (shared_chunks > 0) {
    const auto y = reference::w4a8_project(layer, reference::kW4a8SharedExpert, W4a8Projection::kDown, shared_a_hat);
    for (int64_t h = 0; h < H; ++h) c.conditioned[h] += y.value[h], c.bound[h] += y.magnitude[h];
  }
  return c;
}

void check_case(const Case& c, bool deterministic) {
  SCOPED_TRACE(::testing::Message() << c.name << " H=" << c.H << " I=" << c.I << " E=" << c.E << " k=" << c.k
                                    << " T=" << c.T);
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const MoeLayer layer = testing::random_layer(rng, c.H, c.I, c.E, c.k, c.shared_I, c.limit);
  const auto hidden = testing::random_hidden(rng, c.T, c.H, testing::HiddenValues::kScaledBlocks);
  const auto topk = c.expert_tokens.empty() ? testing::random_topk(rng, c.T, c.E, c.k, c.only_expert)
                                            : testing::counted_topk(rng, c.expert_tokens);
  ASSERT_EQ(topk.tokens, c.T) << "case " << c.name << ": T must be the sum of expert_tokens";
  GpuMoe gpu(w4a8_plan(layer, c.T, deterministic, c.tile), MoeDeviceWeights::upload(layer));
  ASSERT_EQ(gpu.plan.resolved_precision(c.T), Precision::kW4a8);
  // The fp32 output (the combine's sums before the bf16 rounding) and the intermediates of that
  // run; then the bf16 output, from the same intermediates (L1 and the quantizations are
  // deterministic in both combines).
  const std::vector<float> got32 = gpu.run_f32(hidden, topk);
  const Intermediates m(gpu, c.T);
  const std::vector<uint16_t> got = gpu.run(hidden, topk);
  if (deterministic) EXPECT_EQ(gpu.run(hidden, topk), got) << "two deterministic runs differ";

  const int64_t spt = runtime::slots_per_token(gpu.plan.problem());
  std::vector<TokenCheck> checks(static_cast<size_t>(c.T));
  parallel_for(c.T, [&](int64_t t) { checks[t] = check_token(layer, hidden, topk, m, t, spt); });

  TokenCheck all;
  std::vector<float> want(static_cast<size_t>(c.T * c.H));
  int64_t out_of_bound = 0, nonfinite = 0;
  double y_dev2 = 0, y_unit2 = 0, max_y_eps = 0;
  for (int64_t t = 0; t < c.T; ++t) {
    const TokenCheck& k = checks[t];
    all.x_code_mismatches += k.x_code_mismatches;
    all.a_out_of_bound += k.a_out_of_bound;
    all.a_code_mismatches += k.a_code_mismatches;
    all.flipped_codes += k.flipped_codes;
    all.a_values += k.a_values;
    all.max_a_eps = std::max(all.max_a_eps, k.max_a_eps);
    all.a_err2 += k.a_err2, all.a_ref2 += k.a_ref2, all.a_unit2 += k.a_unit2;
    if (!k.first_failure.empty()) note(all, k.first_failure);
    for (int64_t h = 0; h < c.H; ++h) {
      const int64_t i = t * c.H + h;
      const double e = k.conditioned[h], M = k.bound[h], v32 = got32[i], v = bf16_to_f32(got[i]);
      want[i] = bf16_to_f32(reference::f64_to_bf16(e));
      if (!std::isfinite(v) || !std::isfinite(v32)) {
        ++nonfinite;
        continue;
      }
      y_dev2 += (v32 - e) * (v32 - e);
      y_unit2 += M * M;
      if (M > 0) max_y_eps = std::max(max_y_eps, std::fabs(v32 - e) / M);
      // fp32: the MMA's bound; bf16: plus the final rounding.
      const bool ok = std::fabs(v32 - e) <= kMmaEps * M + 1e-30 && std::fabs(v - e) <= kMmaEps * M + 0x1p-8 * std::fabs(e) + 1e-30;
      if (!ok && out_of_bound++ == 0) {
        ADD_FAILURE() << "output [" << t << ", " << h << "]: kernel " << v32 << " (fp32), " << v
                      << " (bf16), the emulation on the kernel's codes " << e << ", bound " << kMmaEps * M;
      }
    }
  }
  EXPECT_EQ(all.x_code_mismatches, 0) << "hidden-state codes or block scales differ from the emulation's";
  EXPECT_EQ(all.a_out_of_bound, 0) << all.first_failure;
  EXPECT_EQ(all.a_code_mismatches, 0) << "L2's input codes are not the quantization of L1's fp32 a";
  EXPECT_TRUE(all.first_failure.empty()) << all.first_failure;
  EXPECT_EQ(nonfinite, 0) << "non-finite or unwritten outputs";
  EXPECT_EQ(out_of_bound, 0) << "outputs beyond the bound";
  const double a_rms_eps = std::sqrt(all.a_err2 > 0 ? all.a_err2 / all.a_unit2 : 0.0);
  const double y_rms_eps = std::sqrt(y_dev2 > 0 ? y_dev2 / y_unit2 : 0.0);
  EXPECT_LE(a_rms_eps, kMmaRmsEps) << "L1's a, RMS of |δa| over its magnitude bound";
  EXPECT_LE(y_rms_eps, kMmaRmsEps) << "the output, RMS of |δy| over its terms' magnitudes";

  const auto plain = testing::widen(reference::moe_forward_w4a8(layer, hidden, c.T, topk));
  std::printf("[ %-24s] T=%-5lld %s | a: rel L2 %.2g, eps max %.2g rms %.2g | codes flipped %lld of %lld | "
              "out: eps max %.2g rms %.2g, rel L2 %.2g on the kernel's codes, %.2g vs the emulation\n",
              c.name, static_cast<long long>(c.T), gpu.plan.describe(c.T).c_str(),
              std::sqrt(all.a_err2 / std::max(all.a_ref2, 1e-300)), all.max_a_eps, a_rms_eps,
              static_cast<long long>(all.flipped_codes), static_cast<long long>(all.a_values), max_y_eps, y_rms_eps,
              testing::compare(got, want).rel_l2, testing::compare(got, plain).rel_l2);
}

class GpuW4a8MoeCases : public ::testing::TestWithParam<Case> {};

TEST_P(GpuW4a8MoeCases, MatchesEmulationStageByStage) {
  MEGAMOE_REQUIRE_GPU();
  check_case(GetParam(), /*deterministic=*/false);
}
TEST_P(GpuW4a8MoeCases, DeterministicMatchesEmulationStageByStage) {
  MEGAMOE_REQUIRE_GPU();
  check_case(GetParam(), /*deterministic=*/true);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuW4a8MoeCases,
    ::testing::Values(Case{"T1", 256, 128, 8, 2, 1}, Case{"T3", 256, 128, 8, 2, 3}, Case{"T17", 256, 128, 8, 2, 17},
                      Case{"T128_wide_tile", 256, 256, 8, 2, 128}, Case{"T1000", 384, 256, 16, 4, 1000},
                      Case{"T4096", 256, 128, 16, 2, 4096},
                      Case{"empty_experts", 256, 128, 8, 1, 48, 0, std::nullopt, -1, {0, 5, 0, 0, 40, 0, 3, 0}},
                      Case{"one_expert_all_tokens", 256, 128, 8, 1, 300, 0, std::nullopt, -1, {0, 0, 0, 300, 0, 0, 0, 0}},
                      Case{"shared_expert", 256, 128, 8, 2, 40, 256},
                      Case{"clamp", 256, 128, 8, 2, 64, 0, 0.5f},
                      Case{"shared_clamp_T1000", 256, 128, 16, 4, 1000, 128, 1.0f},
                      // Every preset's H and I (docs/w4a8.md §7), few experts.
                      Case{"deepseek_v3_T1", 7168, 2048, 4, 2, 1}, Case{"deepseek_v3_T17", 7168, 2048, 4, 2, 17},
                      Case{"deepseek_v3_T128", 7168, 2048, 4, 2, 128},
                      Case{"deepseek_v4_flash_T3", 4096, 2048, 4, 2, 3},
                      Case{"qwen3_235b_T17", 4096, 1536, 4, 2, 17},
                      Case{"qwen3_30b_T3", 2048, 768, 8, 2, 3}, Case{"qwen3_30b_T1000", 2048, 768, 8, 2, 1000},
                      Case{"qwen3_30b_T4096", 2048, 768, 16, 2, 4096},
                      // Every tile of the row's table on the shapes that stress it (items per CTA
                      // past the stages, partial and empty token tiles, an expert over 256 tokens).
                      Case{"T1000_single128", 384, 256, 16, 4, 1000, 0, std::nullopt, -1, {}, "fp8_single128"},
                      Case{"T17_tall", 256, 128, 8, 2, 17, 0, std::nullopt, -1, {}, "fp8_tall128"},
                      Case{"T1000_tall", 384, 256, 16, 4, 1000, 0, std::nullopt, -1, {}, "fp8_tall128"},
                      Case{"T1000_wide", 384, 256, 16, 4, 1000, 0, std::nullopt, -1, {}, "fp8_wide256"},
                      Case{"empty_experts_tall", 256, 128, 8, 1, 48, 0, std::nullopt, -1, {0, 5, 0, 0, 40, 0, 3, 0},
                           "fp8_tall128"},
                      Case{"empty_experts_wide", 256, 128, 8, 1, 48, 0, std::nullopt, -1, {0, 5, 0, 0, 40, 0, 3, 0},
                           "fp8_wide256"},
                      Case{"one_expert_all_tokens_tall", 256, 128, 8, 1, 300, 0, std::nullopt, -1,
                           {0, 0, 0, 300, 0, 0, 0, 0}, "fp8_tall128"},
                      Case{"one_expert_all_tokens_wide", 256, 128, 8, 1, 300, 0, std::nullopt, -1,
                           {0, 0, 0, 300, 0, 0, 0, 0}, "fp8_wide256"},
                      Case{"shared_clamp_T1000_tall", 256, 128, 16, 4, 1000, 128, 1.0f, -1, {}, "fp8_tall128"},
                      Case{"deepseek_v3_T128_wide", 7168, 2048, 4, 2, 128, 0, std::nullopt, -1, {}, "fp8_wide256"},
                      Case{"deepseek_v3_T600_tall", 7168, 2048, 4, 2, 600, 0, std::nullopt, -1, {}, "fp8_tall128"},
                      Case{"qwen3_30b_T4096_tall", 2048, 768, 16, 2, 4096, 0, std::nullopt, -1, {}, "fp8_tall128"},
                      Case{"empty_experts_single128", 256, 128, 8, 1, 48, 0, std::nullopt, -1, {0, 5, 0, 0, 40, 0, 3, 0},
                           "fp8_single128"},
                      Case{"one_expert_all_tokens_single128", 256, 128, 8, 1, 300, 0, std::nullopt, -1,
                           {0, 0, 0, 300, 0, 0, 0, 0}, "fp8_single128"},
                      Case{"shared_clamp_T1000_single128", 256, 128, 16, 4, 1000, 128, 1.0f, -1, {}, "fp8_single128"},
                      // The absorbing tile (the heuristic's above 32 slots per expert: T1000,
                      // T4096, one_expert_all_tokens, shared_clamp_T1000, deepseek_v3_T128 and
                      // qwen3_30b_T1000 / T4096 above run it too): remainders absorbed (129..160
                      // slots) or not (161+), an expert of 300 (128, 128, 44) at DeepSeek-V3's
                      // size, DeepSeek-V3-sized experts of one wide item. Its items of up to 128
                      // slots run fp8_single128's loop.
                      Case{"expert_sizes_absorb", 256, 128, 8, 1, 1005, 0, std::nullopt, -1,
                           {129, 160, 161, 0, 300, 127, 128, 0}, "fp8_absorb160"},
                      Case{"deepseek_v3_T600_absorb", 7168, 2048, 4, 2, 600, 0, std::nullopt, -1, {}, "fp8_absorb160"},
                      Case{"deepseek_v3_wide_items_absorb", 7168, 2048, 4, 1, 600, 0, std::nullopt, -1,
                           {150, 140, 160, 150}, "fp8_absorb160"}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// A captured run replays to the eager output, bit for bit (deterministic combine).
TEST(GpuW4a8Moe, GraphReplayEqualsEager) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t T = 77, H = 256;
  const MoeLayer layer = testing::random_layer(rng, H, 128, 8, 2);
  const auto hidden = testing::random_hidden(rng, T, H);
  const auto topk = testing::random_topk(rng, T, 8, 2);
  GpuMoe gpu(w4a8_plan(layer, T, true), MoeDeviceWeights::upload(layer));
  const auto eager = gpu.run(hidden, topk);
  const auto replays = gpu.run_graph_replays(hidden, topk, 3);
  for (size_t rep = 0; rep < replays.size(); ++rep) EXPECT_EQ(replays[rep], eager) << "replay " << rep;
}

}  // namespace
}  // namespace megamoe
