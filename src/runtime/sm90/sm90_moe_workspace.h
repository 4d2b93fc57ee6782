// What every sm90 row's plan and run() agree on: the problem's derived counts (virtual experts,
// slots), the limits of the sm90 pipeline, and the workspace layout run() carves its buffers from.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "megamoe/runtime.h"

namespace megamoe::runtime {

// The shared expert runs as `shared_chunks` virtual experts of the routed intermediate size
// (every token in each), after the E routed ones.
inline int64_t shared_chunks(const MoeProblem& p) {
  return p.shared_intermediate_size / std::max<int64_t>(p.intermediate_size, 1);
}
inline int64_t virtual_experts(const MoeProblem& p) { return p.num_experts + shared_chunks(p); }
inline int64_t slots_per_token(const MoeProblem& p) { return p.top_k + shared_chunks(p); }

// Throws megamoe::Error (kUnsupported / kInvalidArgument) saying what the sm90 pipeline allows
// (the arch-neutral checks, validate_problem_common, come first).
void validate_sm90_problem(const MoeProblem& p);

// The int32 counters the dispatch kernel zeroes: [0] L1 work items, [1] L2 work items, [2] CTAs
// done zeroing (fused launch), then per virtual expert the L1 items done (fused launch). Past
// them the W4A16 L1 split's arrival counters (l1_split_counters), zeroed with them where a run
// splits L1 (GemmSchedule::k_splits of L1 > 1; dispatch_params counts them then).
inline constexpr int64_t kL1WorkCounter = 0;
inline constexpr int64_t kL2WorkCounter = 1;
inline constexpr int64_t kCtasZeroedCounter = 2;
inline constexpr int64_t kL1DoneCounters = 3;
inline int64_t counter_count(const MoeProblem& p) { return kL1DoneCounters + virtual_experts(p); }
// The arrival counters of L1 split in K at `slots` slots (sm90_w4a16_l1_split.h: one per first
// slot and 64-row W13 tile), and the most any run of the plan may use.
inline int64_t l1_split_counters(const MoeProblem& p, int64_t slots) { return slots * (2 * p.intermediate_size / 64); }
int64_t l1_split_slots(const MoeProblem& p);

// Byte offsets of the workspace's regions, each 256-byte aligned, sized for max_tokens.
// l1_partial: the W4A16 L1 split's partial sums (sm90_w4a16_l1_split.h), l1_partial_slice floats
// per K slice.
struct WorkspaceLayout {
  size_t expert_offsets, l1_tiles, l2_tiles, invalid, counters, cta_counts, cta_invalid, slot_token, slot_weight,
      token_slot, act, out_acc, y_slot, l1_partial, total;
  int64_t l1_partial_slice;
};
WorkspaceLayout workspace_layout(const MoeProblem& p);

// Ids outside [0, E) seen by the last run that used `workspace` (synchronises `stream`).
int64_t read_invalid_id_count(const MoeProblem& p, const void* workspace, cudaStream_t stream);

template <class T>
T* workspace_at(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<uint8_t*>(base) + offset);
}

}  // namespace megamoe::runtime
