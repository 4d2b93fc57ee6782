// The K loop of one W4A8 work item (one warpgroup, 64 weight rows x kBlockN tokens): per 128 of
// K (one activation block), the tokens' codes (gathered by slot, 128-byte swizzle, zero past the
// item's slots), their block scales and the weights' prepacked words stream through kStages
// cp.async stages; the words are decoded to e4m3 (decode_k32_table, the item's expert's table in
// shared memory), four k32 fp8 wgmmas accumulate into a zeroed partial P, and acc += P * 2^e per
// token (docs/w4a8.md §4: the promotion that keeps the tensor core's limited internal
// accumulation to 128 products). kOverlap: block kb + 1 is decoded under block kb's wgmmas.
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

// Shared memory of the W4A8 tile: kStages stages, each one 128-K block of the item's operands:
//   B codes    (kBlockN tokens, 128) e4m3, one 128-byte swizzled row per token   [1024-aligned]
//   W codes    (64 rows, 128) e2m1 in the prepacked order: two 64-K chunks of 2048 bytes
//   W scales   the two chunks' 256-byte scale tiles
//   act scales (kBlockN) fp32: each token's block scale 2^e (0 past the item's slots)
// All four arrive by cp.async, kStages - 1 blocks ahead of the MMA: with the weights loaded into
// registers and the scales by plain loads one block ahead, every block waited a memory latency
// (docs/perf/2026-11-29-h200-w4a8-v37.md). After the stages, the decode table of the item's
// expert (sm90_w4a8_decode_table.h, kTableBytes).
template <int kBlockN, bool kOverlap = false>
struct W4a8SmemLayout {
  // The overlapped loop waits for block kb + 1 while block kb's wgmmas run, one block less ahead:
  // one stage more keeps the same depth of copies in flight. 32 tokens: 7 stages and the decode
  // table leave room for three CTAs per SM (8 stages did before the table). 160: 4 stages, two.
  static constexpr int kStages = kBlockN > 128 ? 4 : (kBlockN == 128 ? 4 : 7) + (kOverlap ? 1 : 0);
  static constexpr int kBBytes = kBlockN * w4a8::kActBlock;
  static constexpr int kWCodeOffset = kBBytes;
  static constexpr int kWCodeBytes = 2 * w4a16::kCodeBytesPerTile;
  static constexpr int kWScaleOffset = kWCodeOffset + kWCodeBytes;
  static constexpr int kWScaleBytes = 2 * w4a16::kScaleBytesPerTile;
  static constexpr int kActScaleOffset = kWScaleOffset + kWScaleBytes;
  static constexpr int kStageBytes = (kActScaleOffset + kBlockN * 4 + 1023) / 1024 * 1024;
  static constexpr int kBytes = kStages * kStageBytes;
  static constexpr int kTableOffset = kBytes;
  static constexpr int kAllocBytes = kTableOffset + w4a8::kTableBytes + 1024;  // room to align the base to 1024 B
  static_assert(kBBytes % 1024 == 0, "each B stage must be whole 1024-byte swizzle atoms");
  static_assert(kWScaleBytes <= 32 * 16, "the weight scales are copied by the first 32 threads, 16 bytes each");
};

namespace detail {

inline constexpr int kW4a8Threads = w4a16::kThreadsPerWarpgroup;

// This thread's copy sources of the item's next block, advanced by one block per copy (loop-carried,
// so that a block's copies cost one add per source: recomputing them from the rows and the
// expert each block was a third of the K loop's instructions). B piece j is 16 bytes of row
// (tid + 128 j) / 8 (token rows in L1, slot rows in L2), zero-filled past the item's slots; act
// scale j is token tid + 128 j's (where that is below kBlockN).
template <bool kIsL1, int kBlockN>
struct W4a8CopySrc {
  static constexpr int kPieces = kBlockN * 8 / kW4a8Threads;
  static constexpr int kActScales = (kBlockN + kW4a8Threads - 1) / kW4a8Threads;
  const uint8_t* b[kPieces];  // row 0 where invalid
  const uint8_t* codes;       // this thread's 16 bytes of the first chunk
  const uint8_t* scales;      // this thread's 16-byte piece of the scales (first 32 threads)
  const float* act_scale[kActScales];  // row 0 where invalid
  uint32_t b_valid;                     // bit j: piece j's row is one of the item's slots
  uint32_t act_scale_valid;             // bit j: act scale j's token is one of the item's slots
};

// B piece j of a thread lands at row r = tid / 8 + 16 j, 16-byte column c = tid % 8, swizzled
// to c ^ (r % 8); 16 j does not change r % 8, so each piece is this offset plus j * 2048.
__device__ __forceinline__ uint32_t b_piece_smem_offset(int tid) {
  const int r = tid / 8, c = tid % 8;
  return static_cast<uint32_t>(r * 128 + ((c ^ (r & 7)) * 16));
}

// This thread's share of the copies of the next block into `stage`, then `src` moves to the block
// after: B codes (16-byte pieces, 128-byte swizzle), its own 16 weight-code bytes of each chunk,
// for the first 32 threads one 16-byte piece of the weight scales, and its act scales
// (W4a8CopySrc).
template <bool kIsL1, int kBlockN>
__device__ __forceinline__ void copy_block(W4a8CopySrc<kIsL1, kBlockN>& src, uint32_t b_smem, uint32_t stage_base,
                                           int tid) {
  using Smem = W4a8SmemLayout<kBlockN>;
  #pragma unroll
  for (int j = 0; j < W4a8CopySrc<kIsL1, kBlockN>::kPieces; ++j) {
    ptx::cp_async_16(stage_base + b_smem + j * (kW4a8Threads / 8) * 128, src.b[j], (src.b_valid >> j) & 1u);
    src.b[j] += w4a8::kActBlock;
  }
  #pragma unroll
  for (int c = 0; c < 2; ++c) {
    ptx::cp_async_16(stage_base + Smem::kWCodeOffset + c * w4a16::kCodeBytesPerTile + tid * 16,
                     src.codes + c * w4a16::kCodeBytesPerTile, true);
  }
  src.codes += 2 * w4a16::kCodeBytesPerTile;
  if (tid < Smem::kWScaleBytes / 16) {
    ptx::cp_async_16(stage_base + Smem::kWScaleOffset + tid * 16, src.scales, true);
  }
  src.scales += 2 * w4a16::kScaleBytesPerTile;
  #pragma unroll
  for (int j = 0; j < W4a8CopySrc<kIsL1, kBlockN>::kActScales; ++j) {
    if (tid + j * kW4a8Threads < kBlockN) {
      ptx::cp_async_4(stage_base + Smem::kActScaleOffset + (tid + j * kW4a8Threads) * 4, src.act_scale[j],
                      (src.act_scale_valid >> j) & 1u);
    }
    src.act_scale[j] += 1;
  }
}

// d = a . b (kAccumulate false: d's old values are not read, so it needs no zeroing) or d += a . b.
template <int kBlockN, bool kAccumulate, size_t... I>
__device__ __forceinline__ void wgmma_e4m3(const uint32_t (&a)[4], uint64_t desc, float (&d)[kBlockN / 2],
                                           std::index_sequence<I...>) {
  using cute::SM90::GMMA::ScaleOut;
  ptx::WgmmaRSE4m3<kBlockN>::Op::fma(a[0], a[1], a[2], a[3], desc, d[I]..., kAccumulate ? ScaleOut::One : ScaleOut::Zero);
}

// acc += part * 2^e per token (docs/w4a8.md §4's promotion), on one warpgroup's (64, kBlockN)
// fragments: acc[4i + 2h + c] is token column 8i + 2t + c, so one 8-byte read of `scales` (the
// block's scales from the item's first token) per i gives both columns', for both rows h.
template <int kBlockN>
__device__ __forceinline__ void promote_partial(const float (&part)[kBlockN / 2], const float* scales, int t,
                                                float (&acc)[kBlockN / 2]) {
  #pragma unroll
  for (int i = 0; i < kBlockN / 8; ++i) {
    const float2 s = *reinterpret_cast<const float2*>(scales + 8 * i + 2 * t);
    const float s0 = s.x, s1 = s.y;
    acc[4 * i] = fmaf(part[4 * i], s0, acc[4 * i]);
    acc[4 * i + 1] = fmaf(part[4 * i + 1], s1, acc[4 * i + 1]);
    acc[4 * i + 2] = fmaf(part[4 * i + 2], s0, acc[4 * i + 2]);
    acc[4 * i + 3] = fmaf(part[4 * i + 3], s1, acc[4 * i + 3]);
  }
}

// acc = x_item . W_tileᵀ of the item's 64-row tile (w.m_block), every K: acc[4i + 2h + c] is
// (row r0 + 8h, token column 8i + 2t + c), r0 = 16 warp + g, in units of the weights' e4m3
// values times the activations' (s2 * 2^k is the epilogue's). The caller's CTA barrier separates
// items (no thread still reads a stage when the next item's first copies overwrite it).
template <bool kIsL1, int kBlockN, bool kOverlap = false>
__device__ __forceinline__ void w4a8_item_mainloop(const W4a8GemmParams& p, const WorkItem& w, uint8_t* smem,
                                                   float (&acc)[kBlockN / 2]) {
  using namespace w4a16;
  using Smem = W4a8SmemLayout<kBlockN, kOverlap>;
  constexpr int kStages = Smem::kStages;
  static_assert(!kOverlap || kStages >= 3, "the overlapped loop keeps two blocks' stages busy: give it 3 or more");
  const W4a16GemmParams& g = p.g;
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, quad = tid % 32 / 4, t = tid % 4;
  const int K = g.k_chunks * kChunkK, blocks = K / w4a8::kActBlock;
  const int64_t tile0 = static_cast<int64_t>(w.m_block) * g.k_chunks;  // (64-row tile, chunk) index of chunk 0
  const uint8_t* codes = g.codes + w.expert * g.code_expert_stride + tile0 * kCodeBytesPerTile;
  const uint8_t* scales = g.scales + w.expert * g.scale_expert_stride + tile0 * kScaleBytesPerTile;
  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t table = smem_base + Smem::kTableOffset;
  // The item's expert's table; the caller's barrier after the previous item means nobody still
  // reads the old one, and the first block's barrier below publishes this one.
  w4a8::fill_decode_table(table, p.exponent_addends[w.expert], tid, kW4a8Threads);

  W4a8CopySrc<kIsL1, kBlockN> src;
  src.b_valid = 0;
  #pragma unroll
  for (int j = 0; j < W4a8CopySrc<kIsL1, kBlockN>::kPieces; ++j) {
    const int slot = w.slot_begin + (tid + j * kW4a8Threads) / 8;
    const bool valid = slot < w.slot_end;
    const int32_t row = valid ? (kIsL1 ? w.slot_token[slot] : slot) : 0;
    src.b[j] = p.b_codes + static_cast<int64_t>(row) * K + (tid % 8) * 16;
    src.b_valid |= static_cast<uint32_t>(valid) << j;
  }
  src.codes = codes + tid * 16;
  // The first 32 threads copy the scales: thread i piece i % 16 of chunk i / 16.
  src.scales = tid < Smem::kWScaleBytes / 16
                   ? scales + (tid / (kScaleBytesPerTile / 16)) * kScaleBytesPerTile + (tid % (kScaleBytesPerTile / 16)) * 16
                   : scales;
  src.act_scale_valid = 0;
  #pragma unroll
  for (int j = 0; j < W4a8CopySrc<kIsL1, kBlockN>::kActScales; ++j) {
    const int n = tid + j * kW4a8Threads, slot = w.slot_begin + n;
    const bool valid = n < kBlockN && slot < w.slot_end;
    const int32_t row = valid ? (kIsL1 ? w.slot_token[slot] : slot) : 0;
    src.act_scale[j] = p.b_scales + static_cast<int64_t>(row) * blocks;
    src.act_scale_valid |= static_cast<uint32_t>(valid) << j;
  }
  const uint32_t b_smem = b_piece_smem_offset(tid);

  #pragma unroll
  for (int j = 0; j < kBlockN / 2; ++j) acc[j] = 0.0f;
  #pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < blocks) copy_block<kIsL1, kBlockN>(src, b_smem, smem_base + s * Smem::kStageBytes, tid);
    ptx::cp_async_commit();  // one group per block, empty past K
  }
  const auto stage_of = [&](int kb) { return smem + (kb % kStages) * Smem::kStageBytes; };
  const auto decode_block = [&](const uint8_t* st, uint32_t (&a)[4][4]) {
    #pragma unroll
    for (int c = 0; c < 2; ++c) {
      const uint4 q = *reinterpret_cast<const uint4*>(st + Smem::kWCodeOffset + c * kCodeBytesPerTile + tid * 16);
      const uint2 sc =
          *reinterpret_cast<const uint2*>(st + Smem::kWScaleOffset + c * kScaleBytesPerTile + (warp * 8 + quad) * 8);
      w4a8::decode_k32_table(q.x, q.y, sc.x, table, a[2 * c]);
      w4a8::decode_k32_table(q.z, q.w, sc.y, table, a[2 * c + 1]);
    }
  };
  // Four k32 wgmmas of one block into part (the first overwrites it), committed, not waited.
  const auto mma_block = [&](const uint8_t* st, const uint32_t (&a)[4][4], float (&part)[kBlockN / 2]) {
    const uint64_t desc = ptx::make_sw128_desc(st);
    ptx::wgmma_fence();
    // k32 step f starts 32 bytes further into each swizzled row (16-byte units in the descriptor).
    wgmma_e4m3<kBlockN, false>(a[0], desc, part, std::make_index_sequence<kBlockN / 2>{});
    #pragma unroll
    for (int f = 1; f < 4; ++f) {
      wgmma_e4m3<kBlockN, true>(a[f], desc + 2 * f, part, std::make_index_sequence<kBlockN / 2>{});
    }
    ptx::wgmma_commit();
  };
  // Refill the stage of block kb - 1 (every thread waited its wgmmas before the caller's barrier)
  // with block kb + kStages - 1; one commit group per call, empty past K.
  const auto refill = [&](int kb) {
    const int next = kb + kStages - 1;
    if (next < blocks) copy_block<kIsL1, kBlockN>(src, b_smem, smem_base + (next % kStages) * Smem::kStageBytes, tid);
    ptx::cp_async_commit();
  };

  if constexpr (!kOverlap) {
    for (int kb = 0; kb < blocks; ++kb) {
      ptx::cp_async_wait<kStages - 2>();  // this thread's copies of block kb have landed
      // Block kb is visible to every thread, and every thread has finished block kb - 1 (its
      // wgmmas waited), whose stage the next copies refill. No proxy fence, as in the W4A16
      // mainloops: its MEMBAR.ALL.CTA would also wait for the copies of the blocks ahead.
      __syncthreads();
      refill(kb);
      const uint8_t* st = stage_of(kb);
      uint32_t a[4][4];
      decode_block(st, a);
      float part[kBlockN / 2];
      mma_block(st, a, part);
      ptx::wgmma_wait_all();
      promote_partial<kBlockN>(part, reinterpret_cast<const float*>(st + Smem::kActScaleOffset), t, acc);
    }
  } else {
    // Block kb + 1 is decoded while block kb's wgmmas run, into the other register set (two
    // explicit sets, the loop unrolled by two, so that no register an in-flight wgmma reads is
    // rewritten). The barrier for block kb + 1 comes after block kb's wgmmas were issued.
    uint32_t a[2][4][4];
    ptx::cp_async_wait<kStages - 2>();  // block 0 has landed
    __syncthreads();
    decode_block(stage_of(0), a[0]);
    const auto step = [&](int kb, const uint32_t (&a_now)[4][4], uint32_t (&a_next)[4][4]) {
      const uint8_t* st = stage_of(kb);
      float part[kBlockN / 2];
      mma_block(st, a_now, part);
      if (kb + 1 < blocks) {
        // Groups committed so far: kStages - 1 + kb; block kb + 1's is the (kb + 2)-th.
        ptx::cp_async_wait<kStages - 3>();
        __syncthreads();  // block kb + 1 visible; every thread waited block kb - 1's wgmmas
        refill(kb);
        decode_block(stage_of(kb + 1), a_next);
      }
      ptx::wgmma_wait_all();
      promote_partial<kBlockN>(part, reinterpret_cast<const float*>(st + Smem::kActScaleOffset), t, acc);
    };
    for (int kb = 0; kb < blocks; kb += 2) {
      step(kb, a[0], a[1]);
      if (kb + 1 < blocks) step(kb + 1, a[1], a[0]);
    }
  }
}

}  // namespace detail

}  // namespace megamoe::kernels::sm90
