// W4A8 numerics (docs/w4a8.md, normative): e4m3 activations with power-of-two block scales, and
// NVFP4 weights rounded once to e4m3 with one rescale exponent per tensor.
#include "megamoe/format.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <span>

#include "format/arg_checks.h"
#include "format/codec_tables.h"
#include "megamoe/status.h"

namespace megamoe::format {

using detail::check_span_size;
using detail::check_ue4m3_scales;
using detail::checked_elements;
using detail::hex_byte;
using detail::kE2m1Values;
using detail::kE4m3Values;
using detail::pow2;

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
