// The two kernels of `megamoe bench --ep`'s unfused baseline (a) that are not NCCL or this
// library's single-GPU layer: packing a rank's token rows per destination rank before the
// all-to-all, and the weighted sum of the partial results that come back.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace megamoe::bench {

// Send row i (0..rows-1) of the packed buffers is token row_token[i] of this rank, bound for rank
// row_dest[i]: its hidden row is copied, its top-k ids become row_dest's local ids (id -
// row_dest * experts_per_rank) where that rank owns them and -1 elsewhere (the receiver's layer
// skips those), its weights are copied.
struct EpPackArgs {
  const uint16_t* hidden = nullptr;   // [T, H] bf16
  const int32_t* topk_ids = nullptr;  // [T, k] global ids
  const float* topk_weights = nullptr;
  const int32_t* row_token = nullptr;  // [rows]
  const int32_t* row_dest = nullptr;   // [rows]
  int64_t rows = 0;
  int64_t hidden_size = 0;  // H, a multiple of 8
  int top_k = 0;
  int64_t experts_per_rank = 0;
  uint16_t* send_hidden = nullptr;  // [rows, H]
  int32_t* send_ids = nullptr;      // [rows, k]
  float* send_weights = nullptr;    // [rows, k]
};
void ep_pack_rows(const EpPackArgs& args, cudaStream_t stream);

// out[t] = bf16(Σ_{d = 0..world-1, slots[t, d] >= 0} partial[slots[t, d]] + shared[t]): the partial
// sums of token t that came back from each rank, in rank order, then the shared expert's, rounded
// once (the EP layer's combine order).
struct EpCombineArgs {
  const float* partial = nullptr;  // [rows, H] fp32, as returned (row i = send row i)
  const int32_t* slots = nullptr;  // [T, world]: the send row of (t, d), or -1
  int world = 0;
  const float* shared = nullptr;   // [T, H] fp32, or null (no shared expert)
  int64_t tokens = 0;
  int64_t hidden_size = 0;         // a multiple of 4
  uint16_t* out = nullptr;         // [T, H] bf16
};
void ep_combine_rows(const EpCombineArgs& args, cudaStream_t stream);

}  // namespace megamoe::bench
