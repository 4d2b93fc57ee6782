// The table form of the W4A8 weight decode (backends/sm90_w4a8/sm90_w4a8_decode_table.h), run on
// the CPU: the same selector, sign and lookup sequence as the device (PRMT emulated), on step words
// built from codes with the layout's bit positions, and tables filled from the definition, against
// format::w4a8_weight_e4m3 for every rescale exponent k, every scale byte valid for k, every code
// and every position of the fragment, the output bytes in the fragment K order (k_of_position). The device:
// tests/gpu/test_gpu_w4a8_decode_table.cu.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <vector>

#include "backends/sm90_w4a16/sm90_w4a16_layout.h"
#include "backends/sm90_w4a8/sm90_w4a8_decode_table.h"
#include "backends/sm90_w4a8/sm90_w4a8_layout.h"
#include "megamoe/format.h"
#include "tests/common/w4a8_decode_cases.h"

namespace megamoe {
namespace {

namespace w4a8 = kernels::sm90::w4a8;
namespace w4a16 = kernels::sm90::w4a16;

// The table of docs/w4a8.md §3 for rows r0 (k0) and r1 (k1), laid out as the device's.
std::vector<uint8_t> make_table(int k0, int k1) {
  std::vector<uint8_t> t(w4a8::kTableBytes, 0);
  for (int e = 0; e < w4a8::kTableEntries; ++e) {
    const uint8_t scale = w4a16::decode_scale(static_cast<uint8_t>(e));
    if (w4a16::encode_scale(scale) != e) continue;  // not an encoded byte: never read
    for (int h = 0; h < 2; ++h) {
      for (int c = 0; c < 8; ++c) {
        t[static_cast<size_t>(e * 16 + 8 * h + c)] = format::w4a8_weight_e4m3(static_cast<uint8_t>(c), scale, h ? k1 : k0);
      }
    }
  }
  return t;
}

TEST(W4a8DecodeTable, PrmtEmulationFollowsThePtxDefinition) {
  EXPECT_EQ(w4a8::prmt(0x33221100u, 0x77665544u, 0x7531), 0x77553311u);
  EXPECT_EQ(w4a8::prmt(0x33221100u, 0x77665544u, 0x0123), 0x00112233u);
  EXPECT_EQ(w4a8::prmt(0x00800001u, 0, 0x8A98), 0x00FF0000u);  // sign-replicate mode
  EXPECT_EQ(w4a8::prmt(0x33221100u, 0x77665544u, 0xFFFF4444), 0x44444444u);  // bits 16..31 unused
}

// Selectors never set a nibble's bit 3 (PRMT's sign-replicate mode): every bit of a step word
// that could reach one, set alone and all together.
TEST(W4a8DecodeTable, SelectorsNeverUseTheSignReplicateMode) {
  for (int bit = -1; bit < 64; ++bit) {
    const uint64_t v = bit < 0 ? ~uint64_t{0} : uint64_t{1} << bit;
    const w4a8::TableOperands op = w4a8::table_operands(static_cast<uint32_t>(v), static_cast<uint32_t>(v >> 32));
    for (int r = 0; r < 4; ++r) EXPECT_EQ(op.selector[r] & 0x8888u, 0u) << "bit " << bit << ", register " << r;
  }
}

// Every k (rows r0 and r1 with different k, as gate and up), every valid scale byte in every
// (row, step) slot, every code at every fragment position: the decoded byte is the definition's.
TEST(W4a8DecodeTable, EveryScaleCodeAndRescaleExponentIsTheDefinedWeight) {
  int64_t checked = 0, mismatches = 0;
  for (int k = w4a8::kMinRescaleExponent; k <= w4a8::kMaxRescaleExponent; ++k) {
    const int k_up = w4a8::kMaxRescaleExponent + w4a8::kMinRescaleExponent - k;  // the other end
    const std::vector<uint8_t> table = make_table(k, k_up);
    for (const testing::W4a8DecodeCase& f : testing::w4a8_decode_cases(k, k_up)) {
      const std::array<uint32_t, 4> a = testing::w4a8_table_decode_host(table, f.word[0], f.word[1], f.scale_word);
      for (int r = 0; r < 4; ++r) {
        const int h = r & 1, s = r >> 1;
        for (int byte = 0; byte < 4; ++byte) {
          // Register r, byte `byte` of thread t is fragment position 16 s + 4t + byte, logical k
          // 16 s + 2t + offset: the step word element at (row r0 + 8 h, k offset 2t + offset).
          const int k_offset = w4a8::k_of_position(byte);  // thread 0: the offset from 2t
          const int p = testing::w4a16_element_at(h, k_offset);
          ASSERT_GE(p, 0);
          const uint8_t want = format::w4a8_weight_e4m3(f.code[s][p], f.scale[h][s], h ? k_up : k);
          const uint8_t got = static_cast<uint8_t>(a[r] >> (8 * byte));
          ++checked;
          if (got != want && ++mismatches <= 8) {
            ADD_FAILURE() << "k " << k << "/" << k_up << ", register " << r << ", byte " << byte << ": code "
                          << int(f.code[s][p]) << ", scale 0x" << std::hex << int(f.scale[h][s]) << ": got 0x"
                          << int(got) << ", want 0x" << int(want);
          }
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(checked, 100000);
}

// The K order for every thread t: byte i of register r is logical k 16 (r / 2) + 2t + (8, 0, 9, 1)[i]
// of the k32 fragment, the same for rows r0 and r1 (the activations, B, are shared by both rows).
TEST(W4a8DecodeTable, RegisterBytesFollowTheTableKOrderForEveryThread) {
  for (int t = 0; t < 4; ++t) {
    for (int i = 0; i < 4; ++i) {
      const int k = w4a8::k_of_position(4 * t + i);
      for (int h = 0; h < 2; ++h) {
        const int p = testing::w4a16_element_at(h, k - 2 * t);
        ASSERT_GE(p, 0) << "t " << t << ", byte " << i;
        EXPECT_EQ(2 * t + w4a16::nibble_k_offset(p), k);
      }
    }
  }
}

}  // namespace
}  // namespace megamoe
