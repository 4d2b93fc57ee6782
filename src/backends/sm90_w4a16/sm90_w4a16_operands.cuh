// The operand copy streams of the sm90 W4A16 mainloops: a thread's share of each item's B tile
// (token rows gathered by slot, 128-byte swizzle, zero-filled past the item's slots) and of its
// prepacked weight codes and scales, with the shared-memory addresses the A decode reads from.
// Both mainloops copy through these, so the layouts they agree on are defined once.
#pragma once

#include <cstdint>

#include "backends/sm90_w4a16/sm90_w4a16_layout.h"
#include "backends/sm90_w4a16/sm90_w4a16_params.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_scheduler.cuh"

namespace megamoe::kernels::sm90 {

namespace detail {

// Piece i of a work item's B tile, 16 bytes of (row i / 8, K chunk columns 8 * (i % 8) ..): its
// global source at chunk k_begin (the slot's token row in L1, the slot's activation row in L2),
// its shared-memory destination in stage 0 (piece c of row r lands at c ^ (r % 8): 128-byte
// swizzle), and whether the row holds a slot of the item (otherwise the copy zero-fills).
template <bool kIsL1, class Smem>
__device__ __forceinline__ void b_piece(const W4a16GemmParams& p, const WorkItem& w, int k_begin, uint32_t smem_u32,
                                        int i, const char*& src, uint32_t& dst, bool& valid) {
  const int r = i / 8, c = i % 8;
  const int slot = w.slot_begin + r;
  valid = slot < w.slot_end;
  const int64_t src_row = !valid ? 0 : (kIsL1 ? w.slot_token[slot] : slot);
  src = reinterpret_cast<const char*>(p.b_src + src_row * p.b_ld + k_begin * w4a16::kChunkK + c * 8);
  dst = smem_u32 + Smem::kBOffset + r * 128 + ((c ^ (r & 7)) * 16);
}

// A thread's pieces of a work item's B tile, tid, tid + kThreads, ... (b_piece at chunk k_begin):
// gemm_item and gemm_item_overlapped copy their B stages from these.
template <int kPieces>
struct BPieces {
  const char* src[kPieces];
  uint32_t dst[kPieces];
  bool valid[kPieces];
};
template <bool kIsL1, class Smem, int kPieces, int kThreads>
__device__ __forceinline__ BPieces<kPieces> b_pieces(const W4a16GemmParams& p, const WorkItem& w, int k_begin,
                                                     uint32_t smem_u32, int tid) {
  BPieces<kPieces> b;
  #pragma unroll
  for (int j = 0; j < kPieces; ++j) b_piece<kIsL1, Smem>(p, w, k_begin, smem_u32, tid + j * kThreads, b.src[j], b.dst[j], b.valid[j]);
  return b;
}

// A thread's weight streams for one work item: its 16 code bytes (and, for 16 threads of the
// warpgroup, 16 scale bytes) of 64-row tile a_tile0's first chunk, their shared-memory
// destinations, and the consumer reads of its A fragments' codes and scales, all at stage 0 (a
// stage adds a constant). code_bias offsets the code source (gemm_item's chunk pairs).
struct WeightStreams {
  const uint8_t* code_src;
  const uint8_t* scale_src;
  uint32_t code_dst, scale_dst;
  const uint8_t* code_lds;
  const uint8_t* scale_lds;
  bool copies_scales;
};
template <class Smem>
__device__ __forceinline__ WeightStreams weight_streams(const W4a16GemmParams& p, int expert, int64_t a_tile0,
                                                        uint8_t* smem, int wg, int wtid, int code_bias) {
  using namespace w4a16;
  const int warp = wtid / 32, g = wtid % 32 / 4;
  const uint32_t smem_u32 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  WeightStreams s;
  s.code_src = p.codes + expert * p.code_expert_stride + a_tile0 * kCodeBytesPerTile + wtid * 16 + code_bias;
  s.scale_src = p.scales + expert * p.scale_expert_stride + a_tile0 * kScaleBytesPerTile + wtid * 16;
  s.code_dst = smem_u32 + Smem::kCodeOffset + wg * kCodeBytesPerTile + wtid * 16;
  s.scale_dst = smem_u32 + Smem::kScaleOffset + wg * kScaleBytesPerTile + wtid * 16;
  s.code_lds = smem + Smem::kCodeOffset + wg * kCodeBytesPerTile + wtid * 16;
  s.scale_lds = smem + Smem::kScaleOffset + wg * kScaleBytesPerTile + (warp * 8 + g) * 8;
  s.copies_scales = wtid < kScaleBytesPerTile / 16;
  return s;
}

}  // namespace detail

}  // namespace megamoe::kernels::sm90
