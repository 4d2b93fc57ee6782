// The parameters of the dispatch and combine kernels every sm90 row shares
// (sm90_moe_dispatch.cuh, sm90_moe_combine.cuh), apart from the kernels so that host code of
// several translation units can build them.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

#include "runtime/token_gate.h"

namespace megamoe::kernels::sm90 {

struct DispatchParams {
  const int32_t* topk_ids;       // (T, k)
  const float* topk_weights;     // (T, k)
  int32_t tokens;                // T
  int32_t top_k;                 // k
  int32_t num_experts;           // E routed
  int32_t shared_chunks;         // virtual shared experts (0 if none)
  int32_t l1_m_tiles;            // 64-row tiles of W13 per expert
  int32_t l2_m_tiles;            // 64-row tiles of W2 per expert
  int32_t l1_block_m_tiles;      // tiles per L1 CTA (warpgroups)
  int32_t l2_block_m_tiles;
  int32_t l1_block_n;            // tokens per L1 tile
  int32_t l2_block_n;
  int32_t l1_tile_step;          // tokens per tile but an expert's last (expert_token_tiles)
  int32_t l2_tile_step;
  int32_t l1_k_splits;           // K slices per L1 tile (1, or a W4A16 L1 split: sm90_w4a16_l1_split.h)
  int32_t l2_k_splits;           // K slices per L2 tile
  // outputs (workspace)
  int32_t* expert_offsets;       // (E' + 1) slot offsets
  int32_t* l1_tile_offsets;      // (E' + 1) prefix of L1 work items
  int32_t* l2_tile_offsets;      // (E' + 1)
  int32_t* slot_token;           // (S) token of each slot
  float* slot_weight;            // (S) routing weight of each slot (1 for shared slices)
  int32_t* token_slot;           // (T, k + shared_chunks) slot of each selection, -1 if invalid
  int32_t* invalid_ids;          // (1) number of ids outside [0, E)
  // (counter_count) zeroed here before the GEMMs start: their work-item counters, the fused
  // launch's per-expert L1 progress.
  int32_t* counters;
  int32_t counter_count;
  // One-CTA path with early start: the atomic-combine accumulator (T, H) fp32, zeroed here
  // (the dispatch is then off the critical path; the L1 GEMM zeroes it otherwise). Null if not.
  float* zero_first;
  int64_t zero_count;  // floats, a multiple of 4
  // Multi-CTA path only: each CTA owns tokens [blockIdx.x * tokens_per_cta, + tokens_per_cta).
  int32_t tokens_per_cta;
  int32_t* cta_counts;           // (kDispatchMaxCtas, E) routed selections per CTA and expert
  int32_t* cta_invalid;          // (kDispatchMaxCtas) invalid ids per CTA
  // The gated kernels only: the tokens arrive while the run is queued (token_gate.h); `tokens`
  // is then their upper bound, and the gate's rows what the run takes.
  runtime::TokenGate gate;
};

struct CombineParams {
  const float* out_acc;        // (T, H) fp32, atomic mode
  const float* y_slot;         // (S, H) fp32, deterministic mode (nullptr otherwise)
  const int32_t* token_slot;   // (T, slots_per_token)
  const float* slot_weight;    // (S)
  int32_t slots_per_token;
  int64_t tokens;
  int64_t hidden;              // H, a multiple of 8
  __nv_bfloat16* out;          // (T, H), or null when out_f32 is set
  float* out_f32;              // (T, H) fp32 before rounding, or null
  const int32_t* tokens_dev;   // the gated combine only: the tokens the dispatch's gate let through
  runtime::ReturnRows returns; // the gated combine only: each row's sum to its source's buffer
};

}  // namespace megamoe::kernels::sm90
