// The sm90 W4A16 prepacked layout (src/backends/sm90_w4a16/sm90_w4a16_layout.h): where the prepack puts
// each code bit and how the mainloop reads it back must agree, and what it reads back must be
// the e2m1 value times 2^-126 as a bf16 — for every element position and every code, exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "backends/sm90_w4a16/sm90_w4a16_layout.h"
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

TEST(W4a16Layout, EveryScaleDecodesToBf16Times2Pow118) {
  // Every pair of nonzero valid ue4m3 scales (subnormals included), in both steps of a word and
  // both rows, with a different pair in the other half and the other step: the decoded bf16 is
  // exactly scale * 2^118, and no other scale's bits leak in.
  for (int a = 1; a < 0x7F; ++a) {
    for (int b = 1; b < 0x7F; b += (a % 7) + 1) {
      const uint8_t ea = encode_scale(static_cast<uint8_t>(a)), eb = encode_scale(static_cast<uint8_t>(b));
      // Row r0 holds (a, b); row r1 holds (b, a).
      const uint32_t word = scale_half(ea, eb) | static_cast<uint32_t>(scale_half(eb, ea)) << 16;
      const uint32_t even = scale_register<0>(word), odd = scale_register<1>(word);
      const auto expect = [](int code, uint32_t bits) {
        const float scale = format::e4m3_to_f32(static_cast<uint8_t>(code));
        EXPECT_EQ(bf16_to_f32(static_cast<uint16_t>(bits)), std::ldexp(scale, 118)) << "scale code " << code;
      };
      expect(a, even & 0xFFFFu);
      expect(b, even >> 16);
      expect(b, odd & 0xFFFFu);
      expect(a, odd >> 16);
    }
  }
}

TEST(W4a16Layout, ZeroScaleDecodesFinite) {
  // A zero scale's block stores codes 0, so its decoded scale only has to be finite.
  const uint32_t word = scale_half(encode_scale(0), encode_scale(0));
  EXPECT_TRUE(std::isfinite(bf16_to_f32(static_cast<uint16_t>(scale_register<0>(word)))));
  EXPECT_TRUE(std::isfinite(bf16_to_f32(static_cast<uint16_t>(scale_register<1>(word)))));
}

}  // namespace
}  // namespace megamoe
