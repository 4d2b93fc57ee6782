#include "backends/sm90_w4a16/sm90_w4a16_prepack.h"

#include "backends/sm90_w4a16/sm90_w4a16_layout.h"
#include "megamoe/status.h"

namespace megamoe::runtime {
namespace {

using namespace kernels::sm90::w4a16;

// Generic prepack: `source(tile_row)` gives the (linear, row) that feeds prepacked row
// `tile_row`; K runs over [k_begin, k_begin + k_len) of that linear's input features.
template <class RowSource>
void prepack(int64_t rows, int64_t k_begin, int64_t k_len, RowSource source,
             std::span<uint8_t> codes, std::span<uint8_t> scales) {
  MEGAMOE_CHECK(rows % kTileM == 0 && k_len % kChunkK == 0, kInvalidArgument, "prepack: (", rows,
                ", ", k_len, ") is not a whole number of (64, 64) tiles");
  MEGAMOE_CHECK(static_cast<int64_t>(codes.size()) == prepacked_code_bytes(rows, k_len) &&
                    static_cast<int64_t>(scales.size()) == prepacked_scale_bytes(rows, k_len),
                kInternal, "prepack: output buffer sizes do not match the matrix");
  const int64_t k_chunks = k_len / kChunkK;
  for (int64_t m = 0; m < rows / kTileM; ++m) {
    // Row pointers of this tile's 64 rows.
    const uint8_t* row_codes[kTileM];
    const uint8_t* row_scales[kTileM];
    for (int r = 0; r < kTileM; ++r) {
      const auto [lin, row] = source(m * kTileM + r);
      row_codes[r] = lin->weight + row * (lin->in_features / 2);
      row_scales[r] = lin->weight_scale + row * (lin->in_features / 16);
    }
    for (int64_t kc = 0; kc < k_chunks; ++kc) {
      const int64_t tile = m * k_chunks + kc;
      uint8_t* tile_codes = codes.data() + tile * kCodeBytesPerTile;
      uint8_t* tile_scales = scales.data() + tile * kScaleBytesPerTile;
      const int64_t k0 = k_begin + kc * kChunkK;
      for (int tid = 0; tid < kThreadsPerWarpgroup; ++tid) {
        const int w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
        for (int s = 0; s < kStepsPerChunk; ++s) {
          uint32_t word = 0;
          for (int p = 0; p < 8; ++p) {
            const int r = 16 * w + g + nibble_row_offset(p);
            const int64_t k = k0 + 16 * s + 2 * t + nibble_k_offset(p);
            // A block whose scale is 0 has weights 0 whatever its codes: clear them, so the
            // mainloop's scale conversion may skip the zero case (scale_pair_to_bf16x2).
            const uint8_t code = row_scales[r][k / 16] == 0 ? 0 : format::e2m1_code_at(row_codes[r], k);
            for (int b = 0; b < 4; ++b) {
              word |= static_cast<uint32_t>((code >> b) & 1u) << code_bit_position(p, b);
            }
          }
          uint8_t* dst = tile_codes + tid * 16 + s * 4;
          for (int b = 0; b < 4; ++b) dst[b] = static_cast<uint8_t>(word >> (8 * b));
        }
      }
      // Per quad (w, g): two little-endian scale words, word i = steps 2i, 2i + 1, its half h
      // for row 16w + g + 8h (sm90_w4a16_layout.h, "Scale encoding").
      for (int w = 0; w < 4; ++w) {
        for (int g = 0; g < 8; ++g) {
          for (int i = 0; i < kStepsPerChunk / 2; ++i) {
            for (int h = 0; h < 2; ++h) {
              const int r = 16 * w + g + 8 * h;
              const uint16_t half = scale_half(encode_scale(row_scales[r][k0 / 16 + 2 * i]),
                                               encode_scale(row_scales[r][k0 / 16 + 2 * i + 1]));
              uint8_t* dst = tile_scales + (w * 8 + g) * 8 + 4 * i + 2 * h;
              dst[0] = static_cast<uint8_t>(half & 0xFF);
              dst[1] = static_cast<uint8_t>(half >> 8);
            }
          }
        }
      }
    }
  }
}

// Generic unprepack, prepack's inverse: `target(tile_row)` gives the (rows, row) that prepacked
// row `tile_row` came from.
template <class RowTarget>
void unprepack(int64_t rows, int64_t k_begin, int64_t k_len, RowTarget target, std::span<const uint8_t> codes,
               std::span<const uint8_t> scales) {
  MEGAMOE_CHECK(rows % kTileM == 0 && k_len % kChunkK == 0, kInvalidArgument, "unprepack: (", rows, ", ", k_len,
                ") is not a whole number of (64, 64) tiles");
  MEGAMOE_CHECK(static_cast<int64_t>(codes.size()) == prepacked_code_bytes(rows, k_len) &&
                    static_cast<int64_t>(scales.size()) == prepacked_scale_bytes(rows, k_len),
                kInternal, "unprepack: input buffer sizes do not match the matrix");
  const int64_t k_chunks = k_len / kChunkK;
  for (int64_t m = 0; m < rows / kTileM; ++m) {
    uint8_t* row_codes[kTileM];
    uint8_t* row_scales[kTileM];
    for (int r = 0; r < kTileM; ++r) {
      const auto [lin, row] = target(m * kTileM + r);
      row_codes[r] = lin->weight + row * (lin->in_features / 2);
      row_scales[r] = lin->weight_scale + row * (lin->in_features / 16);
    }
    for (int64_t kc = 0; kc < k_chunks; ++kc) {
      const int64_t tile = m * k_chunks + kc;
      const uint8_t* tile_codes = codes.data() + tile * kCodeBytesPerTile;
      const uint8_t* tile_scales = scales.data() + tile * kScaleBytesPerTile;
      const int64_t k0 = k_begin + kc * kChunkK;
      for (int tid = 0; tid < kThreadsPerWarpgroup; ++tid) {
        const int w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
        for (int s = 0; s < kStepsPerChunk; ++s) {
          const uint8_t* src = tile_codes + tid * 16 + s * 4;
          const uint32_t word = static_cast<uint32_t>(src[0]) | static_cast<uint32_t>(src[1]) << 8 |
                                static_cast<uint32_t>(src[2]) << 16 | static_cast<uint32_t>(src[3]) << 24;
          for (int p = 0; p < 8; ++p) {
            const int r = 16 * w + g + nibble_row_offset(p);
            const int64_t k = k0 + 16 * s + 2 * t + nibble_k_offset(p);
            uint8_t code = 0;
            for (int b = 0; b < 4; ++b) code |= static_cast<uint8_t>(((word >> code_bit_position(p, b)) & 1u) << b);
            uint8_t& byte = row_codes[r][k / 2];
            byte = k % 2 == 0 ? static_cast<uint8_t>((byte & 0xF0) | code) : static_cast<uint8_t>((byte & 0x0F) | code << 4);
          }
        }
      }
      for (int w = 0; w < 4; ++w) {
        for (int g = 0; g < 8; ++g) {
          for (int i = 0; i < kStepsPerChunk / 2; ++i) {
            for (int h = 0; h < 2; ++h) {
              const int r = 16 * w + g + 8 * h;
              const uint8_t* src = tile_scales + (w * 8 + g) * 8 + 4 * i + 2 * h;
              const uint16_t half = static_cast<uint16_t>(src[0] | src[1] << 8);
              // scale_half's inverse: E_a at bits 4..11, E_b's low nibble at 12..15, high at 0..3.
              const uint8_t encoded_a = static_cast<uint8_t>(half >> 4);
              const uint8_t encoded_b = static_cast<uint8_t>((half >> 12) | (half & 0xF) << 4);
              row_scales[r][k0 / 16 + 2 * i] = decode_scale(encoded_a);
              row_scales[r][k0 / 16 + 2 * i + 1] = decode_scale(encoded_b);
            }
          }
        }
      }
    }
  }
}

}  // namespace

void unprepack_w13(std::span<const uint8_t> codes, std::span<const uint8_t> scales, int64_t col_begin, int64_t cols,
                   const Nvfp4Rows& gate, const Nvfp4Rows& up) {
  MEGAMOE_CHECK(gate.in_features == up.in_features && col_begin >= 0 && col_begin + cols <= gate.out_features &&
                    col_begin + cols <= up.out_features,
                kInvalidArgument, "unprepack_w13: gate/up shapes do not match the slice");
  unprepack(2 * cols, 0, gate.in_features,
            [&](int64_t tile_row) -> std::pair<const Nvfp4Rows*, int64_t> {
              const int64_t m = tile_row / kTileM;
              const int r = static_cast<int>(tile_row % kTileM);
              return {w13_is_up_row(r) ? &up : &gate, col_begin + w13_intermediate_column(m, r)};
            },
            codes, scales);
}

void unprepack_w2(std::span<const uint8_t> codes, std::span<const uint8_t> scales, int64_t k_begin, int64_t k_len,
                  const Nvfp4Rows& down) {
  MEGAMOE_CHECK(k_begin >= 0 && k_begin + k_len <= down.in_features, kInvalidArgument,
                "unprepack_w2: K slice out of range");
  unprepack(down.out_features, k_begin, k_len,
            [&](int64_t tile_row) -> std::pair<const Nvfp4Rows*, int64_t> { return {&down, tile_row}; }, codes,
            scales);
}

void prepack_w13(const Nvfp4Linear& gate, const Nvfp4Linear& up, int64_t col_begin, int64_t cols,
                 std::span<uint8_t> codes, std::span<uint8_t> scales) {
  MEGAMOE_CHECK(gate.in_features == up.in_features && col_begin >= 0 &&
                    col_begin + cols <= gate.out_features && col_begin + cols <= up.out_features,
                kInvalidArgument, "prepack_w13: gate/up shapes do not match the slice");
  prepack(2 * cols, 0, gate.in_features,
          [&](int64_t tile_row) -> std::pair<const Nvfp4Linear*, int64_t> {
            const int64_t m = tile_row / kTileM;
            const int r = static_cast<int>(tile_row % kTileM);
            const int64_t col = col_begin + w13_intermediate_column(m, r);
            return {w13_is_up_row(r) ? &up : &gate, col};
          },
          codes, scales);
}

void prepack_w2(const Nvfp4Linear& down, int64_t k_begin, int64_t k_len, std::span<uint8_t> codes,
                std::span<uint8_t> scales) {
  MEGAMOE_CHECK(k_begin >= 0 && k_begin + k_len <= down.in_features, kInvalidArgument,
                "prepack_w2: K slice out of range");
  prepack(down.out_features, k_begin, k_len,
          [&](int64_t tile_row) -> std::pair<const Nvfp4Linear*, int64_t> { return {&down, tile_row}; },
          codes, scales);
}

}  // namespace megamoe::runtime
