// Element types as they appear in safetensors files, and exact bf16/f16 conversions.
#pragma once

#include <bit>
#include <cstdint>
#include <optional>
#include <string_view>

namespace megamoe {

enum class DType : uint8_t { BF16, F16, F32, U8, I8, I32, I64, F8_E4M3, F8_E5M2 };

// Bytes per element.
int dtype_size(DType t);
// The safetensors spelling: "BF16", "F16", "F32", "U8", "I8", "I32", "I64", "F8_E4M3", "F8_E5M2".
const char* dtype_name(DType t);
std::optional<DType> dtype_from_name(std::string_view name);

// bf16 <-> f32. to_bf16 rounds to nearest even; NaN stays NaN (quiet), infinities stay.
inline float bf16_to_f32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float round_to_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// IEEE half <-> f32 (exact decode; encode rounds to nearest even, overflow to inf).
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

}  // namespace megamoe
