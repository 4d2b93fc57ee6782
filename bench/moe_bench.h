// `megamoe bench`: the W4A16 MoE layer (and, beside it, W4A8 or auto) against its floor and the bf16
// cuBLAS baseline.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace megamoe::bench {

struct BenchOptions {
  std::string preset = "deepseek-v3";
  std::string checkpoint;  // an existing checkpoint dir instead of a synthesized layer
  int64_t layer = -1;      // with checkpoint: the MoE layer (default: the first one)
  std::vector<int64_t> tokens = {1, 4, 16, 64, 256, 1024, 4096, 16384};
  int64_t num_experts = 0;  // synth only: 0 = the preset's
  int64_t shared_experts = -1;  // synth only: -1 = the preset's, 0 = routed experts only
  // How the L2 is emptied before each timed replay (l2_flush.h): "clean" or "dirty".
  std::string flush = "clean";
  int replays = 30;         // timed CUDA-graph replays per point (median reported), >= 20
  // Before each timing (copy bandwidth, MMA rate, every point), run the timed work (with the L2
  // flush before each run, as timed) for this long, untimed: under sustained load the H100's
  // power management lowers the SM clock (SW power cap, within ~0.1-0.3 s), so the times are
  // those of a GPU kept busy, as in serving. 0: time right away (the protocol of every result
  // before docs/perf v26).
  int warm_ms = 0;
  int check_tokens = 4;     // tokens checked against the CPU reference
  bool baseline = true;     // time the bf16 cuBLAS baseline too
  bool deterministic = false;
  // "w4a8" or "auto": that precision's plan is timed beside W4A16's at every point, with its own
  // floor (the fp8 GEMM rate where a point runs W4A8) and its own check ("w4a16": W4A16 alone).
  std::string precision = "w4a16";
  std::optional<bool> fused;  // MoeTuning override (unset: the heuristic's choice)
  std::optional<bool> early_start;  // MoeTuning override (unset: the heuristic's choice)
  std::optional<bool> absorbing_tile;  // MoeTuning override (unset: the heuristic's choice)
  std::optional<int> l1_k_splits;      // MoeTuning override (unset: the heuristic's choice)
  std::optional<int> fused_ctas_per_sm;  // MoeTuning override (unset: the heuristic's choice)
  std::optional<std::string> l1_tile;  // MoeTuning override: a tile table row's name (unset: the heuristic's)
  std::optional<std::string> l2_tile;  // MoeTuning override: a tile table row's name (unset: the heuristic's)
  // The --precision plan's MoeTuning l1_tile / l2_tile (the W4A8 tile table's names).
  std::optional<std::string> w4a8_l1_tile, w4a8_l2_tile;
  uint64_t seed = 0x5eed;
  std::string json;         // write the results here when set
  // Write here, per point, the kernels' timeline of one more run (after the timed ones, the L2
  // flushed first): builds configured with -DMEGAMOE_TIMELINE=ON only (bench/timeline_report.py).
  std::string timeline;
  std::string work_dir;     // where the synthesized checkpoint goes (default: a temp dir)
};

// Runs the benchmark, prints the table on stdout (progress on stderr). Returns 0 when the
// accuracy checks pass, 1 otherwise; throws megamoe::Error on bad options or CUDA failures.
int run_bench(const BenchOptions& opt);

}  // namespace megamoe::bench
