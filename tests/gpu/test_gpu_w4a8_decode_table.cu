// The table form of the W4A8 weight decode on the device (sm90_w4a8_decode.cuh: fill_decode_table,
// decode_k32_table): the table a CTA fills, byte for byte against the definition, and the decoded
// fragments, bit for bit against the host run of the same sequence (sm90_w4a8_decode_table.h) and
// against format::w4a8_weight_e4m3, for every rescale exponent k (rows r0 and r1 with different
// k, as gate and up), every scale byte valid for k in every (row, step) slot, every code at every
// fragment position. The host side: tests/cpu/test_w4a8_decode_table.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "backends/sm90_w4a16/sm90_w4a16_layout.h"
#include "backends/sm90_w4a8/sm90_w4a8_decode.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_decode_table.h"
#include "backends/sm90_w4a8/sm90_w4a8_layout.h"
#include "gpu_test_util.h"
#include "megamoe/format.h"

namespace megamoe {
namespace {

namespace w4a8 = kernels::sm90::w4a8;
namespace w4a16 = kernels::sm90::w4a16;
using testing::DeviceBuffer;

// One CTA fills its table for `exponent_addend`, copies it out, and decodes fragment i of
// (words[2i], words[2i + 1], scale_words[i]) into out[4i..4i + 3].
__global__ void __launch_bounds__(128) decode_table_kernel(const uint32_t* words, const uint32_t* scale_words,
                                                           int fragments, uint32_t exponent_addend,
                                                           uint8_t* table_out, uint32_t* out) {
  __shared__ __align__(16) uint8_t table[w4a8::kTableBytes];
  const int tid = static_cast<int>(threadIdx.x);
  const uint32_t t = static_cast<uint32_t>(__cvta_generic_to_shared(table));
  w4a8::fill_decode_table(t, exponent_addend, tid, 128);
  __syncthreads();
  for (int i = tid; i < w4a8::kTableBytes; i += 128) table_out[i] = table[i];
  for (int i = tid; i < fragments; i += 128) {
    uint32_t a[4];
    w4a8::decode_k32_table(words[2 * i], words[2 * i + 1], scale_words[i], t, a);
    for (int r = 0; r < 4; ++r) out[4 * i + r] = a[r];
  }
}

std::vector<uint8_t> scales_for(int k) {
  std::vector<uint8_t> out;
  for (int s = 0; s <= 0x7E; ++s) {
    const uint8_t b = static_cast<uint8_t>(s);
    if (format::w4a8_weight_rescale_exponent({&b, 1}) <= k) out.push_back(b);
  }
  return out;
}

uint32_t step_word(const std::array<uint8_t, 8>& code) {
  uint32_t w = 0;
  for (int p = 0; p < 8; ++p) {
    for (int b = 0; b < 4; ++b) w |= uint32_t{(code[p] >> b) & 1u} << w4a16::code_bit_position(p, b);
  }
  return w;
}

int element_at(int h, int k_offset) {
  for (int p = 0; p < 8; ++p) {
    if (w4a16::nibble_row_offset(p) == 8 * h && w4a16::nibble_k_offset(p) == k_offset) return p;
  }
  return -1;
}

uint32_t read_u32(const std::vector<uint8_t>& t, uint32_t offset) {
  return uint32_t{t[offset]} | uint32_t{t[offset + 1]} << 8 | uint32_t{t[offset + 2]} << 16 |
         uint32_t{t[offset + 3]} << 24;
}

struct Fragment {
  std::array<uint8_t, 8> code[2];  // step words 2i, 2i + 1
  uint8_t scale[2][2];             // [row h][step]
};

TEST(GpuW4a8DecodeTable, EveryScaleCodeAndRescaleExponentIsTheDefinedWeight) {
  MEGAMOE_REQUIRE_GPU();
  for (int k = w4a8::kMinRescaleExponent; k <= w4a8::kMaxRescaleExponent; ++k) {
    const int k_up = w4a8::kMaxRescaleExponent + w4a8::kMinRescaleExponent - k;
    SCOPED_TRACE(::testing::Message() << "k = " << k << " (row r0), " << k_up << " (row r1)");
    const std::vector<uint8_t> valid = scales_for(k), valid_up = scales_for(k_up);
    const size_t n = std::max(valid.size(), valid_up.size());
    // Fragment (i, c): slot (h, step) has scale i + 3 step of its row's list, element p of step s
    // code (c + 5p + 3s) % 16 (0 where the scale is 0, as the prepack stores).
    std::vector<Fragment> frags;
    std::vector<uint32_t> words, scale_words;
    for (size_t i = 0; i < n; ++i) {
      for (int c = 0; c < 16; ++c) {
        Fragment f{};
        for (int h = 0; h < 2; ++h) {
          const std::vector<uint8_t>& v = h ? valid_up : valid;
          for (int s = 0; s < 2; ++s) f.scale[h][s] = v[(i + static_cast<size_t>(3 * s)) % v.size()];
        }
        for (int s = 0; s < 2; ++s) {
          for (int p = 0; p < 8; ++p) {
            const int h = w4a16::nibble_row_offset(p) / 8;
            f.code[s][p] = f.scale[h][s] == 0 ? 0 : static_cast<uint8_t>((c + 5 * p + 3 * s) % 16);
          }
          words.push_back(step_word(f.code[s]));
        }
        const uint16_t half0 = w4a16::scale_half(w4a16::encode_scale(f.scale[0][0]), w4a16::encode_scale(f.scale[0][1]));
        const uint16_t half1 = w4a16::scale_half(w4a16::encode_scale(f.scale[1][0]), w4a16::encode_scale(f.scale[1][1]));
        scale_words.push_back(uint32_t{half0} | uint32_t{half1} << 16);
        frags.push_back(f);
      }
    }
    const int fragments = static_cast<int>(frags.size());
    const uint32_t addend =
        (w4a8::scale_exponent_addend(k) & 0xFFFFu) | (w4a8::scale_exponent_addend(k_up) & 0xFFFF0000u);
    DeviceBuffer<uint32_t> d_words(words), d_scales(scale_words), d_out(static_cast<size_t>(4 * fragments));
    DeviceBuffer<uint8_t> d_table(static_cast<size_t>(w4a8::kTableBytes));
    d_out.poison();  // 0xFF is NaN in e4m3: no decoded weight (satfinite) is ever that byte
    decode_table_kernel<<<1, 128>>>(d_words.get(), d_scales.get(), fragments, addend, d_table.get(), d_out.get());
    gpu::check_cuda(cudaDeviceSynchronize(), "decode_table_kernel");
    const std::vector<uint8_t> table = d_table.download();
    const std::vector<uint32_t> out = d_out.download();

    // The table: every entry a valid scale of either row's tensor can read, and entry 0.
    int64_t mismatches = 0;
    for (int h = 0; h < 2; ++h) {
      for (const uint8_t scale : h ? valid_up : valid) {
        const int e = w4a16::encode_scale(scale);
        for (int c = 0; c < 8; ++c) {
          const uint8_t want = format::w4a8_weight_e4m3(static_cast<uint8_t>(c), scale, h ? k_up : k);
          const uint8_t got = table[static_cast<size_t>(16 * e + 8 * h + c)];
          if (got != want && ++mismatches <= 8) {
            ADD_FAILURE() << "table entry 0x" << std::hex << e << ", half " << h << ", magnitude " << c << " (scale 0x"
                          << int(scale) << "): got 0x" << int(got) << ", want 0x" << int(want);
          }
        }
      }
    }
    ASSERT_EQ(mismatches, 0);

    // The fragments: the device's registers are the host run's (on the device's own table) and
    // every byte the definition's.
    for (int i = 0; i < fragments; ++i) {
      const Fragment& f = frags[static_cast<size_t>(i)];
      const uint32_t sw = scale_words[static_cast<size_t>(i)];
      const uint32_t off[4] = {w4a8::table_offset<0>(sw, 0), w4a8::table_offset<0>(sw, 1), w4a8::table_offset<1>(sw, 0),
                               w4a8::table_offset<1>(sw, 1)};
      const w4a8::TableOperands op =
          w4a8::table_operands(words[static_cast<size_t>(2 * i)], words[static_cast<size_t>(2 * i + 1)]);
      for (int r = 0; r < 4; ++r) {
        const uint32_t got = out[static_cast<size_t>(4 * i + r)];
        const uint32_t host =
            w4a8::table_lookup(read_u32(table, off[r]), read_u32(table, off[r] + 4), op.selector[r], op.sign[r]);
        if (got != host && ++mismatches <= 8) {
          ADD_FAILURE() << "fragment " << i << ", register " << r << ": device 0x" << std::hex << got << ", host run 0x"
                        << host;
        }
        const int h = r & 1, s = r >> 1;
        for (int byte = 0; byte < 4; ++byte) {
          const int p = element_at(h, w4a8::k_of_position(byte));
          const uint8_t want = format::w4a8_weight_e4m3(f.code[s][p], f.scale[h][s], h ? k_up : k);
          const uint8_t b = static_cast<uint8_t>(got >> (8 * byte));
          if (b != want && ++mismatches <= 8) {
            ADD_FAILURE() << "fragment " << i << ", register " << r << ", byte " << byte << ": code " << int(f.code[s][p])
                          << ", scale 0x" << std::hex << int(f.scale[h][s]) << ": got 0x" << int(b) << ", want 0x"
                          << int(want);
          }
        }
      }
    }
    ASSERT_EQ(mismatches, 0);
  }
}

}  // namespace
}  // namespace megamoe
