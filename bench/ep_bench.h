// `megamoe bench --ep N`: one rank's side (a process the launcher in tools/megamoe/bench.cpp
// started, one per GPU). Every rank loads only its experts (E/R routed + the shared expert) of the
// checkpoint the launcher synthesized, builds the expert-parallel layer (MoeEpLayer) and the
// unfused baseline, and per tokens-per-rank point:
//   1. checks its output of the EP layer's captured graph against the CPU reference;
//   2. times the graph's replays (L2 flushed before each; then an NCCL barrier, so that every rank
//      starts the same replay together; median of `iters`); the point's time is the slowest
//      rank's median;
//   3. baseline (a), the path users have today: its tokens packed per destination rank, NCCL
//      send/recv all-to-all (rows, local ids, weights), this library's single-GPU layer on the
//      received rows, the fp32 partial sums sent back, the weighted sum; checked against the EP
//      layer's output, timed whole and its compute part alone;
//   4. baseline (b) on rank 0 alone: the single-GPU layer over all R * T_r tokens where it fits;
//   5. gathers every rank's figures to rank 0, which prints the table and rewrites the JSON.
// The floor of each rank (ep_bench_model.h) uses its own measured copy and MMA rates and its
// measured NVLink copy rate to the next rank.
#pragma once

#include "bench/ep_bench_model.h"

namespace megamoe::bench {

// Runs rank `rank` of the benchmark `setup` describes; collective with the other ranks (every one
// must call it). Rank 0 prints the results on stdout, writes the JSON (setup.options.json) and
// writes "pass" or "fail" (the output checks) into setup.status_file. Throws megamoe::Error on
// CUDA, NCCL or setup failures.
void run_ep_bench_rank(const EpRankSetup& setup, int rank);

}  // namespace megamoe::bench
