// `megamoe bench --ep-loopback N`: the expert-parallel layer over N virtual ranks on one GPU
// (EpLoopback: each rank its own SM partition and stream), in this process. Per tokens-per-rank
// point: every rank's output checked against the CPU reference; the layer's time (CUDA-graph
// replays of every rank released together after an L2 flush, from the release to the last rank's
// end; median); and from eager runs released the same way with stage events
// (MoeEpLayer::StageEvents), the stages of the slowest rank and the exchange's share (send, and the
// return with the combine and its wait, one kernel; the wait for the peers' rows is inside the
// local stage). The ranks share one GPU's SMs and HBM and exchange through its memory: a debugging
// and regression figure, not a multi-GPU one.
#pragma once

#include "bench/ep_bench_model.h"

namespace megamoe::bench {

// Uses opt.world_size as the number of virtual ranks; the baselines need NCCL between GPUs and
// are not run. Prints the table on stdout; returns 0 when the output checks pass, 1 otherwise.
// Throws megamoe::Error on bad options or CUDA failures.
int run_ep_loopback_bench(const EpBenchOptions& opt);

}  // namespace megamoe::bench
