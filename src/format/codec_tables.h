// The value tables of the e4m3 and e2m1 codes and the rounding onto the e2m1 grid, shared by the
// host codecs and recipes of src/format (internal to it).
#pragma once

#include <array>
#include <cstdint>
#include <limits>

namespace megamoe::format::detail {

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
inline constexpr std::array<float, 256> kE4m3Values = make_e4m3_table();

inline constexpr std::array<float, 16> kE2m1Values = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,
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

}  // namespace megamoe::format::detail
