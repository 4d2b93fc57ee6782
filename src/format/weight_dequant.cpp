// NVFP4 weights decoded on the host, to fp32 and to bf16 rounded once from the exact product, and
// MXFP4 weights to fp32 (docs/design.md §2).
#include "megamoe/format.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <span>

#include "format/arg_checks.h"
#include "format/codec_tables.h"
#include "megamoe/dtype.h"
#include "megamoe/status.h"

namespace megamoe::format {

using detail::check_positive_finite;
using detail::check_span_size;
using detail::check_ue4m3_scales;
using detail::checked_elements;
using detail::kE2m1Values;
using detail::kE4m3Values;

namespace {

// The checks both dequantize entry points share. Returns false (after zero-filling `out`) for
// the zero-weight signature, true when the caller should decode.
template <typename T>
bool check_dequantize_args(const char* fn, const Nvfp4View& w, std::span<T> out,
                           const char* out_layout) {
  const int64_t n = checked_elements(fn, w.rows, w.cols, kNvfp4BlockSize);
  check_span_size(fn, "out", out.size(), n, w.rows, w.cols, out_layout);
  if (n == 0) return false;
  MEGAMOE_CHECK(w.codes != nullptr && w.scales != nullptr, kInvalidArgument, fn,
                ": the codes or scales pointer of a non-empty [", w.rows, ", ", w.cols,
                "] weight is null.");
  if (is_modelopt_zero_weight(w)) {
    std::fill(out.begin(), out.end(), T{0});
    return false;
  }
  check_positive_finite(fn, "global_scale (weight_scale_2)", w.global_scale);
  const int64_t blocks = w.cols / kNvfp4BlockSize;
  check_ue4m3_scales(fn, w.scales, w.rows * blocks, blocks);
  return true;
}

// Calls emit(index, m) for every element, m = e2m1 * ue4m3: at most 2 + 4 significant bits,
// exact in fp32. The global scale is the caller's one rounding.
template <typename Emit>
void decode_unscaled(const Nvfp4View& w, Emit&& emit) {
  const int64_t blocks = w.cols / kNvfp4BlockSize;
  for (int64_t r = 0; r < w.rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float scale = kE4m3Values[w.scales[r * blocks + b]];
      const uint8_t* in = w.codes + r * (w.cols / 2) + b * (kNvfp4BlockSize / 2);
      const int64_t o = r * w.cols + b * kNvfp4BlockSize;
      for (int j = 0; j < kNvfp4BlockSize / 2; ++j) {
        emit(o + 2 * j, kE2m1Values[in[j] & 0xF] * scale);
        emit(o + 2 * j + 1, kE2m1Values[in[j] >> 4] * scale);
      }
    }
  }
}

// bf16 RNE of the exact product m * s2. The fp32 product f = fl32(m * s2) rounds once; rounding
// f again to bf16 is correct except where f lands exactly on a bf16 midpoint (low 16 bits
// 0x8000) that the exact product is not on: every bf16 midpoint is an fp32 number and rounding
// is monotone, so f can reach a midpoint but never cross one. There the double product, exact
// (6 + 24 significant bits), says which side the true value lies on. Infinity and fp32
// subnormals need nothing more: a product that overflows fp32 also overflows bf16, and bf16
// midpoints below the normal range are still fp32 numbers.
inline uint16_t product_to_bf16(float m, float s2) {
  const float f = m * s2;
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0xFFFFu) != 0x8000u) return f32_to_bf16(f);
  const double exact = static_cast<double>(m) * static_cast<double>(s2);
  const double fd = static_cast<double>(f);
  const uint16_t down = static_cast<uint16_t>(u >> 16);  // truncation: toward zero
  if (std::fabs(exact) > std::fabs(fd)) return static_cast<uint16_t>(down + 1);
  if (std::fabs(exact) < std::fabs(fd)) return down;
  return f32_to_bf16(f);  // a true tie: to even
}

}  // namespace

void dequantize(const Nvfp4View& w, std::span<float> out) {
  if (!check_dequantize_args("dequantize", w, out, "rows * cols fp32 values")) return;
  float* o = out.data();
  const float s2 = w.global_scale;
  decode_unscaled(w, [&](int64_t i, float m) { o[i] = m * s2; });
}

void dequantize_to_bf16(const Nvfp4View& w, std::span<uint16_t> out) {
  if (!check_dequantize_args("dequantize_to_bf16", w, out, "rows * cols bf16 values")) return;
  uint16_t* o = out.data();
  const float s2 = w.global_scale;
  decode_unscaled(w, [&](int64_t i, float m) { o[i] = product_to_bf16(m, s2); });
}

void dequantize_mxfp4(std::span<const uint8_t> codes, std::span<const uint8_t> scales,
                      int64_t rows, int64_t cols, std::span<float> out) {
  static constexpr const char* kFn = "dequantize_mxfp4";
  const int64_t n = checked_elements(kFn, rows, cols, kMxfp4BlockSize);
  check_span_size(kFn, "codes", codes.size(), n / 2, rows, cols, "rows * cols / 2 packed bytes");
  check_span_size(kFn, "scales", scales.size(), n / kMxfp4BlockSize, rows, cols,
                  "rows * cols / 32 ue8m0 bytes");
  check_span_size(kFn, "out", out.size(), n, rows, cols, "rows * cols fp32 values");
  const int64_t blocks_per_row = cols / kMxfp4BlockSize;
  for (int64_t i = 0; i < n / kMxfp4BlockSize; ++i) {
    MEGAMOE_CHECK(scales[i] != 0xFF, kInvalidArgument, kFn, ": the ue8m0 scale of row ",
                  i / blocks_per_row, ", block ", i % blocks_per_row,
                  " is 0xFF (NaN); allowed scale bytes are 0x00..0xFE (2^-127..2^127).");
  }
  for (int64_t i = 0; i < n; ++i) {
    // A power-of-two scaling of a 2-bit significand: exact (0.5 * 2^-127 is still an fp32
    // subnormal), except that magnitudes of 2^128 or more, reachable only with the two largest
    // scale bytes, exceed fp32 and become infinity.
    out[i] = e2m1_to_f32(e2m1_code_at(codes.data(), i)) *
             ue8m0_to_f32(scales[i / kMxfp4BlockSize]);
  }
}

}  // namespace megamoe::format
