// What the safetensors reader and writer share: the metadata key of the header and the byte
// extent of a tensor (internal to src/checkpoint).
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "megamoe/dtype.h"

namespace megamoe::checkpoint_detail {

inline constexpr const char* kMetadataKey = "__metadata__";

// numel * dtype size with overflow checks; nullopt when either does not fit in int64/uint64.
struct Extent {
  int64_t numel = 1;
  uint64_t bytes = 0;
};
inline std::optional<Extent> checked_extent(std::span<const int64_t> shape, DType dtype) {
  Extent e;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(e.numel, d, &e.numel)) return std::nullopt;
  }
  if (__builtin_mul_overflow(static_cast<uint64_t>(e.numel),
                             static_cast<uint64_t>(dtype_size(dtype)), &e.bytes)) {
    return std::nullopt;
  }
  return e;
}

}  // namespace megamoe::checkpoint_detail
