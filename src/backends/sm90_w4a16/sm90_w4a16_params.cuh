// Kernel parameters of the sm90 W4A16 grouped GEMM (one GEMM per launch) and of the fused
// L1 + L2 launch. L1 is the gate/up GEMM (x · W13ᵀ, SwiGLU epilogue), L2 the down GEMM (a · W2ᵀ,
// combine epilogue); the cache is always called "the L2 cache". Filled by the host
// (src/backends/sm90_w4a16/sm90_w4a16_run.cu), read by every role of the kernel.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

#include "runtime/token_gate.h"

namespace megamoe::kernels::sm90 {

// One layout for both GEMMs, each field named for what the GEMM that reads it means by it: the kernels' parameter offsets
// are part of their speed (a per-GEMM split with identical instructions ran the fused decode
// launch slower: docs/perf/2026-11-29-h200-w4a16-v30.md §2).
struct W4a16GemmParams {
  // Prepacked weights of all (virtual) experts: expert e starts at e * *_expert_stride bytes.
  const uint8_t* codes;
  const uint8_t* scales;
  int64_t code_expert_stride;
  int64_t scale_expert_stride;
  int32_t m_tiles;    // 64-row tiles per expert
  int32_t k_chunks;   // 64-wide K chunks (K / 64)
  // K slices per tile: L2 (atomic combine only) adds each into the output; L1 (one-warpgroup
  // decode tiles) sums them in the tile's last-arriving item (sm90_w4a16_l1_split.h).
  int32_t k_splits;
  int32_t k_chunks_per_split;
  // Per expert, the global scales of the rows this GEMM multiplies: L1 reads gate and up, L2 down
  // (in gate's place: the layout stays one for both GEMMs).
  union {
    const float* s2_gate;  // L1
    const float* s2_down;  // L2
  };
  const float* s2_up;      // L1
  // B operand source rows: L1 gathers hidden[slot_token[slot]], L2 reads act[slot].
  const __nv_bfloat16* b_src;
  int64_t b_ld;       // elements per row (= K)
  // Schedule from the dispatch kernel.
  const int32_t* expert_offsets;  // (E' + 1)
  const int32_t* tile_offsets;    // (E' + 1)
  // Work items past the first gridDim.x are handed out by this counter (zeroed by the dispatch
  // kernel) as CTAs finish their items' mainloops: items differ in cost (token widths, ragged K
  // slices), so a static stride leaves SMs idle at the end of a prefill GEMM
  // (docs/perf/2026-11-21-h200-w4a16-v3.md).
  int32_t* work_counter;
  int32_t num_experts;            // E' (virtual)
  const int32_t* slot_token;
  const float* slot_weight;
  // L1 output: act (S, I) bf16; L2 outputs: out_acc (T, H) fp32 or y_slot (S, H) fp32. L1 split
  // in K reads L2's output fields as its partial buffer (k slices of (slots, 2I) fp32, the slice
  // l1_partial_slice floats apart) and its tiles' arrival counters (zeroed by the dispatch): the
  // layout stays one for both GEMMs.
  __nv_bfloat16* act;
  int64_t act_ld;
  union {
    float* out_acc;     // L2
    float* l1_partial;  // L1 split in K
  };
  union {
    float* y_slot;          // L2
    int32_t* l1_arrivals;   // L1 split in K
  };
  union {
    int64_t out_ld;            // L2
    int64_t l1_partial_slice;  // L1 split in K
  };
  float swiglu_limit;  // +inf when there is no clamp
  // L1 only: the atomic-combine accumulator (T, H) fp32 that L2 adds into, zeroed here so the run
  // needs no separate memset (L2 starts after this grid has completed; in the fused kernel, L2
  // items wait until every CTA has zeroed its part).
  float* zero_first;
  int64_t zero_count;  // floats, a multiple of 4
  // L1 only, early start (sm90_w4a16_grouped_gemm_kernel.cuh's header, early_schedule in
  // sm90_w4a16_scheduler.cuh): the top-k ids (T, k), or null to wait for
  // the dispatch before the first item. Set only where T * k <= kTinyMaxSelections and
  // T * (k + shared_chunks) <= kTinyMaxSlots.
  const int32_t* topk_ids;
  int32_t tokens;         // T
  int32_t top_k;          // k
  int32_t num_routed;     // E (num_experts counts the shared slices as well)
  int32_t shared_chunks;
  // Pre-wait prefetch into the L2 cache (prefetch_guessed_item, sm90_w4a16_scheduler.cuh): the
  // n-tiles per routed expert the host
  // expects from T * k / E, or 0 for none.
  int32_t guess_n_tiles;
};

// Parameters of the fused L1 + L2 launch.
struct W4a16FusedParams {
  W4a16GemmParams l1, l2;     // l1.work_counter hands out the items of both
  int32_t* l1_tiles_done;     // (E') L1 items completed per expert, zeroed by the dispatch kernel
  int32_t* ctas_zeroed;       // (1) CTAs done zeroing l1.zero_first, zeroed by the dispatch kernel
  // Early start on gated rows (early_schedule_gated, sm90_w4a16_scheduler.cuh): where the
  // dispatch publishes them; gate.published null otherwise.
  runtime::GateRows gate;
};

}  // namespace megamoe::kernels::sm90
