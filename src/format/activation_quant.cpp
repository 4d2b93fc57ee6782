// NVFP4 activation quantization (docs/design.md §2): per-16 ue4m3 scales from a global scale gs,
// e2m1 elements, and the way back. Each value rounds once, to nearest even; no fast-math.
#include "megamoe/format.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

#include "format/arg_checks.h"
#include "format/codec_tables.h"
#include "megamoe/status.h"

namespace megamoe::format {

using detail::check_positive_finite;
using detail::check_span_size;
using detail::check_ue4m3_scales;
using detail::checked_amax;
using detail::checked_elements;
using detail::kE4m3Values;

void quantize_activation(std::span<const float> x, int64_t rows, int64_t cols, float gs,
                         std::span<uint8_t> codes, std::span<uint8_t> scales) {
  static constexpr const char* kFn = "quantize_activation";
  const int64_t n = checked_elements(kFn, rows, cols, kNvfp4BlockSize);
  check_span_size(kFn, "x", x.size(), n, rows, cols, "rows * cols fp32 values");
  check_span_size(kFn, "codes", codes.size(), n / 2, rows, cols, "rows * cols / 2 packed bytes");
  check_span_size(kFn, "scales", scales.size(), n / kNvfp4BlockSize, rows, cols,
                  "rows * cols / 16 ue4m3 bytes");
  check_positive_finite(kFn, "gs", gs);
  checked_amax(kFn, "x", x.data(), n, cols);
  const int64_t blocks = n / kNvfp4BlockSize;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const float* v = x.data() + blk * kNvfp4BlockSize;
    float amax_block = 0.0f;
    for (int i = 0; i < kNvfp4BlockSize; ++i) {
      const float a = std::fabs(v[i]);
      amax_block = a > amax_block ? a : amax_block;
    }
    // fp32, left to right: sf = e4m3_rne(fl32(fl32(gs * amax_block) / 6)); f32_to_e4m3
    // saturates at 448 (also when gs * amax_block overflows to infinity).
    const uint8_t sf_code = f32_to_e4m3((gs * amax_block) / kE2m1Max);
    scales[blk] = sf_code;
    const float sf = kE4m3Values[sf_code];
    uint8_t* out = codes.data() + blk * (kNvfp4BlockSize / 2);
    if (sf == 0.0f) {
      // The whole block is below the smallest scale: every element is 0.
      std::fill(out, out + kNvfp4BlockSize / 2, uint8_t{0});
      continue;
    }
    for (int j = 0; j < kNvfp4BlockSize / 2; ++j) {
      out[j] = pack_e2m1_pair(f32_to_e2m1((v[2 * j] * gs) / sf),
                              f32_to_e2m1((v[2 * j + 1] * gs) / sf));
    }
  }
}

void dequantize_activation(std::span<const uint8_t> codes, std::span<const uint8_t> scales,
                           int64_t rows, int64_t cols, float gs, std::span<float> out) {
  static constexpr const char* kFn = "dequantize_activation";
  const int64_t n = checked_elements(kFn, rows, cols, kNvfp4BlockSize);
  check_span_size(kFn, "codes", codes.size(), n / 2, rows, cols, "rows * cols / 2 packed bytes");
  check_span_size(kFn, "scales", scales.size(), n / kNvfp4BlockSize, rows, cols,
                  "rows * cols / 16 ue4m3 bytes");
  check_span_size(kFn, "out", out.size(), n, rows, cols, "rows * cols fp32 values");
  check_positive_finite(kFn, "gs", gs);
  check_ue4m3_scales(kFn, scales.data(), n / kNvfp4BlockSize, cols / kNvfp4BlockSize);
  for (int64_t i = 0; i < n; ++i) {
    // e2m1 * sf is exact; the division by gs is the one rounding.
    const float sf = kE4m3Values[scales[i / kNvfp4BlockSize]];
    out[i] = (e2m1_to_f32(e2m1_code_at(codes.data(), i)) * sf) / gs;
  }
}

}  // namespace megamoe::format
