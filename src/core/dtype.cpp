#include "megamoe/dtype.h"

#include <bit>
#include <cstdint>
#include <cstring>

#include "core/bits.h"
#include "megamoe/status.h"

namespace megamoe {

using detail::shift_right_rne;

int dtype_size(DType t) {
  switch (t) {
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::F32: return 4;
    case DType::U8: return 1;
    case DType::I8: return 1;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::F8_E4M3: return 1;
    case DType::F8_E5M2: return 1;
  }
  MEGAMOE_FAIL(kInvalidArgument, "dtype_size: DType value ", static_cast<int>(t),
               " is not one of BF16, F16, F32, U8, I8, I32, I64, F8_E4M3, F8_E5M2.");
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::F32: return "F32";
    case DType::U8: return "U8";
    case DType::I8: return "I8";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::F8_E4M3: return "F8_E4M3";
    case DType::F8_E5M2: return "F8_E5M2";
  }
  MEGAMOE_FAIL(kInvalidArgument, "dtype_name: DType value ", static_cast<int>(t),
               " is not one of BF16, F16, F32, U8, I8, I32, I64, F8_E4M3, F8_E5M2.");
}

// Exact, case-sensitive match on the safetensors spelling: a file that says "bf16" is not a
// file this library has been tested against, so it is reported rather than guessed at.
std::optional<DType> dtype_from_name(std::string_view name) {
  static constexpr struct {
    std::string_view name;
    DType type;
  } kNames[] = {{"BF16", DType::BF16}, {"F16", DType::F16},         {"F32", DType::F32},
                {"U8", DType::U8},     {"I8", DType::I8},           {"I32", DType::I32},
                {"I64", DType::I64},   {"F8_E4M3", DType::F8_E4M3}, {"F8_E5M2", DType::F8_E5M2}};
  for (const auto& entry : kNames) {
    if (entry.name == name) return entry.type;
  }
  return std::nullopt;
}

// IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits. Every half is a float, so the
// decode is a re-biasing of the exponent (normals), an exact scaling (subnormals), or a copy of
// the payload (inf/NaN).
float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {
    // man * 2^-24: man < 2^10 converts exactly and the product is a power-of-two scaling.
    const float mag = static_cast<float>(man) * 0x1p-24f;
    return sign ? -mag : mag;
  }
  return std::bit_cast<float>(sign | ((exp + (127 - 15)) << 23) | (man << 13));
}

// Round to nearest even; magnitudes at or above 65520 (the midpoint between 65504, the largest
// half, and 2^16) become infinity, as IEEE requires. NaN stays NaN, made quiet, sign and the top
// payload bits kept.
uint16_t f32_to_f16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  const int exp = static_cast<int>(a >> 23) - 127;
  if (exp >= -14) {
    // Normal half range: re-bias the exponent, then round the 23-bit mantissa to 10 bits; a
    // carry out of the mantissa correctly bumps the exponent (from 65504 up to infinity at most).
    if (exp > 15) return static_cast<uint16_t>(sign | 0x7C00u);
    uint32_t t = a - (static_cast<uint32_t>(127 - 15) << 23);
    t += 0xFFFu + ((t >> 13) & 1u);
    return static_cast<uint16_t>(sign | (t >> 13));
  }
  // Half subnormal range: the value in units of 2^-24, rounded. An fp32 subnormal (exponent
  // field 0) has no implicit bit; it is far below 2^-25 and rounds to 0 either way.
  const uint32_t field = a >> 23;
  const uint32_t m = (a & 0x7FFFFFu) | (field ? 0x800000u : 0u);
  const int e = field ? exp : -126;
  // value = m * 2^(e - 23) = (m * 2^(e + 1)) units of 2^-24; e + 1 <= -14 here.
  return static_cast<uint16_t>(sign | shift_right_rne(m, -(e + 1)));
}

}  // namespace megamoe
