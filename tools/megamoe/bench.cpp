// `megamoe bench [--preset NAME] [--tokens 1,4,...] [--json FILE] ...`: the W4A16 MoE layer on
// this GPU against its floor and the bf16 cuBLAS baseline (bench/moe_bench.h).
#include <memory>
#include <string>

#include "bench/moe_bench.h"
#include "commands.h"
#include "megamoe/status.h"

namespace megamoe::tool {

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
  app->add_option("--replays", opt->replays, "timed graph replays per point (>= 20)")->capture_default_str();
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
  app->add_flag("!--no-baseline", opt->baseline, "skip the bf16 cuBLAS baseline");
  app->add_flag("--deterministic", opt->deterministic, "fixed-order combine");
  auto fused = std::make_shared<std::string>();
  app->add_option("--fused", *fused, "override the heuristic: the fused L1 + L2 launch (16- and 32-token decode tiles: up to 24 tokens per expert)")
      ->check(CLI::IsMember({"on", "off"}));
  auto early_start = std::make_shared<std::string>();
  app->add_option("--early-start", *early_start,
                  "override the heuristic: L1 starts before the dispatch completes (T * top_k <= 32 only)")
      ->check(CLI::IsMember({"on", "off"}));
  auto absorbing_tile = std::make_shared<std::string>();
  app->add_option("--absorbing-tile", *absorbing_tile,
                  "override the heuristic: both GEMMs on the absorbing tile (four warpgroups, 128-token items, an "
                  "expert's last up to 160; needs H and 2I multiples of 256)")
      ->check(CLI::IsMember({"on", "off"}));
  app->add_option("--seed", opt->seed, "seed of the synthesized weights and inputs");
  app->add_option("--json", opt->json, "write the results as JSON (plot with bench/plot_bench.py)");
  app->add_option("--work-dir", opt->work_dir, "where to write the synthesized checkpoint");
  return {app, [opt, fused, early_start, absorbing_tile] {
            if (!fused->empty()) opt->fused = *fused == "on";
            if (!absorbing_tile->empty()) opt->absorbing_tile = *absorbing_tile == "on";
            if (!early_start->empty()) opt->early_start = *early_start == "on";
            if (bench::run_bench(*opt) != 0) {
              MEGAMOE_FAIL(kInternal, "the accuracy check failed (see above)");
            }
          }};
}

}  // namespace megamoe::tool
