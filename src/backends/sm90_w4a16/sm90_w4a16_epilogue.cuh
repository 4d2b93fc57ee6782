// Epilogues of the sm90 W4A16 grouped GEMM, on one warpgroup's (64, BLOCK_N) fp32 accumulators
// (store_tile picks one by GEMM and tile):
//   L1: global scales of gate and up, optional clamp, SwiGLU, one bf16 rounding -> act[slot, I]
//       (swiglu_to_act_direct, swiglu_to_act_staged); split in K, the tile's last-arriving item
//       first adds the slices' sums (sum_k_slices);
//   L2: global scale, routing weight -> atomically added to the fp32 combine accumulator [T, H]
//       (add_weighted_direct), or (deterministic) stored per slot for the fixed-order combine
//       kernel (store_slots_direct); combine_staged does either through shared memory.
// Also the zeroing of the combine accumulator, which L1 does before L2 adds into it.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

#include "kernels/common/ptx_atomics.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_l1_split.h"
#include "backends/sm90_w4a16/sm90_w4a16_layout.h"
#include "backends/sm90_w4a16/sm90_w4a16_params.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_scheduler.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_tile.cuh"

namespace megamoe::kernels::sm90 {

namespace detail {

// silu(x) = x * sigmoid(x), the sigmoid from the SFU's approximate ex2 and rcp (flush to zero):
// five instructions. x / (1 + __expf(-x)) compiles to an IEEE division (FCHK, Newton steps, a
// slow-path call) plus ex2's subnormal fix-ups, several times as many in an epilogue that
// competes for issue slots (docs/perf/2026-11-22-h100-w4a16-v22.md).
// The result is within a few fp32 ulps of the exact one before its single rounding to bf16
// (docs/design.md §2). Limits: x -> -inf gives -0 (rcp(inf) = 0), x -> +inf gives x.
__device__ __forceinline__ float silu(float x) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(e) : "f"(x * -1.4426950408889634f));  // exp(-x)
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(1.0f + e));
  return x * r;
}

// Zeroes `count` floats (a multiple of 4) with the whole grid. Kept out of line so its registers
// do not add to the mainloop's.
inline __device__ __noinline__ void zero_grid_stride(float* dst, int64_t count) {
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count / 4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    reinterpret_cast<float4*>(dst)[i] = zero;
  }
}

// Zeroes slice `work` of `total` of `count` floats (a multiple of 4) with the calling CTA: the
// absorbing tile's L1 zeroes the combine accumulator one slice per work item, as the item starts
// (see w4a16_grouped_gemm_kernel, sm90_w4a16_grouped_gemm_kernel.cuh).
__device__ __forceinline__ void zero_item_slice(float* dst, int64_t count, int work, int total) {
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  const int64_t vecs = count / 4, per = (vecs + total - 1) / total;
  const int64_t end = min(vecs, (static_cast<int64_t>(work) + 1) * per);
  for (int64_t i = static_cast<int64_t>(work) * per + threadIdx.x; i < end; i += blockDim.x) {
    reinterpret_cast<float4*>(dst)[i] = zero;
  }
}

// Calls f(slot, acc index of row r0, acc index of row r0 + 8) for each of this thread's columns
// that holds a slot of the item: acc[4i + 2h + c] = (row r0 + 8h, column 8i + 2t + c).
template <int kBlockN, class F>
__device__ __forceinline__ void for_each_valid_column(const WorkItem& w, int t, F&& f) {
#pragma unroll
  for (int i = 0; i < kBlockN / 8; ++i) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int slot = w.slot_begin + 8 * i + 2 * t + c;
      if (slot < w.slot_end) f(slot, 4 * i + c, 4 * i + 2 + c);
    }
  }
}

// SwiGLU of one (gate, up) accumulator pair with its rows' global scales, clamped to `limit`,
// rounded to bf16 once. The A operand carries 2^-8 (sm90_w4a16_layout.h): the callers scale s2 by
// 2^8, which is exact and gives the same rounding as unscaling the accumulator first.
__device__ __forceinline__ __nv_bfloat16 swiglu_bf16(float gate_acc, float up_acc, float s2_gate, float s2_up,
                                                     float limit) {
  const float gate = fminf(gate_acc * s2_gate, limit);
  const float up = fminf(fmaxf(up_acc * s2_up, -limit), limit);
  return __float2bfloat16_rn(silu(gate) * up);
}

// The epilogues below work on one warpgroup's (64, BLOCK_N) tile m_tile, r0 = 16 * warp + g;
// store_tile picks one.

// L1, one warpgroup (the decode tiles): SwiGLU into act element by element (their items are
// narrow; see add_weighted_direct).
template <int kBlockN>
__device__ __forceinline__ void swiglu_to_act_direct(const W4a16GemmParams& p, const float (&acc)[kBlockN / 2],
                                                     const WorkItem& w, int m_tile, int warp, int g, int t) {
  using namespace w4a16;
  const float s2_gate = p.s2_gate[w.expert] * kAccumulatorUnscale, s2_up = p.s2_up[w.expert] * kAccumulatorUnscale;
  const int64_t col_j = w13_intermediate_column(m_tile, warp * 16 + g);
  for_each_valid_column<kBlockN>(w, t, [&](int slot, int j_gate, int j_up) {
    p.act[static_cast<int64_t>(slot) * p.act_ld + col_j] =
        swiglu_bf16(acc[j_gate], acc[j_up], s2_gate, s2_up, p.swiglu_limit);
  });
}

// L1 split in K, one warpgroup (sm90_w4a16_l1_split.h): stores this item's sums of its valid
// columns in its slice of the partial buffer and counts the item on its tile's arrival counter.
// Returns true in the tile's last-arriving item, whose acc then holds, in every valid column, the
// slices' sums added in slice order: (((s0 + s1) + s2) + s3), its own slice from registers, the
// others from the L2 cache (another SM wrote them). The same order whichever item arrives last, so
// the sum is bitwise the same from run to run; the products and their count are those of the
// unsplit item, only the order of the fp32 additions differs (docs/design.md §2). The hand-off is
// the fused kernel's L1 -> L2 one (ptx_atomics.cuh): stores, a CTA barrier, one thread's acq_rel
// add; that thread's acquire, a CTA barrier, the reads. The counters are zeroed by the dispatch,
// which has completed here: the caller waited for it before the epilogue (after_mainloop).
template <int kBlockN>
__device__ __forceinline__ bool sum_k_slices(const W4a16GemmParams& p, float (&acc)[kBlockN / 2], const WorkItem& w,
                                             int m_tile, int warp, int g, int t) {
  using namespace w4a16;
  __shared__ int last_shared;
  const int64_t rows = static_cast<int64_t>(p.m_tiles) * kTileM;
  const int64_t row0 = static_cast<int64_t>(m_tile) * kTileM + warp * 16 + g;
  for_each_valid_column<kBlockN>(w, t, [&](int slot, int j0, int j1) {
    float* q = p.l1_partial + w4a16_split::partial_offset(w.k_split, p.l1_partial_slice, slot, rows, row0);
    q[0] = acc[j0];
    q[8] = acc[j1];
  });
  __syncthreads();  // every thread's sums stored before the arrival
  if (threadIdx.x == 0) {
    int32_t before;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n"
                 : "=r"(before)
                 : "l"(p.l1_arrivals + w4a16_split::arrival_index(w.slot_begin, m_tile, p.m_tiles))
                 : "memory");
    last_shared = before == p.k_splits - 1;
  }
  __syncthreads();  // last_shared; in the last item, every other item's sums visible from here on
  if (!last_shared) return false;
  for_each_valid_column<kBlockN>(w, t, [&](int slot, int j0, int j1) {
    const float* q = p.l1_partial + w4a16_split::partial_offset(0, p.l1_partial_slice, slot, rows, row0);
    float sum0 = 0.0f, sum1 = 0.0f;
    for (int k = 0; k < p.k_splits; ++k) {
      const bool mine = k == w.k_split;
      const float a0 = mine ? acc[j0] : __ldcg(q + k * p.l1_partial_slice);
      const float a1 = mine ? acc[j1] : __ldcg(q + k * p.l1_partial_slice + 8);
      sum0 = k == 0 ? a0 : sum0 + a0;
      sum1 = k == 0 ? a1 : sum1 + a1;
    }
    acc[j0] = sum0;
    acc[j1] = sum1;
  });
  return true;
}

// L1, two or more warpgroups: SwiGLU into act through shared memory, per warp. A warp's gate / up
// row pairs are 8 consecutive act columns (w13_intermediate_column), 16 bytes of each token's row,
// spread over the 8 lanes of a quad column (g); element by element, each 2-byte store needs a
// 64-bit address of its own, which ptxas computes before the K loop and spills to local memory
// (docs/perf/2026-11-22-h100-w4a16-v22.md). Staged as (kStagedColumns tokens, 8 columns), lane L
// writes token L's 16 bytes with one store. The warp's region (512 bytes) is its own: __syncwarp
// orders it. kOwnStaging: the staging is not the B stages, so no CTA barrier before it.
template <int kBlockN, bool kOwnStaging>
__device__ __forceinline__ void swiglu_to_act_staged(const W4a16GemmParams& p, const float (&acc)[kBlockN / 2],
                                                     const WorkItem& w, int m_tile, int warp, int g, int t,
                                                     uint8_t* staging_smem) {
  using namespace w4a16;
  const float s2_gate = p.s2_gate[w.expert] * kAccumulatorUnscale, s2_up = p.s2_up[w.expert] * kAccumulatorUnscale;
  static_assert(kBlockN % kStagedColumns == 0, "the staged epilogue passes kStagedColumns tokens at a time");
  static_assert(kStagedColumns == 32, "one token per lane in a pass");
  static_assert(kStagedColumns * 8 * 2 * 4 <= kStagedColumns * kStagedStride * 4,
                "a warpgroup's four (kStagedColumns, 8) bf16 regions must fit its staging");
  const int lane = threadIdx.x % 32;
  const int wg = threadIdx.x / kThreadsPerWarpgroup;
  __nv_bfloat16* const stage =
      reinterpret_cast<__nv_bfloat16*>(staging_smem + wg * kStagedColumns * kStagedStride * 4) +
      warp * kStagedColumns * 8;  // (kStagedColumns, 8)
  __nv_bfloat16* const act_cols = p.act + w13_intermediate_column(m_tile, warp * 16);
  if constexpr (!kOwnStaging) __syncthreads();  // the B stages are free once every wgmma is done
  #pragma unroll
  for (int first = 0; first < kBlockN; first += kStagedColumns) {
    #pragma unroll
    for (int i = first / 8; i < (first + kStagedColumns) / 8; ++i) {
      #pragma unroll
      for (int c = 0; c < 2; ++c) {
        stage[(8 * i - first + 2 * t + c) * 8 + g] =
            swiglu_bf16(acc[4 * i + c], acc[4 * i + 2 + c], s2_gate, s2_up, p.swiglu_limit);
      }
    }
    __syncwarp();
    const int slot = w.slot_begin + first + lane;
    if (slot < w.slot_end) {
      *reinterpret_cast<uint4*>(act_cols + static_cast<int64_t>(slot) * p.act_ld) =
          *reinterpret_cast<const uint4*>(stage + lane * 8);
    }
    __syncwarp();  // the next pass overwrites the region
  }
}

// L2, one warpgroup, deterministic combine: y = acc * s2 stored per slot, element by element
// (s2: the down scale times 2^8, as in swiglu_bf16; row0: this thread's first output row).
template <int kBlockN>
__device__ __forceinline__ void store_slots_direct(const W4a16GemmParams& p, const float (&acc)[kBlockN / 2],
                                                   const WorkItem& w, int t, float s2, int64_t row0) {
  for_each_valid_column<kBlockN>(w, t, [&](int slot, int j0, int j1) {
    float* y = p.y_slot + static_cast<int64_t>(slot) * p.out_ld + row0;
    y[0] = acc[j0] * s2;
    y[8] = acc[j1] * s2;
  });
}

// L2, one warpgroup, atomic combine: y = acc * s2 times the routing weight, atomically added to
// the token's row, element by element. The one-warpgroup (decode) tiles do not stage: the staged
// path (combine_staged) changes ptxas's register allocation of their issue-bound L2 mainloops and
// grows every K group (docs/perf/2026-11-21-h100-w4a16-v16.md; tests/sass/check_sass.sh), and
// their items are narrow, so the epilogue is small. The columns' tokens and routing weights are
// loaded in batches of 16 ahead of their atomics: a load after an atomic add to a float* that may
// alias slot_weight cannot move above it, so loading per column made one global-load round trip
// per column in sequence (docs/perf/2026-11-21-h100-w4a16-v15.md).
template <int kBlockN>
__device__ __forceinline__ void add_weighted_direct(const W4a16GemmParams& p, const float (&acc)[kBlockN / 2],
                                                    const WorkItem& w, int t, float s2, int64_t row0) {
  constexpr int kColumns = kBlockN / 4;  // this thread's columns 8i + 2t + c: index 2i + c
  constexpr int kBatch = 16;
  #pragma unroll
  for (int first = 0; first < kColumns; first += kBatch) {
    int32_t token[kBatch];
    float weight[kBatch];
    #pragma unroll
    for (int j = 0; j < kBatch && first + j < kColumns; ++j) {
      const int col = first + j;
      const int slot = w.slot_begin + 8 * (col / 2) + 2 * t + col % 2;
      const bool valid = slot < w.slot_end;
      token[j] = valid ? p.slot_token[slot] : 0;
      weight[j] = valid ? p.slot_weight[slot] : 0.0f;
    }
    #pragma unroll
    for (int j = 0; j < kBatch && first + j < kColumns; ++j) {
      const int col = first + j, i = col / 2, c = col % 2;
      if (w.slot_begin + 8 * i + 2 * t + c < w.slot_end) {
        // Same order as the semantics: y = acc * s2, then times the routing weight.
        float* o = p.out_acc + static_cast<int64_t>(token[j]) * p.out_ld + row0;
        atomicAdd(o, (acc[4 * i + c] * s2) * weight[j]);
        atomicAdd(o + 8, (acc[4 * i + 2 + c] * s2) * weight[j]);
      }
    }
  }
}

// L2, two or more warpgroups, both combines: through a transpose in shared memory. The
// accumulators give a thread two rows (r0, r0 + 8) of many tokens, so storing them as they lie
// takes one 4-byte access per element (a warp's instruction: 4 tokens x 8 rows). Staged per
// warpgroup as (token, 64 rows) columns, a lane holds 4 consecutive rows of one token and writes
// them with one 16-byte access: a quarter of the instructions, and a warp's instruction covers two
// tokens' 64 rows, i.e. whole 128-byte lines. Atomic combine: red.global.add.v4.f32 (sm_90) into
// out_acc[token]; deterministic: a store to y_slot[slot] (the combine kernel sums the slots in a
// fixed order). The combine's cost follows the number of requests that leave the SM, not only its
// bytes: whole lines beat per-warp staging (64-byte pieces), which beats per-element atomics
// (megamoe_mainloop_probe, docs/perf/2026-11-22-h100-w4a16-v19.md).
// The staging (Smem::kStagingOffset) reuses the B stages, free once every warpgroup is past its
// last wgmma (the barrier below), unless the tile has its own (kOwnStaging); the caller's barrier
// after the item hands the B stages back to the next item. Within a pass the warpgroup's warps
// meet at a named barrier (id 1 + warpgroup; id 0 is __syncthreads).
// table_token, table_weight (kOwnStaging): the item's tokens and routing weights in shared
// memory, indexed from w.slot_begin; the other tiles read them from p.
template <int kBlockN, bool kOwnStaging>
__device__ __forceinline__ void combine_staged(const W4a16GemmParams& p, const float (&acc)[kBlockN / 2],
                                               const WorkItem& w, int m_tile, int warp, int g, int t,
                                               uint8_t* staging_smem, const int32_t* table_token,
                                               const float* table_weight) {
  using namespace w4a16;
  const float s2 = p.s2_down[w.expert] * kAccumulatorUnscale;  // exact, see swiglu_bf16
  static_assert(kBlockN % kStagedColumns == 0, "the staged combine passes kStagedColumns tokens at a time");
  const int lane = threadIdx.x % 32;
  const int wg = threadIdx.x / kThreadsPerWarpgroup;
  float* const staging = reinterpret_cast<float*>(staging_smem) + wg * kStagedColumns * kStagedStride;
  const int half = lane / 16;                                             // which of two tokens
  const int64_t rows = static_cast<int64_t>(m_tile) * kTileM + 4 * (lane % 16);  // this lane's 4 rows
  const bool to_slots = p.y_slot != nullptr;
  auto warpgroup_barrier = [wg] { asm volatile("bar.sync %0, 128;\n" :: "r"(1 + wg) : "memory"); };
  if constexpr (!kOwnStaging) __syncthreads();
  #pragma unroll
  for (int first = 0; first < kBlockN; first += kStagedColumns) {
    // This lane's tokens in the pass: columns first + 8 warp + 2 j + half, their destination row
    // (token or slot, -1 past the item's slots) and routing weight: from the absorbing tile's
    // slot table in shared memory, or from global memory before the staging stores, so that
    // their round trip overlaps them.
    int32_t dst_row[kStagedColumns / 8];
    float weight[kStagedColumns / 8];
    #pragma unroll
    for (int j = 0; j < kStagedColumns / 8; ++j) {
      const int column = first + 8 * warp + 2 * j + half;
      const int slot = w.slot_begin + column;
      const bool valid = slot < w.slot_end;
      if constexpr (kOwnStaging) {
        // The absorbing tile: its item's slot table (gemm_item_overlapped).
        dst_row[j] = !valid ? -1 : (to_slots ? slot : table_token[column]);
        weight[j] = valid && !to_slots ? table_weight[column] : 0.0f;
      } else {
        dst_row[j] = !valid ? -1 : (to_slots ? slot : p.slot_token[slot]);
        weight[j] = valid && !to_slots ? p.slot_weight[slot] : 0.0f;
      }
    }
    // Same order as the semantics: y = acc * s2 here, times the routing weight below.
    #pragma unroll
    for (int i = first / 8; i < (first + kStagedColumns) / 8; ++i) {
      #pragma unroll
      for (int c = 0; c < 2; ++c) {
        float* col = staging + (8 * i - first + 2 * t + c) * kStagedStride + 16 * warp;
        col[g] = acc[4 * i + c] * s2;
        col[g + 8] = acc[4 * i + 2 + c] * s2;
      }
    }
    warpgroup_barrier();
    #pragma unroll
    for (int j = 0; j < kStagedColumns / 8; ++j) {
      if (dst_row[j] >= 0) {
        const float4 y =
            *reinterpret_cast<const float4*>(staging + (8 * warp + 2 * j + half) * kStagedStride + 4 * (lane % 16));
        const int64_t offset = static_cast<int64_t>(dst_row[j]) * p.out_ld + rows;
        if (to_slots) {
          *reinterpret_cast<float4*>(p.y_slot + offset) = y;
        } else {
          ptx::red_add_v4(p.out_acc + offset, y.x * weight[j], y.y * weight[j], y.z * weight[j], y.w * weight[j]);
        }
      }
    }
    warpgroup_barrier();  // the next pass overwrites the staging
  }
}

// The epilogue of one warpgroup's (64, BLOCK_N) tile m_tile, r0 = 16 * warp + g: L1's SwiGLU or
// L2's combine, element by element on the one-warpgroup tiles, staged in shared memory on the
// others (staging_smem: Smem::kStagingOffset; kOwnStaging, table_token, table_weight: see
// combine_staged). kL1Split: L1 split in K (one warpgroup): only the tile's last-arriving item
// runs the SwiGLU, on the slices' sums (sum_k_slices).
template <bool kIsL1, int kWarpgroups, int kBlockN, bool kOwnStaging = false, bool kL1Split = false>
__device__ __forceinline__ void store_tile(const W4a16GemmParams& p, float (&acc)[kBlockN / 2],
                                           const WorkItem& w, int m_tile, int warp, int g, int t, uint8_t* staging_smem,
                                           const int32_t* table_token = nullptr, const float* table_weight = nullptr) {
  static_assert(!kL1Split || (kIsL1 && kWarpgroups == 1), "L1 splits K on the one-warpgroup tiles only");
  if constexpr (kIsL1 && kWarpgroups == 1) {
    if constexpr (kL1Split) {
      if (!sum_k_slices<kBlockN>(p, acc, w, m_tile, warp, g, t)) return;
    }
    swiglu_to_act_direct<kBlockN>(p, acc, w, m_tile, warp, g, t);
  } else if constexpr (kIsL1) {
    swiglu_to_act_staged<kBlockN, kOwnStaging>(p, acc, w, m_tile, warp, g, t, staging_smem);
  } else if constexpr (kWarpgroups == 1) {
    const float s2 = p.s2_down[w.expert] * w4a16::kAccumulatorUnscale;  // exact, see swiglu_bf16
    const int64_t row0 = static_cast<int64_t>(m_tile) * w4a16::kTileM + warp * 16 + g;
    if (p.y_slot != nullptr) {
      store_slots_direct<kBlockN>(p, acc, w, t, s2, row0);
    } else {
      add_weighted_direct<kBlockN>(p, acc, w, t, s2, row0);
    }
  } else {
    combine_staged<kBlockN, kOwnStaging>(p, acc, w, m_tile, warp, g, t, staging_smem, table_token, table_weight);
  }
}

}  // namespace detail

}  // namespace megamoe::kernels::sm90
