// The host side of what every sm90 row's run() shares: the dispatch before the GEMMs and the
// combine after them (src/kernels/sm90/sm90_moe_dispatch.cuh, sm90_moe_combine.cuh), over the
// workspace of sm90_moe_workspace.h. A row builds its GEMMs' launches between the two.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

#include "kernels/sm90/sm90_moe_pipeline_params.cuh"
#include "megamoe/runtime.h"
#include "runtime/sm90/sm90_moe_workspace.h"
#include "runtime/token_gate.h"

namespace megamoe::runtime {

// How one GEMM cuts its work, as the dispatch counts work items per expert.
struct GemmSchedule {
  int block_m_tiles = 1;  // 64-row tiles of weights per work item (warpgroups)
  int block_n = 16;       // tokens per work item
  int tile_step = 16;     // tokens per item but an expert's last (which may take more)
  int k_splits = 1;       // K slices per item
};

// What the launches of one run read: the plan's problem, the caller's arguments, the workspace.
struct PipelineRun {
  const MoeProblem& problem;
  const MoeRunArgs& args;
  const WorkspaceLayout& layout;
  int64_t tokens;           // T (with a gate: the bound of what arrives)
  int64_t virtual_experts;  // E routed + shared slices
  int64_t slots_per_token;  // top_k + shared slices
  // The dispatch zeroes the combine accumulator (early start: it is then off the critical path,
  // and the fused launch's L2 items need no hand-off from every CTA's zeroing).
  bool dispatch_zeroes_accumulator;
  // Tokens that arrive on the device while the run is queued (token_gate.h), or null. The gated
  // dispatch and combine run on what arrived; the plan must be deterministic (nothing to zero
  // for T rows) and early start is off (its schedule needs the ids at launch).
  const TokenGate* gate = nullptr;

  static PipelineRun make(const MoeProblem& problem, const MoeRunArgs& args, const WorkspaceLayout& layout,
                          bool early_start, const TokenGate* gate = nullptr);
};

kernels::sm90::DispatchParams dispatch_params(const PipelineRun& r, const GemmSchedule& l1, const GemmSchedule& l2);
// Launched without programmatic serialization: it starts once everything before it on the stream
// has completed (the previous run's combine reads the accumulator the first GEMM zeroes).
// With a gate (d.gate.words set), the gated kernels: `selections` is then the bound's.
void launch_dispatch(const kernels::sm90::DispatchParams& d, int64_t selections, cudaStream_t stream);

// The fp32 accumulator (or the per-slot outputs in top-k order) to the caller's output.
kernels::sm90::CombineParams combine_params(const PipelineRun& r, const kernels::sm90::DispatchParams& d);
void launch_combine(const kernels::sm90::CombineParams& c, int num_sms, cudaStream_t stream);

// Loads the dispatch and combine kernels (MoeBackend::load_kernels).
void load_pipeline_kernels();

}  // namespace megamoe::runtime
