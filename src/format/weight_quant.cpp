// The ModelOpt NVFP4 weight recipe (docs/design.md §2), bit for bit: the global scale as the
// exporter evaluates it on each device, the block loop in its evaluation order, and the
// zero-weight signature it writes. No fast-math: every rounding is one the exporter makes.
#include "megamoe/format.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

#include "format/arg_checks.h"
#include "format/codec_tables.h"
#include "megamoe/status.h"

namespace megamoe::format {

using detail::check_span_size;
using detail::checked_amax;
using detail::checked_elements;
using detail::e2m1_magnitude_code;
using detail::kE4m3Values;
using detail::pow2;

namespace {

// ModelOpt's _cast_fp4 takes the sign from (q < 0): a quotient of -0.0 (a negative-zero weight,
// or a tiny negative one whose quotient underflows) gets code 0x0, not 0x8. Both decode to zero;
// this keeps the bytes identical to ModelOpt's.
inline uint8_t e2m1_code_modelopt(float q) {
  return static_cast<uint8_t>((q < 0.0f ? 0x8 : 0x0) | e2m1_magnitude_code(std::fabs(q)));
}

constexpr float kMinBlockScale = pow2(-9);  // the smallest positive e4m3 value (subnormal 0x01)

// The ModelOpt block loop (docs/design.md §2), given s2. All arithmetic is fp32, in the order
// PyTorch evaluates ModelOpt's NVFP4QTensor expressions, so every rounding matches:
//   ratio   = fl32(amax_block / fl32(6 * s2))      get_weights_scaling_factor: amax / (6.0 * s2)
//   ratio   = 1.0 where ratio == 0                  "per_block_scale[per_block_scale == 0] = 1.0"
//   scale   = e4m3_rne(clamp(ratio, 2^-9, 448))     .to(torch.float8_e4m3fn), RNE
//   divisor = fl32(e4m3_as_f32(scale) * s2)         (scale.to(float32) * s2), one product ...
//   q       = fl32(x / divisor)                     ... then one true division (not x * 1/d,
//                                                   not x / scale / s2: each rounds differently)
//   code    = e2m1_rne(q), sign from (q < 0)        _cast_fp4
// ratio == 0 is exactly "the block amax is 0" except where amax_block / (6 * s2) underflows
// fp32; there ModelOpt also writes 1.0 and every code is 0 either way. The clamp is docs/design.md's:
// it only changes ratios <= 2^-10 (which e4m3 would round to a zero scale, making the block
// undecodable) and ratios above 448 (only reachable with a caller-given global scale).
// Inputs are known finite and shapes checked. No allocation: it is the hot loop of `quantize`.
void quantize_blocks_modelopt(const float* w, int64_t rows, int64_t cols, float s2,
                              uint8_t* codes, uint8_t* scales, ExportDevice device) {
  const int64_t blocks = cols / kNvfp4BlockSize;
  if (s2 == 0.0f) {
    // amax == 0: the recipe's ratio is 0 / (6 * 0) = NaN for every block (so the "== 0 -> 1.0"
    // step does not apply; the clamp keeps NaN), and every quotient x / (NaN * 0) is NaN. Written
    // out, as the exporter writes it on `device` (format.h, ExportDevice).
    std::fill(scales, scales + rows * blocks,
              device == ExportDevice::kCpu ? kZeroWeightScaleByteCpu : kZeroWeightScaleByteGpu);
    std::fill(codes, codes + rows * (cols / 2), kZeroWeightCodeByte);
    return;
  }
  const float six_s2 = 6.0f * s2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = w + r * cols;
    uint8_t* row_codes = codes + r * (cols / 2);
    uint8_t* row_scales = scales + r * blocks;
    for (int64_t b = 0; b < blocks; ++b) {
      const float* x = row + b * kNvfp4BlockSize;
      float amax_block = 0.0f;
      for (int i = 0; i < kNvfp4BlockSize; ++i) {
        const float a = std::fabs(x[i]);
        amax_block = a > amax_block ? a : amax_block;
      }
      float ratio = amax_block / six_s2;
      if (ratio == 0.0f) ratio = 1.0f;
      const uint8_t scale = f32_to_e4m3(std::clamp(ratio, kMinBlockScale, kE4m3Max));
      row_scales[b] = scale;
      const float divisor = kE4m3Values[scale] * s2;
      uint8_t* out = row_codes + b * (kNvfp4BlockSize / 2);
      for (int j = 0; j < kNvfp4BlockSize / 2; ++j) {
        out[j] = pack_e2m1_pair(e2m1_code_modelopt(x[2 * j] / divisor),
                                e2m1_code_modelopt(x[2 * j + 1] / divisor));
      }
    }
  }
}

// Shape and size checks common to both weight entry points.
void check_weight_args(const char* fn, std::span<const float> w, int64_t rows, int64_t cols,
                       std::span<uint8_t> codes, std::span<uint8_t> scales) {
  const int64_t n = checked_elements(fn, rows, cols, kNvfp4BlockSize);
  check_span_size(fn, "w", w.size(), n, rows, cols, "rows * cols fp32 values");
  check_span_size(fn, "codes", codes.size(), n / 2, rows, cols, "rows * cols / 2 packed bytes");
  check_span_size(fn, "scales", scales.size(), n / kNvfp4BlockSize, rows, cols,
                  "rows * cols / 16 ue4m3 bytes");
}

}  // namespace

const char* export_device_name(ExportDevice d) { return d == ExportDevice::kCpu ? "cpu" : "gpu"; }

bool is_modelopt_zero_weight(const Nvfp4View& w) {
  if (w.global_scale != 0.0f || w.rows <= 0 || w.cols <= 0 || w.codes == nullptr ||
      w.scales == nullptr || w.cols % kNvfp4BlockSize != 0) {
    return false;
  }
  const int64_t n_scales = w.rows * (w.cols / kNvfp4BlockSize);
  const int64_t n_codes = w.rows * (w.cols / 2);
  return std::all_of(w.scales, w.scales + n_scales,
                     [](uint8_t b) { return (b & 0x7F) == 0x7F; }) &&
         std::all_of(w.codes, w.codes + n_codes,
                     [](uint8_t b) { return b == kZeroWeightCodeByte; });
}

bool zero_weight_to_decodable(uint8_t* codes, uint8_t* scales, float& global_scale, int64_t rows,
                              int64_t cols) {
  if (!is_modelopt_zero_weight({rows, cols, codes, scales, global_scale})) return false;
  std::fill(codes, codes + rows * (cols / 2), uint8_t{0});
  std::fill(scales, scales + rows * (cols / kNvfp4BlockSize), uint8_t{0});
  global_scale = 1.0f;
  return true;
}

float modelopt_global_scale(float amax, ExportDevice device) {
  MEGAMOE_CHECK(std::isfinite(amax) && amax >= 0.0f, kInvalidArgument,
                "modelopt_global_scale: amax = ", amax,
                " is not allowed; it must be a finite number >= 0.");
  // ModelOpt's `amax.float() / (6.0 * 448.0)`. PyTorch's CPU kernel divides; its CUDA kernel
  // multiplies by the divisor's reciprocal, itself rounded to fp32 first. amax == 0 gives 0
  // either way: the exporter writes it, and the blocks then get the zero-weight signature.
  if (device == ExportDevice::kCpu) return amax / kNvfp4GlobalDivisor;
  constexpr float kReciprocal = 1.0f / kNvfp4GlobalDivisor;  // fl32(1/2688), rounded once
  return amax * kReciprocal;
}

float quantize_weight_modelopt(std::span<const float> w, int64_t rows, int64_t cols,
                               std::span<uint8_t> codes, std::span<uint8_t> scales,
                               ExportDevice device) {
  static constexpr const char* kFn = "quantize_weight_modelopt";
  check_weight_args(kFn, w, rows, cols, codes, scales);
  const float s2 =
      modelopt_global_scale(checked_amax(kFn, "w", w.data(), rows * cols, cols), device);
  quantize_blocks_modelopt(w.data(), rows, cols, s2, codes.data(), scales.data(), device);
  return s2;
}

void quantize_weight_with_global_scale(std::span<const float> w, int64_t rows, int64_t cols,
                                       float global_scale, std::span<uint8_t> codes,
                                       std::span<uint8_t> scales, ExportDevice device) {
  static constexpr const char* kFn = "quantize_weight_with_global_scale";
  check_weight_args(kFn, w, rows, cols, codes, scales);
  MEGAMOE_CHECK(std::isfinite(global_scale) && global_scale >= 0.0f, kInvalidArgument, kFn,
                ": global_scale = ", global_scale,
                " is not allowed; it must be a finite number > 0, or 0 for an all-zero weight.");
  // A separate validation pass, so that nothing is written when the input is rejected.
  const float amax = checked_amax(kFn, "w", w.data(), rows * cols, cols);
  MEGAMOE_CHECK(global_scale > 0.0f || amax == 0.0f, kInvalidArgument, kFn,
                ": global_scale = 0 stands for an all-zero weight (amax 0), but `w` holds a "
                "value of magnitude ", amax, "; a weight with non-zero values needs a global "
                "scale > 0.");
  quantize_blocks_modelopt(w.data(), rows, cols, std::fabs(global_scale), codes.data(),
                           scales.data(), device);
}

}  // namespace megamoe::format
