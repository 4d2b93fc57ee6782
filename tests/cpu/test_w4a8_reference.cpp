// The W4A8 numerics (docs/w4a8.md) and their CPU emulation, the future oracle of the W4A8
// kernels, checked four ways:
//  - the codecs on hand-computed values (ties to even, saturation, subnormals, zero groups) and
//    against brute-force oracles written here (nearest e4m3 value by search, scale exponents by
//    counting);
//  - a tiny layer whose every rounding is worked out by hand below;
//  - fresh random layers against a naive W4A8 forward in this file, bit for bit, and against the
//    exact W4A16 reference: close everywhere, identical where every value is representable;
//  - (disabled by default, slow) the accuracy table of docs/w4a8.md on the model presets.

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "megamoe/dtype.h"
#include "megamoe/format.h"
#include "megamoe/moe.h"
#include "megamoe/presets.h"
#include "megamoe/reference.h"
#include "megamoe/status.h"
#include "tests/common/error_matchers.h"
#include "tests/common/oracles.h"
#include "tests/common/test_util.h"

namespace megamoe {
namespace {

using format::E4m3Overflow;
using reference::ForwardOptions;
using reference::TopK;
using namespace testing;  // the shared generators and oracles (tests/common)

// ---------------------------------------------------------------------------------------------
// Helpers and independent oracles

// The value of a non-negative e4m3 code, from the format's definition (not format::).
double e4m3_value(int code) {
  const int e = (code >> 3) & 0xF, m = code & 7;
  return e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
}

// e4m3 round-to-nearest-even with saturation, by search: the finite code nearest to v, the even
// code on a tie (e4m3 values grow with the code, so the even code is the one whose significand
// ends in 0). Beyond 448 the nearest finite value is 448 itself: saturation.
uint8_t e4m3_by_search(double v) {
  const double a = std::fabs(v);
  int best = 0;
  for (int c = 1; c <= 0x7E; ++c) {
    const double d = std::fabs(e4m3_value(c) - a), db = std::fabs(e4m3_value(best) - a);
    if (d < db || (d == db && c % 2 == 0)) best = c;
  }
  return static_cast<uint8_t>((std::signbit(v) ? 0x80 : 0) | best);
}
double e4m3_signed(uint8_t code) {
  return (code & 0x80 ? -1.0 : 1.0) * e4m3_value(code & 0x7F);
}

// The activation scale exponent by counting up from the clamp.
int act_exponent_by_counting(double amax) {
  int e = -126;
  while (amax > 448.0 * std::ldexp(1.0, e)) ++e;
  return e;
}

// The weight rescale by counting up: the first k where six times the largest scale fits 448.
int rescale_by_counting(const std::vector<uint8_t>& scales) {
  double s = 0;
  for (uint8_t b : scales) s = std::max(s, e4m3_value(b));
  if (s == 0) return 0;
  int k = -40;
  while (6 * s * std::ldexp(1.0, -k) > 448.0) ++k;
  return k;
}

// ---------------------------------------------------------------------------------------------
// f64_to_e4m3

TEST(W4a8Codec, F64ToE4m3EveryValueTieAndBoundary) {
  // Every finite value, both signs; the midpoint to its successor (a tie: to the even code) and
  // the doubles either side of the midpoint.
  for (int c = 0; c <= 0x7D; ++c) {
    const double v = e4m3_value(c), next = e4m3_value(c + 1), mid = (v + next) / 2;
    const int even = c % 2 == 0 ? c : c + 1;
    for (const int sign : {0, 0x80}) {
      const double s = sign ? -1.0 : 1.0;
      ASSERT_EQ(format::f64_to_e4m3(s * v), sign | c) << "code " << c;
      ASSERT_EQ(format::f64_to_e4m3(s * mid), sign | even) << "code " << c;
      ASSERT_EQ(format::f64_to_e4m3(s * std::nextafter(mid, 0.0)), sign | c) << "code " << c;
      ASSERT_EQ(format::f64_to_e4m3(s * std::nextafter(mid, 1e9)), sign | (c + 1))
          << "code " << c;
    }
  }
  // Written out: ties to even in the normal and the subnormal range.
  EXPECT_EQ(format::f64_to_e4m3(1.0625), 0x38);        // between 1 and 1.125: to 1 (even)
  EXPECT_EQ(format::f64_to_e4m3(1.1875), 0x3A);        // between 1.125 and 1.25: to 1.25
  EXPECT_EQ(format::f64_to_e4m3(0x1p-10), 0x00);       // half the smallest subnormal: to 0
  EXPECT_EQ(format::f64_to_e4m3(-0x1p-10), 0x80);      // ... keeping the sign
  EXPECT_EQ(format::f64_to_e4m3(3 * 0x1p-10), 0x02);   // between 1 and 2 units of 2^-9: to 2
  EXPECT_EQ(format::f64_to_e4m3(15 * 0x1p-10), 0x08);  // between 7·2^-9 and 2^-6: to 2^-6
  EXPECT_EQ(format::f64_to_e4m3(1e-300), 0x00);
  // One rounding from double: through fp32, 1 + 2^-4 + 2^-30 would become the tie 1 + 2^-4 and
  // then 1.0; the correct result is 1.125.
  EXPECT_EQ(format::f64_to_e4m3(1 + 0x1p-4 + 0x1p-30), 0x39);
  // The top: 464 is the tie between 448 and the missing 480, and goes to 448 in both modes.
  for (const E4m3Overflow mode : {E4m3Overflow::kSaturate, E4m3Overflow::kNan}) {
    EXPECT_EQ(format::f64_to_e4m3(448.0, mode), 0x7E);
    EXPECT_EQ(format::f64_to_e4m3(464.0, mode), 0x7E);
    EXPECT_EQ(format::f64_to_e4m3(-464.0, mode), 0xFE);
    EXPECT_EQ(format::f64_to_e4m3(std::nan(""), mode), 0x7F);
  }
  EXPECT_EQ(format::f64_to_e4m3(std::nextafter(464.0, 1e9)), 0x7E);
  EXPECT_EQ(format::f64_to_e4m3(-1e30), 0xFE);
  EXPECT_EQ(format::f64_to_e4m3(INFINITY), 0x7E);
  EXPECT_EQ(format::f64_to_e4m3(std::nextafter(464.0, 1e9), E4m3Overflow::kNan), 0x7F);
  EXPECT_EQ(format::f64_to_e4m3(-1e30, E4m3Overflow::kNan), 0xFF);
  EXPECT_EQ(format::f64_to_e4m3(-INFINITY, E4m3Overflow::kNan), 0xFF);
}

TEST(W4a8Codec, F64ToE4m3AgreesWithSearchAndWithTheFp32Codec) {
  const SeedTrace seed;
  Rng rng(seed);
  for (int i = 0; i < 200000; ++i) {
    // Random significands over exponents from below the subnormals to past the saturation.
    const double v = std::ldexp(rng.uniform(-1.0, 1.0), rng.uniform_int(-14, 11));
    ASSERT_EQ(format::f64_to_e4m3(v), e4m3_by_search(v)) << v;
    const float f = static_cast<float>(v);
    ASSERT_EQ(format::f64_to_e4m3(f), format::f32_to_e4m3(f)) << f;
  }
}

// ---------------------------------------------------------------------------------------------
// Activation scales and quantization

TEST(W4a8Codec, ActScaleExponentHandValues) {
  EXPECT_EQ(format::w4a8_act_scale_exponent(448.0), 0);
  EXPECT_EQ(format::w4a8_act_scale_exponent(std::nextafter(448.0, 1e9)), 1);
  EXPECT_EQ(format::w4a8_act_scale_exponent(224.0), -1);
  EXPECT_EQ(format::w4a8_act_scale_exponent(std::nextafter(224.0, 1e9)), 0);
  EXPECT_EQ(format::w4a8_act_scale_exponent(1.0), -8);  // 448·2^-8 = 1.75 >= 1 > 0.875
  EXPECT_EQ(format::w4a8_act_scale_exponent(3.0), -7);
  EXPECT_EQ(format::w4a8_act_scale_exponent(FLT_MAX), 120);
  // The clamp: zero groups and anything below 448·2^-127 get the smallest scale 2^-126.
  EXPECT_EQ(format::w4a8_act_scale_exponent(0.0), -126);
  EXPECT_EQ(format::w4a8_act_scale_exponent(1e-40), -126);
  EXPECT_EQ(format::w4a8_act_scale_exponent(448 * 0x1p-130), -126);
  EXPECT_EQ(format::w4a8_act_scale_exponent(448 * 0x1p-126), -126);
  EXPECT_EQ(format::w4a8_act_scale_exponent(448 * 0x1p-125), -125);
  EXPECT_EQ(format::w4a8_act_scale_exponent(std::nextafter(448 * 0x1p-126, 1.0)), -125);
  EXPECT_MEGAMOE_ERROR(format::w4a8_act_scale_exponent(-1.0), kInvalidArgument, "amax = -1");
  EXPECT_MEGAMOE_ERROR(format::w4a8_act_scale_exponent(INFINITY), kInvalidArgument, "finite");
  EXPECT_MEGAMOE_ERROR(format::w4a8_act_scale_exponent(std::nan("")), kInvalidArgument, "finite");
}

TEST(W4a8Codec, ActScaleExponentAgreesWithCounting) {
  const SeedTrace seed;
  Rng rng(seed);
  for (int i = 0; i < 100000; ++i) {
    const double amax = std::ldexp(rng.uniform(0.5, 1.0), rng.uniform_int(-140, 128));
    ASSERT_EQ(format::w4a8_act_scale_exponent(amax), act_exponent_by_counting(amax)) << amax;
  }
}

TEST(W4a8Codec, QuantizeActivationHandValues) {
  // Row 0, block 0: amax 3 gives e = -7 (x·128). Block 1 is all zero. Row 1, block 0 has amax
  // 0.0234375 (e = -14), block 1 a single tiny value.
  std::vector<double> x(2 * 256, 0.0);
  x[0] = 3.0;                  // 384 = 0x7C
  x[1] = 0.1;                  // 12.8 -> 13 = 0x55
  x[2] = 12.5 / 128;           // 12.5: tie between 12 (0x54, even) and 13
  x[3] = -13.5 / 128;          // -13.5: tie between 13 and 14 (0x56, even)
  x[4] = 3 * 0x1p-17;          // 3·2^-10: subnormal tie between 1 and 2 units: 0x02
  x[5] = -0x1p-17;             // 2^-10: half the smallest subnormal, to -0
  x[6] = 0x1p-17 * 1.0000001;  // just above the half: 0x01
  x[256 + 2] = 0.0234375;      // 384·2^-14
  x[256 + 100] = -0.0087890625;  // -144·2^-14: exact
  x[256 + 200] = 0x1p-100;     // alone in its block: e = -108, 2^-100·2^108 = 256
  std::vector<uint8_t> codes(x.size());
  std::vector<int32_t> exps(4);
  format::quantize_activation_w4a8(x, 2, 256, codes, exps);
  EXPECT_EQ(exps, (std::vector<int32_t>{-7, -126, -14, -108}));
  EXPECT_EQ(codes[0], 0x7C);
  EXPECT_EQ(codes[1], 0x55);
  EXPECT_EQ(codes[2], 0x54);
  EXPECT_EQ(codes[3], 0xD6);
  EXPECT_EQ(codes[4], 0x02);
  EXPECT_EQ(codes[5], 0x80);
  EXPECT_EQ(codes[6], 0x01);
  for (int i = 7; i < 256; ++i) ASSERT_EQ(codes[i], 0) << i;  // zeros, and the zero block
  EXPECT_EQ(codes[256 + 2], 0x7C);
  EXPECT_EQ(codes[256 + 100], 0xF1);  // -144 = -(8+1)·2^4: exponent field 14, mantissa 1
  EXPECT_EQ(codes[256 + 200], 0x78);  // 256 = 8·2^5: exponent field 15, mantissa 0
  EXPECT_EQ(e4m3_signed(codes[256 + 100]) * 0x1p-14, -0.0087890625);

  std::vector<uint8_t> c1(128);
  std::vector<int32_t> e1(1);
  std::vector<double> bad(128, 1.0);
  bad[77] = INFINITY;
  EXPECT_MEGAMOE_ERROR(format::quantize_activation_w4a8(bad, 1, 128, c1, e1), kInvalidArgument,
                       "[0, 77]", "finite");
  std::vector<double> x80(80);
  std::vector<uint8_t> c80(80);
  EXPECT_MEGAMOE_ERROR(format::quantize_activation_w4a8(x80, 1, 80, c80, e1), kInvalidArgument,
                       "multiple of 128");
}

TEST(W4a8Codec, QuantizeActivationRandomBlocksAgainstOracles) {
  const SeedTrace seed;
  Rng rng(seed);
  const int64_t rows = 5, cols = 1024;
  std::vector<double> x(rows * cols);
  for (int64_t b = 0; b < rows * cols / 128; ++b) {
    // Every block its own magnitude; some blocks zero, some with a single live element.
    const int kind = rng.uniform_int(0, 9);
    const double mag = std::ldexp(1.0, rng.uniform_int(-30, 30));
    for (int i = 0; i < 128; ++i) {
      double v = kind == 0 ? 0.0 : mag * rng.normal() * std::ldexp(1.0, rng.uniform_int(-12, 0));
      if (kind == 1 && i != 5) v = 0.0;
      x[b * 128 + i] = bf16_to_f32(f32_to_bf16(static_cast<float>(v)));
    }
  }
  std::vector<uint8_t> codes(x.size());
  std::vector<int32_t> exps(x.size() / 128);
  format::quantize_activation_w4a8(x, rows, cols, codes, exps);
  for (size_t b = 0; b < exps.size(); ++b) {
    double amax = 0;
    for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(x[b * 128 + i]));
    ASSERT_EQ(exps[b], act_exponent_by_counting(amax)) << "block " << b;
    for (int i = 0; i < 128; ++i) {
      const double v = x[b * 128 + i];
      ASSERT_EQ(codes[b * 128 + i], e4m3_by_search(std::ldexp(v, -exps[b])))
          << "block " << b << " element " << i << " value " << v;
      // Never saturated: |x|·2^-e <= 448 by the choice of e.
      ASSERT_LE(std::fabs(std::ldexp(v, -exps[b])), 448.0);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Weights: the rescale and the product rounding

TEST(W4a8Codec, WeightRescaleOnCraftedScaleSets) {
  using V = std::vector<uint8_t>;
  auto k = [](const V& s) { return format::w4a8_weight_rescale_exponent(s); };
  EXPECT_EQ(k(V{0x7E}), 3);              // 448: ModelOpt's largest scale, 6·448·2^-3 = 336
  EXPECT_EQ(k(V{0x38, 0x01, 0x7E}), 3);  // the largest decides
  EXPECT_EQ(k(V{0x7A}), 3);              // 320: 6·320/4 = 480 > 448
  EXPECT_EQ(k(V{0x79}), 2);              // 288: 6·288/4 = 432
  EXPECT_EQ(k(V{0x6A}), 1);              // 80: 480 > 448
  EXPECT_EQ(k(V{0x69}), 0);              // 72: 432
  EXPECT_EQ(k(V{0x68, 0x00}), 0);        // 64: 384
  EXPECT_EQ(k(V{0x38}), -6);             // 1: 6·64 = 384, 6·128 > 448
  EXPECT_EQ(k(V{0x01}), -15);            // 2^-9: 6·2^-9·2^15 = 384
  EXPECT_EQ(k(V{0x07, 0x02}), -12);      // 7·2^-9: 42·2^-9·2^12 = 336, 2^13 gives 672
  EXPECT_EQ(k(V{0x00, 0x00}), 0);        // all zero: nothing to scale
  EXPECT_EQ(k(V{}), 0);
  EXPECT_MEGAMOE_ERROR(k(V{0x38, 0x38, 0x80}), kInvalidArgument, "block scale 2", "0x80");
  EXPECT_MEGAMOE_ERROR(k(V{0x7F}), kInvalidArgument, "block scale 0", "0x7F");

  const SeedTrace seed;
  Rng rng(seed);
  for (int i = 0; i < 2000; ++i) {
    V s(rng.uniform_int(1, 40));
    const int top = rng.uniform_int(0, 0x7E);
    for (uint8_t& b : s) b = static_cast<uint8_t>(rng.uniform_int(0, top));
    ASSERT_EQ(k(s), rescale_by_counting(s));
  }
}

TEST(W4a8Codec, WeightProductRoundingHandValues) {
  auto w = [](int code, int scale, int k) {
    return format::w4a8_weight_e4m3(static_cast<uint8_t>(code), static_cast<uint8_t>(scale), k);
  };
  // Exact products: a power-of-two e2m1 times any scale, in range.
  EXPECT_EQ(w(0x4, 0x3F, 0), 0x47);  // 2·1.875 = 3.75
  EXPECT_EQ(w(0xC, 0x3F, 0), 0xC7);  // the sign comes from the e2m1 code
  // 1.5·(8+m) needs 5-6 significant bits for odd m: RNE to 4.
  EXPECT_EQ(w(0x5, 0x39, 0), 0x46);  // 3·1.125 = 3.375 = 1.1011b·2: tie, up to 3.5 (even)
  EXPECT_EQ(w(0x3, 0x3B, 0), 0x40);  // 1.5·1.375 = 2.0625: down to 2
  EXPECT_EQ(w(0x7, 0x3F, 0), 0x53);  // 6·1.875 = 11.25: down to 11
  EXPECT_EQ(w(0x7, 0x3D, 0), 0x52);  // 6·1.625 = 9.75: up to 10
  EXPECT_EQ(w(0x5, 0x3E, 0), 0x4A);  // 3·1.75 = 5.25: tie, down to 5 (even)
  // With ModelOpt's k = 3: the largest weight 6·448/8 = 336 = 10101b·16 is a tie: to 320.
  EXPECT_EQ(w(0x7, 0x7E, 3), 0x7A);
  EXPECT_EQ(w(0xF, 0x7E, 3), 0xFA);
  EXPECT_EQ(w(0x3, 0x7E, 3), 0x6A);  // 1.5·448/8 = 84: tie, to 80
  EXPECT_EQ(w(0x4, 0x7E, 3), 0x6E);  // 2·448/8 = 112: exact
  // Products in e4m3's subnormal range (k = 3: units of 2^-9 are 2^-6 before the rescale).
  EXPECT_EQ(w(0x7, 0x08, 3), 0x06);  // 6·2^-6/8 = 6·2^-9: exact
  EXPECT_EQ(w(0x7, 0x01, 3), 0x01);  // 6·2^-12 = 0.75 units: up to 1
  EXPECT_EQ(w(0x5, 0x03, 3), 0x01);  // 9·2^-12 = 1.125 units: to 1
  EXPECT_EQ(w(0x7, 0x05, 3), 0x04);  // 30·2^-12 = 3.75 units: to 4
  EXPECT_EQ(w(0x4, 0x06, 3), 0x02);  // 12·2^-12 = 1.5 units: tie, to 2 (even)
  EXPECT_EQ(w(0x2, 0x04, 3), 0x00);  // 4·2^-12 = 0.5 units: tie, flushed to 0 (even)
  EXPECT_EQ(w(0xA, 0x04, 3), 0x80);  // ... keeping the sign
  EXPECT_EQ(w(0x1, 0x01, 3), 0x00);  // 0.5·2^-12: flushed
  // The same products with the smallest k the scale allows stay exact: the rescale is why.
  EXPECT_EQ(e4m3_signed(w(0x1, 0x01, -15)), 0.5 * 0x1p-9 * 0x1p15);

  // Every (k, scale, code) against the search oracle.
  for (int k = -15; k <= 3; ++k) {
    for (int s = 0; s <= 0x7E; ++s) {
      for (int c = 0; c < 16; ++c) {
        const double p = kE2m1[c] * e4m3_value(s) * std::ldexp(1.0, -k);
        ASSERT_EQ(w(c, s, k), e4m3_by_search(p)) << "k " << k << " scale " << s << " code " << c;
      }
    }
  }
}

// The kernel-side forms docs/w4a8.md gives, checked against the definitions: they are the
// document's promises to whoever writes the GPU code.
TEST(W4a8Codec, KernelFormsOfTheDocumentAgree) {
  // The activation exponent from the fp32 bits of amax: e = -126 if the exponent field F is 0,
  // else max(-126, F - 135 + (mantissa field > 0x600000)).
  auto bits_rule = [](float amax) {
    uint32_t u;
    std::memcpy(&u, &amax, 4);
    const int F = static_cast<int>((u >> 23) & 0xFF);
    const uint32_t M = u & 0x7FFFFF;
    return F == 0 ? -126 : std::max(-126, F - 135 + (M > 0x600000u ? 1 : 0));
  };
  const SeedTrace seed;
  Rng rng(seed);
  for (const float amax : {0.0f, 448.0f, std::nextafter(448.0f, 1e9f), 224.0f, 1.0f, 1.75f,
                           std::nextafter(1.75f, 9.0f), FLT_MIN, 1e-40f, FLT_MAX}) {
    EXPECT_EQ(bits_rule(amax), format::w4a8_act_scale_exponent(amax)) << amax;
  }
  for (int i = 0; i < 100000; ++i) {
    const float amax = std::fabs(bf16_to_f32(static_cast<uint16_t>(rng.uniform_int(0, 0x7F7F))));
    ASSERT_EQ(bits_rule(amax), format::w4a8_act_scale_exponent(amax)) << amax;
    // x·2^-e as an fp32 multiply, then the fp32 codec (as cvt.rn.satfinite.e4m3x2.f32 would),
    // gives the code of the exact value, underflowing products included.
    const int e = format::w4a8_act_scale_exponent(amax);
    const float x = amax * static_cast<float>(rng.uniform(-1.0, 1.0)) *
                    std::ldexp(1.0f, -rng.uniform_int(0, 30));
    const float xb = bf16_to_f32(f32_to_bf16(x));
    ASSERT_EQ(format::f32_to_e4m3(xb * std::ldexp(1.0f, -e)),
              format::f64_to_e4m3(std::ldexp(static_cast<double>(xb), -e)))
        << xb << " e " << e;
  }
  // The weight conversion as f16 arithmetic: s' = s·2^-k and c·s' are exact in f16 for every
  // scale a tensor with rescale k can hold (6·s·2^-k <= 448), and one RNE of the f16 product is
  // the definition's byte.
  for (int k = -15; k <= 3; ++k) {
    for (int sb = 0; sb <= 0x7E; ++sb) {
      const float sp = std::ldexp(static_cast<float>(e4m3_value(sb)), -k);
      if (6.0f * sp > 448.0f) continue;
      ASSERT_EQ(f16_to_f32(f32_to_f16(sp)), sp) << "k " << k << " scale " << sb;
      for (int c = 0; c < 16; ++c) {
        const float prod = static_cast<float>(kE2m1[c]) * sp;
        const float prod_f16 = f16_to_f32(f32_to_f16(prod));
        ASSERT_EQ(prod_f16, prod) << "k " << k << " scale " << sb << " code " << c;
        ASSERT_EQ(format::f32_to_e4m3(prod_f16),
                  format::w4a8_weight_e4m3(static_cast<uint8_t>(c), static_cast<uint8_t>(sb), k))
            << "k " << k << " scale " << sb << " code " << c;
      }
    }
  }
}

TEST(W4a8Codec, WeightStatsCountEveryKind) {
  // One row, two blocks. Block 0 (scale 448, so k = 3): 6 and 1.5 are rounded (320, 80), 2, 1,
  // -0.5 exact, the rest zero. Block 1 (scale 2^-9): 6 and -6 land on the subnormal grid as
  // ±2^-9 (moved), 0.5 and 2 are flushed.
  LinearBuilder b(1, 32);
  b.scale(0, 0, 0x7E).scale(0, 1, 0x01);
  const uint8_t block0[] = {0x7, 0x3, 0x4, 0x2, 0x9};
  for (int i = 0; i < 5; ++i) b.code(0, i, block0[i]);
  b.code(0, 16, 0x7).code(0, 17, 0x1).code(0, 19, 0x4).code(0, 31, 0xF);
  const Nvfp4Linear lin = b.build(1.0f);
  const format::W4a8WeightStats st = format::w4a8_weight_stats(lin.view());
  EXPECT_EQ(st.rescale_exponent, 3);
  EXPECT_EQ(st.weights, 32);
  EXPECT_EQ(st.nonzero, 9);
  EXPECT_EQ(st.rounded, 2);
  EXPECT_EQ(st.subnormal, 2);
  EXPECT_EQ(st.flushed, 2);
  EXPECT_EQ(st.moved(), 6);

  // A zero scale makes its block's products zero: not counted as nonzero.
  LinearBuilder z(1, 16);
  z.scale(0, 0, 0x00).code(0, 3, 0x7);
  const Nvfp4Linear zl = z.build(1.0f);
  const format::W4a8WeightStats zs = format::w4a8_weight_stats(zl.view());
  EXPECT_EQ(zs.nonzero, 0);
  EXPECT_EQ(zs.moved(), 0);

  LinearBuilder bad(2, 16);
  bad.scale(1, 0, 0xB8);
  const Nvfp4Linear badl = bad.build(1.0f);
  EXPECT_MEGAMOE_ERROR(format::w4a8_weight_stats(badl.view()), kInvalidArgument,
                       "row 1, block 0", "0xB8");
}

// ---------------------------------------------------------------------------------------------
// The hand layer: H = 256 (two K blocks), I = 128, two experts, one token routed to expert 1
// with weight 0.75, and a second token of zeros. Every rounding of expert 1, worked out:
//
// hidden x (token 0): block 0 has amax x[0] = 5 -> e = -6 (5 <= 448·2^-6 = 7 < 448·2^-7):
//   x[3] = 1.0625 -> 68 = 1.0001b·64, a tie: to 64 (even) -> x_hat[3] = 1
//   x[100] = 0.2421875 -> 15.5, a tie between 15 and 16: to 16 (even) -> x_hat[100] = 0.25
// block 1 has amax x[130] = 0.0234375 -> e = -14 (= 384·2^-14):
//   x[200] = -0.0087890625 -> -144: exact -> x_hat[200] = -9/1024
// gate (s2 = 0.5): every scale 1.0 except row 0 block 0 = 1.125, so S = 1.125 and k = -6
//   (6·1.125·64 = 432). Row 0: col 3 = code 3.0 (3·1.125 = 3.375 -> 3.5, a tie up to even),
//   col 200 = code 1.0 (exact).   g0 = (1·3.5 + (-9/1024)·1)·0.5
// up (s2 = 0.25): every scale 1.0 except row 0 block 6 = 1.375, k = -5. Row 0: col 100 = code
//   -1.5 (-1.5·1.375 = -2.0625 -> -2).   u0 = 0.25·(-2)·0.25 = -0.125
// a0 = silu(g0)·u0 = -0.18578..., alone in its block of I: e = -11, a0·2^11 = -380.5 -> -384
//   (spacing 32 in [256, 512)) -> a_hat0 = -0.1875. Every other a is 0.
// down (s2 = 1.5): rows 0-7 have one weight at col 0 (k = 3 from the scale 448 of row 0):
constexpr int64_t kHandH = 256, kHandI = 128;
struct HandDown {
  uint8_t code, scale;
  double w_hat_times_2k;  // e4m3(c·s·2^-3)·2^3
};
constexpr HandDown kHandDown[8] = {
    {0x7, 0x7E, 2560.0},         // 6·448 = 2688 -> 336 -> 320 (tie to even)
    {0x3, 0x7E, 640.0},          // 1.5·448 = 672 -> 84 -> 80 (tie to even)
    {0xC, 0x7E, -896.0},         // -2·448: exact
    {0x5, 0x39, 3.5},            // 3·1.125 = 3.375 -> 3.5
    {0x7, 0x01, 0x1p-6},         // 6·2^-9 -> 0.75·2^-9 -> 2^-9 (subnormal, moved)
    {0x2, 0x04, 0.0},            // 1·4·2^-9 -> 0.5·2^-9: tie, flushed
    {0xF, 0x08, -6 * 0x1p-6},    // -6·2^-6: exact on the subnormal grid
    {0x3, 0x3B, 2.0},            // 1.5·1.375 = 2.0625 -> 2
};

MoeLayer hand_layer() {
  MoeLayer layer;
  layer.hidden_size = kHandH;
  layer.intermediate_size = kHandI;
  layer.num_experts = 2;
  layer.routing.top_k = 1;
  // Expert 0 is never used: its weights are arbitrary (and would give other results).
  ExpertWeights e0;
  e0.gate = LinearBuilder(kHandI, kHandH).code(0, 0, 0x7).build(1.0f);
  e0.up = LinearBuilder(kHandI, kHandH).code(0, 0, 0x7).build(1.0f);
  e0.down = LinearBuilder(kHandH, kHandI).code(0, 0, 0x7).build(1.0f);
  ExpertWeights e1;
  e1.gate = LinearBuilder(kHandI, kHandH).scale(0, 0, 0x39).code(0, 3, 0x5).code(0, 200, 0x2)
                .build(0.5f);
  e1.up = LinearBuilder(kHandI, kHandH).scale(0, 6, 0x3B).code(0, 100, 0xB).build(0.25f);
  LinearBuilder down(kHandH, kHandI);
  for (int h = 0; h < 8; ++h) down.code(h, 0, kHandDown[h].code).scale(h, 0, kHandDown[h].scale);
  e1.down = down.build(1.5f);
  layer.experts = {e0, e1};
  return layer;
}

TEST(W4a8Reference, HandLayerWorkedValues) {
  const MoeLayer layer = hand_layer();
  std::vector<uint16_t> hidden(2 * kHandH, 0);
  auto set = [&](int h, double v) {
    hidden[h] = f32_to_bf16(static_cast<float>(v));
    ASSERT_EQ(bf16_to_f32(hidden[h]), v) << "not a bf16 value";
  };
  set(0, 5.0);
  set(3, 1.0625);
  set(100, 0.2421875);
  set(130, 0.0234375);
  set(200, -0.0087890625);
  const TopK topk = make_topk(2, 1, {1, 1}, {0.75f, 0.5f});

  const double g0 = (1.0 * 3.5 + (-9.0 / 1024) * 1.0) * 0.5;
  const double u0 = 0.25 * -2.0 * 0.25;
  const double a0 = silu(g0) * u0;
  ASSERT_GT(std::fabs(a0) * 2048, 368.0);  // the hand derivation's bracket: rounds to 384
  ASSERT_LT(std::fabs(a0) * 2048, 400.0);
  const double a_hat0 = -384 * 0x1p-11;

  // Token 1 is all zero: every group's amax is 0. Sums start at +0, so the flushed weight of
  // row 5 gives +0, not -0.
  std::vector<double> want(2 * kHandH, 0.0);
  for (int h = 0; h < 8; ++h) want[h] = 0.0 + 0.75 * (a_hat0 * kHandDown[h].w_hat_times_2k * 1.5);
  for (const ForwardOptions opt : {ForwardOptions{1, 0}, ForwardOptions{2, 1}}) {
    const std::vector<uint16_t> got = reference::moe_forward_w4a8(layer, hidden, 2, topk, opt);
    const std::vector<float> got32 = reference::moe_forward_w4a8_f32(layer, hidden, 2, topk, opt);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i], bf16_of(want[i])) << "element " << i << " want " << want[i];
      EXPECT_EQ(got32[i], static_cast<float>(want[i])) << "element " << i;
    }
  }
  // The rounding is visible: W4A16 gives another output for the same layer.
  const std::vector<float> w4a16 = reference::moe_forward_f32(layer, hidden, 2, topk);
  EXPECT_NE(w4a16[0], static_cast<float>(want[0]));
}

TEST(W4a8Reference, RejectsWhatW4a8CannotRun) {
  MoeLayer layer = hand_layer();
  std::vector<uint16_t> hidden(kHandH, 0);
  const TopK topk = make_topk(1, 1, {1}, {1.0f});
  hidden[17] = 0x7F80;  // +inf
  EXPECT_MEGAMOE_ERROR(reference::moe_forward_w4a8(layer, hidden, 1, topk), kInvalidArgument,
                       "moe_forward_w4a8", "hidden[0, 17]", "finite");
  hidden[17] = 0;
  // An invalid block scale in a used expert is named; W4A16's checks come with the W4A8 name.
  std::vector<uint8_t> scales(kHandH * kHandI / 16, 0x38);
  scales[5 * (kHandI / 16) + 2] = 0xC0;
  layer.experts[1].down =
      make_owned_linear(kHandH, kHandI, std::vector<uint8_t>(kHandH * kHandI / 2), scales, 1.0f);
  EXPECT_MEGAMOE_ERROR(reference::moe_forward_w4a8(layer, hidden, 1, topk), kInvalidArgument,
                       "moe_forward_w4a8", "expert 1 down_proj.weight_scale[5, 2]", "0xC0");
  EXPECT_MEGAMOE_ERROR(reference::moe_forward_w4a8(layer, hidden, 1, make_topk(1, 1, {2}, {1})),
                       kInvalidArgument, "moe_forward_w4a8", "expert ids must be in [0, 2)");
  // K blocks of 128: H = 144 is a valid NVFP4 layer but not a W4A8 one.
  MoeLayer odd;
  odd.hidden_size = 144;
  odd.intermediate_size = 128;
  odd.num_experts = 1;
  odd.routing.top_k = 1;
  odd.experts.push_back({LinearBuilder(128, 144).build(1.0f), LinearBuilder(128, 144).build(1.0f),
                         LinearBuilder(144, 128).build(1.0f)});
  std::vector<uint16_t> h144(144, 0);
  EXPECT_MEGAMOE_ERROR(reference::moe_forward_w4a8(odd, h144, 1, make_topk(1, 1, {0}, {1})),
                       kInvalidArgument, "hidden_size 144", "multiples of 128");
  EXPECT_NO_THROW(reference::moe_forward(odd, h144, 1, make_topk(1, 1, {0}, {1})));
}

// ---------------------------------------------------------------------------------------------
// Random layers against a naive W4A8 forward written from docs/w4a8.md

// The random layers here: every code, scales up to a largest byte drawn per tensor (so the
// rescale k differs between tensors), global scales of many exponents; hidden states whose
// 128-value blocks each have a magnitude of their own, some all zero.
constexpr LinearDraw kW4a8Weights{ScaleCodes::kUpToRandomTop, GlobalScale::kAnyExponent};

struct NaiveW4a8Linear {
  int64_t rows, cols;
  std::vector<double> w_hat;  // e4m3(c·s·2^-k), row-major
  double scale;               // s2·2^k
};

NaiveW4a8Linear naive_linear(const Nvfp4Linear& w) {
  const std::vector<uint8_t> scales(w.weight_scale,
                                    w.weight_scale + w.out_features * w.in_features / 16);
  const int k = rescale_by_counting(scales);
  NaiveW4a8Linear out{w.out_features, w.in_features, {}, std::ldexp(double{w.weight_scale_2}, k)};
  std::map<std::pair<int, int>, double> memo;  // (scale, code) -> w_hat
  for (int64_t r = 0; r < w.out_features; ++r) {
    for (int64_t c = 0; c < w.in_features; ++c) {
      const int64_t i = r * w.in_features + c;
      const uint8_t byte = w.weight[i / 2];
      const int code = i % 2 == 0 ? byte & 0xF : byte >> 4;  // even element: low nibble
      const int s = scales[i / 16];
      auto it = memo.find({s, code});
      if (it == memo.end()) {
        const double p = kE2m1[code] * e4m3_value(s) * std::ldexp(1.0, -k);
        it = memo.emplace(std::make_pair(s, code), e4m3_signed(e4m3_by_search(p))).first;
      }
      out.w_hat.push_back(it->second);
    }
  }
  return out;
}

// x_hat of a vector, 128 values per scale.
std::vector<double> naive_quantize(const std::vector<double>& v) {
  std::vector<double> out(v.size());
  for (size_t b = 0; b < v.size() / 128; ++b) {
    double amax = 0;
    for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(v[b * 128 + i]));
    const int e = act_exponent_by_counting(amax);
    for (int i = 0; i < 128; ++i) {
      out[b * 128 + i] =
          std::ldexp(e4m3_signed(e4m3_by_search(std::ldexp(v[b * 128 + i], -e))), e);
    }
  }
  return out;
}

// Row `row` of W·x: exact partial sums per 128 K, added in order, times the folded scale.
double naive_dot(const NaiveW4a8Linear& W, int64_t row, const std::vector<double>& x) {
  double acc = 0;
  for (int64_t k0 = 0; k0 < W.cols; k0 += 128) {
    double part = 0;
    for (int64_t k = k0; k < k0 + 128; ++k) part += x[k] * W.w_hat[row * W.cols + k];
    acc += part;
  }
  return acc * W.scale;
}

struct NaiveW4a8Expert {
  NaiveW4a8Linear gate, up, down;
};

std::vector<double> naive_expert(const NaiveW4a8Expert& e, const std::vector<double>& x_hat,
                                 std::optional<float> limit) {
  std::vector<double> a(e.gate.rows);
  for (int64_t i = 0; i < e.gate.rows; ++i) {
    double g = naive_dot(e.gate, i, x_hat), u = naive_dot(e.up, i, x_hat);
    if (limit) {
      g = std::min(g, double{*limit});
      u = std::max(std::min(u, double{*limit}), -double{*limit});
    }
    a[i] = silu(g) * u;
  }
  const std::vector<double> a_hat = naive_quantize(a);
  std::vector<double> y(e.down.rows);
  for (int64_t h = 0; h < e.down.rows; ++h) y[h] = naive_dot(e.down, h, a_hat);
  return y;
}

std::vector<double> naive_forward_w4a8(const MoeLayer& layer, const std::vector<uint16_t>& hidden,
                                       int64_t T, const TopK& topk) {
  const int64_t H = layer.hidden_size;
  std::vector<NaiveW4a8Expert> experts;
  for (const ExpertWeights& w : layer.experts) {
    experts.push_back({naive_linear(w.gate), naive_linear(w.up), naive_linear(w.down)});
  }
  std::optional<NaiveW4a8Expert> shared;
  if (layer.shared_expert) {
    shared = NaiveW4a8Expert{naive_linear(layer.shared_expert->gate),
                             naive_linear(layer.shared_expert->up),
                             naive_linear(layer.shared_expert->down)};
  }
  std::vector<double> out(T * H, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> x(H);
    for (int64_t h = 0; h < H; ++h) x[h] = bf16_to_f32(hidden[t * H + h]);
    const std::vector<double> x_hat = naive_quantize(x);
    for (int j = 0; j < topk.k; ++j) {
      const std::vector<double> y =
          naive_expert(experts[topk.ids[t * topk.k + j]], x_hat, layer.swiglu_limit);
      for (int64_t h = 0; h < H; ++h) out[t * H + h] += double{topk.weights[t * topk.k + j]} * y[h];
    }
    if (shared) {
      const std::vector<double> y = naive_expert(*shared, x_hat, layer.swiglu_limit);
      for (int64_t h = 0; h < H; ++h) out[t * H + h] += y[h];
    }
  }
  return out;
}

TEST(W4a8Reference, RandomLayersMatchNaiveBitwiseAndStayNearW4a16) {
  const SeedTrace seed;
  Rng rng(seed);
  const int64_t H = 384, I = 256, I_shared = 128, E = 5, T = 6;
  const int k = 3;
  MoeLayer layer = random_layer(rng, H, I, E, k, I_shared, std::nullopt, kW4a8Weights);
  const std::vector<uint16_t> hidden = random_hidden(rng, T, H, HiddenValues::kScaledBlocks);
  const TopK topk = arbitrary_topk(rng, T, E, k);  // token 0 repeats an expert

  // The rescales differ between tensors (the scale sets do), or the test would not show that
  // each projection gets its own.
  std::set<int> ks;
  for (const ExpertWeights& w : layer.experts) {
    for (const Nvfp4Linear* l : {&w.gate, &w.up, &w.down}) {
      ks.insert(format::w4a8_weight_stats(l->view()).rescale_exponent);
    }
  }
  EXPECT_GE(ks.size(), 2u);

  const std::vector<double> unclamped = naive_forward_w4a8(layer, hidden, T, topk);
  for (const std::optional<float> clamp : {std::optional<float>{}, std::optional<float>{0.05f}}) {
    SCOPED_TRACE(clamp ? "clamp" : "no clamp");
    layer.swiglu_limit = clamp;
    const std::vector<double> expected =
        clamp ? naive_forward_w4a8(layer, hidden, T, topk) : unclamped;
    if (clamp) {
      ASSERT_NE(expected, unclamped) << "the clamp changed nothing";
    }
    for (const ForwardOptions opt :
         {ForwardOptions{1, 0}, ForwardOptions{3, 0}, ForwardOptions{2, 1}, ForwardOptions{3, 4}}) {
      SCOPED_TRACE("threads " + std::to_string(opt.threads) + ", chunk_tokens " +
                   std::to_string(opt.chunk_tokens));
      const std::vector<uint16_t> got = reference::moe_forward_w4a8(layer, hidden, T, topk, opt);
      const std::vector<float> got32 =
          reference::moe_forward_w4a8_f32(layer, hidden, T, topk, opt);
      int mismatches = 0;
      for (int64_t i = 0; i < T * H; ++i) {
        const float want32 = static_cast<float>(expected[i]);
        if (got[i] != bf16_of(expected[i]) || std::memcmp(&got32[i], &want32, 4) != 0) {
          if (++mismatches <= 5) {
            ADD_FAILURE() << "token " << i / H << ", h " << i % H << ": got " << got32[i]
                          << ", want " << want32;
          }
        }
      }
      EXPECT_EQ(mismatches, 0);
    }
    // Against the exact W4A16 output: close, not equal. The bound is loose on purpose: these
    // layers use every scale byte, so many products fall into e4m3's subnormals, and 6 tokens are
    // a small sample (over 300 seeds: median 0.06, 99th percentile 0.10, largest 0.11; a 0.1
    // bound failed CI once). A scale applied twice, to the wrong projection or with the wrong
    // sign gives an error of order 1. Only without
    // the clamp: this small limit keeps mostly the a = silu(g)·u whose g is near 0, which on
    // these layers (|g| in the hundreds) is where any perturbation of g shows most.
    if (clamp) continue;
    const std::vector<float> w4a8 = reference::moe_forward_w4a8_f32(layer, hidden, T, topk);
    const std::vector<float> w4a16 = reference::moe_forward_f32(layer, hidden, T, topk);
    const double err = rel_l2(w4a8, w4a16);
    std::printf("[ random layer ] W4A8 vs W4A16 rel L2 %.3g\n", err);
    EXPECT_GT(err, 1e-4);
    EXPECT_LT(err, 0.3);
  }
}

// The stage-by-stage API (w4a8_project, w4a8_swiglu, w4a8_quantize_dequantize) composed per
// (token, slot) is the emulation: the same fp32 output bit for bit, with and without the clamp.
TEST(W4a8Reference, StagesComposeToTheEmulationBitwise) {
  const SeedTrace seed;
  Rng rng(seed);
  const int64_t H = 256, I = 128, I_shared = 256, E = 4, T = 5;
  const int k = 2;
  MoeLayer layer = random_layer(rng, H, I, E, k, I_shared, std::nullopt, kW4a8Weights);
  const std::vector<uint16_t> hidden = random_hidden(rng, T, H, HiddenValues::kScaledBlocks);
  const TopK topk = arbitrary_topk(rng, T, E, k);
  for (const std::optional<float> clamp : {std::optional<float>{}, std::optional<float>{0.05f}}) {
    SCOPED_TRACE(clamp ? "clamp" : "no clamp");
    layer.swiglu_limit = clamp;
    const std::vector<float> want = reference::moe_forward_w4a8_f32(layer, hidden, T, topk);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> x(H);
      for (int64_t h = 0; h < H; ++h) x[h] = bf16_to_f32(hidden[t * H + h]);
      const std::vector<double> x_hat = reference::w4a8_quantize_dequantize(x);
      auto expert_out = [&](int e) {
        const auto g = reference::w4a8_project(layer, e, reference::W4a8Projection::kGate, x_hat);
        const auto u = reference::w4a8_project(layer, e, reference::W4a8Projection::kUp, x_hat);
        for (size_t i = 0; i < g.value.size(); ++i) {
          EXPECT_GE(g.magnitude[i], std::fabs(g.value[i]));
          EXPECT_GE(u.magnitude[i], std::fabs(u.value[i]));
        }
        const std::vector<double> a_hat =
            reference::w4a8_quantize_dequantize(reference::w4a8_swiglu(layer, g.value, u.value));
        return reference::w4a8_project(layer, e, reference::W4a8Projection::kDown, a_hat).value;
      };
      std::vector<double> sum(H, 0.0);
      for (int j = 0; j < k; ++j) {
        const std::vector<double> y = expert_out(topk.ids[t * k + j]);
        for (int64_t h = 0; h < H; ++h) sum[h] += double{topk.weights[t * k + j]} * y[h];
      }
      const std::vector<double> y = expert_out(reference::kW4a8SharedExpert);
      for (int64_t h = 0; h < H; ++h) sum[h] += y[h];
      int mismatches = 0;
      for (int64_t h = 0; h < H; ++h) {
        const float got = static_cast<float>(sum[h]);
        if (std::memcmp(&got, &want[t * H + h], 4) != 0 && ++mismatches <= 3) {
          ADD_FAILURE() << "token " << t << ", h " << h << ": stages " << got << ", emulation " << want[t * H + h];
        }
      }
      EXPECT_EQ(mismatches, 0);
    }
  }
}

TEST(W4a8Reference, StagesRejectBadArguments) {
  Rng rng(7);
  const MoeLayer layer = random_layer(rng, 128, 128, 2, 1, 0, std::nullopt, kW4a8Weights);
  const std::vector<double> x(128, 1.0);
  using reference::W4a8Projection;
  EXPECT_MEGAMOE_ERROR(reference::w4a8_project(layer, 2, W4a8Projection::kGate, x), kInvalidArgument,
                       "expert 2 is neither a routed expert (0..1)");
  EXPECT_MEGAMOE_ERROR(reference::w4a8_project(layer, reference::kW4a8SharedExpert, W4a8Projection::kGate, x),
                       kInvalidArgument, "no shared expert");
  EXPECT_MEGAMOE_ERROR(reference::w4a8_project(layer, 0, W4a8Projection::kUp, std::vector<double>(64)),
                       kInvalidArgument, "up_proj takes 128 inputs");
  EXPECT_MEGAMOE_ERROR(reference::w4a8_swiglu(layer, x, std::vector<double>(3)), kInvalidArgument, "as many");
  EXPECT_MEGAMOE_ERROR(reference::w4a8_quantize_dequantize(std::vector<double>(100)), kInvalidArgument,
                       "whole blocks of 128");
}

// A layer where every value is representable: hidden values of 2 significant bits, weights
// whose products are exact in e4m3, gate outputs of 2 significant bits >= 48 (so silu(g) = g in
// double) and up outputs of 2 significant bits, so every a = g·u has at most 4 and is exact in
// bf16 and e4m3. There W4A8 must give W4A16's output bit for bit: any difference would be a
// rounding the document does not define, or a scale applied twice or to the wrong projection.
//
// Hidden column 0 is 1 in every token, so each gate row reads only it (g = c·s·s2_gate, the same
// for every token); each up row reads one column of its own; down is dense.
TEST(W4a8Reference, RepresentableLayerEqualsW4a16Bitwise) {
  const SeedTrace seed;
  Rng rng(seed);
  const int64_t H = 256, I = 256, I_shared = 128, E = 3, T = 5;
  const int k = 2;

  std::vector<uint16_t> hidden(T * H);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t b = 0; b < H / 128; ++b) {
      const int exp = rng.uniform_int(-2, 2);  // each block its own magnitude
      for (int64_t i = b * 128; i < (b + 1) * 128; ++i) {
        const double m = rng.uniform_int(0, 1) ? 1.0 : 1.5;
        double v = (rng.uniform_int(0, 1) ? -m : m) * std::ldexp(1.0, exp - rng.uniform_int(0, 2));
        if (rng.uniform_int(0, 7) == 0) v = 0;
        hidden[t * H + i] = f32_to_bf16(static_cast<float>(v));
      }
    }
    hidden[t * H] = f32_to_bf16(1.0f);
  }
  // e2m1 codes 1, 2 or 4 (0x2, 0x4, 0x6) with a random sign.
  auto random_pow2_code = [&] {
    return static_cast<uint8_t>(2 * rng.uniform_int(1, 3) | (rng.uniform_int(0, 1) << 3));
  };
  auto representable_expert = [&](int64_t inter) {
    ExpertWeights w;
    // gate: e2m1 3, 4 or 6 times the scale 2 at column 0, times 16: g in {96, 128, 192}.
    LinearBuilder gate(inter, H);
    for (int64_t i = 0; i < inter; ++i) {
      const uint8_t codes[] = {0x5, 0x6, 0x7};  // 3, 4, 6
      gate.code(i, 0, codes[rng.uniform_int(0, 2)]);
      gate.scale(i, 0, 0x40);  // 2.0
    }
    for (int64_t i = 0; i < inter; ++i) {
      for (int64_t b = 1; b < H / 16; ++b) {
        gate.scale(i, b, static_cast<uint8_t>(rng.uniform_int(0, 0x7E)));
      }
    }
    w.gate = gate.build(16.0f);
    // up: one column per row, a power-of-two code and scale 1 or 2.
    LinearBuilder up(inter, H);
    for (int64_t i = 0; i < inter; ++i) {
      const int64_t col = rng.uniform_int(1, static_cast<int>(H) - 1);
      up.code(i, col, random_pow2_code());
      up.scale(i, col / 16, rng.uniform_int(0, 1) ? 0x38 : 0x40);
    }
    w.up = up.build(0.25f);
    // down: dense, scales in [0.25, 384] with an even mantissa field (0, 2, 4), so that
    // 1.5·(8+m) has at most 4 significant bits.
    LinearBuilder down(H, inter);
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < inter; ++i) {
        down.code(h, i, static_cast<uint8_t>(rng.uniform_int(0, 15)));
      }
      for (int64_t b = 0; b < inter / 16; ++b) {
        const int e = rng.uniform_int(5, 15), m = 2 * rng.uniform_int(0, 2);
        down.scale(h, b, static_cast<uint8_t>(e << 3 | m));
      }
    }
    w.down = down.build(static_cast<float>(rng.uniform(0.5, 2.0)));
    return w;
  };
  MoeLayer layer;
  layer.hidden_size = H;
  layer.intermediate_size = I;
  layer.num_experts = E;
  layer.routing.top_k = k;
  for (int64_t e = 0; e < E; ++e) layer.experts.push_back(representable_expert(I));
  layer.shared_expert = representable_expert(I_shared);
  TopK topk = make_topk(T, k, std::vector<int32_t>(T * k), std::vector<float>(T * k));
  for (int64_t i = 0; i < T * k; ++i) {
    topk.ids[i] = rng.uniform_int(0, E - 1);
    topk.weights[i] = static_cast<float>(rng.uniform(0.1, 1.0));
  }

  const std::vector<float> w4a16 = reference::moe_forward_f32(layer, hidden, T, topk);
  const std::vector<float> w4a8 = reference::moe_forward_w4a8_f32(layer, hidden, T, topk);
  ASSERT_EQ(w4a16.size(), w4a8.size());
  int mismatches = 0, nonzero = 0;
  for (size_t i = 0; i < w4a16.size(); ++i) {
    nonzero += w4a16[i] != 0;
    if (std::memcmp(&w4a16[i], &w4a8[i], 4) != 0 && ++mismatches <= 5) {
      ADD_FAILURE() << "element " << i << ": W4A16 " << w4a16[i] << ", W4A8 " << w4a8[i];
    }
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(nonzero, static_cast<int>(w4a16.size()) / 2);
}

// ---------------------------------------------------------------------------------------------
// The accuracy table of docs/w4a8.md (slow: one to two minutes per large preset on two cores;
// run with --gtest_also_run_disabled_tests --gtest_filter='*AccuracyTable*').
//
// Per preset, real H and I, E reduced to kTableExperts routed experts (+ the preset's shared
// expert), T tokens of N(0,1) bf16 hidden states (as `megamoe bench` draws them), uniform random
// top-k with random normalized weights. Weights are synth_weight's (the generator behind `megamoe
// synth`), quantized as synth does. The unquantized layer uses those bf16 weights, in double,
// with no rounding until the output. Outputs compared in fp32 (before the final bf16 rounding).

constexpr int64_t kTableExperts = 16;
constexpr int64_t kTableTokens = 64;

struct DenseExpert {
  int64_t I;
  std::vector<float> gate, up, down;  // [I, H], [I, H], [H, I]
};

std::vector<double> dense_expert_forward(const DenseExpert& e, int64_t H, const double* x,
                                         std::optional<float> limit) {
  std::vector<double> a(e.I), y(H);
  for (int64_t i = 0; i < e.I; ++i) {
    double g = 0, u = 0;
    for (int64_t h = 0; h < H; ++h) {
      g += x[h] * e.gate[i * H + h];
      u += x[h] * e.up[i * H + h];
    }
    if (limit) {
      g = std::min(g, double{*limit});
      u = std::max(std::min(u, double{*limit}), -double{*limit});
    }
    a[i] = silu(g) * u;
  }
  for (int64_t h = 0; h < H; ++h) {
    double acc = 0;
    for (int64_t i = 0; i < e.I; ++i) acc += a[i] * e.down[h * e.I + i];
    y[h] = acc;
  }
  return y;
}

Nvfp4Linear quantize_linear(const std::vector<float>& w, int64_t rows, int64_t cols) {
  std::vector<uint8_t> codes(rows * cols / 2), scales(rows * cols / 16);
  const float s2 = format::quantize_weight_modelopt(w, rows, cols, codes, scales);
  return make_owned_linear(rows, cols, std::move(codes), std::move(scales), s2);
}

double cosine(const std::vector<float>& a, const std::vector<double>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ab += a[i] * b[i];
    aa += double{a[i]} * a[i];
    bb += b[i] * b[i];
  }
  return ab / std::sqrt(aa * bb);
}

TEST(W4a8Reference, DISABLED_AccuracyTable) {
  const uint64_t seed = fresh_seed();
  std::printf("W4A8 accuracy table: seed %llu, %lld routed experts (+ shared), %lld tokens\n",
              static_cast<unsigned long long>(seed), static_cast<long long>(kTableExperts),
              static_cast<long long>(kTableTokens));
  std::printf("| preset | H | I | W4A16 cos vs unquantized | W4A8 cos vs unquantized | W4A16 rel "
              "L2 vs unquantized | W4A8 rel L2 vs unquantized | W4A8 rel L2 vs W4A16 | weights "
              "moved by e4m3 (rounded / subnormal / flushed) | k |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---|---|\n");
  for (const ModelPreset& preset : model_presets()) {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t H = preset.hidden_size, I = preset.intermediate_size, E = kTableExperts;
    const int k = preset.top_k;
    const int64_t T = kTableTokens;
    Rng rng(seed ^ std::hash<std::string>{}(preset.name));
    const std::vector<uint16_t> hidden = random_hidden(rng, T, H);
    const TopK topk = random_topk(rng, T, E, k);

    MoeLayer layer;
    layer.hidden_size = H;
    layer.intermediate_size = I;
    layer.num_experts = E;
    layer.routing.top_k = k;
    layer.swiglu_limit = preset.swiglu_limit;
    std::vector<double> unquantized(T * H, 0.0);
    format::W4a8WeightStats total;
    std::set<int> ks;
    const std::string mlp = moe_prefix(preset.layer);
    const int64_t n_units = E + (preset.n_shared_experts > 0 ? 1 : 0);
    for (int64_t e = 0; e < n_units; ++e) {
      const bool is_shared = e == E;
      const std::string name =
          is_shared ? mlp + ".shared_experts" : mlp + ".experts." + std::to_string(e);
      DenseExpert d;
      d.I = is_shared ? preset.n_shared_experts * I : I;
      d.gate = synth_weight(seed, name + ".gate_proj.weight", d.I, H);
      d.up = synth_weight(seed, name + ".up_proj.weight", d.I, H);
      d.down = synth_weight(seed, name + ".down_proj.weight", H, d.I);
      ExpertWeights q{quantize_linear(d.gate, d.I, H), quantize_linear(d.up, d.I, H),
                      quantize_linear(d.down, H, d.I)};
      for (const Nvfp4Linear* l : {&q.gate, &q.up, &q.down}) {
        const format::W4a8WeightStats s = format::w4a8_weight_stats(l->view());
        total.weights += s.weights;
        total.nonzero += s.nonzero;
        total.rounded += s.rounded;
        total.subnormal += s.subnormal;
        total.flushed += s.flushed;
        ks.insert(s.rescale_exponent);
      }
      if (is_shared) {
        layer.shared_expert = std::move(q);
      } else {
        layer.experts.push_back(std::move(q));
      }
      // This expert's share of the unquantized output.
      std::vector<double> x(H);
      for (int64_t t = 0; t < T; ++t) {
        double w = is_shared ? 1.0 : 0.0;
        for (int j = 0; j < k && !is_shared; ++j) {
          if (topk.ids[t * k + j] == e) w += topk.weights[t * k + j];
        }
        if (w == 0) continue;
        for (int64_t h = 0; h < H; ++h) x[h] = bf16_to_f32(hidden[t * H + h]);
        const std::vector<double> y = dense_expert_forward(d, H, x.data(), preset.swiglu_limit);
        for (int64_t h = 0; h < H; ++h) unquantized[t * H + h] += w * y[h];
      }
    }
    const std::vector<float> w4a16 = reference::moe_forward_f32(layer, hidden, T, topk);
    const std::vector<float> w4a8 = reference::moe_forward_w4a8_f32(layer, hidden, T, topk);
    const double cos16 = cosine(w4a16, unquantized), cos8 = cosine(w4a8, unquantized);
    const double e16 = rel_l2(w4a16, unquantized), e8 = rel_l2(w4a8, unquantized);
    const double e8_16 = rel_l2(w4a8, w4a16);
    std::string kstr;
    for (int kk : ks) kstr += (kstr.empty() ? "" : ",") + std::to_string(kk);
    const double nz = static_cast<double>(total.nonzero);
    std::printf("| %s | %lld | %lld | %.5f | %.5f | %.4f | %.4f | %.4f | %.2f%% (%.2f%% / %.4f%% / "
                "%.4f%%) of nonzero | %s |\n",
                preset.name.c_str(), static_cast<long long>(H), static_cast<long long>(I), cos16,
                cos8, e16, e8, e8_16, 100.0 * total.moved() / nz, 100.0 * total.rounded / nz,
                100.0 * total.subnormal / nz, 100.0 * total.flushed / nz, kstr.c_str());
    std::printf("  (%s: %.1f s)\n", preset.name.c_str(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    std::fflush(stdout);
    // What docs/w4a8.md reports: W4A8 costs about 0.002 of cosine and sits about 6% (rel L2)
    // from W4A16; these bounds catch a rounding gone wrong (a lost scale, a flushed range) while
    // leaving room for the sampling noise of 64 tokens. (The absolute target, cosine >=
    // 0.984, is met only at its edge: see the document.)
    EXPECT_GT(cos8, cos16 - 0.004) << preset.name;
    EXPECT_LT(cos8, cos16) << preset.name;
    EXPECT_GT(e8_16, 0.03) << preset.name;
    EXPECT_LT(e8_16, 0.08) << preset.name;
  }
}

}  // namespace
}  // namespace megamoe
