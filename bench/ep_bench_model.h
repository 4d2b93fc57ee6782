// `megamoe bench --ep N`: the parts that need no GPU, so that the CPU tests check them: the options
// and their validation, what the launcher hands each rank, the traffic and floors of a point from
// its routing, the expert-weight bytes per GPU of whole models, and the report (table and JSON).
// The GPU side is ep_bench.cpp; the launcher is tools/megamoe/bench.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "megamoe/presets.h"

namespace megamoe::bench {

// The bound on a checked output's relative L2 error (issue 3's, bench_common.h's kMaxRelL2).
constexpr double kEpMaxRelL2 = 2e-3;

struct EpBenchOptions {
  int world_size = 0;                // --ep N: ranks, one GPU each (1..8)
  std::string preset = "deepseek-v3";
  std::string checkpoint;            // benchmark this checkpoint's layer instead of a synthesized one
  int64_t layer = -1;                // with checkpoint: the MoE layer (-1: the first)
  std::vector<int64_t> tokens_per_rank = {1, 8, 32, 128, 512, 4096};
  // The layer's max_tokens_per_rank (EpConfig): what an engine sizes it for once. 0: the largest
  // of tokens_per_rank. Every point runs on the same layer, as in serving.
  int64_t max_tokens_per_rank = 0;
  int64_t num_experts = 0;           // synth only: 0 = the preset's
  int64_t shared_experts = -1;       // synth only: -1 = the preset's, 0 = none
  std::string flush = "clean";       // L2 flush before each timed replay (l2_flush.h)
  int iters = 30;                    // timed replays per measurement (median), >= 20
  int check_tokens = 4;              // tokens per rank checked against the CPU reference
  bool baselines = true;             // time baselines (a) and (b)
  bool deterministic = false;
  bool early_start = true;           // EpConfig::early_start (--early-start off: never)
  uint64_t seed = 0x5eed;
  std::string json;                  // results file (rank 0 rewrites it after every point)
  std::string work_dir;              // where the synthesized checkpoint goes (kept); default: a temporary dir
  double ep_timeout = 60.0;          // seconds a rank waits for its peers at a layer barrier
  double deadline = 0;               // > 0: the launcher ends every rank after this many seconds
};

// Throws megamoe::Error(kInvalidArgument) naming the first invalid option: world size outside
// 1..8, a token count outside 1..65536 or above max_tokens_per_rank, iters < 20, check_tokens
// outside 1..64, an unknown preset or flush mode, a synthesized expert count that does not split
// over the ranks or leaves a rank fewer experts than top_k, --num-experts/--shared-experts with a
// checkpoint, an out-of-range timeout or deadline. Needs no GPU.
void validate_ep_bench_options(const EpBenchOptions& opt);
// max_tokens_per_rank, or the largest of tokens_per_rank where it is 0.
int64_t ep_max_tokens_per_rank(const EpBenchOptions& opt);

// What the launcher hands every rank, as RUN_DIR/ep_bench.json.
struct EpRankSetup {
  EpBenchOptions options;
  std::string checkpoint_dir;  // the checkpoint every rank loads (synthesized, or --checkpoint)
  std::string layer_label;     // the preset's name, or the checkpoint's directory
  std::string layer_comm_id;   // hex NCCL unique id of the MoeEpLayer's communicator
  std::string bench_comm_id;   // hex id of the benchmark's own communicator (sync, baseline, gathers)
  std::string status_file;     // rank 0 writes "pass" or "fail" there once every point is done
};
nlohmann::json to_json(const EpRankSetup& setup);
// Throws megamoe::Error(kInvalidArgument) naming a missing or mistyped field.
EpRankSetup ep_rank_setup_from_json(const nlohmann::json& j);

// ---- traffic and floors of one point

struct EpShape {
  int64_t hidden = 0;               // H
  int64_t intermediate = 0;         // I of a routed expert
  int64_t shared_intermediate = 0;  // 0: no shared expert
  int64_t num_experts = 0;          // E (global)
  int top_k = 0;
  int world = 0;                    // R
};

// What one rank computes and moves in one run of the EP layer, from every rank's routing.
struct EpRankTraffic {
  int64_t tokens = 0;                // this rank's T
  int64_t active_local_experts = 0;  // distinct experts of this rank chosen by any token of any rank
  int64_t received_selections = 0;   // (token, expert) pairs on this rank's experts, every source
  int64_t received_rows = 0;         // rows that reach this rank (one per token with any of its experts)
  int64_t rows_out = 0;              // dispatch rows this rank sends to other ranks
  int64_t rows_in = 0;               // dispatch rows other ranks send to this rank
  // NVLink bytes, other ranks only: a dispatch row is H bf16 + k ids + k weights, a returned
  // partial sum H fp32. Out: rows_out dispatched + rows_in returned; in: the reverse.
  double nvlink_bytes_out = 0;
  double nvlink_bytes_in = 0;
};
// ids[s]: rank s's top-k ids [T_s, k], global; ids outside [0, E) are ignored (the layer skips them).
std::vector<EpRankTraffic> ep_traffic(const EpShape& shape, const std::vector<std::vector<int32_t>>& ids);

// Rows each source rank sends each destination, its own included: count[s][d] (a token goes to a
// rank once, however many of its experts that rank owns).
std::vector<std::vector<int64_t>> ep_row_counts(const EpShape& shape, const std::vector<std::vector<int32_t>>& ids);

struct EpRates {
  double copy_tbps = 0;   // device copy rate (read + write), TB/s
  double mma_tflops = 0;  // dense bf16 GEMM rate, TFLOP/s
  double peer_gbps = 0;   // NVLink copy rate to a peer, GB/s (one direction)
};

struct EpFloor {
  double weight_bytes = 0;  // NVFP4 bytes of the active local experts + the shared expert
  double flops = 0;         // 2 * 3 * H * (received selections * I + T * shared I)
  double nvlink_bytes = 0;  // max(out, in)
  double hbm_us = 0, mma_us = 0, nvlink_us = 0;
  double us = 0;            // the largest of the three
  std::string bound;        // "hbm", "mma" or "nvlink"
};
// One rank's floor: its weight bytes over its copy rate, its FLOPs over its MMA rate, its NVLink
// bytes over the peer rate (the larger direction: NVLink is full duplex), whichever is largest
// (the three can overlap, so the floor is their maximum, not their sum).
EpFloor ep_rank_floor(const EpShape& shape, const EpRankTraffic& traffic, const EpRates& rates);

// ---- expert weight bytes per GPU of whole models

struct EpWeightEstimate {
  std::string model;
  int world = 0;
  int64_t moe_layers = 0;
  int64_t routed_experts_per_gpu = 0;  // E / R (the shared expert is replicated on every GPU)
  double bytes_per_layer = 0;          // per GPU: (E/R routed + shared) NVFP4 bytes of one layer
  double bytes_per_gpu = 0;            // per GPU, all MoE layers
  double model_bytes = 0;              // all experts of all MoE layers, on one copy
};
// MoE layers of the models the estimates cover: deepseek-v3 58 (61 layers, first 3 dense),
// kimi-k2 60 (61 layers, first 1 dense). Throws megamoe::Error(kInvalidArgument) for others.
int64_t preset_moe_layers(const std::string& preset);
// NVFP4 bytes (0.5625 per weight; the per-tensor fp32 global scales are left out, < 1 KB a layer)
// of the routed experts a GPU owns at EP `world` plus the shared expert, one copy each.
EpWeightEstimate ep_weight_estimate(const ModelPreset& preset, int world);
// DeepSeek-V3 and Kimi-K2 at EP4 and EP8 (docs/design.md §7 quotes it).
std::vector<EpWeightEstimate> ep_weight_estimate_table();
std::string format_weight_estimates(const std::vector<EpWeightEstimate>& rows);
nlohmann::json to_json(const EpWeightEstimate& e);

// ---- results

// One rank's measurements at one point, gathered to rank 0 (trivially copyable: the ranks
// exchange it as bytes).
struct EpRankPoint {
  int64_t tokens = 0;
  double us = 0;                   // EP layer: median over the timed graph replays
  double check_rel_l2 = 0;         // the timed graph's output against the CPU reference, check rows
  int64_t check_rows = 0;
  int64_t check_nonfinite = 0;     // over the whole output
  int64_t invalid_ids = 0;         // must be 0 (the ids are drawn in range)
  double a_us = -1;                // baseline (a), whole: -1 where not run
  double a_compute_us = -1;        // baseline (a), its local layer + shared expert alone
  double a_rel_l2_vs_ep = 0;       // (a)'s output against the EP layer's, every row
  int64_t a_nonfinite = 0;
  uint64_t inputs_fnv1a = 0;       // this rank's hidden, ids and weights
  // The layer's stage stamps (MoeEpLayer::StageStamps after send_begin, in its order), µs from
  // send_begin, medians over separate replays of the timed graph; -1 where the layer has none
  // (world size 1).
  static constexpr int kStages = 8;
  double stage_us[kStages] = {-1, -1, -1, -1, -1, -1, -1, -1};
};
// The names of EpRankPoint::stage_us, in its order.
inline constexpr const char* kEpStageNames[EpRankPoint::kStages] = {
    "send_end", "gate_begin", "gate_open", "return_begin", "return_end", "combine_begin", "partials_arrived",
    "combine_end"};

// Baseline (b) at one point, run on rank 0 alone.
struct EpSingleGpuPoint {
  bool ran = false;
  std::string skipped;        // why not, when !ran
  double bytes_needed = 0;    // weights + workspace + inputs/outputs on one GPU
  double us = 0;
  double check_rel_l2 = 0;    // against the CPU reference
  int64_t check_nonfinite = 0;
};

struct EpPointResult {
  int64_t tokens_per_rank = 0;
  std::vector<EpRankPoint> ranks;
  std::vector<EpRankTraffic> traffic;
  std::vector<EpFloor> floors;
  EpSingleGpuPoint single;
  bool baselines = true;
};

// Every check of the point passed: each rank's output finite and within kMaxRelL2 of the CPU
// reference, no invalid ids, (a)'s output finite and within kMaxRelL2 of the EP layer's, (b)'s
// (where it ran) within kMaxRelL2 of the reference.
bool ep_point_pass(const EpPointResult& p);
// The point's line of the table (ep_table_header's columns).
std::string ep_table_header();
std::string ep_table_row(const EpPointResult& p);
nlohmann::json to_json(const EpPointResult& p);

// ---- the run's header

// What every rank reports once, gathered to rank 0 (trivially copyable: the ranks exchange it as
// bytes).
struct EpRankInfo {
  char device[96] = {};
  EpRates rates;
  int64_t ep_device_bytes = 0;  // MoeEpLayer::device_bytes + its EpGroup's
  int64_t free_bytes = 0;       // cudaMemGetInfo after setup
};

// The run as rank 0 reports it before its points.
struct EpRunInfo {
  std::string device;            // rank 0's GPU
  std::string layer_label;       // EpRankSetup::layer_label
  EpShape shape;
  int64_t experts_per_rank = 0;  // E / R
  int64_t max_tokens_per_rank = 0;
  bool deterministic = false;
  int iters = 0;
  bool baselines = true;
  std::string flush;             // the L2 flush mode's name
  int nccl_version = 0;          // NCCL_VERSION_CODE of the build
  std::string peer_rate_method;  // how the NVLink rates were measured
  std::vector<EpRankInfo> ranks;
  std::string single_skipped;    // why baseline (b) does not run (empty: it does)
};
// Prints the run's header, every rank's rates, the weight estimates and the table's column names on
// stdout; returns the JSON report without points.
nlohmann::json ep_run_header(const EpRunInfo& run);
// Prints the point's line of the table and, where a check failed, every rank's figures.
void print_ep_point(const EpPointResult& point);

}  // namespace megamoe::bench
