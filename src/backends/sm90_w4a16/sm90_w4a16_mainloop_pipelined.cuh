// The pipelined mainloop of the sm90 W4A16 grouped GEMM (the decode tiles and the non-overlapped
// 128-token tile): a cp.async multi-stage pipeline with one CTA barrier per group of K chunks;
// each group's weights are decoded into registers (sm90_w4a16_decode.cuh), then its wgmmas run
// with one round trip. The K loop is unrolled over the stages so that every shared-memory address
// and chunk offset is an immediate: the narrow (decode) tiles are bound by issue slots.
#pragma once

#include <cstdint>
#include <utility>

#include "kernels/common/ptx_cp_async.cuh"
#include "kernels/common/ptx_wgmma.cuh"
#include "kernels/common/static_for.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_decode.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_epilogue.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_operands.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_params.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_scheduler.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_tile.cuh"

namespace megamoe::kernels::sm90 {

namespace detail {

// Calls f(std::integral_constant<int, width>) with the narrowest allowed width >= rows, or
// kBlockN when rows exceeds it (a tile that is not its expert's last). Each width is its own
// mainloop instantiation: a branch between wgmmas would make ptxas serialise them.
template <int kBlockN, int kWidth = kTokenWidthStep<kBlockN>, class F>
__device__ __forceinline__ void with_token_width(int rows, F&& f) {
  static_assert(kBlockN % kTokenWidthStep<kBlockN> == 0, "BLOCK_N must be a multiple of the token width step");
  if constexpr (kWidth >= kBlockN) {
    f(std::integral_constant<int, kBlockN>{});
  } else {
    if (rows <= kWidth) {
      f(std::integral_constant<int, kWidth>{});
    } else {
      with_token_width<kBlockN, kWidth + kTokenWidthStep<kBlockN>>(rows, f);
    }
  }
}

// The pipelined mainloop's per-thread copy streams (weight_streams, b_pieces; kGroup chunks per
// pipeline group). The K loop is unrolled over the kStages stages, so every stage index is a
// compile-time constant: shared-memory addresses and the global offsets of chunks within a round
// of kStages are immediates, and the only per-round arithmetic is one pointer advance per stream
// (the integer pipes bound this loop, and recomputing addresses per chunk is a large share of its
// instructions: docs/perf/2026-11-21-h200-w4a16.md).
//   A: each thread copies its own 16 code bytes of the (64, 64) tile; 16 threads per warpgroup
//      copy the tile's 256 scale bytes. The weight sources stand at the next group of chunks to
//      copy (advanced by one group per group of copies). The code pointer sits half a group past
//      the group's first chunk (kPipelinedCodeBias) so the chunks' offsets, -1 KiB and +1 KiB, fit
//      the LDGSTS immediate; two chunks further (4 KiB) makes ptxas add a 64-bit offset per copy
//      (docs/perf/2026-11-21-h200-w4a16-v5.md).
//   B: (width rows, 8 x 16 bytes) pieces, a fixed set per thread; piece c of row r lands at
//      c ^ (r % 8) (128-byte swizzle). Rows past the expert's slots are zero-filled (src-size 0).
template <int kGroup>
inline constexpr int kPipelinedCodeBias = (kGroup - 1) * w4a16::kCodeBytesPerTile / 2;

// Closes a group of copies: one cp.async group, and the weight sources move to the next group.
template <int kGroup>
__device__ __forceinline__ void commit_copy_group(WeightStreams& ws) {
  ptx::cp_async_commit();
  ws.code_src += kGroup * w4a16::kCodeBytesPerTile;
  ws.scale_src += kGroup * w4a16::kScaleBytesPerTile;
}

// The pipeline's prologue: the item's first kStages - kGroup chunks (of n), kGroup per cp.async
// group. load(offset) copies chunk `offset` of the round into stage offset % kStages (gemm_item).
template <int kStages, int kGroup, class Load>
__device__ __forceinline__ void copy_first_chunks(int n, WeightStreams& ws, Load&& load) {
  static_for<kStages - kGroup>([&](auto s) {
    if (static_cast<int>(decltype(s)::value) < n) load(s);
    if constexpr ((decltype(s)::value + 1) % kGroup == 0) commit_copy_group<kGroup>(ws);
  });
}

// Decodes kChunks consecutive chunks from stages kFirstStage.. (all landed), then issues their
// wgmmas into acc and waits once: one wgmma round trip per group instead of per chunk. No control
// flow between the wgmmas and no A producer overlapping an in-flight group, either of which makes
// ptxas serialise or inject warpgroup arrives (C7513/C7519). b_desc0: stage 0's B descriptor.
template <class Smem, class Op, int kChunks, int kFirstStage, int kAcc>
__device__ __forceinline__ void compute_chunks(const WeightStreams& ws, uint64_t b_desc0, float (&acc)[kAcc]) {
  using namespace w4a16;
  uint32_t a[kChunks][kStepsPerChunk][4];
  #pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const uint4 q = *reinterpret_cast<const uint4*>(ws.code_lds + (kFirstStage + j) * Smem::kCodeStageBytes);
    const uint2 sc = *reinterpret_cast<const uint2*>(ws.scale_lds + (kFirstStage + j) * Smem::kScaleStageBytes);
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
    const uint32_t scale_words[2] = {sc.x, sc.y};  // steps (0, 1) and (2, 3)
    static_for<kStepsPerChunk>([&](auto step) {
      constexpr int s = decltype(step)::value;
      // Scales (row r0, row r0 + 8) of k-block s of this chunk: scale word s / 2.
      decode_step<s % 2>(words[s], scale_words[s / 2], a[j][s]);
    });
  }
  ptx::wgmma_fence();
  #pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    // The descriptor's address field counts 16-byte units: a stage offset is a constant add.
    const uint64_t desc = b_desc0 + static_cast<uint64_t>((kFirstStage + j) * Smem::kBTileBytes / 16);
    #pragma unroll
    for (int s = 0; s < kStepsPerChunk; ++s) {
      // k16 step s starts 32 bytes further along the swizzled 128-byte rows.
      ptx::wgmma_rs<Op>(a[j][s], desc + static_cast<uint64_t>(s * 2), acc, std::make_index_sequence<kAcc>{});
    }
  }
  ptx::wgmma_commit();
  ptx::wgmma_wait_all();
  // wgmma reads its A registers asynchronously: keep them alive until it has completed.
  #pragma unroll
  for (int j = 0; j < kChunks; ++j)
    #pragma unroll
    for (int s = 0; s < kStepsPerChunk; ++s)
      #pragma unroll
      for (int i = 0; i < 4; ++i) ptx::keep_in_register(a[j][s][i]);
  #pragma unroll
  for (int i = 0; i < kAcc; ++i) ptx::keep_in_register(acc[i]);
}

// The K loop over an item's n chunks, after copy_first_chunks. Chunks are consumed kGroup at a
// time per barrier (amortising the barrier, the waits and the wgmma round trip), with
// kStages - kGroup chunks of copies in flight ahead of the group being computed. Every group of
// chunks is one cp.async group (empty at the end of K), so the number allowed to stay pending is
// a constant. Rounds of kStages chunks; group q of a round computes stages
// [q * kGroup, (q + 1) * kGroup).
template <class Smem, class Op, int kStages, int kGroup, int kPieces, int kAcc, class Load>
__device__ __forceinline__ void pipelined_k_loop(int n, WeightStreams& ws, BPieces<kPieces>& b, uint64_t b_desc0,
                                                 float (&acc)[kAcc], Load&& load) {
  using namespace w4a16;
  for (int base = 0; base < n; base += kStages) {
    bool done = false;
    static_for<kStages / kGroup>([&](auto q) {
      constexpr int kFirst = decltype(q)::value * kGroup;
      const int c = base + kFirst;  // first chunk of this group
      if (done || c >= n) {
        done = true;
        return;
      }
      if (kGroup == 2 && c + 1 == n) {  // an odd chunk count: the last chunk is in flight
        ptx::cp_async_wait<0>();
        __syncthreads();
        compute_chunks<Smem, Op, 1, kFirst>(ws, b_desc0, acc);
        done = true;
        return;
      }
      ptx::cp_async_wait<(kStages - 2 * kGroup) / kGroup>();
      // Completion of this thread's copies + the barrier publish the group to every thread and
      // to wgmma. No proxy fence: it lowers to MEMBAR.ALL.CTA, which waits for every cp.async
      // in flight and collapses the pipeline; CUTLASS's cp.async GMMA mainloops likewise hand
      // cp.async stages to wgmma through a barrier alone.
      __syncthreads();  // this group visible to all; everyone is done with the previous group
      // The group's refills: chunks base + kFirst + kStages - kGroup .. + kStages - 1. One
      // range test for the whole group away from the end of K: a test and a branch per chunk
      // starts a new block per chunk, which ptxas pads before its first LDGSTS, and this loop is
      // issue-bound at the narrow tiles (docs/perf/2026-11-21-h200-w4a16-v5.md).
      constexpr int kRefill = kFirst + kStages - kGroup;  // < 2 * kStages
      if (base + kRefill + kGroup <= n) {
        static_for<kGroup>([&](auto j) { load(std::integral_constant<int, kRefill + decltype(j)::value>{}); });
      } else {
        static_for<kGroup>([&](auto j) {
          constexpr int kChunk = kRefill + decltype(j)::value;
          if (base + kChunk < n) load(std::integral_constant<int, kChunk>{});
        });
      }
      commit_copy_group<kGroup>(ws);
      compute_chunks<Smem, Op, kGroup, kFirst>(ws, b_desc0, acc);
    });
    #pragma unroll
    for (int j = 0; j < kPieces; ++j) b.src[j] += kStages * kChunkK * 2;
  }
  ptx::cp_async_wait<0>();
}

// Runs one work item with the whole CTA: mainloop over its K slice, then after_mainloop() (every
// thread; the schedulers claim their next item there), then the epilogue. The caller's barrier
// after it hands the shared-memory stages to the next item. kL1Split: L1 split in K (store_tile).
template <bool kIsL1, int kWarpgroups, int kBlockN, int kStages, bool kL1Split = false, class AfterMainloop>
__device__ __forceinline__ void gemm_item(const W4a16GemmParams& p, const WorkItem& w, uint8_t* smem,
                                          AfterMainloop&& after_mainloop) {
  using namespace w4a16;
  using Smem = W4a16SmemLayout<kWarpgroups, kBlockN, kStages>;
  static_assert(kStages >= 2, "the cp.async pipeline needs at least 2 stages");
  static_assert(!kIsL1 || kBlockN % 8 == 0, "BLOCK_N must be a multiple of 8: each B stage is whole 8-row swizzle atoms");
  constexpr int kThreads = kWarpgroups * kThreadsPerWarpgroup;
  const uint32_t smem_u32 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int tid = threadIdx.x;
  // Which 64-row tile of the block, and the thread in its warpgroup. Constant for one warpgroup:
  // ptxas cannot know tid < 128 and would carry wg's multiples through every copy address.
  const int wg = kWarpgroups == 1 ? 0 : tid / kThreadsPerWarpgroup;
  const int wtid = kWarpgroups == 1 ? tid : tid % kThreadsPerWarpgroup;
  const int warp = wtid / 32, lane = wtid % 32;
  const int g = lane / 4, t = lane % 4;
  // The tile's token width for this work item: the narrowest allowed width that holds its
  // slots. An expert's last tile is usually partly empty (uniform routing puts 128 +- 11 tokens
  // on an expert at DeepSeek-V3 T=4096); wgmma time is linear in N, so a narrower wgmma on
  // that tile saves tensor time without changing the schedule, the shared-memory stages or
  // the arithmetic of any valid column.
  with_token_width<kBlockN>(w.slot_end - w.slot_begin, [&](auto width) {
    constexpr int kWidth = decltype(width)::value;
    using Op = typename ptx::WgmmaRS<kWidth>::Op;
    constexpr int kAcc = kWidth / 2;  // fp32 accumulators per thread: (64, width) / 128
    // Chunks per pipeline group (see pipelined_k_loop).
    // Tiles up to N = 64 pair chunks: the A fragments of two chunks (32 registers) fit next to
    // their accumulators, while the 128-token tile needs those registers for its 64
    // accumulators. (Four chunks per group at N = 16 need enough registers to cost a CTA per SM,
    // which is slower: docs/perf/2026-11-21-h200-w4a16-v2.md.)
    constexpr int kGroup = kChunksPerGroup<kBlockN>;
    static_assert(kGroup <= 2, "the tail handles at most one leftover chunk");
    static_assert(kStages >= 2 * kGroup && kStages % kGroup == 0,
                  "need kStages >= 2 * kGroup (a group computing, a group landing), a multiple of kGroup");
    const int e = w.expert, m_block = w.m_block;
    const int m_tile = m_block * kWarpgroups + wg;
    constexpr int kPieces = kWidth * 8 / kThreads;
    static_assert(kWidth * 8 % kThreads == 0, "every token width * 8 must be a multiple of the thread count");
    const auto [k_begin, n] = item_chunks(p, w);  // chunks of this work item
    const int64_t a_tile0 = static_cast<int64_t>(m_block * kWarpgroups + wg) * p.k_chunks + k_begin;
    WeightStreams ws = weight_streams<Smem>(p, e, a_tile0, smem, wg, wtid, kPipelinedCodeBias<kGroup>);
    BPieces<kPieces> b = b_pieces<kIsL1, Smem, kPieces, kThreads>(p, w, k_begin, smem_u32, tid);
    const uint64_t b_desc0 = ptx::make_sw128_desc(smem + Smem::kBOffset);  // stage 0

    // Copies chunk (round base + kOffset) into stage kOffset % kStages; kOffset < 2 * kStages.
    // Its weights are chunk kOffset % kGroup of the group the weight pointers stand at. A lambda,
    // as in gemm_item_overlapped: the same code as a __forceinline__ function reorders ptxas's
    // register moves in the 128-token tile (compare tests/sass/check_sass.sh's counts).
    auto load = [&](auto offset) {
      constexpr int kOffset = decltype(offset)::value;
      constexpr int kStage = kOffset % kStages;
      constexpr int kInGroup = kOffset % kGroup;
      ptx::cp_async_16(ws.code_dst + kStage * Smem::kCodeStageBytes,
                       ws.code_src + kInGroup * kCodeBytesPerTile - kPipelinedCodeBias<kGroup>, true);
      if (ws.copies_scales) {
        ptx::cp_async_16(ws.scale_dst + kStage * Smem::kScaleStageBytes, ws.scale_src + kInGroup * kScaleBytesPerTile, true);
      }
      #pragma unroll
      for (int j = 0; j < kPieces; ++j) {
        ptx::cp_async_16(b.dst[j] + kStage * Smem::kBTileBytes, b.src[j] + kOffset * kChunkK * 2, b.valid[j]);
      }
    };

    float acc[kAcc];
    #pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
    copy_first_chunks<kStages, kGroup>(n, ws, load);
    pipelined_k_loop<Smem, Op, kStages, kGroup>(n, ws, b, b_desc0, acc, load);

    after_mainloop();
    detail::store_tile<kIsL1, kWarpgroups, kWidth, false, kL1Split>(p, acc, w, m_tile, warp, g, t,
                                                                   smem + Smem::kStagingOffset);
  });
}

}  // namespace detail

}  // namespace megamoe::kernels::sm90
