// The scalar codecs of the NVFP4 / MXFP4 formats (docs/design.md §2): e2m1 elements, e4m3 (and
// ue4m3 scale) bytes, e5m2 and ue8m0. Each is exact or rounds once, to nearest even; no fast-math.
#include "megamoe/format.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/bits.h"
#include "format/codec_tables.h"
#include "megamoe/dtype.h"

namespace megamoe::format {

using megamoe::detail::shift_right_rne;
using detail::e2m1_magnitude_code;
using detail::kE2m1Values;
using detail::kE4m3Values;

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

}  // namespace megamoe::format
