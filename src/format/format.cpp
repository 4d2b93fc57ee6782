// NVFP4 / MXFP4 host numerics (docs/design.md §2). Everything here is exact or rounds once, to
// nearest even, at the point the design says; there is no fast-math anywhere in this file.
#include "megamoe/format.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "core/bits.h"
#include "megamoe/dtype.h"
#include "megamoe/status.h"

namespace megamoe::format {

namespace {

using detail::shift_right_rne;

// 2^e for small |e|, by repeated exact doubling/halving so it can run at compile time.
constexpr float pow2(int e) {
  float v = 1.0f;
  for (; e > 0; --e) v *= 2.0f;
  for (; e < 0; ++e) v *= 0.5f;
  return v;
}

// All 256 float8_e4m3fn values: (8 + m) * 2^(e - 10) for e >= 1, m * 2^-9 for e == 0.
constexpr std::array<float, 256> make_e4m3_table() {
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) {
    const int e = (c >> 3) & 0xF;
    const int m = c & 0x7;
    float mag;
    if (e == 0xF && m == 0x7) {
      mag = std::numeric_limits<float>::quiet_NaN();
    } else if (e == 0) {
      mag = static_cast<float>(m) * pow2(-9);
    } else {
      mag = static_cast<float>(8 + m) * pow2(e - 10);
    }
    t[c] = (c & 0x80) ? -mag : mag;
  }
  return t;
}
constexpr std::array<float, 256> kE4m3Values = make_e4m3_table();

constexpr std::array<float, 16> kE2m1Values = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,
                                               4.0f,  6.0f,  -0.0f, -0.5f, -1.0f, -1.5f,
                                               -2.0f, -3.0f, -4.0f, -6.0f};

// Magnitude code (0..7) of a = |q| on the E2M1 grid, round to nearest even, saturating at 6.
// Each comparison is one boundary of docs/design.md §2: a tie between two grid points goes to the
// even code, so the comparison is strict (>) where the lower neighbour is even and >= where the
// upper one is. This is ModelOpt's searchsorted + "odd bound rounds up" written out. NaN fails
// every comparison and maps to 0; +inf passes all and maps to 7 (6.0).
inline uint8_t e2m1_magnitude_code(float a) {
  return static_cast<uint8_t>((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) +
                              (a > 2.5f) + (a >= 3.5f) + (a > 5.0f));
}

// ModelOpt's _cast_fp4 takes the sign from (q < 0): a quotient of -0.0 (a negative-zero weight,
// or a tiny negative one whose quotient underflows) gets code 0x0, not 0x8. Both decode to zero;
// this keeps the bytes identical to ModelOpt's.
inline uint8_t e2m1_code_modelopt(float q) {
  return static_cast<uint8_t>((q < 0.0f ? 0x8 : 0x0) | e2m1_magnitude_code(std::fabs(q)));
}

constexpr float kMinBlockScale = pow2(-9);  // the smallest positive e4m3 value (subnormal 0x01)

// Shape checks shared by every matrix entry point. Returns rows * cols.
int64_t checked_elements(const char* fn, int64_t rows, int64_t cols, int block) {
  MEGAMOE_CHECK(rows >= 0 && cols >= 0, kInvalidArgument, fn, ": the shape [", rows, ", ", cols,
                "] has a negative dimension; rows and cols must be >= 0.");
  MEGAMOE_CHECK(cols % block == 0, kInvalidArgument, fn, ": cols = ", cols,
                " is not a multiple of ", block, "; the format has one scale per ", block,
                " consecutive elements along K, so K must be a multiple of ", block, ".");
  MEGAMOE_CHECK(cols == 0 || rows <= std::numeric_limits<int64_t>::max() / cols,
                kInvalidArgument, fn, ": the shape [", rows, ", ", cols,
                "] has more elements than fit in int64.");
  return rows * cols;
}

void check_span_size(const char* fn, const char* name, size_t got, int64_t want, int64_t rows,
                     int64_t cols, const char* layout) {
  MEGAMOE_CHECK(got == static_cast<uint64_t>(want), kInvalidArgument, fn, ": `", name, "` has ",
                got, " elements, but a [", rows, ", ", cols, "] matrix needs ", want, " (",
                layout, ").");
}

void check_positive_finite(const char* fn, const char* name, float v) {
  MEGAMOE_CHECK(std::isfinite(v) && v > 0.0f, kInvalidArgument, fn, ": ", name, " = ", v,
                " is not allowed; it must be a finite number greater than 0.");
}

// amax(|w|) over a [rows, cols] matrix; throws on the first non-finite element, naming it.
float checked_amax(const char* fn, const char* name, const float* w, int64_t n, int64_t cols) {
  float amax = 0.0f;
  bool all_finite = true;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(w[i]);
    all_finite &= (a <= FLT_MAX);  // false for inf and NaN
    amax = a > amax ? a : amax;
  }
  if (!all_finite) {
    for (int64_t i = 0; i < n; ++i) {
      MEGAMOE_CHECK(std::isfinite(w[i]), kInvalidArgument, fn, ": `", name, "` element [",
                    i / cols, ", ", i % cols, "] is ", w[i],
                    "; NVFP4 quantization needs every value to be finite (no NaN or infinity).");
    }
  }
  return amax;
}

std::string hex_byte(uint8_t b) {
  static constexpr char kDigits[] = "0123456789ABCDEF";
  return std::string{'0', 'x', kDigits[b >> 4], kDigits[b & 0xF]};
}

// Every byte of a ue4m3 scale array must be a valid scale; names the first bad one.
void check_ue4m3_scales(const char* fn, const uint8_t* scales, int64_t n, int64_t blocks_per_row) {
  for (int64_t i = 0; i < n; ++i) {
    if (!ue4m3_is_valid(scales[i])) {
      MEGAMOE_FAIL(kInvalidArgument, fn, ": the block scale of row ", i / blocks_per_row,
                   ", block ", i % blocks_per_row, " is byte ", hex_byte(scales[i]), " (",
                   e4m3_to_f32(scales[i]),
                   "); a ue4m3 scale must be finite and non-negative (sign bit clear, not 0x7F).");
    }
  }
}

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

float e2m1_to_f32(uint8_t code) { return kE2m1Values[code & 0xF]; }

uint8_t f32_to_e2m1(float x) {
  // NaN: the magnitude code is 0 and the sign is dropped, giving +0 as documented.
  if (std::isnan(x)) return 0x0;
  return static_cast<uint8_t>((std::signbit(x) ? 0x8 : 0x0) | e2m1_magnitude_code(std::fabs(x)));
}

float e4m3_to_f32(uint8_t code) { return kE4m3Values[code]; }

uint8_t f32_to_e4m3(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7F;
  // 448 = 0x7E is the largest finite code. Values in (448, 464] would round to it anyway; larger
  // ones (and infinity) would round to 480, which e4m3fn does not have: saturate.
  if (a >= std::bit_cast<uint32_t>(kE4m3Max)) return static_cast<uint8_t>(sign | 0x7E);
  const int exp = static_cast<int>(a >> 23) - 127;
  if (exp >= -6) {
    // e4m3 normal range [2^-6, 448): re-bias the exponent (127 -> 7), then round the 23-bit
    // mantissa to 3 bits; a mantissa carry bumps the exponent, at most up to 448 (0x7E).
    uint32_t t = a - (static_cast<uint32_t>(127 - 7) << 23);
    t += 0x7FFFFu + ((t >> 20) & 1u);
    return static_cast<uint8_t>(sign | (t >> 20));
  }
  // Subnormal range: the value in units of 2^-9 (codes 0..8; 8 is 2^-6, the smallest normal).
  // value = m * 2^(e - 23) = m * 2^(e - 14) units, with e <= -7.
  const uint32_t field = a >> 23;
  const uint32_t m = (a & 0x7FFFFFu) | (field ? 0x800000u : 0u);
  const int e = field ? exp : -126;
  return static_cast<uint8_t>(sign | shift_right_rne(m, 14 - e));
}

bool ue4m3_is_valid(uint8_t code) { return (code & 0x80) == 0 && code != 0x7F; }

// e5m2 is the upper byte of an IEEE half (same sign, 5-bit exponent and bias 15), so its decode
// is the exact half decode of (code << 8), infinities and NaN included.
float e5m2_to_f32(uint8_t code) { return f16_to_f32(static_cast<uint16_t>(code << 8)); }

float ue8m0_to_f32(uint8_t code) {
  if (code == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(code) - 127);  // exact: 2^-127 is an fp32 subnormal
}

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

// ---- W4A8 (docs/w4a8.md) ------------------------------------------------------------------

uint8_t f64_to_e4m3(double x, E4m3Overflow overflow) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(x);
  // Above 464 RNE would give 480, which e4m3fn does not have (464 itself ties to 448).
  if (a > 464.0) {
    return static_cast<uint8_t>(sign | (overflow == E4m3Overflow::kSaturate ? 0x7E : 0x7F));
  }
  // e4m3 keeps 4 significant bits: the spacing near a in [2^(e-1), 2^e) is 2^(e-4); below the
  // normal range (2^-6) it is the subnormal spacing 2^-9.
  int e = 0;
  std::frexp(a, &e);
  const int q = std::max(e - 4, -9);
  const double scaled = std::ldexp(a, -q);  // exact: a power-of-two scaling, at most 2^5 down
  double r = std::floor(scaled);
  const double frac = scaled - r;  // exact
  if (frac > 0.5 || (frac == 0.5 && std::fmod(r, 2.0) != 0.0)) r += 1.0;
  // r * 2^q is an e4m3 value <= 448, exact in fp32, so f32_to_e4m3 only encodes it.
  return static_cast<uint8_t>(sign | f32_to_e4m3(static_cast<float>(std::ldexp(r, q))));
}

int w4a8_act_scale_exponent(double amax) {
  MEGAMOE_CHECK(std::isfinite(amax) && amax >= 0.0, kInvalidArgument,
                "w4a8_act_scale_exponent: amax = ", amax,
                " is not allowed; it must be a finite number >= 0.");
  if (amax == 0.0) return kW4a8MinActScaleExp;
  // amax in [2^(E-1), 2^E): amax * 2^(9-E) is in [256, 512). 448 < 512, so e = E - 9 is the
  // answer when that value is <= 448, else E - 8 (amax * 2^(8-E) < 256 <= 448). Exact compare.
  int E = 0;
  std::frexp(amax, &E);
  const int e = std::ldexp(amax, 9 - E) <= static_cast<double>(kE4m3Max) ? E - 9 : E - 8;
  return std::max(e, kW4a8MinActScaleExp);
}

void quantize_activation_w4a8(std::span<const double> x, int64_t rows, int64_t cols,
                              std::span<uint8_t> codes, std::span<int32_t> scale_exponents) {
  static constexpr const char* kFn = "quantize_activation_w4a8";
  const int64_t n = checked_elements(kFn, rows, cols, kW4a8ActBlockSize);
  check_span_size(kFn, "x", x.size(), n, rows, cols, "rows * cols values");
  check_span_size(kFn, "codes", codes.size(), n, rows, cols, "rows * cols e4m3 bytes");
  check_span_size(kFn, "scale_exponents", scale_exponents.size(), n / kW4a8ActBlockSize, rows,
                  cols, "rows * cols / 128 exponents");
  for (int64_t i = 0; i < n; ++i) {
    MEGAMOE_CHECK(std::isfinite(x[i]), kInvalidArgument, kFn, ": element [", i / cols, ", ",
                  i % cols, "] is ", x[i], "; W4A8 quantization needs finite values.");
  }
  for (int64_t blk = 0; blk < n / kW4a8ActBlockSize; ++blk) {
    const double* v = x.data() + blk * kW4a8ActBlockSize;
    double amax = 0.0;
    for (int i = 0; i < kW4a8ActBlockSize; ++i) amax = std::max(amax, std::fabs(v[i]));
    const int e = w4a8_act_scale_exponent(amax);
    scale_exponents[blk] = e;
    for (int i = 0; i < kW4a8ActBlockSize; ++i) {
      codes[blk * kW4a8ActBlockSize + i] = f64_to_e4m3(std::ldexp(v[i], -e));
    }
  }
}

int w4a8_weight_rescale_exponent(std::span<const uint8_t> block_scales) {
  // Non-negative e4m3 codes are ordered like their values, so the largest byte is the largest
  // scale.
  uint8_t largest = 0;
  for (size_t i = 0; i < block_scales.size(); ++i) {
    const uint8_t b = block_scales[i];
    MEGAMOE_CHECK(ue4m3_is_valid(b), kInvalidArgument, "w4a8_weight_rescale_exponent: block scale ",
                  i, " is the byte ", hex_byte(b),
                  ", not a valid ue4m3 scale (it must be finite and non-negative).");
    largest = std::max(largest, b);
  }
  if (largest == 0) return 0;
  const double worst = static_cast<double>(kE2m1Max) * kE4m3Values[largest];  // exact
  int k = -16;  // 6 * 2^-9 * 2^16 = 768 > 448: the loop always moves past it
  while (std::ldexp(worst, -k) > static_cast<double>(kE4m3Max)) ++k;
  return k;
}

uint8_t w4a8_weight_e4m3(uint8_t e2m1_code, uint8_t scale_byte, int k) {
  // e2m1 * ue4m3 has at most 2 + 4 significant bits, and 2^-k only moves the exponent: exact.
  const double product = static_cast<double>(kE2m1Values[e2m1_code & 0xF]) *
                         static_cast<double>(kE4m3Values[scale_byte]);
  return f64_to_e4m3(std::ldexp(product, -k), E4m3Overflow::kSaturate);
}

W4a8WeightStats w4a8_weight_stats(const Nvfp4View& w) {
  static constexpr const char* kFn = "w4a8_weight_stats";
  const int64_t n = checked_elements(kFn, w.rows, w.cols, kNvfp4BlockSize);
  W4a8WeightStats st;
  st.weights = n;
  if (n == 0) return st;
  MEGAMOE_CHECK(w.codes != nullptr && w.scales != nullptr, kInvalidArgument, kFn,
                ": the codes or scales pointer of a non-empty [", w.rows, ", ", w.cols,
                "] weight is null.");
  const int64_t blocks = n / kNvfp4BlockSize;
  check_ue4m3_scales(kFn, w.scales, blocks, w.cols / kNvfp4BlockSize);
  st.rescale_exponent = w4a8_weight_rescale_exponent({w.scales, static_cast<size_t>(blocks)});
  // What happens to each (scale byte, magnitude code) pair: 0 zero product, 1 exact,
  // 2 rounded (normal result), 3 rounded into the subnormals, 4 flushed.
  std::array<std::array<uint8_t, 8>, 128> kind{};
  for (int s = 0; s < 128; ++s) {
    if (!ue4m3_is_valid(static_cast<uint8_t>(s))) continue;
    for (int c = 1; c < 8; ++c) {
      const double p = std::ldexp(static_cast<double>(kE2m1Values[c]) * kE4m3Values[s],
                                  -st.rescale_exponent);
      if (p == 0.0) continue;
      const double q = kE4m3Values[w4a8_weight_e4m3(static_cast<uint8_t>(c),
                                                    static_cast<uint8_t>(s),
                                                    st.rescale_exponent)];
      kind[s][c] = q == p ? 1 : q == 0.0 ? 4 : q < pow2(-6) ? 3 : 2;
    }
  }
  std::array<int64_t, 5> count{};
  for (int64_t b = 0; b < blocks; ++b) {
    const auto& row = kind[w.scales[b]];
    const uint8_t* c = w.codes + b * (kNvfp4BlockSize / 2);
    for (int j = 0; j < kNvfp4BlockSize / 2; ++j) {
      ++count[row[c[j] & 0x7]];
      ++count[row[(c[j] >> 4) & 0x7]];
    }
  }
  st.nonzero = count[1] + count[2] + count[3] + count[4];
  st.rounded = count[2];
  st.subnormal = count[3];
  st.flushed = count[4];
  return st;
}

}  // namespace megamoe::format
