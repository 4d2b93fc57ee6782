// The argument checks of the entry points of src/format (internal to it). Each throws
// megamoe::Error(kInvalidArgument) naming the function `fn`, the argument and what is allowed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace megamoe::format::detail {

// Shape checks shared by every matrix entry point. Returns rows * cols.
int64_t checked_elements(const char* fn, int64_t rows, int64_t cols, int block);
// A span argument `name` of `got` elements must hold `want`, the [rows, cols] matrix in `layout`.
void check_span_size(const char* fn, const char* name, size_t got, int64_t want, int64_t rows,
                     int64_t cols, const char* layout);
void check_positive_finite(const char* fn, const char* name, float v);
// amax(|w|) over a [rows, cols] matrix; throws on the first non-finite element, naming it.
float checked_amax(const char* fn, const char* name, const float* w, int64_t n, int64_t cols);
// A byte as messages quote it: "0x7F".
std::string hex_byte(uint8_t b);
// Every byte of a ue4m3 scale array must be a valid scale; names the first bad one.
void check_ue4m3_scales(const char* fn, const uint8_t* scales, int64_t n, int64_t blocks_per_row);

}  // namespace megamoe::format::detail
