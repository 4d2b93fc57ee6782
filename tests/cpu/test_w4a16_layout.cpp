// The sm90 W4A16 prepacked layout (src/kernels/sm90/sm90_w4a16_layout.h): where the prepack puts
// each code bit and how the mainloop reads it back must agree, and what it reads back must be
// the e2m1 value times 2^-126 as a bf16 — for every element position and every code, exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "kernels/sm90/sm90_w4a16_layout.h"
#include "megamoe/dtype.h"
#include "megamoe/format.h"

namespace megamoe {
namespace {

using namespace kernels::sm90::w4a16;

TEST(W4a16Layout, CodeBitsTileTheStepWord) {
  std::set<int> used;
  for (int p = 0; p < 8; ++p) {
    for (int b = 0; b < 4; ++b) {
      const int pos = code_bit_position(p, b);
      ASSERT_GE(pos, 0);
      ASSERT_LT(pos, 32);
      EXPECT_TRUE(used.insert(pos).second) << "bit " << pos << " used twice (element " << p << ")";
    }
  }
  EXPECT_EQ(used.size(), 32u);
}

TEST(W4a16Layout, EveryElementDecodesToE2m1Times2PowMinus126) {
  for (int p = 0; p < 8; ++p) {
    for (uint32_t code = 0; code < 16; ++code) {
      // The element alone, then with every other element set to a busy neighbour (code 0xF):
      // the register must not pick up another element's bits.
      for (const uint32_t others : {0u, 0xFu}) {
        uint32_t word = 0;
        for (int q = 0; q < 8; ++q) {
          const uint32_t c = q == p ? code : others;
          for (int b = 0; b < 4; ++b) word |= ((c >> b) & 1u) << code_bit_position(q, b);
        }
        const uint32_t reg = step_register(word, p / 2);
        const uint16_t half = static_cast<uint16_t>(p % 2 == 0 ? reg & 0xFFFFu : reg >> 16);
        const float expected = std::ldexp(format::e2m1_to_f32(static_cast<uint8_t>(code)), -126);
        const float got = bf16_to_f32(half);
        EXPECT_EQ(got, expected) << "element " << p << " code " << code << " others " << others;
        EXPECT_EQ(std::signbit(got), (code & 8u) != 0) << "element " << p << " code " << code;
      }
    }
  }
}

TEST(W4a16Layout, ScaleConstantRebiasesF16ToBf16Times2Pow118) {
  // Every nonzero valid ue4m3 scale: its f16 bits >> 3 + the constant is bf16(scale * 2^118).
  for (int code = 1; code < 0x7F; ++code) {
    const float scale = format::e4m3_to_f32(static_cast<uint8_t>(code));
    const uint16_t f16 = f32_to_f16(scale);  // exact: at most 3 mantissa bits, >= 2^-9
    const uint32_t bits = (static_cast<uint32_t>(f16) >> 3) + (kScaleF16ToBf16Times2Pow118 & 0xFFFFu);
    ASSERT_LT(bits, 0x7F80u) << "scale code " << code << " overflows bf16";
    EXPECT_EQ(bf16_to_f32(static_cast<uint16_t>(bits)), std::ldexp(scale, 118)) << "scale code " << code;
  }
}

}  // namespace
}  // namespace megamoe
