// Host prepack of NVFP4 weights into the layout of backends/sm90_w4a16/sm90_w4a16_layout.h.
// A reshuffle of the checkpoint's code bits and scale bytes: same bits, nothing decoded, with one
// canonicalisation that keeps every weight's value: the codes of a block whose scale is 0 are
// stored as 0 (the mainloop's scale conversion is exact for nonzero scales only).
#pragma once

#include <cstdint>
#include <span>

#include "megamoe/moe.h"

namespace megamoe::runtime {

// Bytes of one prepacked (rows, K) matrix.
inline int64_t prepacked_code_bytes(int64_t rows, int64_t k) { return rows * k / 2; }
inline int64_t prepacked_scale_bytes(int64_t rows, int64_t k) { return rows * k / 16; }

// W13 of one expert slice: intermediate columns [col_begin, col_begin + cols) of gate and up,
// interleaved per 64-row tile (w13_intermediate_column). Rows = 2 * cols; K = in_features.
void prepack_w13(const Nvfp4Linear& gate, const Nvfp4Linear& up, int64_t col_begin, int64_t cols,
                 std::span<uint8_t> codes, std::span<uint8_t> scales);

// W2 of one expert slice: all rows, input columns [k_begin, k_begin + k_len).
void prepack_w2(const Nvfp4Linear& down, int64_t k_begin, int64_t k_len, std::span<uint8_t> codes,
                std::span<uint8_t> scales);

// A linear's bytes in the checkpoint layout, writable: [out, in/2] codes, [out, in/16] scales.
struct Nvfp4Rows {
  int64_t out_features = 0;
  int64_t in_features = 0;
  uint8_t* weight = nullptr;
  uint8_t* weight_scale = nullptr;
};

// The inverses: the slice's codes and scales written back in the checkpoint layout. Every weight
// keeps its value; the codes of a block whose scale is 0 come back as 0 (prepack's one
// canonicalisation), everything else bit for bit.
void unprepack_w13(std::span<const uint8_t> codes, std::span<const uint8_t> scales, int64_t col_begin, int64_t cols,
                   const Nvfp4Rows& gate, const Nvfp4Rows& up);
void unprepack_w2(std::span<const uint8_t> codes, std::span<const uint8_t> scales, int64_t k_begin, int64_t k_len,
                  const Nvfp4Rows& down);

}  // namespace megamoe::runtime
