// Bit-level helpers shared by the host codecs (src/core/dtype.cpp, src/format/codecs.cpp). Bit
// casts between float and its bits are std::bit_cast everywhere (and in include/megamoe/dtype.h).
#pragma once

#include <cstdint>

namespace megamoe::detail {

// m / 2^s rounded to nearest, ties to even, in integers (so the result does not depend on the
// floating-point rounding mode). s >= 32 only happens for magnitudes far below half the target
// unit, which round to 0. Requires s >= 1.
inline uint32_t shift_right_rne(uint32_t m, int s) {
  if (s >= 32) return 0;
  const uint32_t q = m >> s;
  const uint32_t rem = m & ((1u << s) - 1u);
  const uint32_t half = 1u << (s - 1);
  return q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
}

}  // namespace megamoe::detail
