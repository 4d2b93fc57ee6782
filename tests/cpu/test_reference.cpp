// The CPU reference is the oracle of every GPU test, so it is checked three ways here:
//  - hand-built layers whose expected outputs are written out as arithmetic on the chosen
//    codes, scales and inputs (no loops shared with the implementation);
//  - fresh random layers against a naive implementation in this file (format::dequantize, plain
//    loops in double), bit for bit, for several thread counts and token chunkings;
//  - routing on hand-picked logits, every tie and the noaux_tc group logic worked by hand.

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "megamoe/dtype.h"
#include "megamoe/format.h"
#include "megamoe/moe.h"
#include "megamoe/reference.h"
#include "megamoe/status.h"
#include "tests/common/error_matchers.h"
#include "tests/common/oracles.h"
#include "tests/common/test_util.h"

namespace megamoe {
namespace {

using reference::ForwardOptions;
using reference::TopK;

// ---------------------------------------------------------------------------------------------
// Helpers

using namespace testing;  // the shared generators and oracles (tests/common)

double bf16_round(double v) { return bf16_to_f32(bf16_of(v)); }

std::vector<uint16_t> to_bf16(const std::vector<double>& v) {
  std::vector<uint16_t> out;
  for (double d : v) out.push_back(f32_to_bf16(static_cast<float>(d)));  // exact in the tests
  return out;
}

// ---------------------------------------------------------------------------------------------
// Rounding double -> bf16 once

TEST(ReferenceRounding, F64ToBf16EveryValueTieAndBoundary) {
  // For every finite bf16 value v (both signs) and its successor in magnitude: v itself, the
  // midpoint (a tie: to the even code) and the doubles on either side of it. The successor of
  // the largest finite value 0x7F7F is 2^128: its ties and above go to infinity.
  for (uint32_t c = 0; c <= 0x7F7F; ++c) {
    const double v = bf16_to_f32(static_cast<uint16_t>(c));
    const double next = c == 0x7F7F ? 0x1p128 : bf16_to_f32(static_cast<uint16_t>(c + 1));
    const double mid = (v + next) / 2;
    const uint16_t even = static_cast<uint16_t>(c % 2 == 0 ? c : c + 1);
    for (const uint16_t sign : {uint16_t{0}, uint16_t{0x8000}}) {
      const double s = sign ? -1.0 : 1.0;
      ASSERT_EQ(reference::f64_to_bf16(s * v), sign | c) << "code " << c;
      ASSERT_EQ(reference::f64_to_bf16(s * mid), sign | even) << "code " << c;
      ASSERT_EQ(reference::f64_to_bf16(s * std::nextafter(mid, 0.0)), sign | c) << "code " << c;
      ASSERT_EQ(reference::f64_to_bf16(s * std::nextafter(mid, INFINITY)), sign | (c + 1))
          << "code " << c;
    }
  }
  // The double-rounding trap and the specials.
  EXPECT_EQ(reference::f64_to_bf16(1 + 0x1p-8 + 0x1p-30), 0x3F81);
  EXPECT_EQ(reference::f64_to_bf16(-(1 + 0x1p-8 + 0x1p-50)), 0xBF81);
  EXPECT_EQ(reference::f64_to_bf16(0x1p-134 + 0x1p-180), 0x0001);  // just above half of 2^-133
  EXPECT_EQ(reference::f64_to_bf16(1e-300), 0x0000);
  EXPECT_EQ(reference::f64_to_bf16(-1e-300), 0x8000);
  EXPECT_EQ(reference::f64_to_bf16(1e300), 0x7F80);
  EXPECT_EQ(reference::f64_to_bf16(-INFINITY), 0xFF80);
  const uint16_t nan = reference::f64_to_bf16(std::nan(""));
  EXPECT_GT(nan & 0x7FFF, 0x7F80);
}

TEST(ReferenceRounding, F64ToBf16MatchesRoundToOddOnRandomDoubles) {
  const SeedTrace seed;
  Rng gen(seed);
  for (int i = 0; i < 200000; ++i) {
    // Random significand bits, exponents from below the bf16 subnormals to past its maximum.
    const double m = 1.0 + static_cast<double>(gen() >> 12) * 0x1p-52;
    const int e = static_cast<int>(gen() % 290) - 150;
    const double v = (gen() & 1 ? -1.0 : 1.0) * std::ldexp(m, e);
    ASSERT_EQ(reference::f64_to_bf16(v), bf16_of(v)) << v;
  }
}

// ---------------------------------------------------------------------------------------------
// The hand layer: H = 32, I = 16. Only a few weights are non-zero, at places that exercise the
// low and the high nibble, both blocks of a row and the last element of a row.
//
// gate (s2 = 0.5):  row 0: col 5 = +2 (block 0 scale 1.5), col 20 = -1 (block 1 scale 0.5)
//                   row 1: col 30 = +0.5 (block 1 scale 2)
//                   row 2: col 9 = +1 (scale 1)
// up (s2 = 0.25):   row 0: col 0 = +4          row 1: col 31 = -6 (block 1 scale 0.25)
//                   row 2: col 24 = +6
// down (s2 = s2_down), row h: col 0 = code h%16, col 1 = code (5h+3)%16, col 2 = code (3h+1)%16
//                   (every code appears), block scale kDownScale[h%8] (subnormals, 448 included)
constexpr int64_t kHandH = 32;
constexpr int64_t kHandI = 16;
constexpr uint8_t kDownScaleByte[8] = {0x38, 0x01, 0x05, 0x7E, 0x30, 0x3C, 0x28, 0x4B};
constexpr double kDownScale[8] = {1.0, 0x1p-9, 5 * 0x1p-9, 448.0, 0.5, 1.5, 0.25, 5.5};

ExpertWeights hand_expert(float s2_down) {
  ExpertWeights w;
  w.gate = LinearBuilder(kHandI, kHandH)
               .code(0, 5, 0x4).scale(0, 0, 0x3C).code(0, 20, 0xA).scale(0, 1, 0x30)
               .code(1, 30, 0x1).scale(1, 1, 0x40)
               .code(2, 9, 0x2)
               .build(0.5f);
  w.up = LinearBuilder(kHandI, kHandH)
             .code(0, 0, 0x6)
             .code(1, 31, 0xF).scale(1, 1, 0x28)
             .code(2, 24, 0x7)
             .build(0.25f);
  LinearBuilder down(kHandH, kHandI);
  for (int64_t h = 0; h < kHandH; ++h) {
    down.code(h, 0, h % 16).code(h, 1, (5 * h + 3) % 16).code(h, 2, (3 * h + 1) % 16);
    down.scale(h, 0, kDownScaleByte[h % 8]);
  }
  w.down = down.build(s2_down);
  return w;
}

// a = bf16(silu(g)·u) of the three live channels, from the weights listed above.
std::vector<double> hand_a(const std::vector<double>& x, std::optional<double> limit) {
  double g[3] = {(x[5] * 2 * 1.5 + x[20] * -1 * 0.5) * 0.5, (x[30] * 0.5 * 2.0) * 0.5,
                 (x[9] * 1) * 0.5};
  double u[3] = {(x[0] * 4) * 0.25, (x[31] * -6 * 0.25) * 0.25, (x[24] * 6) * 0.25};
  std::vector<double> a(3);
  for (int i = 0; i < 3; ++i) {
    if (limit) {
      g[i] = std::min(g[i], *limit);
      u[i] = std::clamp(u[i], -*limit, *limit);
    }
    a[i] = bf16_round(silu(g[i]) * u[i]);
  }
  return a;
}

// y[h] of the hand expert for the channels a.
std::vector<double> hand_y(const std::vector<double>& a, double s2_down) {
  std::vector<double> y(kHandH);
  for (int64_t h = 0; h < kHandH; ++h) {
    y[h] = (a[0] * kE2m1[h % 16] + a[1] * kE2m1[(5 * h + 3) % 16] +
            a[2] * kE2m1[(3 * h + 1) % 16]) * kDownScale[h % 8] * s2_down;
  }
  return y;
}

// Routed experts 0, 1, 2 differ in their down global scale.
constexpr float kHandS2Down[3] = {3.0f, 2.0f, 5.0f};

MoeLayer hand_layer() {
  MoeLayer layer;
  layer.hidden_size = kHandH;
  layer.intermediate_size = kHandI;
  layer.num_experts = 3;
  for (float s2 : kHandS2Down) layer.experts.push_back(hand_expert(s2));
  layer.routing.top_k = 2;
  return layer;
}

// Two tokens: x0[h] = (h - 16)/4, x1[h] = (11 - h)·0.375 (all exact in bf16).
std::vector<double> hand_x(int t) {
  std::vector<double> x(kHandH);
  for (int64_t h = 0; h < kHandH; ++h) x[h] = t == 0 ? (h - 16) / 4.0 : (11 - h) * 0.375;
  return x;
}

void expect_outputs(const std::vector<uint16_t>& got_bf16, const std::vector<float>& got_f32,
                    const std::vector<double>& expected_sum) {
  ASSERT_EQ(got_bf16.size(), expected_sum.size());
  ASSERT_EQ(got_f32.size(), expected_sum.size());
  for (size_t i = 0; i < expected_sum.size(); ++i) {
    EXPECT_EQ(got_bf16[i], bf16_of(expected_sum[i]))
        << "element " << i << ": expected " << expected_sum[i] << ", got "
        << bf16_to_f32(got_bf16[i]);
    EXPECT_EQ(got_f32[i], static_cast<float>(expected_sum[i])) << "element " << i;
  }
}

TEST(ReferenceForward, HandLayerWorkedValues) {
  // The worked intermediate values of token 0 (x[5] = -2.75, x[20] = 1, x[30] = 3.5, x[9] =
  // -1.75, x[0] = -4, x[31] = 3.75, x[24] = 2), before silu:
  //   g = (-2.75·3 - 0.5)·0.5 = -4.375, 3.5·0.5 = 1.75, -1.75·0.5 = -0.875
  //   u = -4·4·0.25 = -4, 3.75·(-1.5)·0.25 = -1.40625, 2·6·0.25 = 3
  const std::vector<double> a = hand_a(hand_x(0), std::nullopt);
  EXPECT_EQ(a[0], bf16_round(silu(-4.375) * -4.0));
  EXPECT_EQ(a[1], bf16_round(silu(1.75) * -1.40625));
  EXPECT_EQ(a[2], bf16_round(silu(-0.875) * 3.0));
}

TEST(ReferenceForward, HandLayerOneExpertGateAndUpScalesDiffer) {
  const MoeLayer layer = hand_layer();
  const std::vector<uint16_t> hidden = to_bf16(hand_x(0));
  const TopK topk = make_topk(1, 1, {1}, {0.5f});
  const std::vector<double> y = hand_y(hand_a(hand_x(0), std::nullopt), kHandS2Down[1]);
  std::vector<double> expected(kHandH);
  int nonzero = 0;
  for (int64_t h = 0; h < kHandH; ++h) {
    expected[h] = 0.5 * y[h];
    nonzero += expected[h] != 0.0;
  }
  ASSERT_GT(nonzero, 20);
  expect_outputs(reference::moe_forward(layer, hidden, 1, topk),
                 reference::moe_forward_f32(layer, hidden, 1, topk), expected);
}

TEST(ReferenceForward, HandLayerTwoTokensTwoSlots) {
  const MoeLayer layer = hand_layer();
  std::vector<double> x = hand_x(0);
  const std::vector<double> x1 = hand_x(1);
  x.insert(x.end(), x1.begin(), x1.end());
  const TopK topk = make_topk(2, 2, {2, 0, 0, 1}, {0.25f, 1.5f, -0.75f, 2.0f});
  const std::vector<double> a0 = hand_a(hand_x(0), std::nullopt);
  const std::vector<double> a1 = hand_a(hand_x(1), std::nullopt);
  std::vector<double> expected(2 * kHandH);
  for (int64_t h = 0; h < kHandH; ++h) {
    expected[h] = 0.25 * hand_y(a0, 5.0)[h] + 1.5 * hand_y(a0, 3.0)[h];
    expected[kHandH + h] = -0.75 * hand_y(a1, 3.0)[h] + 2.0 * hand_y(a1, 2.0)[h];
  }
  const std::vector<uint16_t> hidden = to_bf16(x);
  expect_outputs(reference::moe_forward(layer, hidden, 2, topk),
                 reference::moe_forward_f32(layer, hidden, 2, topk), expected);
}

TEST(ReferenceForward, HandLayerSwigluClamp) {
  // Limit 1.5: gate is clamped from above only (g0 = -4.375 stays, g1 = 1.75 -> 1.5); up from
  // both sides (u0 = -4 -> -1.5, u2 = 3 -> 1.5).
  MoeLayer layer = hand_layer();
  layer.swiglu_limit = 1.5f;
  const std::vector<uint16_t> hidden = to_bf16(hand_x(0));
  const TopK topk = make_topk(1, 1, {1}, {0.5f});
  const std::vector<double> a = hand_a(hand_x(0), 1.5);
  EXPECT_EQ(a[0], bf16_round(silu(-4.375) * -1.5));
  EXPECT_EQ(a[1], bf16_round(silu(1.5) * -1.40625));
  EXPECT_EQ(a[2], bf16_round(silu(-0.875) * 1.5));
  const std::vector<double> y = hand_y(a, kHandS2Down[1]);
  std::vector<double> expected(kHandH);
  for (int64_t h = 0; h < kHandH; ++h) expected[h] = 0.5 * y[h];
  expect_outputs(reference::moe_forward(layer, hidden, 1, topk),
                 reference::moe_forward_f32(layer, hidden, 1, topk), expected);

  // The same layer without the clamp gives the unclamped values.
  layer.swiglu_limit.reset();
  const std::vector<double> y_off = hand_y(hand_a(hand_x(0), std::nullopt), kHandS2Down[1]);
  for (int64_t h = 0; h < kHandH; ++h) expected[h] = 0.5 * y_off[h];
  expect_outputs(reference::moe_forward(layer, hidden, 1, topk),
                 reference::moe_forward_f32(layer, hidden, 1, topk), expected);
}

TEST(ReferenceForward, HandLayerSharedExpertHasWeightOne) {
  MoeLayer layer = hand_layer();
  layer.shared_expert = hand_expert(0.75f);
  const std::vector<uint16_t> hidden = to_bf16(hand_x(1));
  const TopK topk = make_topk(1, 1, {1}, {0.5f});
  const std::vector<double> a = hand_a(hand_x(1), std::nullopt);
  std::vector<double> expected(kHandH);
  for (int64_t h = 0; h < kHandH; ++h) {
    expected[h] = 0.5 * hand_y(a, 2.0)[h] + hand_y(a, 0.75)[h];
  }
  expect_outputs(reference::moe_forward(layer, hidden, 1, topk),
                 reference::moe_forward_f32(layer, hidden, 1, topk), expected);
}

TEST(ReferenceForward, HandLayerRepeatedExpertCountsTwice) {
  const MoeLayer layer = hand_layer();
  const std::vector<uint16_t> hidden = to_bf16(hand_x(0));
  const TopK topk = make_topk(1, 2, {1, 1}, {0.25f, 0.5f});
  const std::vector<double> y = hand_y(hand_a(hand_x(0), std::nullopt), 2.0);
  std::vector<double> expected(kHandH);
  for (int64_t h = 0; h < kHandH; ++h) expected[h] = 0.25 * y[h] + 0.5 * y[h];
  expect_outputs(reference::moe_forward(layer, hidden, 1, topk),
                 reference::moe_forward_f32(layer, hidden, 1, topk), expected);
}

TEST(ReferenceForward, RoundsOnceStraightFromDouble) {
  // One expert, H = I = 16. gate rows 0-2 read x[3] = 16 with weight 4: g = 64, and
  // silu(64) = 64 exactly in double (exp(-64) vanishes next to 1). up rows 0, 1, 2 read x[0] =
  // 2^-6, x[1] = 2^-14, x[2] = 2^-36 with weight 1; up row 0 reads all three. So
  //   a0 = bf16(64·(2^-6 + 2^-14 + 2^-36)) = bf16(1 + 2^-8 + 2^-30) = 1 + 2^-7
  // (rounding through fp32 first gives the tie 1 + 2^-8 and then 1.0), a1 = 2^-8, a2 = 2^-30.
  MoeLayer layer;
  layer.hidden_size = 16;
  layer.intermediate_size = 16;
  layer.num_experts = 1;
  layer.routing.top_k = 1;
  ExpertWeights w;
  w.gate = LinearBuilder(16, 16).code(0, 3, 0x6).code(1, 3, 0x6).code(2, 3, 0x6).build(1.0f);
  w.up = LinearBuilder(16, 16)
             .code(0, 0, 0x2).code(0, 1, 0x2).code(0, 2, 0x2)
             .code(1, 1, 0x2)
             .code(2, 2, 0x2)
             .build(1.0f);
  // down: y0 = a0; y1 = a0 - a1 + a2 = 1 + 2^-8 + 2^-30 (rounds up to 1 + 2^-7);
  // y2 = -y1; y3 = a0 - a1 = 1 + 2^-8 (a tie: to even, 1.0); y4 = a0 + a1 = 1 + 2^-7 + 2^-8
  // (a tie: to even, 1 + 2^-6); rows 5-15 are 0.
  w.down = LinearBuilder(16, 16)
               .code(0, 0, 0x2)
               .code(1, 0, 0x2).code(1, 1, 0xA).code(1, 2, 0x2)
               .code(2, 0, 0xA).code(2, 1, 0x2).code(2, 2, 0xA)
               .code(3, 0, 0x2).code(3, 1, 0xA)
               .code(4, 0, 0x2).code(4, 1, 0x2)
               .build(1.0f);
  layer.experts.push_back(w);
  std::vector<double> x(16, 1.0);
  x[0] = 0x1p-6;
  x[1] = 0x1p-14;
  x[2] = 0x1p-36;
  x[3] = 16.0;
  std::vector<double> x2 = x;
  x2.insert(x2.end(), x.begin(), x.end());
  const std::vector<uint16_t> hidden = to_bf16(x2);
  // Token 1 adds 2^-30·y: y3 + 2^-30·y3 lies above the tie, so a double sum rounds y3 up
  // (an fp32 sum would lose the small term and round the tie to even).
  const TopK topk = make_topk(2, 2, {0, 0, 0, 0}, {1.0f, 0.0f, 1.0f, 0x1p-30f});
  const std::vector<uint16_t> out = reference::moe_forward(layer, hidden, 2, topk);
  const std::vector<float> out32 = reference::moe_forward_f32(layer, hidden, 2, topk);
  ASSERT_EQ(out.size(), 32u);
  EXPECT_EQ(out[0], 0x3F81);   // 1 + 2^-7
  EXPECT_EQ(out[1], 0x3F81);   // 1 + 2^-8 + 2^-30 -> 1 + 2^-7
  EXPECT_EQ(out[2], 0xBF81);   // -(1 + 2^-7)
  EXPECT_EQ(out[3], 0x3F80);   // the tie 1 + 2^-8 -> 1.0
  EXPECT_EQ(out[4], 0x3F82);   // the tie 1 + 3·2^-8 -> 1 + 2^-6
  for (int h = 5; h < 16; ++h) EXPECT_EQ(out[h], 0x0000) << h;
  EXPECT_EQ(out[16 + 3], 0x3F81);  // 1 + 2^-8 + 2^-30·(1 + 2^-8) -> 1 + 2^-7
  EXPECT_EQ(out32[0], 1.0f + 0x1p-7f);
  EXPECT_EQ(out32[1], 1.0f + 0x1p-8f);  // fp32 cannot hold the 2^-30
  EXPECT_EQ(out32[3], 1.0f + 0x1p-8f);
  EXPECT_EQ(out32[16 + 3], 1.0f + 0x1p-8f);
}

TEST(ReferenceForward, ZeroTokensGiveEmptyOutputs) {
  const MoeLayer layer = hand_layer();
  const TopK topk = make_topk(0, 2, {}, {});
  EXPECT_TRUE(reference::moe_forward(layer, {}, 0, topk).empty());
  EXPECT_TRUE(reference::moe_forward_f32(layer, {}, 0, topk).empty());
}

TEST(ReferenceForward, RejectsBadArguments) {
  const MoeLayer layer = hand_layer();
  const std::vector<uint16_t> hidden = to_bf16(hand_x(0));
  const auto fwd = [&](const TopK& t, std::span<const uint16_t> h, int64_t tokens,
                       ForwardOptions opt = {}) {
    reference::moe_forward(layer, h, tokens, t, opt);
  };
  EXPECT_MEGAMOE_ERROR(fwd(make_topk(1, 2, {0, 3}, {1, 1}), hidden, 1), kInvalidArgument,
                       "token 0, slot 1 is 3", "[0, 3)");
  EXPECT_MEGAMOE_ERROR(fwd(make_topk(1, 2, {-1, 0}, {1, 1}), hidden, 1), kInvalidArgument,
                       "token 0, slot 0 is -1", "[0, 3)");
  EXPECT_MEGAMOE_ERROR(fwd(make_topk(1, 1, {0}, {NAN}), hidden, 1), kInvalidArgument,
                       "token 0, slot 0", "finite");
  EXPECT_MEGAMOE_ERROR(fwd(make_topk(1, 1, {0}, {INFINITY}), hidden, 1), kInvalidArgument,
                       "finite");
  EXPECT_MEGAMOE_ERROR(fwd(make_topk(1, 1, {0}, {1}), std::span(hidden).first(31), 1),
                       kInvalidArgument, "hidden holds 31", "hidden_size (32)");
  EXPECT_MEGAMOE_ERROR(fwd(make_topk(1, 1, {0}, {1}), hidden, 2), kInvalidArgument, "tokens (2)");
  EXPECT_MEGAMOE_ERROR(fwd(make_topk(2, 1, {0, 0}, {1, 1}), hidden, 1), kInvalidArgument,
                       "2 tokens", "holds 1");
  EXPECT_MEGAMOE_ERROR(fwd(make_topk(1, 0, {}, {}), hidden, 1), kInvalidArgument, "k is 0", ">= 1");
  EXPECT_MEGAMOE_ERROR(fwd(make_topk(1, 2, {0}, {1}), hidden, 1), kInvalidArgument,
                       "ids hold 1", "k (2)");
  EXPECT_MEGAMOE_ERROR(fwd(make_topk(1, 1, {0}, {1}), hidden, -1), kInvalidArgument,
                       "tokens is -1");
  EXPECT_MEGAMOE_ERROR(fwd(make_topk(1, 1, {0}, {1}), hidden, 1, {.threads = -1}), kInvalidArgument,
                       "threads is -1");
  EXPECT_MEGAMOE_ERROR(fwd(make_topk(1, 1, {0}, {1}), hidden, 1, {.chunk_tokens = -2}),
                       kInvalidArgument, "chunk_tokens is -2");
  // An inconsistent layer is rejected by MoeLayer::validate before anything is read.
  MoeLayer broken = hand_layer();
  broken.experts.pop_back();
  EXPECT_MEGAMOE_ERROR(reference::moe_forward(broken, hidden, 1, make_topk(1, 1, {0}, {1})),
                       kInvalidArgument, "experts");
}

TEST(ReferenceForward, RejectsInvalidBlockScalesOfUsedExperts) {
  // 0x7F is NaN, 0x80 is -0, 0xB8 is -1: none is a ue4m3 scale.
  for (uint8_t bad : {uint8_t{0x7F}, uint8_t{0x80}, uint8_t{0xB8}}) {
    MoeLayer layer = hand_layer();
    LinearBuilder down(kHandH, kHandI);
    down.scale(7, 0, bad);
    layer.experts[2].down = down.build(1.0f);
    const std::vector<uint16_t> hidden = to_bf16(hand_x(0));
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02X", bad);
    EXPECT_MEGAMOE_ERROR(reference::moe_forward(layer, hidden, 1, make_topk(1, 1, {2}, {1})),
                         kInvalidArgument, "expert 2 down_proj.weight_scale[7, 0]", hex);
    // Only the experts a token uses are read.
    EXPECT_NO_THROW(reference::moe_forward(layer, hidden, 1, make_topk(1, 1, {1}, {1})));
  }
}

// ---------------------------------------------------------------------------------------------
// Random layers against a naive implementation.

// Every code and every valid scale byte (zero, subnormals, up to 448: exponents over the whole
// range), global scales of many exponents.
constexpr LinearDraw kAnyWeights{ScaleCodes::kEveryCode, GlobalScale::kAnyExponent};

// The naive forward: dequantize with global scale 1 (exact e2m1·ue4m3 in fp32), plain loops,
// one double accumulator per dot product in index order, global scales on the sums.
struct NaiveExpert {
  int64_t H, I;
  std::vector<float> gate, up, down;
  double s2_gate, s2_up, s2_down;
};

std::vector<float> dequantize_unscaled(const Nvfp4Linear& w) {
  format::Nvfp4View v = w.view();
  v.global_scale = 1.0f;
  std::vector<float> out(w.out_features * w.in_features);
  format::dequantize(v, out);
  return out;
}

NaiveExpert naive_expert(const ExpertWeights& w) {
  return {w.gate.in_features,        w.gate.out_features,     dequantize_unscaled(w.gate),
          dequantize_unscaled(w.up), dequantize_unscaled(w.down), w.gate.weight_scale_2,
          w.up.weight_scale_2,       w.down.weight_scale_2};
}

// y of one token; appends every (g, u) before clamping to `pre_clamp` when given.
std::vector<double> naive_expert_forward(const NaiveExpert& e, const std::vector<double>& x,
                                         std::optional<float> limit,
                                         std::vector<double>* pre_clamp = nullptr) {
  std::vector<double> a(e.I);
  for (int64_t i = 0; i < e.I; ++i) {
    double g = 0, u = 0;
    for (int64_t h = 0; h < e.H; ++h) g += x[h] * e.gate[i * e.H + h];
    for (int64_t h = 0; h < e.H; ++h) u += x[h] * e.up[i * e.H + h];
    g *= e.s2_gate;
    u *= e.s2_up;
    if (pre_clamp) {
      pre_clamp->push_back(std::fabs(g));
      pre_clamp->push_back(std::fabs(u));
    }
    if (limit) {
      g = std::min(g, double{*limit});
      u = std::max(std::min(u, double{*limit}), -double{*limit});
    }
    a[i] = bf16_round(silu(g) * u);
  }
  std::vector<double> y(e.H);
  for (int64_t h = 0; h < e.H; ++h) {
    double acc = 0;
    for (int64_t i = 0; i < e.I; ++i) acc += a[i] * e.down[h * e.I + i];
    y[h] = acc * e.s2_down;
  }
  return y;
}

// The double sums out[t, h] before the final rounding.
std::vector<double> naive_forward(const MoeLayer& layer, const std::vector<uint16_t>& hidden,
                                  int64_t tokens, const TopK& topk,
                                  std::vector<double>* pre_clamp = nullptr) {
  const int64_t H = layer.hidden_size;
  std::vector<NaiveExpert> experts;
  for (const ExpertWeights& w : layer.experts) experts.push_back(naive_expert(w));
  std::optional<NaiveExpert> shared;
  if (layer.shared_expert) shared = naive_expert(*layer.shared_expert);
  std::vector<double> out(tokens * H, 0.0);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<double> x(H);
    for (int64_t h = 0; h < H; ++h) x[h] = bf16_to_f32(hidden[t * H + h]);
    for (int j = 0; j < topk.k; ++j) {
      const std::vector<double> y = naive_expert_forward(experts[topk.ids[t * topk.k + j]], x,
                                                         layer.swiglu_limit, pre_clamp);
      for (int64_t h = 0; h < H; ++h) out[t * H + h] += double{topk.weights[t * topk.k + j]} * y[h];
    }
    if (shared) {
      const std::vector<double> y = naive_expert_forward(*shared, x, layer.swiglu_limit, pre_clamp);
      for (int64_t h = 0; h < H; ++h) out[t * H + h] += y[h];
    }
  }
  return out;
}

TEST(ReferenceForward, RandomLayersMatchNaiveBitwise) {
  const SeedTrace seed;
  Rng rng(seed);
  // H and I span several 64-row tasks; the shared expert has its own intermediate size.
  const int64_t H = 160, I = 96, I_shared = 48, E = 6, T = 7;
  const int k = 3;
  MoeLayer layer = random_layer(rng, H, I, E, k, I_shared, std::nullopt, kAnyWeights);
  const std::vector<uint16_t> hidden = random_hidden(rng, T, H, HiddenValues::kWideExponents);
  const TopK topk = arbitrary_topk(rng, T, E, k);  // token 0 repeats an expert

  // Clamp at the median |g|, |u| of the unclamped run, so that it bites often.
  std::vector<double> pre_clamp;
  const std::vector<double> unclamped = naive_forward(layer, hidden, T, topk, &pre_clamp);
  std::nth_element(pre_clamp.begin(), pre_clamp.begin() + pre_clamp.size() / 2, pre_clamp.end());
  const float limit = static_cast<float>(pre_clamp[pre_clamp.size() / 2]);
  ASSERT_GT(limit, 0.0f);

  for (const std::optional<float> clamp : {std::optional<float>{}, std::optional<float>{limit}}) {
    SCOPED_TRACE(clamp ? "clamp " + std::to_string(*clamp) : std::string("no clamp"));
    layer.swiglu_limit = clamp;
    const std::vector<double> expected = clamp ? naive_forward(layer, hidden, T, topk) : unclamped;
    if (clamp) {
      ASSERT_NE(expected, unclamped) << "the clamp changed nothing";
    }
    std::vector<uint16_t> want(T * H);
    std::vector<float> want32(T * H);
    for (int64_t i = 0; i < T * H; ++i) {
      want[i] = bf16_of(expected[i]);
      want32[i] = static_cast<float>(expected[i]);
    }
    for (const ForwardOptions opt : {ForwardOptions{1, 0}, ForwardOptions{2, 0},
                                     ForwardOptions{3, 0}, ForwardOptions{2, 1},
                                     ForwardOptions{3, 4}}) {
      SCOPED_TRACE("threads " + std::to_string(opt.threads) + ", chunk_tokens " +
                   std::to_string(opt.chunk_tokens));
      const std::vector<uint16_t> got = reference::moe_forward(layer, hidden, T, topk, opt);
      const std::vector<float> got32 = reference::moe_forward_f32(layer, hidden, T, topk, opt);
      ASSERT_EQ(got.size(), want.size());
      int mismatches = 0;
      for (int64_t i = 0; i < T * H; ++i) {
        if (got[i] != want[i] || std::memcmp(&got32[i], &want32[i], 4) != 0) {
          if (++mismatches <= 5) {
            ADD_FAILURE() << "token " << i / H << ", h " << i % H << ": got " << got32[i]
                          << " (bf16 0x" << std::hex << got[i] << "), want " << want32[i]
                          << " (bf16 0x" << want[i] << std::dec << ")";
          }
        }
      }
      EXPECT_EQ(mismatches, 0);
    }
  }
}

// A DeepSeek-V3-shaped layer (H = 7168, I = 2048, E = 256 in 8 groups, top-4 groups, top-8,
// scale 2.5, one shared expert) for 2 tokens, routed from logits. Holding 256 distinct experts
// would take 6.3 GB, so the routed experts share the storage of 8 distinct random experts
// (expert e uses pool[e % 8]); the forward still decodes every used expert on its own, so its
// cost is that of a real layer.
TEST(ReferenceForward, DeepSeekV3ShapedLayerRunsInSeconds) {
  const SeedTrace seed;
  Rng rng(seed);
  const int64_t H = 7168, I = 2048, E = 256, T = 2;
  const auto t_build = std::chrono::steady_clock::now();
  MoeLayer layer;
  layer.hidden_size = H;
  layer.intermediate_size = I;
  layer.num_experts = E;
  layer.routing = {RoutingKind::kNoauxTc, 8, true, 8, 4, 2.5f};
  std::vector<ExpertWeights> pool;
  for (int i = 0; i < 8; ++i) pool.push_back(random_expert(rng, H, I, kAnyWeights));
  for (int64_t e = 0; e < E; ++e) layer.experts.push_back(pool[e % 8]);
  layer.shared_expert = random_expert(rng, H, I, kAnyWeights);
  layer.router_weight.resize(E * H);
  for (float& w : layer.router_weight) w = static_cast<float>(rng.normal() * 0.02);
  layer.e_score_correction_bias.resize(E);
  for (float& b : layer.e_score_correction_bias) b = static_cast<float>(rng.uniform(-0.05, 0.05));
  const std::vector<uint16_t> hidden = random_hidden(rng, T, H, HiddenValues::kWideExponents);

  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<float> logits = reference::router_logits(layer, hidden, T);
  const TopK topk = reference::route(layer.routing, logits, T, E, layer.e_score_correction_bias);
  const auto t1 = std::chrono::steady_clock::now();
  const std::vector<uint16_t> out = reference::moe_forward(layer, hidden, T, topk);
  const auto t2 = std::chrono::steady_clock::now();
  const auto ms = [](auto a, auto b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  };
  std::cout << "[ DeepSeek-V3 shape, T=2 ] build " << ms(t_build, t0) << " ms, route "
            << ms(t0, t1) << " ms, forward " << ms(t1, t2) << " ms\n";

  ASSERT_EQ(out.size(), static_cast<size_t>(T * H));
  int nonzero = 0;
  for (uint16_t v : out) {
    ASSERT_TRUE(std::isfinite(bf16_to_f32(v)));
    nonzero += (v & 0x7FFF) != 0;
  }
  EXPECT_GT(nonzero, T * H / 2);
}

// ---------------------------------------------------------------------------------------------
// Routing

RoutingConfig softmax_cfg(int k, bool renorm, float scale = 1.0f) {
  RoutingConfig c;
  c.kind = RoutingKind::kSoftmaxTopK;
  c.top_k = k;
  c.renormalize = renorm;
  c.routed_scaling_factor = scale;
  return c;
}

// softmax(l)[e] in double, written out.
double softmax_at(const std::vector<float>& l, int e) {
  double z = 0;
  for (float v : l) z += std::exp(double{v});
  return std::exp(double{l[e]}) / z;
}

TEST(ReferenceRouting, SoftmaxTiesGoToTheLowerIndex) {
  const std::vector<float> l = {1, 3, 2, 3};
  // Experts 1 and 3 tie on the best score: 1 first.
  TopK r = reference::route(softmax_cfg(2, false), l, 1, 4);
  EXPECT_EQ(r.tokens, 1);
  EXPECT_EQ(r.k, 2);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 3}));
  EXPECT_FLOAT_EQ(r.weights[0], static_cast<float>(softmax_at(l, 1)));
  EXPECT_EQ(r.weights[0], r.weights[1]);
  // Renormalised, the tie splits evenly; times the scaling factor.
  r = reference::route(softmax_cfg(2, true, 2.5f), l, 1, 4);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(r.weights, (std::vector<float>{1.25f, 1.25f}));
  // k = 3: the two tied experts, then expert 2.
  r = reference::route(softmax_cfg(3, true), l, 1, 4);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 3, 2}));
  const double z3 = 2 * std::exp(3.0) + std::exp(2.0);
  EXPECT_FLOAT_EQ(r.weights[0], static_cast<float>(std::exp(3.0) / z3));
  EXPECT_FLOAT_EQ(r.weights[2], static_cast<float>(std::exp(2.0) / z3));
  // A tie at the selection boundary: three experts score 2 behind expert 1; the lowest wins.
  r = reference::route(softmax_cfg(2, false), std::vector<float>{2, 5, 2, 2}, 1, 4);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 0}));
  r = reference::route(softmax_cfg(4, false), std::vector<float>{2, 5, 2, 2}, 1, 4);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 0, 2, 3}));
}

TEST(ReferenceRouting, SoftmaxWeights) {
  // Equal logits, k = E: every weight is exactly 1/4 with and without renormalisation.
  const std::vector<float> eq = {0.5f, 0.5f, 0.5f, 0.5f};
  for (bool renorm : {false, true}) {
    const TopK r = reference::route(softmax_cfg(4, renorm), eq, 1, 4);
    EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1, 2, 3}));
    EXPECT_EQ(r.weights, (std::vector<float>(4, 0.25f)));
  }
  // k = 1 renormalised is the scaling factor itself.
  TopK r = reference::route(softmax_cfg(1, true, 1.5f), std::vector<float>{-1, 4, 0.25f}, 1, 3);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1}));
  EXPECT_EQ(r.weights, (std::vector<float>{1.5f}));
  // Large logits do not overflow: p = 1/(1 + e^-20).
  r = reference::route(softmax_cfg(1, false), std::vector<float>{80, 100}, 1, 2);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1}));
  EXPECT_FLOAT_EQ(r.weights[0], static_cast<float>(1.0 / (1.0 + std::exp(-20.0))));
  // Two tokens, rows in order; no renormalisation, times 2.
  const std::vector<float> l2 = {0, 1, 2, /*token 1*/ 3, -1, 0};
  r = reference::route(softmax_cfg(2, false, 2.0f), l2, 2, 3);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 1, 0, 2}));
  const std::vector<float> t0(l2.begin(), l2.begin() + 3), t1(l2.begin() + 3, l2.end());
  EXPECT_FLOAT_EQ(r.weights[0], static_cast<float>(2 * softmax_at(t0, 2)));
  EXPECT_FLOAT_EQ(r.weights[1], static_cast<float>(2 * softmax_at(t0, 1)));
  EXPECT_FLOAT_EQ(r.weights[2], static_cast<float>(2 * softmax_at(t1, 0)));
  EXPECT_FLOAT_EQ(r.weights[3], static_cast<float>(2 * softmax_at(t1, 2)));
  // Renormalised: p_e / (p_a + p_b).
  r = reference::route(softmax_cfg(2, true), l2, 2, 3);
  const double d0 = std::exp(2.0) + std::exp(1.0);
  EXPECT_FLOAT_EQ(r.weights[0], static_cast<float>(std::exp(2.0) / d0));
  EXPECT_FLOAT_EQ(r.weights[1], static_cast<float>(std::exp(1.0) / d0));
}

RoutingConfig noaux_cfg(int k, int n_group, int topk_group, bool renorm, float scale) {
  return {RoutingKind::kNoauxTc, k, renorm, n_group, topk_group, scale};
}
double sigmoid(double l) { return 1.0 / (1.0 + std::exp(-l)); }

// E = 16 in 4 groups of 4, keep 2 groups, k = 4. Sigmoids: s(3) = .9526, s(2.5) = .9241,
// s(2) = .8808, s(1) = .7311, s(.5) = .6225, s(0) = .5, s(-.5) = .3775, s(-1) = .2689,
// s(-2) = .1192, s(-3) = .0474, s(-4) = .0180.
const std::vector<float> kNoauxLogits = {3, 2.5f, -1, -2,  0, 0.5f, -3, -3,
                                         1, -1, 1, -0.5f,  2, 2, -4, -4};
const std::vector<float> kNoauxBias = {-0.6f, -0.6f, 0, 0,  0.3f, 0, 0.1f, 0,
                                       0, 0.5f, 0, 0,       0, 0, 0, 0};

TEST(ReferenceRouting, NoauxTcWithoutBias) {
  // Group scores (top-2 sums): G0 .9526+.9241 = 1.877, G1 .6225+.5 = 1.123,
  // G2 .7311+.7311 = 1.462, G3 .8808+.8808 = 1.762. Keep G0, G3; top 4: e0, e1, e12, e13
  // (e12 and e13 tie: the lower first).
  const TopK r = reference::route(noaux_cfg(4, 4, 2, true, 1.0f), kNoauxLogits, 1, 16);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1, 12, 13}));
  const double sum = sigmoid(3) + sigmoid(2.5) + 2 * sigmoid(2);
  EXPECT_FLOAT_EQ(r.weights[0], static_cast<float>(sigmoid(3) / sum));
  EXPECT_FLOAT_EQ(r.weights[2], static_cast<float>(sigmoid(2) / sum));
  EXPECT_EQ(r.weights[2], r.weights[3]);
}

TEST(ReferenceRouting, NoauxTcBiasChoosesAndSigmoidWeighs) {
  // Choice scores s + bias: G0 .3526 .3241 .2689 .1192 (top-2 sum .677); G1 .8 .6225 .1474
  // .0474 (1.4225); G2 .7311 .7689 .7311 .3775 (1.5); G3 .8808 .8808 .018 .018 (1.7616).
  // Keep G3 and G2 (G1 has the larger maximum, .8, so a max-based group score would keep G1).
  // Top 4 by choice: e12, e13 (tie: lower first), e9 (.7689), then e8 over e10 (tie at .7311).
  // Weights use the un-biased s: e9 weighs s(-1) = .2689 although its choice score is second.
  for (const bool renorm : {true, false}) {
    const TopK r =
        reference::route(noaux_cfg(4, 4, 2, renorm, 2.5f), kNoauxLogits, 1, 16, kNoauxBias);
    EXPECT_EQ(r.ids, (std::vector<int32_t>{12, 13, 9, 8}));
    const double sum = renorm ? 2 * sigmoid(2) + sigmoid(-1) + sigmoid(1) : 1.0;
    EXPECT_FLOAT_EQ(r.weights[0], static_cast<float>(sigmoid(2) / sum * 2.5));
    EXPECT_EQ(r.weights[1], r.weights[0]);
    EXPECT_FLOAT_EQ(r.weights[2], static_cast<float>(sigmoid(-1) / sum * 2.5));
    EXPECT_FLOAT_EQ(r.weights[3], static_cast<float>(sigmoid(1) / sum * 2.5));
  }
  // A second token with all logits 0 (s = .5 everywhere), rows in token order.
  std::vector<float> l2 = kNoauxLogits;
  l2.insert(l2.end(), 16, 0.0f);
  const TopK r2 = reference::route(noaux_cfg(4, 4, 2, true, 1.0f), l2, 2, 16, kNoauxBias);
  EXPECT_EQ(std::vector<int32_t>(r2.ids.begin(), r2.ids.begin() + 4),
            (std::vector<int32_t>{12, 13, 9, 8}));
  // Token 1: choice = .5 + bias; group sums G0 .5+.5 = 1.0, G1 .8+.6 = 1.4, G2 1.0+.5 = 1.5,
  // G3 1.0. Keep G2, G1; top 4: e9 (1.0), e4 (.8), e6 (.6), then e5, e7, e8, e10, e11 tie at
  // .5: e5. Equal sigmoids renormalise to 1/4 each.
  EXPECT_EQ(std::vector<int32_t>(r2.ids.begin() + 4, r2.ids.end()),
            (std::vector<int32_t>{9, 4, 6, 5}));
  for (int j = 4; j < 8; ++j) EXPECT_EQ(r2.weights[j], 0.25f);
}

TEST(ReferenceRouting, NoauxTcGroupTiesGoToTheLowerGroup) {
  // E = 8 in 4 groups of 2, keep 1. All equal: G0 wins the tie.
  TopK r = reference::route(noaux_cfg(2, 4, 1, true, 1.0f), std::vector<float>(8, 0.0f), 1, 8);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(r.weights, (std::vector<float>{0.5f, 0.5f}));
  // G1 and G3 tie for best: G1 wins.
  r = reference::route(noaux_cfg(2, 4, 1, false, 1.0f),
                       std::vector<float>{0, 0, 1, 1, 0, 0, 1, 1}, 1, 8);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(r.weights[0], static_cast<float>(sigmoid(1)));
  // n_group = 1 is plain top-k on the choice score.
  r = reference::route(noaux_cfg(3, 1, 1, false, 1.0f), std::vector<float>{0, 2, 1, 2}, 1, 4);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 3, 2}));
}

TEST(ReferenceRouting, NoauxTcUnderflowedSigmoidsGiveZeroWeights) {
  const TopK r =
      reference::route(noaux_cfg(2, 2, 1, true, 2.5f), std::vector<float>(4, -1000.0f), 1, 4);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(r.weights, (std::vector<float>{0.0f, 0.0f}));
}

TEST(ReferenceRouting, ZeroTokens) {
  const TopK r = reference::route(softmax_cfg(2, true), {}, 0, 4);
  EXPECT_EQ(r.tokens, 0);
  EXPECT_EQ(r.k, 2);
  EXPECT_TRUE(r.ids.empty());
  EXPECT_TRUE(r.weights.empty());
}

TEST(ReferenceRouting, RejectsBadArguments) {
  const std::vector<float> l(16, 0.0f);
  const auto route = [](RoutingConfig c, std::vector<float> logits, int64_t t, int64_t e,
                        std::vector<float> bias = {}) { reference::route(c, logits, t, e, bias); };
  EXPECT_MEGAMOE_ERROR(route(softmax_cfg(0, true), l, 1, 16), kInvalidArgument,
                       "top_k is 0", "[1, num_experts = 16]");
  EXPECT_MEGAMOE_ERROR(route(softmax_cfg(17, true), l, 1, 16), kInvalidArgument, "top_k is 17");
  EXPECT_MEGAMOE_ERROR(route(softmax_cfg(2, true), l, 1, 15), kInvalidArgument,
                       "16 values", "tokens (1)");
  EXPECT_MEGAMOE_ERROR(route(softmax_cfg(2, true), l, -1, 16), kInvalidArgument, "tokens is -1");
  EXPECT_MEGAMOE_ERROR(route(softmax_cfg(2, true), {}, 0, 0), kInvalidArgument, "num_experts is 0");
  EXPECT_MEGAMOE_ERROR(route(softmax_cfg(2, true, NAN), l, 1, 16), kInvalidArgument,
                       "routed_scaling_factor");
  EXPECT_MEGAMOE_ERROR(route(softmax_cfg(2, true, 0.0f), l, 1, 16), kInvalidArgument,
                       "routed_scaling_factor is 0");
  EXPECT_MEGAMOE_ERROR(route(softmax_cfg(2, true), l, 1, 16, std::vector<float>(16, 0.0f)),
                       kInvalidArgument, "softmax", "takes none");
  std::vector<float> bad = l;
  bad[13] = NAN;
  EXPECT_MEGAMOE_ERROR(route(softmax_cfg(2, true), bad, 2, 8), kInvalidArgument,
                       "token 1, expert 5", "finite");
  bad[13] = -INFINITY;
  EXPECT_MEGAMOE_ERROR(route(noaux_cfg(2, 2, 1, true, 1), bad, 1, 16), kInvalidArgument,
                       "expert 13", "finite");

  EXPECT_MEGAMOE_ERROR(route(noaux_cfg(4, 3, 2, true, 1), l, 1, 16), kInvalidArgument,
                       "n_group is 3", "divide");
  EXPECT_MEGAMOE_ERROR(route(noaux_cfg(4, 0, 1, true, 1), l, 1, 16), kInvalidArgument,
                       "n_group is 0");
  EXPECT_MEGAMOE_ERROR(route(noaux_cfg(1, 16, 2, true, 1), l, 1, 16), kInvalidArgument,
                       "at least 2 experts");
  EXPECT_MEGAMOE_ERROR(route(noaux_cfg(4, 4, 0, true, 1), l, 1, 16), kInvalidArgument,
                       "topk_group is 0", "[1, n_group = 4]");
  EXPECT_MEGAMOE_ERROR(route(noaux_cfg(4, 4, 5, true, 1), l, 1, 16), kInvalidArgument,
                       "topk_group is 5");
  EXPECT_MEGAMOE_ERROR(route(noaux_cfg(9, 4, 2, true, 1), l, 1, 16), kInvalidArgument,
                       "top_k is 9", "hold only 8");
  EXPECT_MEGAMOE_ERROR(route(noaux_cfg(4, 4, 2, true, 1), l, 1, 16, std::vector<float>(15, 0.0f)),
                       kInvalidArgument, "bias holds 15", "num_experts (16)");
  std::vector<float> bad_bias(16, 0.0f);
  bad_bias[7] = INFINITY;
  EXPECT_MEGAMOE_ERROR(route(noaux_cfg(4, 4, 2, true, 1), l, 1, 16, bad_bias), kInvalidArgument,
                       "expert 7", "finite");
  RoutingConfig unknown = softmax_cfg(2, true);
  unknown.kind = static_cast<RoutingKind>(7);
  EXPECT_MEGAMOE_ERROR(route(unknown, l, 1, 16), kInvalidArgument, "routing kind 7");
}

TEST(ReferenceRouting, RouterLogits) {
  // E = 3, H = 16. Row 0: 0.5·x2 - 3·x15. Row 1: Σ x. Row 2: x0 + x1 only. (router_logits
  // reads only the router; no experts are needed.)
  MoeLayer layer;
  layer.hidden_size = 16;
  layer.num_experts = 3;
  layer.router_weight.assign(3 * 16, 0.0f);
  layer.router_weight[0 * 16 + 2] = 0.5f;
  layer.router_weight[0 * 16 + 15] = -3.0f;
  for (int h = 0; h < 16; ++h) layer.router_weight[1 * 16 + h] = 1.0f;
  layer.router_weight[2 * 16 + 0] = 1.0f;
  layer.router_weight[2 * 16 + 1] = 1.0f;
  // Token 0: x[h] = h - 4 (Σ = 56). Token 1: x0 = 1, x1 = 2^-30 (fp32 rounds the sum to 1),
  // x15 = 2^100, the rest 0.
  std::vector<double> x(32, 0.0);
  for (int h = 0; h < 16; ++h) x[h] = h - 4;
  x[16] = 1.0;
  x[17] = 0x1p-30;
  x[31] = 0x1p100;
  const std::vector<float> logits = reference::router_logits(layer, to_bf16(x), 2);
  EXPECT_EQ(logits, (std::vector<float>{0.5f * -2 - 3 * 11, 56, -4 + -3,
                                        -3 * 0x1p100f, 1 + 0x1p100f, 1.0f}));

  EXPECT_MEGAMOE_ERROR(reference::router_logits(layer, to_bf16(x), 3), kInvalidArgument,
                       "hidden holds 32", "tokens (3)");
  EXPECT_MEGAMOE_ERROR(reference::router_logits(layer, to_bf16(x), -1), kInvalidArgument,
                       "tokens is -1");
  layer.router_weight.pop_back();
  EXPECT_MEGAMOE_ERROR(reference::router_logits(layer, to_bf16(x), 2), kInvalidArgument,
                       "router_weight holds 47");
  layer.router_weight.clear();
  EXPECT_MEGAMOE_ERROR(reference::router_logits(layer, to_bf16(x), 2), kInvalidArgument,
                       "no router weight");
}

}  // namespace
}  // namespace megamoe
