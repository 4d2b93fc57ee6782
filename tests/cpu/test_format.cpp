// NVFP4 / MXFP4 numerics (include/megamoe/format.h, docs/design.md §2). Small domains are checked
// exhaustively against formulas and brute-force nearest-value searches written independently in
// this file; the ModelOpt recipe against hand-computed bytes and, on fresh random data with
// scales that vary per row and per block, against its defining properties.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "megamoe/dtype.h"
#include "megamoe/format.h"
#include "megamoe/reference.h"
#include "megamoe/status.h"
#include "tests/common/test_util.h"

namespace megamoe::format {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

// ---- Independent references -------------------------------------------------------------------

constexpr double kE2m1Grid[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};

// Nearest E2M1 magnitude code of |q| by exhaustive search; ties go to the even code; saturates.
uint8_t e2m1_nearest_magnitude(double a) {
  if (a >= 6.0) return 7;  // saturation (distances to huge values would tie in double)
  int best = 0;
  for (int c = 1; c < 8; ++c) {
    const double d = std::fabs(kE2m1Grid[c] - a), db = std::fabs(kE2m1Grid[best] - a);
    if (d < db || (d == db && (c % 2) == 0)) best = c;
  }
  return static_cast<uint8_t>(best);
}

// float8_e4m3fn by its definition: bias 7, subnormal m * 2^-9, S.1111.111 is NaN, no inf.
double e4m3_reference(uint8_t c) {
  const int s = c >> 7, e = (c >> 3) & 0xF, m = c & 7;
  double mag;
  if (e == 15 && m == 7) {
    mag = std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    mag = m * std::ldexp(1.0, -9);
  } else {
    mag = (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
  }
  return s ? -mag : mag;
}

// Nearest e4m3 code of a finite x by exhaustive search over the 127 magnitudes; ties to the even
// code; |x| above 448 saturates; the sign follows x.
uint8_t e4m3_nearest(double x) {
  static const std::vector<double> magnitudes = [] {
    std::vector<double> m(0x7F);
    for (int c = 0; c <= 0x7E; ++c) m[c] = e4m3_reference(static_cast<uint8_t>(c));
    return m;
  }();
  const double a = std::fabs(x);
  int best = 0;
  if (a >= 448.0) {
    best = 0x7E;
  } else {
    for (int c = 1; c <= 0x7E; ++c) {
      const double d = std::fabs(magnitudes[c] - a), db = std::fabs(magnitudes[best] - a);
      if (d < db || (d == db && (c % 2) == 0)) best = c;
    }
  }
  return static_cast<uint8_t>(best | (std::signbit(x) ? 0x80 : 0));
}

std::string hex(int v) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "0x%02X", v);
  return buf;
}

template <typename F>
void expect_error(F&& f, ErrorCode code, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no megamoe::Error thrown (expected one mentioning '" << needle << "')";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message '" << e.what() << "' does not mention '" << needle << "'";
  }
}

// ---- E2M1 -------------------------------------------------------------------------------------

TEST(E2m1, AllSixteenCodesDecode) {
  const float want[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(e2m1_to_f32(static_cast<uint8_t>(c)), want[c]) << c;
    EXPECT_EQ(std::signbit(e2m1_to_f32(static_cast<uint8_t>(c))), c >= 8) << c;
    EXPECT_EQ(e2m1_to_f32(static_cast<uint8_t>(c | 0xF0)), want[c]) << "high bits ignored";
  }
}

TEST(E2m1, EveryGridValueEncodesToItsCode) {
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(f32_to_e2m1(e2m1_to_f32(static_cast<uint8_t>(c))), c) << c;
  }
}

TEST(E2m1, MidpointTiesGoToTheEvenCode) {
  // midpoint, the code it must give (even mantissa), and the two neighbours' codes.
  struct Tie {
    float mid;
    uint8_t even, below, above;
  };
  const Tie ties[] = {{0.25f, 0, 0, 1}, {0.75f, 2, 1, 2}, {1.25f, 2, 2, 3}, {1.75f, 4, 3, 4},
                      {2.5f, 4, 4, 5},  {3.5f, 6, 5, 6},  {5.0f, 6, 6, 7}};
  for (const Tie& t : ties) {
    for (int neg : {0, 1}) {
      const float s = neg ? -1.0f : 1.0f;
      const uint8_t sb = neg ? 0x8 : 0x0;
      EXPECT_EQ(f32_to_e2m1(s * t.mid), t.even | sb) << s * t.mid;
      EXPECT_EQ(f32_to_e2m1(s * std::nextafter(t.mid, 0.0f)), t.below | sb) << s * t.mid;
      EXPECT_EQ(f32_to_e2m1(s * std::nextafter(t.mid, 100.0f)), t.above | sb) << s * t.mid;
    }
  }
}

TEST(E2m1, SaturationSignedZeroAndNan) {
  for (float v : {6.0f, 6.5f, 100.0f, FLT_MAX, kInf}) {
    EXPECT_EQ(f32_to_e2m1(v), 0x7) << v;
    EXPECT_EQ(f32_to_e2m1(-v), 0xF) << -v;
  }
  EXPECT_EQ(f32_to_e2m1(0.0f), 0x0);
  EXPECT_EQ(f32_to_e2m1(-0.0f), 0x8);
  EXPECT_EQ(f32_to_e2m1(-1e-30f), 0x8);
  EXPECT_EQ(f32_to_e2m1(-std::numeric_limits<float>::denorm_min()), 0x8);
  EXPECT_EQ(f32_to_e2m1(0.1f), 0x0);
  EXPECT_EQ(f32_to_e2m1(kNan), 0x0);
  EXPECT_EQ(f32_to_e2m1(-kNan), 0x0);
}

TEST(E2m1, EncodeMatchesNearestSearchOnEveryBf16AndRandomFloats) {
  const testing::SeedTrace seed;
  std::vector<float> inputs;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float v = bf16_to_f32(static_cast<uint16_t>(h));
    if (!std::isnan(v)) inputs.push_back(v);
  }
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-8.0f, 8.0f);
  for (int i = 0; i < 200000; ++i) inputs.push_back(u(rng));
  for (float v : inputs) {
    const uint8_t want = static_cast<uint8_t>(e2m1_nearest_magnitude(std::fabs(v)) |
                                              (std::signbit(v) ? 0x8 : 0));
    ASSERT_EQ(f32_to_e2m1(v), want) << "x = " << v;
  }
}

TEST(Packing, ElementTwoJIsTheLowNibble) {
  EXPECT_EQ(pack_e2m1_pair(0x3, 0xA), 0xA3);
  EXPECT_EQ(pack_e2m1_pair(0xF3, 0x1A), 0xA3) << "only the low nibble of each input is used";
  const uint8_t bytes[3] = {0x21, 0x43, 0xF5};
  const uint8_t want[6] = {0x1, 0x2, 0x3, 0x4, 0x5, 0xF};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(e2m1_code_at(bytes, i), want[i]) << i;
}

// ---- E4M3 / UE4M3 -----------------------------------------------------------------------------

TEST(E4m3, All256BytesDecodeExactly) {
  for (int c = 0; c < 256; ++c) {
    const float got = e4m3_to_f32(static_cast<uint8_t>(c));
    const double want = e4m3_reference(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << hex(c);
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << hex(c);
      EXPECT_EQ(std::signbit(got), c >= 0x80) << hex(c);
    }
  }
  // Landmarks written out by hand.
  EXPECT_EQ(e4m3_to_f32(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0xFE), -448.0f);
  EXPECT_EQ(e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_f32(0x39), 1.125f);
  EXPECT_EQ(e4m3_to_f32(0x30), 0.5f);
  EXPECT_EQ(e4m3_to_f32(0x08), 0.015625f);  // 2^-6, the smallest normal
  EXPECT_EQ(e4m3_to_f32(0x07), 0.013671875f);  // 7 * 2^-9, the largest subnormal
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0xFF)));
}

TEST(E4m3, SubnormalsAreMTimesTwoToTheMinusNine) {
  for (int m = 0; m < 8; ++m) {
    EXPECT_EQ(e4m3_to_f32(static_cast<uint8_t>(m)), std::ldexp(static_cast<float>(m), -9)) << m;
    EXPECT_EQ(e4m3_to_f32(static_cast<uint8_t>(0x80 | m)), -std::ldexp(static_cast<float>(m), -9));
    EXPECT_EQ(f32_to_e4m3(std::ldexp(static_cast<float>(m), -9)), m) << m;
  }
  EXPECT_EQ(f32_to_e4m3(std::ldexp(1.0f, -10)), 0x00);  // tie between 0 and 2^-9: even (0)
  EXPECT_EQ(f32_to_e4m3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(f32_to_e4m3(3 * std::ldexp(1.0f, -10)), 0x02);  // tie between 1 and 2: even (2)
  EXPECT_EQ(f32_to_e4m3(5 * std::ldexp(1.0f, -10)), 0x02);  // tie between 2 and 3: even (2)
  EXPECT_EQ(f32_to_e4m3(15 * std::ldexp(1.0f, -10)), 0x08);  // tie between 7 and 2^-6: even
  EXPECT_EQ(f32_to_e4m3(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(f32_to_e4m3(-std::numeric_limits<float>::denorm_min()), 0x80);
  EXPECT_EQ(f32_to_e4m3(-0.0f), 0x80);
}

TEST(E4m3, EveryFiniteByteRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    EXPECT_EQ(f32_to_e4m3(e4m3_to_f32(static_cast<uint8_t>(c))), c) << hex(c);
  }
}

TEST(E4m3, TiesBetweenAdjacentCodesRoundToEven) {
  for (int c = 0; c < 0x7E; ++c) {
    const double lo = e4m3_reference(static_cast<uint8_t>(c));
    const double hi = e4m3_reference(static_cast<uint8_t>(c + 1));
    const float mid = static_cast<float>((lo + hi) / 2);  // exact in fp32
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);
    const int even = (c & 1) ? c + 1 : c;
    for (int neg : {0, 1}) {
      const float s = neg ? -1.0f : 1.0f;
      const int sb = neg ? 0x80 : 0;
      EXPECT_EQ(f32_to_e4m3(s * mid), even | sb) << "tie " << s * mid;
      EXPECT_EQ(f32_to_e4m3(s * std::nextafter(mid, 0.0f)), c | sb) << s * mid;
      EXPECT_EQ(f32_to_e4m3(s * std::nextafter(mid, 1e9f)), (c + 1) | sb) << s * mid;
    }
  }
}

TEST(E4m3, SaturatesAt448AndMapsNanTo0x7F) {
  for (float v : {448.0f, 448.5f, 460.0f, 464.0f, 465.0f, 479.0f, 480.0f, 1e6f, FLT_MAX, kInf}) {
    EXPECT_EQ(f32_to_e4m3(v), 0x7E) << v;
    EXPECT_EQ(f32_to_e4m3(-v), 0xFE) << -v;
  }
  EXPECT_EQ(f32_to_e4m3(std::nextafter(448.0f, 0.0f)), 0x7E);
  EXPECT_EQ(f32_to_e4m3(432.0f), 0x7E);  // tie between 416 (odd) and 448: even
  EXPECT_EQ(f32_to_e4m3(kNan), 0x7F);
  EXPECT_EQ(f32_to_e4m3(-kNan), 0x7F);
}

TEST(E4m3, EncodeMatchesNearestSearchOnEveryHalfAndBf16) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    for (float v : {f16_to_f32(static_cast<uint16_t>(h)), bf16_to_f32(static_cast<uint16_t>(h))}) {
      if (std::isnan(v)) continue;
      ASSERT_EQ(f32_to_e4m3(v), e4m3_nearest(v)) << "x = " << v;
    }
  }
}

TEST(Ue4m3, ValidIffFiniteAndSignClear) {
  for (int c = 0; c < 256; ++c) {
    EXPECT_EQ(ue4m3_is_valid(static_cast<uint8_t>(c)), c <= 0x7E) << hex(c);
  }
}

// ---- E5M2, UE8M0 ------------------------------------------------------------------------------

TEST(E5m2, All256BytesDecodeExactly) {
  for (int c = 0; c < 256; ++c) {
    const int s = c >> 7, e = (c >> 2) & 0x1F, m = c & 3;
    double mag;
    if (e == 31) {
      mag = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
    } else if (e == 0) {
      mag = m * std::ldexp(1.0, -16);
    } else {
      mag = (1.0 + m / 4.0) * std::ldexp(1.0, e - 15);
    }
    const double want = s ? -mag : mag;
    const float got = e5m2_to_f32(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << hex(c);
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << hex(c);
    }
  }
  EXPECT_EQ(e5m2_to_f32(0x7B), 57344.0f);
  EXPECT_EQ(e5m2_to_f32(0x01), std::ldexp(1.0f, -16));
}

TEST(Ue8m0, All256BytesDecodeToPowersOfTwo) {
  for (int c = 0; c < 255; ++c) {
    const float got = ue8m0_to_f32(static_cast<uint8_t>(c));
    EXPECT_EQ(static_cast<double>(got), std::ldexp(1.0, c - 127)) << c;
  }
  EXPECT_EQ(ue8m0_to_f32(127), 1.0f);
  EXPECT_EQ(ue8m0_to_f32(0), std::ldexp(1.0f, -127));  // an fp32 subnormal, exact
  EXPECT_EQ(ue8m0_to_f32(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(ue8m0_to_f32(0xFF)));
}

// ---- ModelOpt weight recipe -------------------------------------------------------------------

constexpr ExportDevice kCpu = ExportDevice::kCpu;
constexpr ExportDevice kGpu = ExportDevice::kGpu;

TEST(ModeloptGlobalScale, BothDivisionsByHand) {
  for (ExportDevice d : {kCpu, kGpu}) {
    EXPECT_EQ(modelopt_global_scale(0.0f, d), 0.0f);  // what the exporter writes for amax 0
    for (float bad : {-1.0f, -0.5f, kNan, kInf}) {
      expect_error([&] { modelopt_global_scale(bad, d); }, ErrorCode::kInvalidArgument, "amax");
    }
  }
  EXPECT_EQ(modelopt_global_scale(2688.0f, kCpu), 1.0f);
  EXPECT_EQ(modelopt_global_scale(5376.0f, kCpu), 2.0f);
  // fl32(1/2688) = 0x1.861862p-12 (1/2688 = 0x1.86186186...p-12 rounds down).
  EXPECT_EQ(modelopt_global_scale(1.0f, kGpu), 0x1.861862p-12f);
  EXPECT_EQ(modelopt_global_scale(1.0f, kCpu), 0x1.861862p-12f);
  EXPECT_EQ(modelopt_global_scale(2688.0f, kGpu), 1.0f);  // 2688 * fl32(1/2688) rounds back to 1
  // The correctly rounded quotient 1.03125 / 2688 is 0x1.924924p-12 (PyTorch's CPU division);
  // the product 1.03125 * fl32(1/2688) is one ulp larger (PyTorch's CUDA kernel).
  EXPECT_EQ(modelopt_global_scale(1.03125f, kCpu), 0x1.924924p-12f);
  EXPECT_EQ(modelopt_global_scale(1.03125f, kGpu), 0x1.924926p-12f);
  // The default is the GPU form, where published checkpoints come from.
  EXPECT_EQ(modelopt_global_scale(1.03125f), 0x1.924926p-12f);
  EXPECT_STREQ(export_device_name(kGpu), "gpu");
  EXPECT_STREQ(export_device_name(kCpu), "cpu");
}

// Over every positive finite bf16 value (the amax of a bf16 weight is one): the CPU form is the
// correctly rounded quotient and the GPU form the correctly rounded product with fl32(1/2688),
// both computed here in double (exact enough: double then fp32 rounding is correct for one
// operation on fp32 inputs, since 53 >= 2 * 24 + 2). The two are at most one ulp apart and do
// differ, on about a fifth of the values.
TEST(ModeloptGlobalScale, EveryBf16AmaxBothDivisions) {
  const double reciprocal = static_cast<double>(static_cast<float>(1.0 / 2688.0));
  int differ = 0, total = 0;
  for (uint32_t h = 0x0001; h < 0x7F80; ++h) {
    const float amax = bf16_to_f32(static_cast<uint16_t>(h));
    const float cpu = modelopt_global_scale(amax, kCpu);
    const float gpu = modelopt_global_scale(amax, kGpu);
    ASSERT_EQ(cpu, static_cast<float>(static_cast<double>(amax) / 2688.0)) << amax;
    ASSERT_EQ(gpu, static_cast<float>(static_cast<double>(amax) * reciprocal)) << amax;
    if (cpu == 0.0f) continue;  // underflow: both forms give 0 or the same subnormal
    ++total;
    if (cpu != gpu) {
      ++differ;
      ASSERT_EQ(std::fabs(std::nextafter(cpu, gpu) - gpu), 0.0f) << "more than one ulp: " << amax;
    }
  }
  EXPECT_GT(differ, total / 10) << differ << " of " << total;
  EXPECT_LT(differ, total / 3) << differ << " of " << total;
}

// A 2 x 32 matrix (four blocks) worked out by hand. amax = 2688, so s2 = 2688 / 2688 = 1 and
// each block's divisor is just its e4m3 scale. Codes are listed per element; bytes pack
// element 2j in the low nibble.
TEST(ModeloptWeight, HandComputedExample) {
  const std::vector<float> w = {
      // Row 0, block 0: amax 2688, ratio = 2688 / (6 * 1) = 448 -> scale 0x7E, divisor 448.
      //   x    : 2688 -2688  112   113  336  -336  560  784 1120 1568 2240  2241 0 -0 448  672
      //   x/448:    6    -6 0.25 .2522 0.75 -0.75 1.25 1.75  2.5  3.5    5 5.002 0 -0   1  1.5
      //   code :    7     F    0     1    2     A    2    4    4    6    6     7 0  0   2    3
      // (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5 -> 4.0: ties
      // to the even code; -0 has code 0x0, because ModelOpt takes the sign from x < 0.)
      2688, -2688, 112, 113, 336, -336, 560, 784, 1120, 1568, 2240, 2241, 0, -0.0f, 448, 672,
      // Row 0, block 1: amax 7, ratio = 7 / 6 = 1.1667 -> e4m3 neighbours 1.125 (0x39) and
      // 1.25 (0x3A); 1.125 is nearer: scale 0x39, divisor 1.125. x = 1.125 * q for exact q:
      //   q   : 6.22  -6.22 0.25 -0.75 1.25 1.75 2.5 3.5 5 0.5 -1.5 3 4 6 -0.0889 0.2667
      //   code:    7      F    0     A    2    4   4   6 6   1    B 5 6 7       8      1
      7, -7, 0.28125f, -0.84375f, 1.40625f, 1.96875f, 2.8125f, 3.9375f, 5.625f, 0.5625f,
      -1.6875f, 3.375f, 4.5f, 6.75f, -0.1f, 0.3f,
      // Row 1, block 0: all zero -> ratio 0 -> scale 1.0 (0x38); every code 0 (also for -0).
      0, 0, 0, 0, -0.0f, 0, 0, 0, 0, 0, 0, 0, 0, 0, -0.0f, 0,
      // Row 1, block 1: amax 2^-9 * 1.25 = 0.00244; ratio = 0.00244 / 6 = 4.07e-4 < 2^-9, so the
      // clamp gives 2^-9 (0x01, a subnormal scale), divisor 2^-9: q = x * 512.
      //   x   : 1e-3 -1e-3 2^-11 5e-4 3*2^-11 -2.5e-4 0 7.5e-4 2^-10 -1.2e-3 6e-4 1.1e-4
      //   q   : .512 -.512  0.25 .256    0.75   -.128 0   .384   0.5  -.6144 .3072 .0563
      //   code:    1     9     0    1       2       8 0      1     1       9     1     0
      //   x   : -1.3e-4 1.25*2^-10 1.25*2^-9 -1e-5
      //   q   :  -.0666      0.625      1.25 -.00512
      //   code:       8          1         2       8
      1e-3f, -1e-3f, 0.00048828125f, 5e-4f, 0.00146484375f, -2.5e-4f, 0, 7.5e-4f,
      0.0009765625f, -1.2e-3f, 6e-4f, 1.1e-4f, -1.3e-4f, 0.001220703125f, 0.00244140625f,
      -1e-5f};
  const std::vector<uint8_t> want_codes = {
      0xF7, 0x10, 0xA2, 0x42, 0x64, 0x76, 0x00, 0x32,   // row 0 block 0
      0xF7, 0xA0, 0x42, 0x64, 0x16, 0x5B, 0x76, 0x18,   // row 0 block 1
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,   // row 1 block 0
      0x91, 0x10, 0x82, 0x10, 0x91, 0x01, 0x18, 0x82};  // row 1 block 1
  const std::vector<uint8_t> want_scales = {0x7E, 0x39, 0x38, 0x01};

  // amax 2688: s2 = 1 exactly (both forms; the cases below were worked out with the division).
  std::vector<uint8_t> codes(32), scales(4);
  const float s2 = quantize_weight_modelopt(w, 2, 32, codes, scales, kCpu);
  EXPECT_EQ(s2, 1.0f);
  EXPECT_EQ(scales, want_scales);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(codes[i], want_codes[i]) << "byte " << i;

  // The same bytes through the given-global-scale entry point.
  std::vector<uint8_t> codes2(32), scales2(4);
  quantize_weight_with_global_scale(w, 2, 32, 1.0f, codes2, scales2);
  EXPECT_EQ(codes2, codes);
  EXPECT_EQ(scales2, scales);
}

// With a caller-given global scale: the block ratio amax / (6 * s2), its clamp at 448 and the
// divisor b * s2, by hand.
TEST(ModeloptWeight, GivenGlobalScaleByHand) {
  std::vector<float> w(32, 0.0f);
  // Block 0: s2 = 0.5, amax 1.5 -> ratio 1.5 / 3 = 0.5 (0x30), divisor 0.25; 1.5 / 0.25 = 6
  // (code 7); 0.375 / 0.25 = 1.5 (code 3); -0.125 / 0.25 = -0.5 (code 9).
  w[0] = 1.5f;
  w[1] = 0.375f;
  w[2] = -0.125f;
  // Block 1: amax 1000 -> ratio 1000 / 3 = 333.33 -> e4m3 neighbours 320 (0x7A) and 352 (0x7B):
  // 320 is nearer; divisor 160: 1000 / 160 = 6.25 saturates (code 7), -480 / 160 = -3 (code D).
  w[16] = 1000.0f;
  w[17] = -480.0f;
  std::vector<uint8_t> codes(16), scales(2);
  quantize_weight_with_global_scale(w, 1, 32, 0.5f, codes, scales);
  EXPECT_EQ(scales[0], 0x30);
  EXPECT_EQ(scales[1], 0x7A);
  EXPECT_EQ(codes[0], 0x37);
  EXPECT_EQ(codes[1], 0x09);
  EXPECT_EQ(codes[8], 0xD7);
  for (int i : {2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15}) EXPECT_EQ(codes[i], 0x00) << i;

  // A global scale so small that the ratio exceeds 448: the scale clamps to 448 (0x7E).
  // s2 = 2^-10: ratio = 6 / (6 * 2^-10) = 1024 -> 448; divisor 448 * 2^-10 = 0.4375; 6 / 0.4375
  // = 13.7 saturates to code 7; 0.4375 -> 1.0 (code 2).
  std::vector<float> w2(16, 0.0f);
  w2[0] = 6.0f;
  w2[1] = 0.4375f;
  std::vector<uint8_t> codes2(8), scales2(1);
  quantize_weight_with_global_scale(w2, 1, 16, std::ldexp(1.0f, -10), codes2, scales2);
  EXPECT_EQ(scales2[0], 0x7E);
  EXPECT_EQ(codes2[0], 0x27);
}

// The recipe's fp32 evaluation order matters at ties. Each case below is a 1 x 32 matrix: block 0
// holds the tensor amax (so s2 = fl32(amax / 2688)), block 1 holds y (its block amax) and maybe
// x. The numbers were chosen so that ModelOpt's order lands exactly on an e4m3 or e2m1 tie while
// a plausible re-ordering lands one ulp beside it and gives a different byte.
TEST(ModeloptWeight, Fp32EvaluationOrderIsModelOpts) {
  struct ScaleCase {
    float amax, y;
    uint8_t scale;  // of block 1
  };
  const ScaleCase scale_cases[] = {
      // ratio = fl32(y / fl32(6 * s2)) = 2.625 exactly: the tie between 2.5 (0x42) and 2.75
      // (0x43) goes to the even 0x42. y * fl32(1 / (6 * s2)) is 2.6250002 and would give 0x43.
      {0x1.4cp-2f, 0x1.f2p-10f, 0x42},
      // ratio = 0.0068359375 = 3.5 * 2^-9 exactly: the subnormal tie between 0x03 and 0x04 goes
      // to 0x04. fl32(fl32(y / 6) / s2) falls just below and would give 0x03.
      {0x1.d8p+2f, 0x1.d8p-14f, 0x04},
      // ratio = 0.32812503, one ulp above the tie 0.328125 between 0.3125 (0x2A) and 0.34375
      // (0x2B): 0x2B. (y / 6) / s2, y * 448 / amax and y * (1 / (6 * s2)) all give 0x2A.
      {0x1.fp+3f, 0x1.74p-7f, 0x2B},
  };
  for (const ScaleCase& c : scale_cases) {
    std::vector<float> w(32, 0.0f);
    w[0] = c.amax;
    w[16] = c.y;
    std::vector<uint8_t> codes(16), scales(2);
    quantize_weight_modelopt(w, 1, 32, codes, scales, kCpu);  // s2 by the exact division
    EXPECT_EQ(scales[0], 0x7E);
    EXPECT_EQ(scales[1], c.scale) << "amax " << c.amax << " y " << c.y;
  }

  struct CodeCase {
    float amax, y, x;
    uint8_t scale, byte8, byte9;  // block 1's scale; its elements (y, x) and (-x, 0)
  };
  const CodeCase code_cases[] = {
      // s2 = fl32(0.61328125 / 2688); ratio 1.4379 -> b = 1.5 (0x3C); divisor d = fl32(1.5 * s2).
      // y / d = 5.75 -> 6 (code 7); x / d = 3.5 exactly, a tie -> 4 (code 6); -x -> code E.
      // fl32(fl32(x / 1.5) / s2) = 3.4999998 would give 3 (code 5).
      {0x1.3ap-1f, 0x1.02p-9f, 0x1.3ap-10f, 0x3C, 0x67, 0x0E},
      // s2 = fl32(15.625 / 2688); ratio 0.4235 -> b = 0.4375 (0x2E); y / d = 5.81 -> code 7;
      // x / d = 0.75 exactly, a tie -> 1 (code 2); -x -> code A. x * fl32(1 / d) = 0.74999994
      // would give 0.5 (code 1).
      {0x1.f4p+3f, 0x1.e4p-7f, 0x1.f4p-10f, 0x2E, 0x27, 0x0A},
  };
  for (const CodeCase& c : code_cases) {
    std::vector<float> w(32, 0.0f);
    w[0] = c.amax;
    w[16] = c.y;
    w[17] = c.x;
    w[18] = -c.x;
    std::vector<uint8_t> codes(16), scales(2);
    quantize_weight_modelopt(w, 1, 32, codes, scales, kCpu);  // s2 by the exact division
    EXPECT_EQ(scales[1], c.scale) << "amax " << c.amax;
    EXPECT_EQ(codes[8], c.byte8) << "amax " << c.amax;
    EXPECT_EQ(codes[9], c.byte9) << "amax " << c.amax;
  }
}

struct RandomWeights {
  std::vector<float> w;
  int64_t rows, cols;
};

// Random weights whose magnitude varies per row (2^-8..2^4) and per block (2^-24..1 relative,
// log-uniform), with all-zero blocks, blocks far below the tensor amax (whose block scale
// clamps to 2^-9 or is an e4m3 subnormal), isolated outliers, negative zeros and exact ties.
RandomWeights make_random_weights(std::mt19937& rng, int64_t rows, int64_t cols, bool as_bf16) {
  RandomWeights r{std::vector<float>(rows * cols), rows, cols};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  for (int64_t i = 0; i < rows; ++i) {
    const float row_scale = std::exp2(-8.0f + 12.0f * uni(rng));
    for (int64_t b = 0; b < cols / 16; ++b) {
      const float kind = uni(rng);
      float block_scale = row_scale * std::exp2(-24.0f * uni(rng));
      if (kind < 0.05f) block_scale = 0.0f;                 // an all-zero block
      else if (kind < 0.15f) block_scale *= 1e-6f;          // far below amax: clamped scale
      for (int k = 0; k < 16; ++k) {
        float v = block_scale * normal(rng);
        if (uni(rng) < 0.01f) v *= 40.0f;                   // an outlier
        if (uni(rng) < 0.01f) v = -0.0f;
        if (as_bf16) v = round_to_bf16(v);
        r.w[i * cols + b * 16 + k] = v;
      }
    }
  }
  // A one-block matrix draws its only block all-zero 5% of the time; the all-zero tensor has its
  // own test (the exporter's zero signature), so keep every random matrix nonzero.
  if (std::all_of(r.w.begin(), r.w.end(), [](float v) { return v == 0.0f; })) r.w[0] = 0.75f;
  return r;
}

// Checks the recipe's defining properties on (w, codes, scales, s2), independently of the
// implementation: block scales are the nearest e4m3 (ties even) of the clamped fp32 ratio, and
// every code is the nearest E2M1 grid point (ties even) of x / fl32(b * s2), signed by x < 0.
void check_recipe_properties(const RandomWeights& r, float s2, const std::vector<uint8_t>& codes,
                             const std::vector<uint8_t>& scales, int* clamped_low,
                             int* subnormal_scales, int* zero_blocks) {
  const int64_t blocks = r.cols / 16;
  for (int64_t i = 0; i < r.rows; ++i) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* x = &r.w[i * r.cols + b * 16];
      float amax_block = 0.0f;
      for (int k = 0; k < 16; ++k) amax_block = std::max(amax_block, std::fabs(x[k]));
      const float six_s2 = 6.0f * s2;   // fp32, as ModelOpt
      float ratio = amax_block / six_s2;  // fp32
      if (ratio == 0.0f) {
        ratio = 1.0f;
        ++*zero_blocks;
      }
      if (ratio < std::ldexp(1.0f, -9)) ++*clamped_low;
      const double clamped = std::clamp<double>(ratio, std::ldexp(1.0, -9), 448.0);
      const uint8_t want_scale = e4m3_nearest(clamped);
      const uint8_t scale = scales[i * blocks + b];
      ASSERT_EQ(scale, want_scale) << "row " << i << " block " << b << " ratio " << ratio;
      if (scale < 0x08) ++*subnormal_scales;
      const float divisor = static_cast<float>(e4m3_reference(scale)) * s2;  // fp32 product
      for (int k = 0; k < 16; ++k) {
        const float q = x[k] / divisor;  // fp32 division
        const uint8_t want = static_cast<uint8_t>(e2m1_nearest_magnitude(std::fabs(q)) |
                                                  (q < 0.0f ? 0x8 : 0x0));
        const int64_t idx = i * r.cols + b * 16 + k;
        ASSERT_EQ(e2m1_code_at(codes.data(), idx), want)
            << "row " << i << " col " << b * 16 + k << " x " << x[k] << " q " << q;
      }
    }
  }
}

TEST(ModeloptWeight, RandomMatricesSatisfyTheRecipe) {
  const testing::SeedTrace seed;
  std::mt19937 rng(seed);
  int clamped_low = 0, subnormal_scales = 0, zero_blocks = 0;
  const int64_t shapes[][2] = {{64, 256}, {7, 48}, {1, 16}, {33, 1024}};
  for (const auto& shape : shapes) {
    for (bool as_bf16 : {true, false}) {
      const RandomWeights r = make_random_weights(rng, shape[0], shape[1], as_bf16);
      std::vector<uint8_t> codes(r.w.size() / 2), scales(r.w.size() / 16);
      const ExportDevice device = as_bf16 ? kGpu : kCpu;
      const float s2 = quantize_weight_modelopt(r.w, r.rows, r.cols, codes, scales, device);
      float amax = 0.0f;
      for (float v : r.w) amax = std::max(amax, std::fabs(v));
      ASSERT_GT(amax, 0.0f);
      ASSERT_EQ(s2, device == kCpu ? amax / 2688.0f : amax * (1.0f / 2688.0f));
      check_recipe_properties(r, s2, codes, scales, &clamped_low, &subnormal_scales,
                              &zero_blocks);
      if (HasFatalFailure()) return;

      // Dequantize gives e2m1 * ue4m3 * s2 with one rounding.
      std::vector<float> out(r.w.size());
      dequantize(Nvfp4View{r.rows, r.cols, codes.data(), scales.data(), s2}, out);
      for (size_t idx = 0; idx < out.size(); ++idx) {
        const double exact = static_cast<double>(e2m1_to_f32(e2m1_code_at(codes.data(), idx))) *
                             e4m3_reference(scales[idx / 16]) * s2;
        ASSERT_EQ(out[idx], static_cast<float>(exact)) << idx;
      }
    }
  }
  // The data must have exercised the corner cases, or the test proves less than it claims.
  EXPECT_GT(clamped_low, 0);
  EXPECT_GT(subnormal_scales, 0);
  EXPECT_GT(zero_blocks, 0);
}

TEST(ModeloptWeight, GivenGlobalScaleMatchesTheRecipeOnRandomData) {
  const testing::SeedTrace seed;
  std::mt19937 rng(seed);
  int clamped_low = 0, subnormal_scales = 0, zero_blocks = 0;
  const RandomWeights r = make_random_weights(rng, 16, 512, true);
  // A global scale smaller than amax / 2688, so some ratios exceed 448 and clamp.
  float amax = 0.0f;
  for (float v : r.w) amax = std::max(amax, std::fabs(v));
  const float gs = amax / 2688.0f / 4.0f;
  std::vector<uint8_t> codes(r.w.size() / 2), scales(r.w.size() / 16);
  quantize_weight_with_global_scale(r.w, r.rows, r.cols, gs, codes, scales);
  check_recipe_properties(r, gs, codes, scales, &clamped_low, &subnormal_scales, &zero_blocks);
  EXPECT_NE(std::find(scales.begin(), scales.end(), 0x7E), scales.end());
}

// amax 0: s2 = 0, every block ratio 0/0 = NaN (scale 0x7F from a GPU, whose default NaN is
// positive, 0xFF from an x86 CPU), every quotient NaN (code 7 in each nibble): the bytes ModelOpt's
// exporter writes.
TEST(ModeloptWeight, AllZeroTensorGetsTheExportersZeroSignature) {
  for (ExportDevice d : {kCpu, kGpu}) {
    SCOPED_TRACE(export_device_name(d));
    std::vector<float> w(2 * 32, 0.0f);
    w[5] = -0.0f;
    std::vector<uint8_t> codes(32, 0xAA), scales(4, 0xAA);
    EXPECT_EQ(quantize_weight_modelopt(w, 2, 32, codes, scales, d), 0.0f);
    for (uint8_t s : scales) EXPECT_EQ(s, d == kCpu ? 0xFF : 0x7F);
    for (uint8_t c : codes) EXPECT_EQ(c, 0x77);
    EXPECT_TRUE(is_modelopt_zero_weight({2, 32, codes.data(), scales.data(), 0.0f}));
    // The same through the given-global-scale entry point, and back to zeros.
    std::vector<uint8_t> codes2(32), scales2(4);
    quantize_weight_with_global_scale(w, 2, 32, 0.0f, codes2, scales2, d);
    EXPECT_EQ(codes2, codes);
    EXPECT_EQ(scales2, scales);
    std::vector<float> back(64, 1.0f);
    dequantize({2, 32, codes.data(), scales.data(), 0.0f}, back);
    for (float v : back) EXPECT_EQ(v, 0.0f);
    std::vector<uint16_t> back16(64, 0x3F80);
    dequantize_to_bf16({2, 32, codes.data(), scales.data(), 0.0f}, back16);
    for (uint16_t v : back16) EXPECT_EQ(v, 0x0000);
  }
  // An empty matrix is valid and writes nothing.
  EXPECT_EQ(quantize_weight_modelopt({}, 0, 16, {}, {}), 0.0f);
  // A zero global scale stands for amax 0 only.
  std::vector<float> w(16, 0.0f);
  w[3] = 0.5f;
  std::vector<uint8_t> codes(8), scales(1);
  expect_error([&] { quantize_weight_with_global_scale(w, 1, 16, 0.0f, codes, scales); },
               ErrorCode::kInvalidArgument, "all-zero");
}

// Only the exact signature is the zero weight: any other byte, or a non-zero global scale, and
// the NaN scales are invalid again.
TEST(ModeloptWeight, ZeroSignatureIsExact) {
  std::vector<uint8_t> codes(16, 0x77), scales = {0xFF, 0x7F};  // either NaN
  const Nvfp4View sig{2, 16, codes.data(), scales.data(), 0.0f};
  EXPECT_TRUE(is_modelopt_zero_weight(sig));
  EXPECT_TRUE(is_modelopt_zero_weight({2, 16, codes.data(), scales.data(), -0.0f}));
  EXPECT_FALSE(is_modelopt_zero_weight({2, 16, codes.data(), scales.data(), 1e-30f}));
  EXPECT_FALSE(is_modelopt_zero_weight({2, 16, codes.data(), scales.data(), kNan}));
  EXPECT_FALSE(is_modelopt_zero_weight({0, 16, codes.data(), scales.data(), 0.0f}));
  EXPECT_FALSE(is_modelopt_zero_weight({2, 16, nullptr, scales.data(), 0.0f}));
  std::vector<float> out(32);
  for (size_t i = 0; i < codes.size(); ++i) {
    for (uint8_t other : {0x00, 0x76, 0xF7, 0x7F}) {
      codes[i] = other;
      EXPECT_FALSE(is_modelopt_zero_weight(sig)) << "code byte " << i << " = " << hex(other);
      expect_error([&] { dequantize(sig, out); }, ErrorCode::kInvalidArgument, "global_scale");
    }
    codes[i] = 0x77;
  }
  for (size_t i = 0; i < scales.size(); ++i) {
    const uint8_t was = scales[i];
    for (uint8_t other : {0x00, 0x38, 0xFE, 0x7E, 0x80}) {
      scales[i] = other;
      EXPECT_FALSE(is_modelopt_zero_weight(sig)) << "scale byte " << i << " = " << hex(other);
    }
    scales[i] = was;
  }
  // NaN scales with a real global scale: rejected, naming the block.
  expect_error([&] { dequantize({2, 16, codes.data(), scales.data(), 1.0f}, out); },
               ErrorCode::kInvalidArgument, "row 0, block 0");

  // The in-place rewrite: only the exact signature changes, to zeros with global scale 1.
  float g = 0.0f;
  ASSERT_TRUE(is_modelopt_zero_weight(sig));
  EXPECT_TRUE(zero_weight_to_decodable(codes.data(), scales.data(), g, 2, 16));
  EXPECT_EQ(codes, std::vector<uint8_t>(16, 0x00));
  EXPECT_EQ(scales, std::vector<uint8_t>(2, 0x00));
  EXPECT_EQ(g, 1.0f);
  std::vector<uint8_t> near_codes(16, 0x77), near_scales(2, 0xFF);
  near_codes[15] = 0x07;
  g = 0.0f;
  EXPECT_FALSE(zero_weight_to_decodable(near_codes.data(), near_scales.data(), g, 2, 16));
  EXPECT_EQ(near_scales, std::vector<uint8_t>(2, 0xFF));
  EXPECT_EQ(near_codes[0], 0x77);
  EXPECT_EQ(g, 0.0f);
}

TEST(ModeloptWeight, RejectsNonFiniteWeightsNamingTheElement) {
  std::vector<uint8_t> codes(16, 0xAA), scales(2, 0xAA);
  for (float bad : {kNan, kInf, -kInf}) {
    std::vector<float> w(32, 1.0f);
    w[16 + 5] = bad;  // row 1, column 5
    expect_error([&] { quantize_weight_modelopt(w, 2, 16, codes, scales); },
                 ErrorCode::kInvalidArgument, "[1, 5]");
    expect_error([&] { quantize_weight_with_global_scale(w, 2, 16, 1.0f, codes, scales); },
                 ErrorCode::kInvalidArgument, "[1, 5]");
  }
  // Nothing was written.
  for (uint8_t c : codes) EXPECT_EQ(c, 0xAA);
  for (uint8_t s : scales) EXPECT_EQ(s, 0xAA);
}

TEST(ModeloptWeight, RejectsBadShapesAndSizes) {
  std::vector<float> w(64, 1.0f);
  std::vector<uint8_t> codes(32), scales(4);
  const auto q = [&](int64_t rows, int64_t cols, size_t nw, size_t nc, size_t ns) {
    quantize_weight_modelopt(std::span<const float>(w.data(), nw), rows, cols,
                             std::span<uint8_t>(codes.data(), nc),
                             std::span<uint8_t>(scales.data(), ns));
  };
  expect_error([&] { q(2, 24, 48, 24, 3); }, ErrorCode::kInvalidArgument, "multiple of 16");
  expect_error([&] { q(-1, 32, 64, 32, 4); }, ErrorCode::kInvalidArgument, "negative");
  expect_error([&] { q(2, -32, 64, 32, 4); }, ErrorCode::kInvalidArgument, "negative");
  expect_error([&] { q(2, 32, 63, 32, 4); }, ErrorCode::kInvalidArgument, "`w`");
  expect_error([&] { q(2, 32, 64, 31, 4); }, ErrorCode::kInvalidArgument, "`codes`");
  expect_error([&] { q(2, 32, 64, 32, 3); }, ErrorCode::kInvalidArgument, "`scales`");
  expect_error([&] { q(std::numeric_limits<int64_t>::max() / 16, 32, 64, 32, 4); },
               ErrorCode::kInvalidArgument, "int64");
  for (float bad : {0.0f, -1.0f, kNan, kInf}) {
    expect_error([&] { quantize_weight_with_global_scale(w, 2, 32, bad, codes, scales); },
                 ErrorCode::kInvalidArgument, "global_scale");
  }
}

// ---- Dequantize -------------------------------------------------------------------------------

TEST(Dequantize, HandComputedValues) {
  // Row 0: scale 0x39 (1.125), codes 7, F, 1, 8 ...; row 1: subnormal scale 0x03 (3 * 2^-9).
  std::vector<uint8_t> codes(16, 0x00), scales = {0x39, 0x03};
  codes[0] = 0xF7;  // elements 0, 1: +6, -6
  codes[1] = 0x81;  // elements 2, 3: +0.5, -0
  codes[8] = 0x2C;  // row 1 elements 0, 1: -2, +1
  std::vector<float> out(32);
  dequantize(Nvfp4View{2, 16, codes.data(), scales.data(), 0.5f}, out);
  EXPECT_EQ(out[0], 6 * 1.125f * 0.5f);
  EXPECT_EQ(out[1], -6 * 1.125f * 0.5f);
  EXPECT_EQ(out[2], 0.5f * 1.125f * 0.5f);
  EXPECT_EQ(out[3], 0.0f);
  EXPECT_TRUE(std::signbit(out[3]));
  EXPECT_EQ(out[16], -2 * 3 * std::ldexp(1.0f, -9) * 0.5f);
  EXPECT_EQ(out[17], 1 * 3 * std::ldexp(1.0f, -9) * 0.5f);
  for (int i : {4, 15, 18, 31}) EXPECT_EQ(out[i], 0.0f) << i;
}

TEST(Dequantize, RejectsInvalidScalesAndArguments) {
  std::vector<uint8_t> codes(16, 0x11), scales = {0x38, 0x38};
  std::vector<float> out(32);
  for (uint8_t bad : {0x7F, 0xFF, 0x80, 0xB8}) {
    scales[1] = bad;
    expect_error([&] { dequantize(Nvfp4View{2, 16, codes.data(), scales.data(), 1.0f}, out); },
                 ErrorCode::kInvalidArgument, "row 1, block 0");
  }
  scales[1] = 0x38;
  for (float bad : {0.0f, -1.0f, kNan, kInf}) {
    expect_error([&] { dequantize(Nvfp4View{2, 16, codes.data(), scales.data(), bad}, out); },
                 ErrorCode::kInvalidArgument, "global_scale");
  }
  expect_error([&] { dequantize(Nvfp4View{2, 16, nullptr, scales.data(), 1.0f}, out); },
               ErrorCode::kInvalidArgument, "null");
  expect_error([&] { dequantize(Nvfp4View{2, 16, codes.data(), nullptr, 1.0f}, out); },
               ErrorCode::kInvalidArgument, "null");
  expect_error([&] { dequantize(Nvfp4View{2, 8, codes.data(), scales.data(), 1.0f}, out); },
               ErrorCode::kInvalidArgument, "multiple of 16");
  expect_error(
      [&] {
        dequantize(Nvfp4View{2, 16, codes.data(), scales.data(), 1.0f},
                   std::span<float>(out.data(), 31));
      },
      ErrorCode::kInvalidArgument, "`out`");
}

// dequantize_to_bf16 against the correctly rounded value of the exact product, computed by the
// reference's double-to-bf16 rounding: every code with every valid scale byte, over global scales
// that put products in the normal and subnormal bf16 ranges and past its largest value. The set
// holds cases where rounding the fp32 product again lands one ulp off, so a double rounding
// would fail here.
TEST(Dequantize, ToBf16RoundsOnceFromTheExactProduct) {
  const testing::SeedTrace seed;
  std::mt19937 rng(seed);
  std::vector<float> globals = {1.0f, 0x1.924926p-12f, 0x1.000102p0f, 0x1.7fffffp-3f,
                                std::ldexp(1.0f, -130), std::ldexp(0x1.555556p0f, -140),
                                FLT_MAX / 2048.0f, FLT_MAX};
  std::uniform_int_distribution<uint32_t> mantissa(0, (1u << 23) - 1);
  std::uniform_int_distribution<int> exponent(-140, 100);
  for (int i = 0; i < 200; ++i) {
    globals.push_back(std::ldexp(1.0f + std::ldexp(static_cast<float>(mantissa(rng)), -23),
                                 exponent(rng)));
  }
  // Random s2 hit a bf16 midpoint with the fp32 product too rarely (the products m have only 16
  // distinct mantissas), so aim at them: s2 near M / m for a midpoint M and an odd mantissa m
  // (e2m1 1.5 times a ue4m3 mantissa), and its fp32 neighbours.
  std::uniform_int_distribution<int> bf16_mantissa(0, 127), scale_mantissa(0, 7);
  for (int i = 0; i < 200; ++i) {
    const double midpoint = 1.0 + (bf16_mantissa(rng) + 0.5) / 128.0;
    const double m = 1.5 * (1.0 + scale_mantissa(rng) / 8.0);
    const float s2 = std::ldexp(static_cast<float>(midpoint / m), exponent(rng));
    globals.push_back(s2);
    globals.push_back(std::nextafter(s2, 0.0f));
    globals.push_back(std::nextafter(s2, FLT_MAX));
  }
  // A [256, 32] matrix whose row r holds code byte r (so every pair of codes) in every position;
  // its block scales cycle through the 254 valid bytes, shifted by one on each pass.
  const int64_t rows = 256, cols = 32;
  std::vector<uint8_t> codes(rows * cols / 2), scales(rows * cols / 16);
  std::vector<uint8_t> valid;
  for (int b = 0; b < 256; ++b) {
    if (ue4m3_is_valid(static_cast<uint8_t>(b))) valid.push_back(static_cast<uint8_t>(b));
  }
  for (int64_t r = 0; r < rows; ++r) {
    std::fill(codes.begin() + r * cols / 2, codes.begin() + (r + 1) * cols / 2,
              static_cast<uint8_t>(r));
  }
  std::vector<uint16_t> out(rows * cols);
  int64_t double_rounding_cases = 0, checked = 0;
  for (size_t pass = 0; pass < globals.size(); ++pass) {
    const size_t offset = pass % valid.size();
    for (size_t i = 0; i < scales.size(); ++i) scales[i] = valid[(i + offset) % valid.size()];
    const float s2 = globals[pass];
    dequantize_to_bf16({rows, cols, codes.data(), scales.data(), s2}, out);
    for (int64_t idx = 0; idx < rows * cols; ++idx) {
      const double m = static_cast<double>(e2m1_to_f32(e2m1_code_at(codes.data(), idx))) *
                       e4m3_reference(scales[idx / 16]);
      const uint16_t want = reference::f64_to_bf16(m * static_cast<double>(s2));
      ASSERT_EQ(out[idx], want) << "element " << idx << ", m " << m << ", s2 " << s2;
      double_rounding_cases +=
          f32_to_bf16(static_cast<float>(m) * s2) != want;  // what a double rounding gives
      ++checked;
    }
  }
  EXPECT_GT(double_rounding_cases, 0) << "the data has no case a double rounding gets wrong, so "
                                         "the test could not tell the two apart (" << checked
                                      << " elements)";
  // Its fp32 counterpart: one rounding to fp32 of the same product.
  std::vector<float> out32(rows * cols);
  dequantize({rows, cols, codes.data(), scales.data(), globals[3]}, out32);
  for (int64_t idx = 0; idx < rows * cols; ++idx) {
    const double m = static_cast<double>(e2m1_to_f32(e2m1_code_at(codes.data(), idx))) *
                     e4m3_reference(scales[idx / 16]);
    ASSERT_EQ(out32[idx], static_cast<float>(m * static_cast<double>(globals[3]))) << idx;
  }
}

// ---- Activation recipe ------------------------------------------------------------------------

TEST(Activation, HandComputedBlocks) {
  // Block 0, gs = 1: amax 6 -> sf = e4m3(1 * 6 / 6) = 1 (0x38); x * gs / sf = x:
  //   6 -> 7, -3 -> D, 1.25 -> 2 (tie to even), 0.3 -> 1, -0 -> 8, 5 -> 6 (tie), rest 0.
  // Block 1, gs = 1: amax 0.009 -> sf = e4m3(0.0015) = 2^-9 (0x01, the nearest code);
  //   0.009 / 2^-9 = 4.608 -> 6 (4.0); -0.0005 / 2^-9 = -0.256 -> 9.
  // Block 2, gs = 1: amax 1e-4 -> 1e-4 / 6 is below half of 2^-9: sf = 0, every code 0.
  std::vector<float> x(48, 0.0f);
  x[0] = 6;
  x[1] = -3;
  x[2] = 1.25f;
  x[3] = 0.3f;
  x[4] = -0.0f;
  x[5] = 5;
  x[16] = 0.009f;
  x[17] = -0.0005f;
  x[32] = 1e-4f;
  x[33] = -1e-4f;
  std::vector<uint8_t> codes(24), scales(3);
  quantize_activation(x, 1, 48, 1.0f, codes, scales);
  EXPECT_EQ(scales[0], 0x38);
  EXPECT_EQ(scales[1], 0x01);
  EXPECT_EQ(scales[2], 0x00);
  EXPECT_EQ(codes[0], 0xD7);
  EXPECT_EQ(codes[1], 0x12);
  EXPECT_EQ(codes[2], 0x68);
  EXPECT_EQ(codes[8], 0x96);
  EXPECT_EQ(codes[16], 0x00);

  std::vector<float> back(48);
  dequantize_activation(codes, scales, 1, 48, 1.0f, back);
  EXPECT_EQ(back[0], 6.0f);
  EXPECT_EQ(back[1], -3.0f);
  EXPECT_EQ(back[2], 1.0f);
  EXPECT_EQ(back[3], 0.5f);
  EXPECT_EQ(back[5], 4.0f);
  EXPECT_EQ(back[16], 4 * std::ldexp(1.0f, -9));
  EXPECT_EQ(back[17], -0.5f * std::ldexp(1.0f, -9));
  EXPECT_EQ(back[32], 0.0f);

  // gs scales both ways: gs = 4, amax 3 -> sf = e4m3(4 * 3 / 6) = 2 (0x40); 3 * 4 / 2 = 6.
  std::vector<float> y(16, 0.0f);
  y[0] = 3.0f;
  y[1] = -0.75f;  // -0.75 * 4 / 2 = -1.5 -> B
  std::vector<uint8_t> c2(8), s2(1);
  quantize_activation(y, 1, 16, 4.0f, c2, s2);
  EXPECT_EQ(s2[0], 0x40);
  EXPECT_EQ(c2[0], 0xB7);
  std::vector<float> yb(16);
  dequantize_activation(c2, s2, 1, 16, 4.0f, yb);
  EXPECT_EQ(yb[0], 3.0f);
  EXPECT_EQ(yb[1], -0.75f);
}

// The activation recipe's fp32 order, at ties: sf = e4m3(fl32(fl32(gs * amax) / 6)) and
// q = fl32(fl32(x * gs) / sf). Re-ordered products land one ulp beside the tie.
TEST(Activation, Fp32EvaluationOrder) {
  {
    // gs * y = 31.500002 (rounded), / 6 = 5.2500005: just above the tie 5.25 between 5 (0x4A)
    // and 5.5 (0x4B), so 0x4B. gs * (y / 6) and y * (gs / 6) both give exactly 5.25 -> 0x4A.
    // Then y * gs / 5.5 = 5.73 -> 6 (code 7); -y -> code F.
    const float gs = 0x1.4ad4aep+11f;
    std::vector<float> x(16, 0.0f);
    x[0] = 0x1.86p-7f;
    x[1] = -0x1.86p-7f;
    std::vector<uint8_t> codes(8), scales(1);
    quantize_activation(x, 1, 16, gs, codes, scales);
    EXPECT_EQ(scales[0], 0x4B);
    EXPECT_EQ(codes[0], 0xF7);
  }
  {
    // Block amax y: ratio 10.42 -> sf = 10 (0x52). x * gs = 35 (rounded), / 10 = 3.5 exactly:
    // the tie goes to 4 (code 6); -x -> code E. x * (gs / sf) = 3.4999998 would give 3 (code 5).
    // y * gs / 10 = 6.25 -> 6 (code 7).
    const float gs = 0x1.4d6536p+14f;
    std::vector<float> x(16, 0.0f);
    x[0] = 0x1.8p-9f;
    x[1] = 0x1.adfffep-10f;
    x[2] = -0x1.adfffep-10f;
    std::vector<uint8_t> codes(8), scales(1);
    quantize_activation(x, 1, 16, gs, codes, scales);
    EXPECT_EQ(scales[0], 0x52);
    EXPECT_EQ(codes[0], 0x67);
    EXPECT_EQ(codes[1], 0x0E);
  }
}

TEST(Activation, RandomRoundTrip) {
  const testing::SeedTrace seed;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  const int64_t rows = 24, cols = 320;
  std::vector<float> x(rows * cols);
  for (int64_t i = 0; i < rows; ++i) {
    const float row_scale = std::exp2(-6.0f + 10.0f * uni(rng));
    for (int64_t b = 0; b < cols / 16; ++b) {
      const float block_scale = row_scale * std::exp2(-4.0f * uni(rng));
      for (int k = 0; k < 16; ++k) x[i * cols + b * 16 + k] = block_scale * normal(rng);
    }
  }
  float amax = 0.0f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  const float gs = 2688.0f / amax;
  std::vector<uint8_t> codes(x.size() / 2), scales(x.size() / 16);
  quantize_activation(x, rows, cols, gs, codes, scales);
  std::vector<float> back(x.size());
  dequantize_activation(codes, scales, rows, cols, gs, back);
  for (int64_t blk = 0; blk < rows * cols / 16; ++blk) {
    float amax_block = 0.0f;
    for (int k = 0; k < 16; ++k) amax_block = std::max(amax_block, std::fabs(x[blk * 16 + k]));
    const float ratio = (gs * amax_block) / 6.0f;  // fp32, left to right
    ASSERT_EQ(scales[blk], e4m3_nearest(std::min<double>(ratio, 448.0))) << "block " << blk;
    const float sf = static_cast<float>(e4m3_reference(scales[blk]));
    for (int k = 0; k < 16; ++k) {
      const int64_t idx = blk * 16 + k;
      const float q = (x[idx] * gs) / sf;
      const uint8_t want = static_cast<uint8_t>(e2m1_nearest_magnitude(std::fabs(q)) |
                                                (std::signbit(q) ? 0x8 : 0x0));
      ASSERT_EQ(e2m1_code_at(codes.data(), idx), want) << "element " << idx;
      ASSERT_EQ(back[idx], (e2m1_to_f32(want) * sf) / gs) << "element " << idx;
      // sf is within 1/16 of the ratio (its scales here are e4m3 normals), so |q| <= 6.4 and
      // the error is at most half the widest grid step (4 -> 6), i.e. one sf / gs.
      if (sf >= 0.015625f) {
        ASSERT_LE(std::fabs(back[idx] - x[idx]), sf / gs * 1.0001f) << "element " << idx;
      }
    }
  }
}

TEST(Activation, RejectsBadArguments) {
  std::vector<float> x(32, 1.0f), out(32);
  std::vector<uint8_t> codes(16), scales(2, 0x38);
  for (float bad : {0.0f, -2.0f, kNan, kInf}) {
    expect_error([&] { quantize_activation(x, 1, 32, bad, codes, scales); },
                 ErrorCode::kInvalidArgument, "gs");
    expect_error([&] { dequantize_activation(codes, scales, 1, 32, bad, out); },
                 ErrorCode::kInvalidArgument, "gs");
  }
  x[17] = kNan;
  expect_error([&] { quantize_activation(x, 1, 32, 1.0f, codes, scales); },
               ErrorCode::kInvalidArgument, "[0, 17]");
  x[17] = 1.0f;
  expect_error([&] { quantize_activation(x, 1, 24, 1.0f, codes, scales); },
               ErrorCode::kInvalidArgument, "multiple of 16");
  expect_error(
      [&] { quantize_activation(x, 1, 32, 1.0f, std::span<uint8_t>(codes.data(), 15), scales); },
      ErrorCode::kInvalidArgument, "`codes`");
  expect_error(
      [&] { quantize_activation(x, 1, 32, 1.0f, codes, std::span<uint8_t>(scales.data(), 1)); },
      ErrorCode::kInvalidArgument, "`scales`");
  expect_error([&] { dequantize_activation(codes, scales, 1, 32, 1.0f,
                                           std::span<float>(out.data(), 16)); },
               ErrorCode::kInvalidArgument, "`out`");
  scales[1] = 0x7F;
  expect_error([&] { dequantize_activation(codes, scales, 1, 32, 1.0f, out); },
               ErrorCode::kInvalidArgument, "row 0, block 1");
}

// ---- MXFP4 ------------------------------------------------------------------------------------

TEST(Mxfp4, DequantizeByHand) {
  // 2 rows x 64 columns: row 0 scales 127 (x1) and 129 (x4); row 1 scales 0 (x2^-127) and 254
  // (x2^127).
  std::vector<uint8_t> codes(64, 0x00), scales = {127, 129, 0, 254};
  codes[0] = 0x97;   // flat elements 0, 1 (row 0, block 0): 6, -0.5      (x1)
  codes[16] = 0x3A;  // flat elements 32, 33 (row 0, block 1): -1, 1.5    (x4)
  codes[32] = 0x51;  // flat elements 64, 65 (row 1, block 0): 0.5, 3     (x2^-127)
  codes[48] = 0x43;  // flat elements 96, 97 (row 1, block 1): 1.5, 2     (x2^127)
  std::vector<float> out(128);
  dequantize_mxfp4(codes, scales, 2, 64, out);
  EXPECT_EQ(out[0], 6.0f);
  EXPECT_EQ(out[1], -0.5f);
  EXPECT_EQ(out[32], -4.0f);
  EXPECT_EQ(out[33], 6.0f);
  EXPECT_EQ(out[64], std::ldexp(1.0f, -128));       // fp32 subnormal, exact
  EXPECT_EQ(out[65], 3 * std::ldexp(1.0f, -127));
  EXPECT_EQ(out[96], 1.5f * std::ldexp(1.0f, 127));  // largest finite result
  EXPECT_EQ(out[97], kInf);                          // 2 * 2^127 exceeds fp32
  for (int i : {2, 31, 34, 63, 66, 95, 98, 127}) EXPECT_EQ(out[i], 0.0f) << i;
}

TEST(Mxfp4, RejectsNanScalesAndBadShapes) {
  std::vector<uint8_t> codes(32, 0x22), scales = {127, 0xFF};
  std::vector<float> out(64);
  expect_error([&] { dequantize_mxfp4(codes, scales, 2, 32, out); }, ErrorCode::kInvalidArgument,
               "row 1, block 0");
  scales[1] = 127;
  expect_error([&] { dequantize_mxfp4(codes, scales, 4, 16, out); }, ErrorCode::kInvalidArgument,
               "multiple of 32");
  expect_error([&] {
    dequantize_mxfp4(std::span<const uint8_t>(codes.data(), 31), scales, 2, 32, out);
  }, ErrorCode::kInvalidArgument, "`codes`");
  expect_error([&] {
    dequantize_mxfp4(codes, std::span<const uint8_t>(scales.data(), 1), 2, 32, out);
  }, ErrorCode::kInvalidArgument, "`scales`");
  expect_error([&] { dequantize_mxfp4(codes, scales, 2, 32, std::span<float>(out.data(), 63)); },
               ErrorCode::kInvalidArgument, "`out`");
}

}  // namespace
}  // namespace megamoe::format
