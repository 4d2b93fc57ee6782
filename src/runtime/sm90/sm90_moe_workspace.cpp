// The sm90 pipeline's limits and workspace layout (sm90_moe_workspace.h).
#include "runtime/sm90/sm90_moe_workspace.h"

#include <limits>

#include "backends/sm90_w4a16/sm90_w4a16_l1_split.h"
#include "kernels/sm90/sm90_moe_dispatch_limits.h"
#include "megamoe/gpu.h"
#include "megamoe/status.h"

namespace megamoe::runtime {

void validate_sm90_problem(const MoeProblem& p) {
  MEGAMOE_CHECK(p.hidden_size > 0 && p.hidden_size % 64 == 0, kUnsupported,
                "MoePlan: hidden_size = ", p.hidden_size,
                " is not supported; the sm90 kernels need a positive multiple of 64");
  MEGAMOE_CHECK(p.intermediate_size > 0 && p.intermediate_size % 64 == 0, kUnsupported,
                "MoePlan: intermediate_size = ", p.intermediate_size,
                " is not supported; the sm90 kernels need a positive multiple of 64");
  MEGAMOE_CHECK(p.num_experts >= 1 && p.num_experts <= 1024, kUnsupported,
                "MoePlan: num_experts = ", p.num_experts, " is outside the supported 1..1024");
  MEGAMOE_CHECK(p.shared_intermediate_size >= 0 &&
                    p.shared_intermediate_size % p.intermediate_size == 0 &&
                    shared_chunks(p) <= 8,
                kUnsupported, "MoePlan: shared_intermediate_size = ", p.shared_intermediate_size,
                " must be 0 or a multiple (at most 8x) of intermediate_size = ",
                p.intermediate_size);
  MEGAMOE_CHECK(p.max_tokens * slots_per_token(p) < std::numeric_limits<int32_t>::max(),
                kInvalidArgument, "MoePlan: max_tokens * (top_k + shared slices) overflows int32");
}

int64_t l1_split_slots(const MoeProblem& p) { return w4a16_split::partial_slots(p.max_tokens, slots_per_token(p)); }

WorkspaceLayout workspace_layout(const MoeProblem& p) {
  WorkspaceLayout w{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += (bytes + 255) / 256 * 256;
    return at;
  };
  const size_t ev = static_cast<size_t>(virtual_experts(p)) + 1;
  const size_t slots = static_cast<size_t>(p.max_tokens * slots_per_token(p));
  w.expert_offsets = take(ev * 4);
  w.l1_tiles = take(ev * 4);
  w.l2_tiles = take(ev * 4);
  w.invalid = take(4);
  w.counters = take(static_cast<size_t>(counter_count(p) + l1_split_counters(p, l1_split_slots(p))) * 4);
  // The multi-CTA dispatch's per-CTA expert counts (large T only).
  w.cta_counts = take(static_cast<size_t>(kernels::sm90::kDispatchMaxCtas) * static_cast<size_t>(p.num_experts) * 4);
  w.cta_invalid = take(static_cast<size_t>(kernels::sm90::kDispatchMaxCtas) * 4);
  w.slot_token = take(slots * 4);
  w.slot_weight = take(slots * 4);
  w.token_slot = take(slots * 4);
  w.act = take(slots * static_cast<size_t>(p.intermediate_size) * 2);
  w.out_acc = p.deterministic ? off : take(static_cast<size_t>(p.max_tokens * p.hidden_size) * 4);
  w.y_slot = p.deterministic ? take(slots * static_cast<size_t>(p.hidden_size) * 4) : off;
  // L1 split in K: kMaxL1KSplits slices of (split slots, 2I) fp32 (a few MB at most: the split
  // runs only up to kL1SplitMaxSlots slots).
  w.l1_partial_slice = l1_split_slots(p) * 2 * p.intermediate_size;
  w.l1_partial = take(static_cast<size_t>(w4a16_split::kMaxL1KSplits * w.l1_partial_slice) * 4);
  w.total = off;
  return w;
}

int64_t read_invalid_id_count(const MoeProblem& problem, const void* workspace, cudaStream_t stream) {
  int32_t count = 0;
  const WorkspaceLayout layout = workspace_layout(problem);
  gpu::check_cuda(cudaMemcpyAsync(&count, static_cast<const uint8_t*>(workspace) + layout.invalid, 4,
                                  cudaMemcpyDeviceToHost, stream),
                  "cudaMemcpyAsync(invalid id count)");
  gpu::check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return count;
}

}  // namespace megamoe::runtime
