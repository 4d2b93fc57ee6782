// Arithmetic the reference suites check the library against, written here from the formats'
// definitions and sharing no code with it: the e2m1 values, a double -> bf16 rounding, silu, and
// NVFP4 linears built code by code.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "megamoe/dtype.h"
#include "megamoe/format.h"
#include "megamoe/moe.h"

namespace megamoe::testing {

// Every e2m1 code's value (docs/design.md §2), written out: bit 3 is the sign.
inline constexpr double kE2m1[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};

// Rounds a double to bf16 once: round-to-odd onto fp32 (which keeps 16 more significand bits than
// bf16 over bf16's whole range), then round-to-nearest-even onto bf16.
inline uint16_t bf16_of(double v) {
  float f = static_cast<float>(v);
  if (std::isfinite(v) && static_cast<double>(f) != v) {
    if (std::fabs(static_cast<double>(f)) > std::fabs(v)) f = std::nextafter(f, 0.0f);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    bits |= 1u;
    std::memcpy(&f, &bits, 4);
  }
  return f32_to_bf16(f);
}

inline double silu(double g) { return g / (1.0 + std::exp(-g)); }

// A [rows, cols] NVFP4 linear under construction: one e2m1 code per element (all 0 at first)
// and one ue4m3 byte per 16-element block (all 1.0 = 0x38 at first).
struct LinearBuilder {
  int64_t rows, cols;
  std::vector<uint8_t> codes, scales;
  LinearBuilder(int64_t r, int64_t c) : rows(r), cols(c), codes(r * c, 0), scales(r * c / 16, 0x38) {}
  LinearBuilder& code(int64_t r, int64_t c, uint8_t v) {
    codes[r * cols + c] = v;
    return *this;
  }
  LinearBuilder& scale(int64_t r, int64_t block, uint8_t byte) {
    scales[r * (cols / 16) + block] = byte;
    return *this;
  }
  Nvfp4Linear build(float s2) const {
    std::vector<uint8_t> packed(rows * cols / 2);
    for (size_t j = 0; j < packed.size(); ++j) packed[j] = format::pack_e2m1_pair(codes[2 * j], codes[2 * j + 1]);
    return make_owned_linear(rows, cols, packed, scales, s2);
  }
};

}  // namespace megamoe::testing
