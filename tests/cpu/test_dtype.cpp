// Element types and the exact bf16/f16 conversions (include/megamoe/dtype.h), and the error
// names of status.h. Every 16-bit pattern is checked against formulas written independently
// here (sign/exponent/mantissa arithmetic in double), and every tie between adjacent values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "megamoe/dtype.h"
#include "megamoe/format.h"
#include "megamoe/status.h"

namespace megamoe {
namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE binary16 by its definition: (-1)^s * 2^(e-15) * (1 + m/1024), subnormal 2^-14 * m/1024.
double f16_reference(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  double mag;
  if (e == 31) {
    mag = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (e == 0) {
    mag = std::ldexp(m / 1024.0, -14);
  } else {
    mag = std::ldexp(1.0 + m / 1024.0, e - 15);
  }
  return s ? -mag : mag;
}

// bfloat16 by its definition: 8 exponent bits (bias 127), 7 mantissa bits.
double bf16_reference(uint16_t h) {
  const int s = h >> 15, e = (h >> 7) & 0xFF, m = h & 0x7F;
  double mag;
  if (e == 255) {
    mag = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (e == 0) {
    mag = std::ldexp(m / 128.0, -126);
  } else {
    mag = std::ldexp(1.0 + m / 128.0, e - 127);
  }
  return s ? -mag : mag;
}

TEST(Status, ErrorCodeNamesAreDistinctAndNonEmpty) {
  const ErrorCode all[] = {ErrorCode::kInvalidArgument, ErrorCode::kInvalidCheckpoint,
                           ErrorCode::kNotFound,        ErrorCode::kIo,
                           ErrorCode::kUnsupported,     ErrorCode::kCuda,
                           ErrorCode::kInternal};
  std::set<std::string> names;
  for (ErrorCode c : all) {
    const std::string name = error_code_name(c);
    EXPECT_FALSE(name.empty());
    EXPECT_NE(name, "unknown_error_code");
    names.insert(name);
  }
  EXPECT_EQ(names.size(), std::size(all));
  EXPECT_STREQ(error_code_name(ErrorCode::kInvalidCheckpoint), "invalid_checkpoint");
  // A value outside the enum must still give a string (this runs while reporting errors).
  EXPECT_STREQ(error_code_name(static_cast<ErrorCode>(99)), "unknown_error_code");
}

TEST(Status, CheckAndFailThrowErrorWithCodeAndMessage) {
  try {
    MEGAMOE_CHECK(1 + 1 == 3, kNotFound, "tensor ", "x.weight", " has ", 3, " dims.");
    FAIL() << "MEGAMOE_CHECK did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
    EXPECT_STREQ(e.what(), "tensor x.weight has 3 dims.");
  }
  EXPECT_NO_THROW(MEGAMOE_CHECK(true, kInternal, "never"));
  try {
    MEGAMOE_FAIL(kIo, "read failed");
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kIo);
    EXPECT_STREQ(e.what(), "read failed");
  }
}

TEST(DType, SizesNamesAndParsing) {
  struct Row {
    DType t;
    int size;
    const char* name;
  };
  const Row rows[] = {{DType::BF16, 2, "BF16"}, {DType::F16, 2, "F16"},
                      {DType::F32, 4, "F32"},   {DType::U8, 1, "U8"},
                      {DType::I8, 1, "I8"},     {DType::I32, 4, "I32"},
                      {DType::I64, 8, "I64"},   {DType::F8_E4M3, 1, "F8_E4M3"},
                      {DType::F8_E5M2, 1, "F8_E5M2"}};
  for (const Row& r : rows) {
    EXPECT_EQ(dtype_size(r.t), r.size) << r.name;
    EXPECT_STREQ(dtype_name(r.t), r.name);
    const auto parsed = dtype_from_name(r.name);
    ASSERT_TRUE(parsed.has_value()) << r.name;
    EXPECT_EQ(*parsed, r.t);
  }
  // Exact safetensors spelling only.
  for (const char* bad : {"", "bf16", "BF16 ", "F8_E4M3FN", "FP32", "BOOL", "F64", "U16"}) {
    EXPECT_FALSE(dtype_from_name(bad).has_value()) << "'" << bad << "'";
  }
}

TEST(DType, InvalidEnumValueIsRejected) {
  const auto bogus = static_cast<DType>(200);
  EXPECT_THROW(dtype_size(bogus), Error);
  EXPECT_THROW(dtype_name(bogus), Error);
  try {
    dtype_size(bogus);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("200"), std::string::npos) << e.what();
  }
}

TEST(F16, EveryBitPatternDecodesExactly) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float got = f16_to_f32(static_cast<uint16_t>(h));
    const double want = f16_reference(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << std::hex << h;
      EXPECT_EQ(std::signbit(got), (h & 0x8000) != 0) << std::hex << h;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << std::hex << h;
      EXPECT_EQ(std::signbit(got), (h & 0x8000) != 0) << std::hex << h;  // -0 stays -0
    }
  }
}

TEST(F16, EveryNonNanRoundTrips) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7C00) == 0x7C00 && (h & 0x3FF)) continue;  // NaN
    EXPECT_EQ(f32_to_f16(f16_to_f32(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
}

TEST(F16, NanStaysQuietNanWithSign) {
  for (uint32_t h : {0x7C01u, 0x7D00u, 0x7E00u, 0x7FFFu, 0xFC01u, 0xFE00u}) {
    const uint16_t back = f32_to_f16(f16_to_f32(static_cast<uint16_t>(h)));
    EXPECT_EQ(back & 0x7C00, 0x7C00) << std::hex << h;
    EXPECT_NE(back & 0x0200, 0) << "quiet bit, " << std::hex << h;
    EXPECT_EQ(back & 0x8000, h & 0x8000) << std::hex << h;
  }
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::quiet_NaN()) & 0x7E00, 0x7E00);
  // A signalling fp32 NaN whose payload lives only in the low bits must not become infinity.
  const uint16_t low_payload = f32_to_f16(from_bits(0x7F800001u));
  EXPECT_EQ(low_payload & 0x7E00, 0x7E00);
}

// Every tie between adjacent halves (subnormal, normal, and 65504 | 2^16) rounds to the even
// pattern; one float ulp either side rounds to the nearer one.
TEST(F16, TiesRoundToEvenAndNeighboursToNearest) {
  for (uint32_t h = 0; h < 0x7C00; ++h) {
    const double lo = f16_reference(static_cast<uint16_t>(h));
    const double hi = (h + 1 == 0x7C00) ? 65536.0 : f16_reference(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((lo + hi) / 2);  // 12 significant bits: exact
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);
    const uint32_t even = (h & 1) ? h + 1 : h;
    for (int sgn : {0, 1}) {
      const float s = sgn ? -1.0f : 1.0f;
      const uint32_t sb = sgn ? 0x8000u : 0u;
      EXPECT_EQ(f32_to_f16(s * mid), even | sb) << "tie above " << std::hex << h;
      EXPECT_EQ(f32_to_f16(s * std::nextafter(mid, 0.0f)), h | sb) << std::hex << h;
      EXPECT_EQ(f32_to_f16(s * std::nextafter(mid, 1e30f)), (h + 1) | sb) << std::hex << h;
    }
  }
}

TEST(F16, OverflowUnderflowAndSpecials) {
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7BFF);
  EXPECT_EQ(f32_to_f16(65519.99f), 0x7BFF);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7C00);  // the tie with 2^16 goes to the even pattern: inf
  EXPECT_EQ(f32_to_f16(1e6f), 0x7C00);
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::max()), 0x7C00);
  EXPECT_EQ(f32_to_f16(-std::numeric_limits<float>::infinity()), 0xFC00);
  EXPECT_EQ(f32_to_f16(0.0f), 0x0000);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // its half: tie to 0
  EXPECT_EQ(f32_to_f16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(f32_to_f16(-std::numeric_limits<float>::denorm_min()), 0x8000);
  EXPECT_EQ(f32_to_f16(1.0f), 0x3C00);
  EXPECT_EQ(f32_to_f16(-2.5f), 0xC100);
}

TEST(BF16, EveryBitPatternDecodesExactlyAndRoundTrips) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float got = bf16_to_f32(static_cast<uint16_t>(h));
    const double want = bf16_reference(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << std::hex << h;
      const uint16_t back = f32_to_bf16(got);
      EXPECT_EQ(back & 0x7F80, 0x7F80) << std::hex << h;
      EXPECT_NE(back & 0x0040, 0) << "quiet bit, " << std::hex << h;
      EXPECT_EQ(back & 0x8000, h & 0x8000) << std::hex << h;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << std::hex << h;
      EXPECT_EQ(f32_to_bf16(got), h) << std::hex << h;
      EXPECT_EQ(round_to_bf16(got), got) << std::hex << h;
    }
  }
}

// In bf16 the tie between patterns h and h+1 is the float whose low 16 bits are 0x8000.
TEST(BF16, TiesRoundToEvenAndNeighboursToNearest) {
  for (uint32_t h = 0; h < 0x7F80; ++h) {
    const uint32_t even = (h & 1) ? h + 1 : h;
    for (uint32_t sb : {0u, 0x8000u}) {
      const uint32_t base = (h | sb) << 16;
      EXPECT_EQ(f32_to_bf16(from_bits(base | 0x8000u)), even | sb) << std::hex << h;
      EXPECT_EQ(f32_to_bf16(from_bits(base | 0x7FFFu)), h | sb) << std::hex << h;
      EXPECT_EQ(f32_to_bf16(from_bits(base | 0x8001u)), (h + 1) | sb) << std::hex << h;
    }
  }
  // The largest finite bf16 and its tie with infinity.
  EXPECT_EQ(f32_to_bf16(from_bits(0x7F7F7FFFu)), 0x7F7F);
  EXPECT_EQ(f32_to_bf16(from_bits(0x7F7F8000u)), 0x7F80);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(round_to_bf16(1.00390625f), 1.0f);       // 1 + 2^-8: tie, down to even
  EXPECT_EQ(round_to_bf16(1.01171875f), 1.015625f);  // 1 + 3*2^-8: tie, up to even
}

TEST(LoadAsF32, EveryFloatDtypeAtUnalignedOffsets) {
  // One buffer per dtype, each starting one byte past an aligned address.
  std::vector<unsigned char> buf(64, 0);
  unsigned char* p = buf.data() + 1;

  const uint16_t bf[3] = {f32_to_bf16(1.5f), f32_to_bf16(-3.0f), f32_to_bf16(1e-3f)};
  std::memcpy(p, bf, sizeof(bf));
  EXPECT_EQ(load_as_f32(DType::BF16, p, 0), 1.5f);
  EXPECT_EQ(load_as_f32(DType::BF16, p, 1), -3.0f);
  EXPECT_EQ(load_as_f32(DType::BF16, p, 2), round_to_bf16(1e-3f));

  const uint16_t h[3] = {0x3C00, 0xC100, 0x0001};
  std::memcpy(p, h, sizeof(h));
  EXPECT_EQ(load_as_f32(DType::F16, p, 0), 1.0f);
  EXPECT_EQ(load_as_f32(DType::F16, p, 1), -2.5f);
  EXPECT_EQ(load_as_f32(DType::F16, p, 2), std::ldexp(1.0f, -24));

  const float f[3] = {0.1f, -7.25f, 3e38f};
  std::memcpy(p, f, sizeof(f));
  EXPECT_EQ(load_as_f32(DType::F32, p, 0), 0.1f);
  EXPECT_EQ(load_as_f32(DType::F32, p, 1), -7.25f);
  EXPECT_EQ(load_as_f32(DType::F32, p, 2), 3e38f);

  const unsigned char e4m3[4] = {0x38, 0xFE, 0x01, 0x7F};  // 1, -448, 2^-9, NaN
  std::memcpy(p, e4m3, sizeof(e4m3));
  EXPECT_EQ(load_as_f32(DType::F8_E4M3, p, 0), 1.0f);
  EXPECT_EQ(load_as_f32(DType::F8_E4M3, p, 1), -448.0f);
  EXPECT_EQ(load_as_f32(DType::F8_E4M3, p, 2), std::ldexp(1.0f, -9));
  EXPECT_TRUE(std::isnan(load_as_f32(DType::F8_E4M3, p, 3)));

  const unsigned char e5m2[3] = {0x3C, 0xC2, 0x7C};  // 1, -3, inf
  std::memcpy(p, e5m2, sizeof(e5m2));
  EXPECT_EQ(load_as_f32(DType::F8_E5M2, p, 0), 1.0f);
  EXPECT_EQ(load_as_f32(DType::F8_E5M2, p, 1), -3.0f);
  EXPECT_EQ(load_as_f32(DType::F8_E5M2, p, 2), std::numeric_limits<float>::infinity());
}

TEST(LoadAsF32, RejectsIntegerDtypesNullAndNegativeIndex) {
  const int64_t v[2] = {1, 2};
  for (DType t : {DType::U8, DType::I8, DType::I32, DType::I64}) {
    try {
      load_as_f32(t, v, 0);
      FAIL() << "integer dtype " << dtype_name(t) << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(dtype_name(t)), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(load_as_f32(DType::F32, nullptr, 0), Error);
  EXPECT_THROW(load_as_f32(DType::F32, v, -1), Error);
}

}  // namespace
}  // namespace megamoe
