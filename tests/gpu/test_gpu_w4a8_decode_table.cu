// The table form of the W4A8 weight decode on the device (sm90_w4a8_decode.cuh: fill_decode_table,
// decode_k32_table): the table a CTA fills, byte for byte against the definition, and the decoded
// fragments, bit for bit against the host run of the same sequence (sm90_w4a8_decode_table.h) and
// against format::w4a8_weight_e4m3, for every rescale exponent k (rows r0 and r1 with different
// k, as gate and up), every scale byte valid for k in every (row, step) slot, every code at every
// fragment position. The host side: tests/cpu/test_w4a8_decode_table.cpp.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <vector>

#include "backends/sm90_w4a16/sm90_w4a16_layout.h"
#include "backends/sm90_w4a8/sm90_w4a8_decode.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_decode_table.h"
#include "backends/sm90_w4a8/sm90_w4a8_layout.h"
#include "gpu_test_util.h"
#include "megamoe/format.h"
#include "tests/common/w4a8_decode_cases.h"

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

TEST(GpuW4a8DecodeTable, EveryScaleCodeAndRescaleExponentIsTheDefinedWeight) {
  MEGAMOE_REQUIRE_GPU();
  for (int k = w4a8::kMinRescaleExponent; k <= w4a8::kMaxRescaleExponent; ++k) {
    const int k_up = w4a8::kMaxRescaleExponent + w4a8::kMinRescaleExponent - k;
    SCOPED_TRACE(::testing::Message() << "k = " << k << " (row r0), " << k_up << " (row r1)");
    const std::vector<uint8_t> valid = testing::w4a8_scales_for(k), valid_up = testing::w4a8_scales_for(k_up);
    const std::vector<testing::W4a8DecodeCase> frags = testing::w4a8_decode_cases(k, k_up);
    std::vector<uint32_t> words, scale_words;
    for (const testing::W4a8DecodeCase& f : frags) {
      words.push_back(f.word[0]);
      words.push_back(f.word[1]);
      scale_words.push_back(f.scale_word);
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
      const testing::W4a8DecodeCase& f = frags[static_cast<size_t>(i)];
      const std::array<uint32_t, 4> host = testing::w4a8_table_decode_host(table, f.word[0], f.word[1], f.scale_word);
      for (int r = 0; r < 4; ++r) {
        const uint32_t got = out[static_cast<size_t>(4 * i + r)];
        if (got != host[static_cast<size_t>(r)] && ++mismatches <= 8) {
          ADD_FAILURE() << "fragment " << i << ", register " << r << ": device 0x" << std::hex << got << ", host run 0x"
                        << host[static_cast<size_t>(r)];
        }
        const int h = r & 1, s = r >> 1;
        for (int byte = 0; byte < 4; ++byte) {
          const int p = testing::w4a16_element_at(h, w4a8::k_of_position(byte));
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
