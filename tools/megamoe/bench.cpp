// `megamoe bench [--preset NAME] [--tokens 1,4,...] [--json FILE] ...`: the W4A16 MoE layer on
// this GPU against its floor and the bf16 cuBLAS baseline (bench/moe_bench.h).
// `megamoe bench --ep N [--tokens-per-rank 1,8,...]`: the expert-parallel layer over N GPUs of this
// host against its floor and the unfused and single-GPU baselines (bench/ep_bench.h). This command
// is the launcher: it synthesizes the layer once, then starts one process per GPU (this executable
// again, with the hidden --ep-rank and --ep-setup) and waits for them.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/ep_bench.h"
#include "bench/ep_bench_model.h"
#include "bench/ep_loopback_bench.h"
#include "bench/moe_bench.h"
#include "backends/sm90_w4a16/sm90_w4a16_tiles.h"
#include "backends/sm90_w4a8/sm90_w4a8_tiles.h"
#include "commands.h"
#include "megamoe/gpu.h"
#include "megamoe/presets.h"
#include "megamoe/status.h"
#include "tools/megamoe/ep_launch.h"
#if MEGAMOE_HAS_EP
#include "megamoe/ep.h"
#endif

namespace megamoe::tool {

namespace {

// The rows of the W4A16 tile table, which --l1-tile and --l2-tile name.
std::vector<std::string> w4a16_tile_names() {
  std::vector<std::string> names;
  for (const W4a16TileEntry& e : kW4a16Tiles) names.emplace_back(e.name);
  return names;
}

// What only the EP launcher and its ranks take from the command line.
struct EpCli {
  int ep = 0;                 // --ep N (0: the single-GPU benchmark)
  int ep_loopback = 0;        // --ep-loopback N: N virtual ranks on GPU 0, in this process
  int ep_rank = -1;           // set by the launcher in the processes it starts
  std::string ep_setup;       // the launcher's RUN_DIR/ep_bench.json (launcher -> ranks)
  std::vector<int64_t> tokens_per_rank = bench::EpBenchOptions{}.tokens_per_rank;
  int64_t max_tokens_per_rank = 0;
  double ep_timeout = 60.0;
  double deadline = 0;
};

// The EP run's options from the single-GPU ones they share and the EP ones; refuses the options
// that have no meaning for it (named, with what to use instead).
bench::EpBenchOptions ep_options(const bench::BenchOptions& b, const EpCli& e, const CLI::App& app) {
  auto given = [&](const char* name) { return app.count(name) > 0; };
  MEGAMOE_CHECK(!given("--tokens"), kInvalidArgument,
                "bench --ep: --tokens is the single-GPU token list; with --ep give --tokens-per-rank");
  for (const char* name : {"--fused", "--absorbing-tile", "--l1-tile", "--l2-tile", "--l1-k-splits",
                           "--fused-ctas-per-sm"}) {
    MEGAMOE_CHECK(!given(name), kInvalidArgument, "bench --ep: ", name,
                  " overrides the single-GPU heuristic; the expert-parallel layer takes no tuning overrides but "
                  "--early-start off");
  }
  MEGAMOE_CHECK(!given("--timeline"), kInvalidArgument,
                "bench --ep: --timeline records the single-GPU layer's kernels; run it without --ep");
  MEGAMOE_CHECK(!given("--warm-ms") || b.warm_ms == 0, kInvalidArgument,
                "bench --ep: --warm-ms is not supported with --ep (every rank must run the layer the same number "
                "of times, and a warm-up by time does not guarantee it)");
  bench::EpBenchOptions o;
  o.world_size = e.ep;
  o.preset = b.preset;
  o.checkpoint = b.checkpoint;
  o.layer = b.layer;
  o.tokens_per_rank = e.tokens_per_rank;
  o.max_tokens_per_rank = e.max_tokens_per_rank;
  o.num_experts = b.num_experts;
  o.shared_experts = b.shared_experts;
  o.flush = b.flush;
  o.iters = b.replays;
  o.check_tokens = b.check_tokens;
  o.baselines = b.baseline;
  o.deterministic = b.deterministic;
  o.early_start = b.early_start.value_or(true);  // on: where the heuristic starts early, as by default
  o.seed = b.seed;
  o.json = b.json.empty() ? "" : std::filesystem::absolute(b.json).string();
  o.work_dir = b.work_dir;
  o.ep_timeout = e.ep_timeout;
  o.deadline = e.deadline;
  return o;
}

// The launcher: validates (no GPU needed for that), synthesizes the layer once, starts the ranks,
// and reports the checks' verdict that rank 0 left.
void run_ep_launcher(const bench::EpBenchOptions& opt) {
  bench::validate_ep_bench_options(opt);
#if !MEGAMOE_HAS_EP
  MEGAMOE_FAIL(kUnsupported, "megamoe bench --ep: this build has no expert parallelism (configured with "
               "-DMEGAMOE_EP=OFF)");
#else
  const int R = opt.world_size;
  MEGAMOE_CHECK(gpu::device_count() >= R, kUnsupported, "megamoe bench --ep ", R, " needs ", R,
                " CUDA devices (one per rank); this host has ", gpu::device_count());
  std::string dir_template = (std::filesystem::temp_directory_path() / "megamoe-bench-ep-XXXXXX").string();
  MEGAMOE_CHECK(mkdtemp(dir_template.data()) != nullptr, kIo, "megamoe bench --ep: could not create a temporary "
                "directory in ", std::filesystem::temp_directory_path().string());
  const std::filesystem::path dir = dir_template;
  try {
    bench::EpRankSetup setup;
    setup.options = opt;
    if (opt.checkpoint.empty()) {
      // Synthesized once, here; every rank maps it and reads only its own experts.
      const ModelPreset& preset = find_preset(opt.preset);
      setup.checkpoint_dir = opt.work_dir.empty() ? (dir / "checkpoint").string() : opt.work_dir;
      SynthOptions so;
      so.seed = opt.seed;
      so.num_experts = opt.num_experts;
      so.shared_experts = opt.shared_experts;
      so.progress = true;
      synth_checkpoint(preset, setup.checkpoint_dir, so);
      setup.layer_label = preset.name + (opt.shared_experts == 0 ? "-routed" : "");
      if (opt.num_experts > 0) setup.layer_label += "-E" + std::to_string(opt.num_experts);
    } else {
      setup.checkpoint_dir = std::filesystem::absolute(opt.checkpoint).string();
      setup.layer_label = opt.checkpoint;
    }
    setup.layer_comm_id = EpUniqueId::create().to_hex();
    setup.bench_comm_id = EpUniqueId::create().to_hex();
    setup.status_file = (dir / "status").string();
    const std::string setup_file = (dir / "ep_bench.json").string();
    {
      std::ofstream f(setup_file);
      f << bench::to_json(setup).dump(2) << "\n";
      MEGAMOE_CHECK(f.good(), kIo, "megamoe bench --ep: cannot write '", setup_file, "'");
    }
    EpRankLaunch launch;
    launch.command = "megamoe bench --ep " + std::to_string(R);
    launch.world_size = R;
    launch.deadline_seconds = opt.deadline;
    launch.rank_argv = [&](int r) {
      return std::vector<std::string>{"megamoe", "bench", "--ep-rank", std::to_string(r), "--ep-setup", setup_file};
    };
    run_ep_ranks(launch);
    std::ifstream status(setup.status_file);
    std::string verdict;
    status >> verdict;
    MEGAMOE_CHECK(verdict == "pass" || verdict == "fail", kInternal, "megamoe bench --ep: rank 0 left no verdict in '",
                  setup.status_file, "'");
    MEGAMOE_CHECK(verdict == "pass", kInternal, "megamoe bench --ep ", R, ": the output checks failed (see above)");
  } catch (...) {
    std::filesystem::remove_all(dir);
    throw;
  }
  std::filesystem::remove_all(dir);
#endif
}

// A rank (a process the launcher started).
void run_ep_rank(const EpCli& e) {
  std::ifstream f(e.ep_setup);
  MEGAMOE_CHECK(f.good(), kIo, "megamoe bench --ep-rank ", e.ep_rank, ": cannot read '", e.ep_setup, "'");
  nlohmann::json j;
  try {
    f >> j;
  } catch (const nlohmann::json::exception& ex) {
    MEGAMOE_FAIL(kInvalidArgument, "megamoe bench --ep-rank: '", e.ep_setup, "' is not JSON: ", ex.what());
  }
  bench::run_ep_bench_rank(bench::ep_rank_setup_from_json(j), e.ep_rank);
}

}  // namespace

Command add_bench_command(CLI::App& parent) {
  auto opt = std::make_shared<bench::BenchOptions>();
  CLI::App* app = parent.add_subcommand(
      "bench",
      "Benchmark the GPU MoE layer (default: a synthesized DeepSeek-V3 layer): accuracy against "
      "the CPU reference, then per token count the median time of CUDA-graph replays with the "
      "L2 flushed, % of the floor, TFLOP/s, weight GB/s and the speedup over bf16 cuBLAS.");
  app->add_option("--preset", opt->preset, "model preset to synthesize")->capture_default_str();
  app->add_option("--checkpoint", opt->checkpoint, "benchmark this checkpoint directory instead");
  app->add_option("--layer", opt->layer, "with --checkpoint: the MoE layer (default: the first)");
  app->add_option("--tokens", opt->tokens, "token counts T, comma separated")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--num-experts", opt->num_experts, "synthesize fewer experts (0: the preset's)");
  app->add_option("--shared-experts", opt->shared_experts,
                  "synthesize this many shared experts (-1: the preset's, 0: none; docs/design.md §4's floors and "
                  "peer figures are for the routed experts only)")
      ->capture_default_str();
  app->add_option("--flush", opt->flush,
                  "how the L2 is emptied before each replay: clean (memset a buffer, then read another: the L2 "
                  "holds clean lines, as after another layer's weight reads) or dirty (memset only: the layer "
                  "also pays for writing back the memset's lines)")
      ->check(CLI::IsMember({"clean", "dirty"}))
      ->capture_default_str();
  app->add_option("--replays,--iters", opt->replays, "timed graph replays per point (>= 20)")->capture_default_str();
  app->add_option("--warm-ms", opt->warm_ms,
                  "before each timing, run the timed work (and its L2 flushes) this many ms untimed, so that the GPU's power "
                  "management settles (the SM clock drops under sustained load): times of a GPU kept busy; 0: "
                  "time right away (0..60000)")
      ->capture_default_str();
  app->add_option("--check-tokens", opt->check_tokens,
                  "tokens checked against the CPU reference: the accuracy line's, and per timed point that many "
                  "of its tokens (spread from the first to the last), whose output comes from a replay of the "
                  "timed graph (1..64)")
      ->capture_default_str();
  app->add_flag("!--no-baseline", opt->baseline, "skip the bf16 cuBLAS baseline (with --ep: baselines (a) and (b))");
  app->add_flag("--deterministic", opt->deterministic, "fixed-order combine");
  app->add_option("--precision", opt->precision,
                  "w4a8 or auto: time that precision's plan beside W4A16's at every point (its floor with the fp8 "
                  "GEMM rate where it runs W4A8, its output checked against the W4A8 emulation); w4a16: W4A16 alone")
      ->check(CLI::IsMember({"w4a16", "w4a8", "auto"}))
      ->capture_default_str();
  auto fused = std::make_shared<std::string>();
  app->add_option("--fused", *fused, "override the heuristic: the fused L1 + L2 launch (16- and 32-token decode tiles: up to 24 tokens per expert)")
      ->check(CLI::IsMember({"on", "off"}));
  auto early_start = std::make_shared<std::string>();
  app->add_option("--early-start", *early_start,
                  "override the heuristic: L1 starts before the dispatch completes (T * top_k <= 32 only); with "
                  "--ep/--ep-loopback, off keeps the local experts from starting early")
      ->check(CLI::IsMember({"on", "off"}));
  auto absorbing_tile = std::make_shared<std::string>();
  app->add_option("--absorbing-tile", *absorbing_tile,
                  "override the heuristic: both GEMMs on the absorbing tile (four warpgroups, 128-token items, an "
                  "expert's last up to 160; needs H and 2I multiples of 256)")
      ->check(CLI::IsMember({"on", "off"}));
  app->add_option_function<int>(
         "--l1-k-splits", [opt](int k) { opt->l1_k_splits = k; },
         "override the heuristic: L1's K slices on the decode tiles (1 keeps L1 whole, up to 4; the last slice "
         "to finish runs the SwiGLU; at most 64 slots T * (top_k + shared slices))")
      ->check(CLI::Range(1, 4));
  app->add_option_function<int>(
         "--fused-ctas-per-sm", [opt](int n) { opt->fused_ctas_per_sm = n; },
         "override the heuristic: CTAs per SM of the fused launch's grid (the kernel's occupancy caps it; only "
         "at the T where the layer runs the fused launch)")
      ->check(CLI::Range(1, 16));
  for (auto [flag, field, gemm] : {std::tuple{"--l1-tile", &opt->l1_tile, "L1 (x W13, SwiGLU)"},
                                   std::tuple{"--l2-tile", &opt->l2_tile, "L2 (act W2, combine)"}}) {
    app->add_option_function<std::string>(
           flag, [field](const std::string& name) { *field = name; },
           std::string("override the heuristic: ") + gemm +
               "'s tile, by its name in the W4A16 tile table; the layer then runs two launches without early "
               "start (with --fused on: one, where both GEMMs take decode16 or decode32)")
        ->check(CLI::IsMember(w4a16_tile_names()));
  }
  std::vector<std::string> w4a8_names;
  for (const runtime::W4a8Tile& t : runtime::kW4a8Tiles) w4a8_names.emplace_back(t.name);
  for (auto [flag, field, gemm] : {std::tuple{"--w4a8-l1-tile", &opt->w4a8_l1_tile, "L1"},
                                   std::tuple{"--w4a8-l2-tile", &opt->w4a8_l2_tile, "L2"}}) {
    app->add_option_function<std::string>(
           flag, [field](const std::string& name) { *field = name; },
           std::string("with --precision w4a8: ") + gemm + "'s tile in the W4A8 tile table, in place of its heuristic's")
        ->check(CLI::IsMember(w4a8_names));
  }
  app->add_option("--seed", opt->seed, "seed of the synthesized weights and inputs");
  app->add_option("--json", opt->json, "write the results as JSON (plot with bench/plot_bench.py)");
  app->add_option("--timeline", opt->timeline,
                  "per point, record one more run (after an L2 flush) of the W4A16 kernels' work items (SM, CTA, "
                  "expert, %globaltimer stamps) and write them as JSON (summarize with bench/timeline_report.py); "
                  "builds configured with -DMEGAMOE_TIMELINE=ON only");
  app->add_option("--work-dir", opt->work_dir, "where to write the synthesized checkpoint");
  auto ep = std::make_shared<EpCli>();
  app->add_option("--ep", ep->ep,
                  "expert parallelism over N GPUs of this host (1..8): this command starts one process per GPU, "
                  "each with E/N experts; per --tokens-per-rank point the slowest rank's time, % of floor, the unfused "
                  "baseline (NCCL all-to-all + the single-GPU layer) and the single-GPU layer on all tokens");
  app->add_option("--ep-loopback", ep->ep_loopback,
                  "the expert-parallel layer over N virtual ranks on GPU 0 (1..8), each on its own share of the "
                  "SMs, in this process: per --tokens-per-rank point the layer time and the exchange's share (SM "
                  "partitions of one GPU: a debugging figure, not a multi-GPU one; no baselines)")
      ->check(CLI::Range(1, 8));
  app->add_option("--tokens-per-rank", ep->tokens_per_rank, "with --ep: tokens per rank T_r, comma separated")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--max-tokens-per-rank", ep->max_tokens_per_rank,
                  "with --ep: the layer's max tokens per rank, what an engine sizes it for (0: the largest T_r)")
      ->capture_default_str();
  app->add_option("--ep-timeout", ep->ep_timeout, "with --ep: seconds a rank waits for its peers in a run of the layer")
      ->capture_default_str();
  app->add_option("--ep-deadline", ep->deadline,
                  "with --ep: end every rank and fail after this many seconds (0: no limit)")
      ->capture_default_str();
  // Set by the launcher for the processes it starts.
  app->add_option("--ep-rank", ep->ep_rank)->group("")->check(CLI::Range(0, 7));
  app->add_option("--ep-setup", ep->ep_setup)->group("");
  return {app, [opt, fused, early_start, absorbing_tile, ep, app] {
            if (ep->ep_rank >= 0) return run_ep_rank(*ep);
            if (!early_start->empty()) opt->early_start = *early_start == "on";
            MEGAMOE_CHECK(app->count("--precision") == 0 || (app->count("--ep") == 0 && app->count("--ep-loopback") == 0),
                          kInvalidArgument, "bench: --precision times the single-GPU layer; the expert-parallel "
                          "benchmarks (--ep, --ep-loopback) run w4a16");
            if (app->count("--ep-loopback") > 0) {
              MEGAMOE_CHECK(app->count("--ep") == 0 && app->count("--ep-deadline") == 0, kInvalidArgument,
                            "bench --ep-loopback runs virtual ranks in this process: it takes neither --ep nor "
                            "--ep-deadline");
              EpCli lb = *ep;
              lb.ep = ep->ep_loopback;
              if (bench::run_ep_loopback_bench(ep_options(*opt, lb, *app)) != 0) {
                MEGAMOE_FAIL(kInternal, "bench --ep-loopback: the output checks failed (see above)");
              }
              return;
            }
            if (app->count("--ep") > 0) return run_ep_launcher(ep_options(*opt, *ep, *app));
            for (const char* name : {"--tokens-per-rank", "--max-tokens-per-rank", "--ep-timeout", "--ep-deadline"}) {
              MEGAMOE_CHECK(app->count(name) == 0, kInvalidArgument, "bench: ", name, " needs --ep N or --ep-loopback N");
            }
            if (!fused->empty()) opt->fused = *fused == "on";
            if (!absorbing_tile->empty()) opt->absorbing_tile = *absorbing_tile == "on";
            if (bench::run_bench(*opt) != 0) {
              MEGAMOE_FAIL(kInternal, "the accuracy check failed (see above)");
            }
          }};
}

}  // namespace megamoe::tool
