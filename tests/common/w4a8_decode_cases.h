// Host-side pieces of the W4A8 weight-decode tests (CPU and GPU): the scale bytes a tensor of
// rescale exponent k may hold, step words built from codes by the W4A16 layout's bit positions,
// the step-word element at a (row, k) offset, the host run of the table decode
// (sm90_w4a8_decode_table.h), and the enumeration of k32 fragments the exhaustive tests decode.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "backends/sm90_w4a16/sm90_w4a16_layout.h"
#include "backends/sm90_w4a8/sm90_w4a8_decode_table.h"
#include "megamoe/format.h"

namespace megamoe::testing {

// Ue4m3 bytes a tensor with rescale exponent k may hold (6 * s * 2^-k <= 448).
inline std::vector<uint8_t> w4a8_scales_for(int k) {
  std::vector<uint8_t> out;
  for (int s = 0; s <= 0x7E; ++s) {
    const uint8_t b = static_cast<uint8_t>(s);
    if (format::w4a8_weight_rescale_exponent({&b, 1}) <= k) out.push_back(b);
  }
  return out;
}

// A step word holding code[p] at element p (sm90_w4a16_layout.h, code_bit_position).
inline uint32_t w4a16_step_word(const std::array<uint8_t, 8>& code) {
  uint32_t w = 0;
  for (int p = 0; p < 8; ++p) {
    for (int b = 0; b < 4; ++b) {
      w |= uint32_t{static_cast<uint32_t>(code[p] >> b) & 1u} << kernels::sm90::w4a16::code_bit_position(p, b);
    }
  }
  return w;
}

// Element p of a step word at (row offset 8 h, k offset from 2t); -1 if none.
inline int w4a16_element_at(int h, int k_offset) {
  for (int p = 0; p < 8; ++p) {
    if (kernels::sm90::w4a16::nibble_row_offset(p) == 8 * h && kernels::sm90::w4a16::nibble_k_offset(p) == k_offset) {
      return p;
    }
  }
  return -1;
}

// The host run of decode_k32_table on a table's bytes (laid out as the device's).
inline std::array<uint32_t, 4> w4a8_table_decode_host(const std::vector<uint8_t>& table, uint32_t even, uint32_t odd,
                                                      uint32_t scale_word) {
  namespace w4a8 = kernels::sm90::w4a8;
  const auto read_u32 = [&](uint32_t at) {
    return uint32_t{table[at]} | uint32_t{table[at + 1]} << 8 | uint32_t{table[at + 2]} << 16 |
           uint32_t{table[at + 3]} << 24;
  };
  const uint32_t off[4] = {w4a8::table_offset<0>(scale_word, 0), w4a8::table_offset<0>(scale_word, 1),
                           w4a8::table_offset<1>(scale_word, 0), w4a8::table_offset<1>(scale_word, 1)};
  const w4a8::TableOperands op = w4a8::table_operands(even, odd);
  std::array<uint32_t, 4> a{};
  for (int r = 0; r < 4; ++r) a[r] = w4a8::table_lookup(read_u32(off[r]), read_u32(off[r] + 4), op.selector[r], op.sign[r]);
  return a;
}

// One k32 fragment's inputs: the codes of step words 2i and 2i + 1, the scale of each (row h,
// step) slot, and the words the decode reads.
struct W4a8DecodeCase {
  std::array<uint8_t, 8> code[2];
  uint8_t scale[2][2];  // [row h][step]
  uint32_t word[2];
  uint32_t scale_word;
};

// Every valid scale byte of rows r0 (rescale exponent k) and r1 (k_up) in every (row, step) slot,
// every code at every element: case (i, c) gives slot (h, s) scale i + 3 s of its row's list and
// element p of step s code (c + 5 p + 3 s) % 16 (0 where the scale is 0, as the prepack stores).
inline std::vector<W4a8DecodeCase> w4a8_decode_cases(int k, int k_up) {
  namespace w4a16 = kernels::sm90::w4a16;
  const std::vector<uint8_t> valid = w4a8_scales_for(k), valid_up = w4a8_scales_for(k_up);
  const size_t n = std::max(valid.size(), valid_up.size());
  std::vector<W4a8DecodeCase> cases;
  for (size_t i = 0; i < n; ++i) {
    for (int c = 0; c < 16; ++c) {
      W4a8DecodeCase f{};
      for (int h = 0; h < 2; ++h) {
        const std::vector<uint8_t>& v = h ? valid_up : valid;
        for (int s = 0; s < 2; ++s) f.scale[h][s] = v[(i + static_cast<size_t>(3 * s)) % v.size()];
      }
      for (int s = 0; s < 2; ++s) {
        for (int p = 0; p < 8; ++p) {
          const int h = w4a16::nibble_row_offset(p) / 8;
          f.code[s][p] = f.scale[h][s] == 0 ? 0 : static_cast<uint8_t>((c + 5 * p + 3 * s) % 16);
        }
        f.word[s] = w4a16_step_word(f.code[s]);
      }
      const uint16_t half0 = w4a16::scale_half(w4a16::encode_scale(f.scale[0][0]), w4a16::encode_scale(f.scale[0][1]));
      const uint16_t half1 = w4a16::scale_half(w4a16::encode_scale(f.scale[1][0]), w4a16::encode_scale(f.scale[1][1]));
      f.scale_word = uint32_t{half0} | uint32_t{half1} << 16;
      cases.push_back(f);
    }
  }
  return cases;
}

}  // namespace megamoe::testing
