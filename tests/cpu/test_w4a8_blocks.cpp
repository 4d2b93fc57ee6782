// The host-side parts of the sm90 W4A8 building blocks (backends/sm90_w4a8/): the fragment's K
// permutation, the bit patterns and integer arithmetic the device decode and activation
// quantization are made of (constexpr, so the CPU runs the same code), the exactness of the f16
// products the decode relies on, and the rescale exponents k from a layer's scales. The device
// paths themselves: tests/gpu/test_gpu_w4a8_blocks.cu.
#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "backends/sm90_w4a16/sm90_w4a16_layout.h"
#include "backends/sm90_w4a8/sm90_w4a8_layout.h"
#include "backends/sm90_w4a8/sm90_w4a8_rescale.h"
#include "megamoe/dtype.h"
#include "megamoe/format.h"
#include "tests/common/error_matchers.h"
#include "tests/common/test_util.h"

namespace megamoe {
namespace {

namespace w4a8 = kernels::sm90::w4a8;
namespace w4a16 = kernels::sm90::w4a16;

// Ue4m3 bytes a tensor with rescale exponent k may hold: 6 * s * 2^-k <= 448.
bool scale_fits(uint8_t byte, int k) { return format::w4a8_weight_rescale_exponent({&byte, 1}) <= k; }

TEST(W4a8Layout, KPermutationIsABijectionWithinEachSixteen) {
  const int want[16] = {8, 0, 9, 1, 10, 2, 11, 3, 12, 4, 13, 5, 14, 6, 15, 7};
  for (int p = 0; p < 16; ++p) EXPECT_EQ(w4a8::k_of_position(p), want[p]) << "position " << p;
  std::vector<int> seen(128, 0);
  for (int p = 0; p < 128; ++p) {
    const int k = w4a8::k_of_position(p);
    ASSERT_EQ(k / 16, p / 16) << "position " << p << " leaves its 16";
    ++seen[static_cast<size_t>(k)];
    EXPECT_EQ(w4a8::position_of_k(k), p);
  }
  for (int k = 0; k < 128; ++k) EXPECT_EQ(seen[static_cast<size_t>(k)], 1) << "k " << k;
}

// The decode puts step word elements a4, a0, a5, a1 (row r0) into bytes 0..3 of one register and
// a6, a2, a7, a3 (row r1) into another: byte i of thread t's register must be the element whose
// W4A16 position (row offset, k offset 2t + ...) is the fragment position 4t + i's logical k.
TEST(W4a8Layout, DecodedBytesAreTheElementsOfTheirFragmentPositions) {
  const int row0[4] = {4, 0, 5, 1}, row1[4] = {6, 2, 7, 3};
  for (int t = 0; t < 4; ++t) {
    for (int i = 0; i < 4; ++i) {
      const int k = w4a8::k_of_position(4 * t + i);
      EXPECT_EQ(w4a16::nibble_row_offset(row0[i]), 0);
      EXPECT_EQ(w4a16::nibble_row_offset(row1[i]), 8);
      EXPECT_EQ(2 * t + w4a16::nibble_k_offset(row0[i]), k) << "t " << t << ", byte " << i;
      EXPECT_EQ(2 * t + w4a16::nibble_k_offset(row1[i]), k) << "t " << t << ", byte " << i;
    }
  }
}

// A step word holding `code` at element p and random codes elsewhere.
uint32_t step_word_with(testing::Rng& rng, int p, uint8_t code) {
  uint32_t word = static_cast<uint32_t>(rng());
  for (int b = 0; b < 4; ++b) {
    const int bit = w4a16::code_bit_position(p, b);
    word = (word & ~(1u << bit)) | static_cast<uint32_t>((code >> b) & 1u) << bit;
  }
  return word;
}

TEST(W4a8Layout, CodePairsAreE2m1TimesTwoToTheMinus14InF16) {
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  for (int p = 0; p < 8; ++p) {
    for (int code = 0; code < 16; ++code) {
      for (int draw = 0; draw < 64; ++draw) {
        const uint32_t pair = w4a8::f16_code_pair(step_word_with(rng, p, static_cast<uint8_t>(code)), p / 2);
        const uint16_t half = static_cast<uint16_t>(pair >> (16 * (p % 2)));
        const float want = std::ldexp(format::e2m1_to_f32(static_cast<uint8_t>(code)), -14);
        ASSERT_EQ(f16_to_f32(half), want) << "element " << p << ", code " << code;
        ASSERT_EQ(half >> 15, code >> 3) << "element " << p << ", code " << code << ": the sign (-0 included)";
      }
    }
  }
}

// The scale word of a quad: row r0 holds (a, b) for steps (2i, 2i + 1), row r1 (b, a).
uint32_t scale_word(uint8_t a, uint8_t b) {
  const uint8_t ea = w4a16::encode_scale(a), eb = w4a16::encode_scale(b);
  return w4a16::scale_half(ea, eb) | static_cast<uint32_t>(w4a16::scale_half(eb, ea)) << 16;
}

TEST(W4a8Layout, ScalePairsAreTheScaleTimesTwoToTheNineMinusK) {
  for (int k = w4a8::kMinRescaleExponent; k <= w4a8::kMaxRescaleExponent; ++k) {
    const uint32_t addend = w4a8::scale_exponent_addend(k);
    for (int a = 0; a <= 0x7E; ++a) {
      for (const int b : {0, 0x01, 0x37, 0x38, a, 0x7E - a}) {
        const uint8_t at[2][2] = {{static_cast<uint8_t>(a), static_cast<uint8_t>(b)},
                                  {static_cast<uint8_t>(b), static_cast<uint8_t>(a)}};  // [step][row]
        if (!scale_fits(at[0][0], k) || !scale_fits(at[0][1], k)) continue;
        const uint32_t word = scale_word(at[0][0], at[1][0]);
        const uint32_t pairs[2] = {w4a8::f16_scale_pair<0>(word, addend), w4a8::f16_scale_pair<1>(word, addend)};
        for (int step = 0; step < 2; ++step) {
          for (int row = 0; row < 2; ++row) {
            const float got = f16_to_f32(static_cast<uint16_t>(pairs[step] >> (16 * row)));
            const uint8_t s = at[step][row];
            ASSERT_TRUE(std::isfinite(got)) << "k " << k << ", scale byte " << int(s);
            if (s != 0) {
              ASSERT_EQ(got, std::ldexp(format::e4m3_to_f32(s), 9 - k))
                  << "k " << k << ", scale byte " << int(s) << ", row " << row << ", step " << step;
            }
          }
        }
      }
    }
  }
}

// The device decode multiplies the two f16 values above, then by 32, and converts once. Each
// product must be exact in f16 (the HMUL2 then rounds nothing), and the result's RNE to e4m3 the
// defined weight, for every code, every scale a tensor with that k may hold, and every k.
TEST(W4a8Layout, F16ProductsAreExactAndRoundToTheDefinedWeight) {
  for (int k = w4a8::kMinRescaleExponent; k <= w4a8::kMaxRescaleExponent; ++k) {
    for (int s = 0; s <= 0x7E; ++s) {
      const uint8_t byte = static_cast<uint8_t>(s);
      if (!scale_fits(byte, k)) continue;
      const uint32_t pair = w4a8::f16_scale_pair<0>(scale_word(byte, 0), w4a8::scale_exponent_addend(k));
      const float scale = f16_to_f32(static_cast<uint16_t>(pair));
      // The prepack stores the codes of a zero-scale block as 0 (sm90_w4a16_layout.h).
      for (int c = 0; c < (s == 0 ? 1 : 16); ++c) {
        const uint8_t code = static_cast<uint8_t>(c);
        SCOPED_TRACE(::testing::Message() << "k " << k << ", scale byte " << s << ", code " << c);
        const float first = std::ldexp(format::e2m1_to_f32(code), -14) * scale;  // exact in fp32: 2 + 4 bits
        ASSERT_EQ(f16_to_f32(f32_to_f16(first)), first) << "e2m1 * s * 2^(-5-k) is not an f16";
        const float second = first * 32.0f;
        ASSERT_EQ(f16_to_f32(f32_to_f16(second)), second);
        ASSERT_EQ(format::f64_to_e4m3(second), format::w4a8_weight_e4m3(code, byte, k));
      }
    }
  }
}

// The activation exponent from amax's fp32 bits against the definition, on every bf16 magnitude
// (the hidden states) and on fp32 values around every boundary 448 * 2^e.
TEST(W4a8ActQuant, ExponentFromTheBitsIsTheDefinition) {
  for (uint32_t h = 0; h < 0x7F80; ++h) {
    const uint32_t bits = h << 16;
    ASSERT_EQ(w4a8::act_scale_exponent(bits), format::w4a8_act_scale_exponent(std::bit_cast<float>(bits)))
        << "bf16 bits " << h;
  }
  for (int e = -140; e <= 119; ++e) {  // 448 * 2^119 is the last finite one
    const uint32_t edge = std::bit_cast<uint32_t>(std::ldexp(448.0f, e));
    for (uint32_t bits = edge - 2; bits <= edge + 2 && bits < 0x7F800000u; ++bits) {
      ASSERT_EQ(w4a8::act_scale_exponent(bits), format::w4a8_act_scale_exponent(std::bit_cast<float>(bits)))
          << "fp32 bits " << bits;
    }
  }
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  for (int i = 0; i < 100000; ++i) {
    const uint32_t bits = static_cast<uint32_t>(rng()) % 0x7F800000u;
    ASSERT_EQ(w4a8::act_scale_exponent(bits), format::w4a8_act_scale_exponent(std::bit_cast<float>(bits)))
        << "fp32 bits " << bits;
  }
}

// ---- the rescale exponents k of a layer

std::vector<uint8_t> scales_of(const Nvfp4Linear& lin) {
  return {lin.weight_scale, lin.weight_scale + lin.out_features * lin.in_features / 16};
}
// `lin` with other block scales: the same codes and global scale.
Nvfp4Linear with_scales(const Nvfp4Linear& lin, std::vector<uint8_t> scales) {
  std::vector<uint8_t> codes(lin.weight, lin.weight + lin.out_features * lin.in_features / 2);
  return make_owned_linear(lin.out_features, lin.in_features, std::move(codes), std::move(scales),
                           lin.weight_scale_2);
}

std::array<int, 3> format_exponents(const ExpertWeights& ex) {
  std::array<int, 3> k{};
  const Nvfp4Linear* lin[3] = {&ex.gate, &ex.up, &ex.down};
  for (size_t p = 0; p < 3; ++p) k[p] = format::w4a8_weight_rescale_exponent(scales_of(*lin[p]));
  return k;
}

TEST(W4a8Rescale, HostExponentsAreEachTensorsOwn) {
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  // The largest scale drawn per tensor, so that k differs between tensors and projections.
  MoeLayer layer =
      testing::random_layer(rng, 128, 64, 6, 2, 128, std::nullopt, {testing::ScaleCodes::kUpToRandomTop});
  // One all-zero tensor (k = 0) and one whose largest scale is 2^-9 (k = -15).
  std::vector<uint8_t> zero = scales_of(layer.experts[1].up), tiny = scales_of(layer.experts[2].down);
  for (uint8_t& s : zero) s = 0;
  for (uint8_t& s : tiny) s = static_cast<uint8_t>(rng() % 2);
  layer.experts[1].up = with_scales(layer.experts[1].up, std::move(zero));
  layer.experts[2].down = with_scales(layer.experts[2].down, std::move(tiny));

  const runtime::W4a8RescaleExponents k = runtime::w4a8_rescale_exponents(layer);
  ASSERT_EQ(k.routed.size(), layer.experts.size());
  for (size_t e = 0; e < layer.experts.size(); ++e) {
    EXPECT_EQ(k.routed[e], format_exponents(layer.experts[e])) << "expert " << e;
  }
  EXPECT_EQ(k.shared, format_exponents(*layer.shared_expert));
  EXPECT_EQ(k.routed[1][1], 0);
  EXPECT_EQ(k.routed[2][2], -15);

  layer.shared_expert.reset();
  EXPECT_EQ(runtime::w4a8_rescale_exponents(layer).shared, (std::array<int, 3>{0, 0, 0}));
}

TEST(W4a8Rescale, HostRejectsAnInvalidScaleNamingIt) {
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  MoeLayer layer = testing::random_layer(rng, 128, 64, 3, 2);
  std::vector<uint8_t> scales = scales_of(layer.experts[2].gate);  // [64, 128]: 8 blocks per row
  scales[5 * 8 + 3] = 0xB8;                                        // -1.0
  layer.experts[2].gate = with_scales(layer.experts[2].gate, std::move(scales));
  EXPECT_MEGAMOE_ERROR(runtime::w4a8_rescale_exponents(layer), kInvalidArgument, "expert 2's gate", "[5, 3]", "0xB8");
}

}  // namespace
}  // namespace megamoe
