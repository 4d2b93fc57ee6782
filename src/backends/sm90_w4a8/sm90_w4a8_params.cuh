// Kernel parameters of the sm90 W4A8 grouped GEMM (one GEMM per launch; docs/w4a8.md §8). The
// schedule, the weights and the outputs are the W4A16 row's (W4a16GemmParams: its scheduler
// decodes the same work items, over the same prepacked bytes); what differs is the B operand,
// e4m3 codes with one scale 2^e per 128 of K, the per-tensor constants of the fp8 decode and L1's
// fp32 output. Filled by the host (sm90_w4a8_run.cu).
#pragma once

#include <cstdint>

#include "backends/sm90_w4a16/sm90_w4a16_params.cuh"

namespace megamoe::kernels::sm90 {

struct W4a8GemmParams {
  // Read as W4A16's: codes, scales and their strides, m_tiles, k_chunks (K / 64), k_splits = 1,
  // the dispatch's offsets, work counter and slots; L1's s2_gate / s2_up and L2's s2_down hold
  // s2 * 2^k (the rescale folded in); L2's out_acc / y_slot / out_ld; swiglu_limit, act_ld (I).
  W4a16GemmParams g;
  // B: L1 the hidden states' codes [T, H] gathered by slot_token, L2 the SwiGLU output's codes
  // [S, I] by slot; e4m3 in the fp8 MMA's K order (sm90_w4a8_layout.h), row-major.
  const uint8_t* b_codes;
  const float* b_scales;  // [rows, K / 128]: the block scales 2^e
  // Per virtual expert, the decode's scale constant (scale_exponent_addend): L1 gate rows in the
  // low half and up rows in the high half of each scale pair, L2 both halves down's.
  const uint32_t* exponent_addends;
  float* act_f32;  // L1 output: a [S, I] fp32, quantized by the next pass (never rounded to bf16)
};

}  // namespace megamoe::kernels::sm90
