// The K loop of one W4A8 work item (one warpgroup, 64 weight rows x kBlockN tokens): per 128 of
// K (one activation block), the tokens' codes stream through two cp.async stages (gathered by
// slot, 128-byte swizzle, zero past the item's slots) with their block scales 2^e, the weights'
// prepacked words are loaded straight into registers one block ahead and decoded to e4m3
// (decode_k32), four k32 fp8 wgmmas accumulate into a zeroed partial P, and acc += P * 2^e per
// token (docs/w4a8.md §4: the promotion that keeps the tensor core's limited internal
// accumulation to 128 products).
#pragma once

#include <cstdint>
#include <utility>

#include "backends/sm90_w4a16/sm90_w4a16_layout.h"
#include "backends/sm90_w4a16/sm90_w4a16_scheduler.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_tile.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_act_quant.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_decode.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_layout.h"
#include "backends/sm90_w4a8/sm90_w4a8_params.cuh"
#include "kernels/common/ptx_cp_async.cuh"
#include "kernels/common/ptx_wgmma_e4m3.cuh"

namespace megamoe::kernels::sm90 {

// Shared memory of the W4A8 tile: two stages of (kBlockN tokens, 128 codes) and their tokens'
// block scales.
template <int kBlockN>
struct W4a8SmemLayout {
  static constexpr int kStages = 2;
  static constexpr int kBStageBytes = kBlockN * w4a8::kActBlock;  // one 128-byte swizzled row per token
  static constexpr int kScaleOffset = kStages * kBStageBytes;
  static constexpr int kBytes = kScaleOffset + kStages * kBlockN * 4;
  static constexpr int kAllocBytes = kBytes + 1024;  // room to align the base to 1024 B
  static_assert(kBStageBytes % 1024 == 0, "each B stage must be whole 1024-byte swizzle atoms");
};

namespace detail {

inline constexpr int kW4a8Threads = w4a16::kThreadsPerWarpgroup;

// A thread's weight words of one 128-K block: two 64-K chunks of the prepacked layout, per chunk
// its 16 code bytes (four k16 step words) and 8 scale bytes (two scale words).
struct W4a8BlockWords {
  uint4 codes[2];
  uint2 scales[2];
};
__device__ __forceinline__ W4a8BlockWords load_block_words(const uint8_t* codes, const uint8_t* scales, int kb) {
  W4a8BlockWords w;
  #pragma unroll
  for (int c = 0; c < 2; ++c) {
    w.codes[c] = __ldg(reinterpret_cast<const uint4*>(codes + (2 * kb + c) * w4a16::kCodeBytesPerTile));
    w.scales[c] = __ldg(reinterpret_cast<const uint2*>(scales + (2 * kb + c) * w4a16::kScaleBytesPerTile));
  }
  return w;
}

// The item's B rows (token rows in L1, slot rows in L2) this thread copies, piece j of row
// (tid + 128 j) / 8; -1 past the item's slots (zero-filled).
template <bool kIsL1, int kBlockN>
struct W4a8BRows {
  static constexpr int kPieces = kBlockN * 8 / kW4a8Threads;
  int64_t row[kPieces];
};

// Issues the copies of block kb into `stage`: the codes (16-byte pieces, 128-byte swizzle: piece
// c of row r lands at c ^ (r % 8)) and, for the first kBlockN threads, their token's 2^e (0 past
// the item's slots: the column is never stored).
template <bool kIsL1, int kBlockN>
__device__ __forceinline__ void copy_b_block(const W4a8GemmParams& p, const W4a8BRows<kIsL1, kBlockN>& rows,
                                             int64_t scale_row, int kb, int K, uint8_t* smem, int stage, int tid) {
  using Smem = W4a8SmemLayout<kBlockN>;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + stage * Smem::kBStageBytes;
  #pragma unroll
  for (int j = 0; j < W4a8BRows<kIsL1, kBlockN>::kPieces; ++j) {
    const int i = tid + j * kW4a8Threads, r = i / 8, c = i % 8;
    const bool valid = rows.row[j] >= 0;
    const uint8_t* src = p.b_codes + (valid ? rows.row[j] : 0) * K + kb * w4a8::kActBlock + c * 16;
    ptx::cp_async_16(base + r * 128 + ((c ^ (r & 7)) * 16), src, valid);
  }
  if (tid < kBlockN) {
    float* scale = reinterpret_cast<float*>(smem + Smem::kScaleOffset) + stage * kBlockN;
    scale[tid] = scale_row >= 0 ? w4a8::exp2i(p.b_exponents[scale_row * (K / w4a8::kActBlock) + kb]) : 0.0f;
  }
}

template <int kBlockN, size_t... I>
__device__ __forceinline__ void wgmma_e4m3(const uint32_t (&a)[4], uint64_t desc, float (&d)[kBlockN / 2],
                                           std::index_sequence<I...>) {
  ptx::WgmmaRSE4m3<kBlockN>::Op::fma(a[0], a[1], a[2], a[3], desc, d[I]...);
}

// acc = x_item . W_tileᵀ of the item's 64-row tile (w.m_block), every K: acc[4i + 2h + c] is
// (row r0 + 8h, token column 8i + 2t + c), r0 = 16 warp + g, in units of the weights' e4m3
// values times the activations' (s2 * 2^k is the epilogue's).
template <bool kIsL1, int kBlockN>
__device__ __forceinline__ void w4a8_item_mainloop(const W4a8GemmParams& p, const WorkItem& w, uint8_t* smem,
                                                   float (&acc)[kBlockN / 2]) {
  using namespace w4a16;
  using Smem = W4a8SmemLayout<kBlockN>;
  const W4a16GemmParams& g = p.g;
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, quad = tid % 32 / 4;
  const int K = g.k_chunks * kChunkK, blocks = K / w4a8::kActBlock;
  const int64_t tile0 = static_cast<int64_t>(w.m_block) * g.k_chunks;  // (64-row tile, chunk) index of chunk 0
  const uint8_t* codes = g.codes + w.expert * g.code_expert_stride + tile0 * kCodeBytesPerTile + tid * 16;
  const uint8_t* scales =
      g.scales + w.expert * g.scale_expert_stride + tile0 * kScaleBytesPerTile + (warp * 8 + quad) * 8;
  const uint32_t addend = p.exponent_addends[w.expert];

  W4a8BRows<kIsL1, kBlockN> rows;
  #pragma unroll
  for (int j = 0; j < W4a8BRows<kIsL1, kBlockN>::kPieces; ++j) {
    const int slot = w.slot_begin + (tid + j * kW4a8Threads) / 8;
    rows.row[j] = slot < w.slot_end ? (kIsL1 ? w.slot_token[slot] : slot) : -1;
  }
  int64_t scale_row = -1;
  if (tid < kBlockN && w.slot_begin + tid < w.slot_end) {
    scale_row = kIsL1 ? w.slot_token[w.slot_begin + tid] : w.slot_begin + tid;
  }

  #pragma unroll
  for (int j = 0; j < kBlockN / 2; ++j) acc[j] = 0.0f;
  copy_b_block<kIsL1, kBlockN>(p, rows, scale_row, 0, K, smem, 0, tid);
  ptx::cp_async_commit();
  W4a8BlockWords words = load_block_words(codes, scales, 0);
  const int t = tid % 4;
  for (int kb = 0; kb < blocks; ++kb) {
    const int stage = kb & 1;
    if (kb + 1 < blocks) copy_b_block<kIsL1, kBlockN>(p, rows, scale_row, kb + 1, K, smem, stage ^ 1, tid);
    ptx::cp_async_commit();  // possibly empty: the wait below always leaves the newest group
    uint32_t a[4][4];
    #pragma unroll
    for (int f = 0; f < 4; ++f) {
      const uint4 c = words.codes[f / 2];
      const uint32_t s = f % 2 == 0 ? words.scales[f / 2].x : words.scales[f / 2].y;
      w4a8::decode_k32(f % 2 == 0 ? c.x : c.z, f % 2 == 0 ? c.y : c.w, s, addend, a[f]);
    }
    if (kb + 1 < blocks) words = load_block_words(codes, scales, kb + 1);
    ptx::cp_async_wait<1>();
    ptx::fence_proxy_async_shared();
    __syncthreads();  // block kb's codes and scales are in `stage`
    float part[kBlockN / 2];
    #pragma unroll
    for (int j = 0; j < kBlockN / 2; ++j) part[j] = 0.0f;
    const uint64_t desc = ptx::make_sw128_desc(smem + stage * Smem::kBStageBytes);
    ptx::wgmma_fence();
    #pragma unroll
    for (int f = 0; f < 4; ++f) {
      // k32 step f starts 32 bytes further into each swizzled row (16-byte units in the descriptor).
      wgmma_e4m3<kBlockN>(a[f], desc + 2 * f, part, std::make_index_sequence<kBlockN / 2>{});
    }
    ptx::wgmma_commit();
    ptx::wgmma_wait_all();
    const float* block_scale = reinterpret_cast<const float*>(smem + Smem::kScaleOffset) + stage * kBlockN;
    #pragma unroll
    for (int j = 0; j < kBlockN / 2; ++j) acc[j] = fmaf(part[j], block_scale[8 * (j / 4) + 2 * t + j % 2], acc[j]);
    __syncthreads();  // every thread is done with `stage`: the next iteration's copies refill it
  }
}

}  // namespace detail

}  // namespace megamoe::kernels::sm90
