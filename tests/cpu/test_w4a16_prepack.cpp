// The sm90 W4A16 prepack (backends/sm90_w4a16/sm90_w4a16_prepack.h) and its inverse: unprepack
// gives back the checkpoint layout, bit for bit but for the codes of zero-scale blocks (prepack
// stores them as 0; the block's weights are 0 either way). What a prepared layer that holds its
// weights once needs to give its state dict back in the checkpoint's layout.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "backends/sm90_w4a16/sm90_w4a16_layout.h"
#include "backends/sm90_w4a16/sm90_w4a16_prepack.h"
#include "megamoe/format.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "tests/common/test_util.h"

namespace megamoe {
namespace {

using namespace kernels::sm90::w4a16;
using runtime::Nvfp4Rows;

TEST(W4a16Prepack, ScaleEncodingRoundTripsEveryValidByte) {
  for (int b = 0; b <= 0x7E; ++b) {
    EXPECT_EQ(decode_scale(encode_scale(static_cast<uint8_t>(b))), b) << "ue4m3 byte " << b;
  }
}

// The checkpoint bytes a round trip must give back: the codes of every zero-scale block cleared.
std::vector<uint8_t> canonical_codes(const Nvfp4Linear& l) {
  std::vector<uint8_t> codes(l.weight, l.weight + l.out_features * l.in_features / 2);
  for (int64_t r = 0; r < l.out_features; ++r) {
    for (int64_t blk = 0; blk < l.in_features / 16; ++blk) {
      if (l.weight_scale[r * (l.in_features / 16) + blk] != 0) continue;
      for (int64_t i = 0; i < 8; ++i) codes[static_cast<size_t>(r * (l.in_features / 2) + blk * 8 + i)] = 0;
    }
  }
  return codes;
}

struct Buffers {
  std::vector<uint8_t> codes, scales;
  Nvfp4Rows rows(int64_t out, int64_t in) {
    codes.assign(static_cast<size_t>(out * in / 2), 0xAB);  // poison: every byte must be written
    scales.assign(static_cast<size_t>(out * in / 16), 0xCD);
    return {out, in, codes.data(), scales.data()};
  }
};

TEST(W4a16Prepack, UnprepackInvertsPrepack) {
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t H = 256, I = 192;
  // Every scale byte, zero and subnormal ones included.
  const ExpertWeights ex = testing::random_expert(rng, H, I, {testing::ScaleCodes::kEveryCode});

  // W13 whole, and one 64-column slice of it (as a shared expert's slices are prepacked).
  for (const auto [col_begin, cols] : {std::pair<int64_t, int64_t>{0, I}, {64, 64}}) {
    SCOPED_TRACE(::testing::Message() << "W13 columns [" << col_begin << ", " << col_begin + cols << ")");
    std::vector<uint8_t> codes(static_cast<size_t>(runtime::prepacked_code_bytes(2 * cols, H)));
    std::vector<uint8_t> scales(static_cast<size_t>(runtime::prepacked_scale_bytes(2 * cols, H)));
    runtime::prepack_w13(ex.gate, ex.up, col_begin, cols, codes, scales);
    Buffers g, u;
    const Nvfp4Rows gate = g.rows(I, H), up = u.rows(I, H);
    runtime::unprepack_w13(codes, scales, col_begin, cols, gate, up);
    const std::vector<uint8_t> want_g = canonical_codes(ex.gate), want_u = canonical_codes(ex.up);
    const int64_t row_bytes = H / 2, row_scales = H / 16;
    for (int64_t r = col_begin; r < col_begin + cols; ++r) {
      for (int64_t i = 0; i < row_bytes; ++i) {
        const size_t at = static_cast<size_t>(r * row_bytes + i);
        ASSERT_EQ(g.codes[at], want_g[at]) << "gate row " << r << " byte " << i;
        ASSERT_EQ(u.codes[at], want_u[at]) << "up row " << r << " byte " << i;
      }
      for (int64_t i = 0; i < row_scales; ++i) {
        const size_t at = static_cast<size_t>(r * row_scales + i);
        ASSERT_EQ(g.scales[at], ex.gate.weight_scale[at]) << "gate row " << r << " scale " << i;
        ASSERT_EQ(u.scales[at], ex.up.weight_scale[at]) << "up row " << r << " scale " << i;
      }
    }
  }

  // W2 whole, and a 64-wide K slice of it.
  for (const auto [k_begin, k_len] : {std::pair<int64_t, int64_t>{0, I}, {128, 64}}) {
    SCOPED_TRACE(::testing::Message() << "W2 K [" << k_begin << ", " << k_begin + k_len << ")");
    std::vector<uint8_t> codes(static_cast<size_t>(runtime::prepacked_code_bytes(H, k_len)));
    std::vector<uint8_t> scales(static_cast<size_t>(runtime::prepacked_scale_bytes(H, k_len)));
    runtime::prepack_w2(ex.down, k_begin, k_len, codes, scales);
    Buffers d;
    const Nvfp4Rows down = d.rows(H, I);
    runtime::unprepack_w2(codes, scales, k_begin, k_len, down);
    const std::vector<uint8_t> want = canonical_codes(ex.down);
    for (int64_t r = 0; r < H; ++r) {
      for (int64_t k = k_begin; k < k_begin + k_len; k += 2) {
        const size_t at = static_cast<size_t>(r * (I / 2) + k / 2);
        ASSERT_EQ(d.codes[at], want[at]) << "down row " << r << " k " << k;
      }
      for (int64_t k = k_begin; k < k_begin + k_len; k += 16) {
        const size_t at = static_cast<size_t>(r * (I / 16) + k / 16);
        ASSERT_EQ(d.scales[at], ex.down.weight_scale[at]) << "down row " << r << " k " << k;
      }
    }
  }
}

// A layout this build does not have is refused before anything is read (no device needed).
TEST(W4a16Prepack, UnprepackStackedNamesTheBuiltLayouts) {
  StackedNvfp4Weights in;
  StackedNvfp4Buffers out;
  try {
    unprepack_stacked("sm80-something", in, out);
    ADD_FAILURE() << "no error for an unknown layout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("weight layout \"sm80-something\" is not one of this build's "
                                         "(sm90-prepacked-nvfp4)"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace megamoe
