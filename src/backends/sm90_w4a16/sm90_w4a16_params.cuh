// Kernel parameters of the sm90 W4A16 grouped GEMMs (one GEMM per launch) and of the fused
// L1 + L2 launch. L1 is the gate/up GEMM (x · W13ᵀ, SwiGLU epilogue), L2 the down GEMM (a · W2ᵀ,
// combine epilogue); the cache is always called "the L2 cache". Each GEMM has a type of its own:
// what both read (weights, B rows, the dispatch's schedule) is W4a16GemmCommon, and each adds its
// epilogue's fields. Filled by the host (src/backends/sm90_w4a16/sm90_w4a16_run.cu).
#pragma once

#include <cuda_bf16.h>
#include <cstdint>
#include <type_traits>

namespace megamoe::kernels::sm90 {

// What the mainloops and the scheduler read, the same for both GEMMs.
struct W4a16GemmCommon {
  // Prepacked weights of all (virtual) experts: expert e starts at e * *_expert_stride bytes.
  const uint8_t* codes;
  const uint8_t* scales;
  int64_t code_expert_stride;
  int64_t scale_expert_stride;
  int32_t m_tiles;    // 64-row tiles per expert
  int32_t k_chunks;   // 64-wide K chunks (K / 64)
  int32_t k_splits;   // K slices per tile, each added into the output (L2 atomic mode only)
  int32_t k_chunks_per_split;
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
  int32_t num_routed;             // E (num_experts counts the shared slices as well)
  const int32_t* slot_token;
  const float* slot_weight;
  // Pre-wait prefetch into the L2 cache (prefetch_guessed_item, sm90_w4a16_scheduler.cuh): the
  // n-tiles per routed expert the host expects from T * k / E, or 0 for none.
  int32_t guess_n_tiles;
};

// The parameters of GEMM L1 (kIsL1) or L2.
template <bool kIsL1>
struct W4a16GemmParams;

// L1: SwiGLU into act; zeroes the combine accumulator; may start early.
template <>
struct W4a16GemmParams<true> : W4a16GemmCommon {
  const float* s2_gate;  // per expert: the gate rows' global scale
  const float* s2_up;    // per expert: the up rows' global scale
  __nv_bfloat16* act;    // (S, I) bf16, L2's B operand
  int64_t act_ld;
  float swiglu_limit;    // +inf when there is no clamp
  // The atomic-combine accumulator (T, H) fp32 that L2 adds into, zeroed here so the run needs
  // no separate memset (L2 starts after this grid has completed; in the fused kernel, L2 items
  // wait until every CTA has zeroed its part), or null.
  float* zero_first;
  int64_t zero_count;    // floats, a multiple of 4
  // Early start (sm90_w4a16_grouped_gemm_kernel.cuh's header, early_schedule in
  // sm90_w4a16_scheduler.cuh): the top-k ids (T, k), or null to wait for the dispatch before the
  // first item. Set only where T * k <= kTinyMaxSelections and
  // T * (k + shared_chunks) <= kTinyMaxSlots.
  const int32_t* topk_ids;
  int32_t tokens;        // T
  int32_t top_k;         // k
  int32_t shared_chunks;
};

// L2: scaled by the routing weight and added into the combine accumulator, or stored per slot for
// the deterministic combine.
template <>
struct W4a16GemmParams<false> : W4a16GemmCommon {
  const float* s2_down;  // per expert: the down rows' global scale
  float* out_acc;        // (T, H) fp32, atomic combine; null when deterministic
  float* y_slot;         // (S, H) fp32, deterministic combine; null otherwise
  int64_t out_ld;
};

using W4a16L1Params = W4a16GemmParams<true>;
using W4a16L2Params = W4a16GemmParams<false>;

static_assert(std::is_trivially_copyable_v<W4a16L1Params> && std::is_trivially_copyable_v<W4a16L2Params>,
              "kernel parameters are copied bytewise");

// Parameters of the fused L1 + L2 launch.
struct W4a16FusedParams {
  W4a16L1Params l1;           // l1.work_counter hands out the items of both; L1 never splits K
  W4a16L2Params l2;
  int32_t* l1_tiles_done;     // (E') L1 items completed per expert, zeroed by the dispatch kernel
  int32_t* ctas_zeroed;       // (1) CTAs done zeroing l1.zero_first, zeroed by the dispatch kernel
};

}  // namespace megamoe::kernels::sm90
