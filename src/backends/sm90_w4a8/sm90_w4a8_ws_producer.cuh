// The producer warpgroup of the warp-specialized W4A8 tile (sm90_w4a8_ws_layout.cuh): per 128-K
// block of the CTA's items, cp.async copies of the tokens' codes and block scales and the weights'
// prepacked words, kCopyAhead blocks ahead; then each thread decodes the words it copied
// (decode_k32) into the four e4m3x4 A registers of the consumer thread with its index, and stores
// them for that thread to load. Each warp copies
// the scale bytes of its own rows, so the warps need no barrier among themselves.
#pragma once

#include <cstdint>

#include "backends/sm90_w4a16/sm90_w4a16_layout.h"
#include "backends/sm90_w4a16/sm90_w4a16_scheduler.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_decode.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_layout.h"
#include "backends/sm90_w4a8/sm90_w4a8_params.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_ws_layout.cuh"
#include "kernels/common/ptx_cp_async.cuh"
#include "kernels/common/ptx_mbarrier.cuh"
#include "kernels/common/ptx_wgmma_e4m3.cuh"

namespace megamoe::kernels::sm90::detail {

// What the producer copies of one item: its weight tiles' first chunk and this thread's B rows
// (piece j: row tid / 8 + 16 j; -1 past the item's slots, zero-filled) and exponent rows.
template <bool kIsL1, int kMTiles>
struct W4a8WsCopyItem {
  using L = W4a8WsLayout<kMTiles>;
  static constexpr int kPieces = L::kBlockN * 8 / w4a16::kThreadsPerWarpgroup;
  static constexpr int kExps = L::kBlockN / w4a16::kThreadsPerWarpgroup;
  const uint8_t* codes;
  const uint8_t* scales;
  uint32_t addend;
  int32_t row[kPieces];
  int32_t exp_row[kExps];
};

template <bool kIsL1, int kMTiles>
__device__ __forceinline__ void ws_begin_copy_item(const W4a8GemmParams& p, int work, int total, int tid,
                                                   W4a8WsCopyItem<kIsL1, kMTiles>& it) {
  using namespace w4a16;
  using Item = W4a8WsCopyItem<kIsL1, kMTiles>;
  const W4a16GemmParams& g = p.g;
  const WorkItem w = decode_work<W4a8WsLayout<kMTiles>::kBlockN>(g, work, total);
  const int64_t tile0 = static_cast<int64_t>(w.m_block) * kMTiles * g.k_chunks;
  it.codes = g.codes + w.expert * g.code_expert_stride + tile0 * kCodeBytesPerTile;
  it.scales = g.scales + w.expert * g.scale_expert_stride + tile0 * kScaleBytesPerTile;
  it.addend = p.exponent_addends[w.expert];
  #pragma unroll
  for (int j = 0; j < Item::kPieces; ++j) {
    const int slot = w.slot_begin + tid / 8 + 16 * j;
    it.row[j] = slot < w.slot_end ? (kIsL1 ? w.slot_token[slot] : slot) : -1;
  }
  #pragma unroll
  for (int j = 0; j < Item::kExps; ++j) {
    const int slot = w.slot_begin + tid + kThreadsPerWarpgroup * j;
    it.exp_row[j] = slot < w.slot_end ? (kIsL1 ? w.slot_token[slot] : slot) : -1;
  }
}

// This thread's copies of block kb into the stage at `st`: B codes (piece c of row r at
// c ^ (r % 8)), its 16 code bytes of each chunk of each weight tile, for lanes < 8 kMTiles one
// 16-byte piece of its warp's scale bytes, its tokens' block scales; lane 0 records the addend.
template <bool kIsL1, int kMTiles>
__device__ __forceinline__ void ws_copy_block(const W4a8GemmParams& p, const W4a8WsCopyItem<kIsL1, kMTiles>& it,
                                              int kb, int K, uint32_t st, int tid) {
  using namespace w4a16;
  using L = W4a8WsLayout<kMTiles>;
  using Item = W4a8WsCopyItem<kIsL1, kMTiles>;
  const int warp = tid / 32, lane = tid % 32, c8 = tid % 8;
  #pragma unroll
  for (int j = 0; j < Item::kPieces; ++j) {
    const int r = tid / 8 + 16 * j;
    const bool valid = it.row[j] >= 0;
    const uint8_t* src = p.b_codes + static_cast<int64_t>(valid ? it.row[j] : 0) * K + kb * w4a8::kActBlock + c8 * 16;
    ptx::cp_async_16(st + r * 128 + ((c8 ^ (r & 7)) * 16), src, valid);
  }
  const int64_t tile_code_stride = static_cast<int64_t>(p.g.k_chunks) * kCodeBytesPerTile;
  const int64_t tile_scale_stride = static_cast<int64_t>(p.g.k_chunks) * kScaleBytesPerTile;
  #pragma unroll
  for (int i = 0; i < kMTiles; ++i) {
    #pragma unroll
    for (int c = 0; c < 2; ++c) {
      ptx::cp_async_16(st + L::kWCodeOffset + i * L::kWCodeTileBytes + c * kCodeBytesPerTile + tid * 16,
                       it.codes + i * tile_code_stride + (2 * kb + c) * kCodeBytesPerTile + tid * 16, true);
    }
  }
  // Warp w reads bytes [64 w, 64 w + 64) of each chunk's scale tile (rows 16 w .. 16 w + 15).
  if (lane < 8 * kMTiles) {
    const int i = lane / 8, c = lane / 4 % 2, piece = lane % 4;
    const int within = warp * 64 + piece * 16;
    ptx::cp_async_16(st + L::kWScaleOffset + i * L::kWScaleTileBytes + c * kScaleBytesPerTile + within,
                     it.scales + i * tile_scale_stride + (2 * kb + c) * kScaleBytesPerTile + within, true);
  }
  #pragma unroll
  for (int j = 0; j < Item::kExps; ++j) {
    const bool valid = it.exp_row[j] >= 0;
    ptx::cp_async_4(st + L::kActScaleOffset + (tid + kThreadsPerWarpgroup * j) * 4,
                    p.b_scales + static_cast<int64_t>(valid ? it.exp_row[j] : 0) * (K / w4a8::kActBlock) + kb, valid);
  }
  if (lane == 0) {
    asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(st + L::kAddendOffset + warp * 4), "r"(it.addend) : "memory");
  }
}

// Decodes the weight words of the stage at `st` (this thread's copies, landed) into its A
// fragments: step f of tile i is consumer thread tid's four registers (rows 16 warp + g and + 8,
// decode_k32's order), one 16-byte store.
template <int kMTiles>
__device__ __forceinline__ void ws_decode_block(uint8_t* st, int tid) {
  using namespace w4a16;
  using L = W4a8WsLayout<kMTiles>;
  const int warp = tid / 32, g = tid % 32 / 4;
  const uint32_t addend = *reinterpret_cast<const uint32_t*>(st + L::kAddendOffset + warp * 4);
  #pragma unroll
  for (int i = 0; i < kMTiles; ++i) {
    #pragma unroll
    for (int c = 0; c < 2; ++c) {
      const uint4 q =
          *reinterpret_cast<const uint4*>(st + L::kWCodeOffset + i * L::kWCodeTileBytes + c * kCodeBytesPerTile + tid * 16);
      const uint2 sc = *reinterpret_cast<const uint2*>(st + L::kWScaleOffset + i * L::kWScaleTileBytes +
                                                       c * kScaleBytesPerTile + (warp * 8 + g) * 8);
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t a[4];
        w4a8::decode_k32(h ? q.z : q.x, h ? q.w : q.y, h ? sc.y : sc.x, addend, a);
        *reinterpret_cast<uint4*>(st + L::kAOffset + ((4 * i + 2 * c + h) * kThreadsPerWarpgroup + tid) * 16) =
            make_uint4(a[0], a[1], a[2], a[3]);
      }
    }
  }
}

// The producer's whole launch: the CTA's items are work blockIdx.x, + gridDim.x, ... (every item
// has the same K, so a static round robin balances them), `blocks` 128-K blocks each; block j of
// that sequence uses stage j % kStages.
template <bool kIsL1, int kMTiles>
__device__ __forceinline__ void w4a8_ws_produce(const W4a8GemmParams& p, uint8_t* smem, int total, int blocks, int K) {
  using L = W4a8WsLayout<kMTiles>;
  constexpr int kStages = L::kStages, kAhead = L::kCopyAhead;
  const int tid = static_cast<int>(threadIdx.x);
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int items = static_cast<int>(blockIdx.x) < total ? (total - 1 - static_cast<int>(blockIdx.x)) / gridDim.x + 1 : 0;
  const int steps = items * blocks;

  W4a8WsCopyItem<kIsL1, kMTiles> it;
  int copy_j = 0, copy_kb = 0, copy_work = static_cast<int>(blockIdx.x);
  // Copies the next block of the sequence (one cp.async group, empty past the end).
  auto copy_next = [&]() {
    if (copy_j < steps) {
      if (copy_kb == 0) ws_begin_copy_item<kIsL1, kMTiles>(p, copy_work, total, tid, it);
      const int s = copy_j % kStages;
      if (copy_j >= kStages) ptx::mbarrier_wait(L::empty_bar(base, s), (copy_j / kStages + 1) & 1);
      ws_copy_block<kIsL1, kMTiles>(p, it, copy_kb, K, base + s * L::kStageBytes, tid);
      // The consumers' view of the B rows and block scales: this arrival fires once they have landed.
      ptx::cp_async_mbarrier_arrive(L::full_bar(base, s));
      ++copy_j;
      if (++copy_kb == blocks) {
        copy_kb = 0;
        copy_work += static_cast<int>(gridDim.x);
      }
    }
    ptx::cp_async_commit();
  };
  #pragma unroll 1
  for (int j = 0; j < kAhead; ++j) copy_next();
  #pragma unroll 1
  for (int j = 0; j < steps; ++j) {
    copy_next();
    ptx::cp_async_wait<kAhead>();  // this thread's copies of block j have landed
    __syncwarp();                  // and its warp's scale bytes and addend
    const int s = j % kStages;
    ws_decode_block<kMTiles>(smem + s * L::kStageBytes, tid);
    ptx::mbarrier_arrive(L::full_bar(base, s));  // the A fragments, to the consumers' loads
  }
}

}  // namespace megamoe::kernels::sm90::detail
