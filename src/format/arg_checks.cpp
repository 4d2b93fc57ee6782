// The argument checks of src/format (arg_checks.h).
#include "format/arg_checks.h"

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "megamoe/format.h"
#include "megamoe/status.h"

namespace megamoe::format::detail {

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

}  // namespace megamoe::format::detail
