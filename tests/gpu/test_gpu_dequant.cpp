// The device NVFP4 decoders (kernels/common/nvfp4_decode.cuh), through the dequantizer, against
// the CPU codecs: every e2m1 code with every ue4m3 scale code, bit for bit.
#include <gtest/gtest.h>

#include <cmath>

#include "gpu_test_util.h"
#include "megamoe/dtype.h"
#include "megamoe/format.h"
#include "megamoe/status.h"
#include "tests/common/test_util.h"

namespace megamoe {
namespace {

using testing::DeviceBuffer;

std::vector<uint16_t> cpu_dequant_bf16(const format::Nvfp4View& w) {
  std::vector<float> f(static_cast<size_t>(w.rows * w.cols));
  format::dequantize(w, f);
  std::vector<uint16_t> out(f.size());
  for (size_t i = 0; i < f.size(); ++i) out[i] = f32_to_bf16(f[i]);
  return out;
}

void expect_gpu_matches_cpu(const std::vector<uint8_t>& codes, const std::vector<uint8_t>& scales,
                            float s2, int64_t rows, int64_t cols) {
  DeviceBuffer<uint8_t> d_codes(codes), d_scales(scales);
  DeviceBuffer<uint16_t> d_out(static_cast<size_t>(rows * cols));
  d_out.poison();
  gpu::dequantize_nvfp4(d_codes.get(), d_scales.get(), s2, rows, cols, d_out.get(), nullptr);
  gpu::check_cuda(cudaDeviceSynchronize(), "dequantize_nvfp4");
  const auto got = d_out.download();
  const auto want = cpu_dequant_bf16({rows, cols, codes.data(), scales.data(), s2});
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], want[i]) << "element " << i << " (row " << i / cols << ", col " << i % cols
                               << "): code " << int(format::e2m1_code_at(codes.data(), i))
                               << ", scale byte 0x" << std::hex << int(scales[i / 16]);
  }
}

TEST(GpuDequant, EveryCodeWithEveryValidScale) {
  MEGAMOE_REQUIRE_GPU();
  // One row per valid ue4m3 scale byte (0x00..0x7E), each row holding every e2m1 code twice
  // in a row-dependent order, so a permuted nibble or a mis-decoded subnormal scale shows.
  const int64_t rows = 0x7F, cols = 32;
  std::vector<uint8_t> codes(rows * cols / 2), scales(rows * cols / 16);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t code = static_cast<uint8_t>((c + 3 * r) & 0xF);
      uint8_t& b = codes[(r * cols + c) / 2];
      b = (c & 1) ? static_cast<uint8_t>((b & 0x0F) | (code << 4)) : static_cast<uint8_t>((b & 0xF0) | code);
    }
    scales[r * 2] = static_cast<uint8_t>(r);
    scales[r * 2 + 1] = static_cast<uint8_t>(0x7E - r);
  }
  expect_gpu_matches_cpu(codes, scales, 1.0f, rows, cols);
  expect_gpu_matches_cpu(codes, scales, 3.7e-3f, rows, cols);
}

TEST(GpuDequant, RandomTensor) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t rows = 333, cols = 16 * 37;
  std::vector<uint8_t> codes(rows * cols / 2), scales(rows * cols / 16);
  for (auto& b : codes) b = static_cast<uint8_t>(rng());
  for (auto& s : scales) s = static_cast<uint8_t>(rng() % 0x7F);
  expect_gpu_matches_cpu(codes, scales, std::ldexp(1.0f + (rng() % 1000) / 1000.0f, -7), rows, cols);
}

TEST(GpuDequant, RejectsBadShape) {
  EXPECT_THROW(gpu::dequantize_nvfp4(nullptr, nullptr, 1.0f, 4, 24, nullptr, nullptr), Error);
}

}  // namespace
}  // namespace megamoe
