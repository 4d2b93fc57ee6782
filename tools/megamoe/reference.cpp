// `megamoe reference --checkpoint DIR --layer L --input X.safetensors --output Y.safetensors
// [--threads N]`: one MoE layer through the exact CPU reference (the oracle of every GPU test).
#include "megamoe/reference.h"

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "megamoe/status.h"

namespace megamoe::tool {

namespace {

struct ReferenceArgs {
  std::string checkpoint;
  int64_t layer = 0;
  std::string input;
  std::string output;
  int threads = 0;
};

void run_reference(const ReferenceArgs& args) {
  MEGAMOE_CHECK(args.threads >= 0, kInvalidArgument, "--threads is ", args.threads,
                "; use 0 for all cores or a positive count.");
  check_distinct_files(args.input, args.output);
  const LayerJob job = load_layer_job(args.checkpoint, args.layer, args.input);
  check_output_is_not_an_input(args.output, job.input_files);
  const std::vector<uint16_t> out =
      reference::moe_forward(job.layer, job.hidden, job.topk.tokens, job.topk, {.threads = args.threads});
  write_layer_output(args.output, job, out);
  std::fprintf(
      stderr,
      "megamoe reference: %lld tokens through layer %lld (%lld experts, top-%lld, %s) -> '%s'\n",
      (long long)job.topk.tokens, (long long)args.layer, (long long)job.layer.num_experts,
      (long long)job.topk.k, job.routing_name(), args.output.c_str());
}

}  // namespace

Command add_reference_command(CLI::App& parent) {
  auto args = std::make_shared<ReferenceArgs>();
  CLI::App* app = parent.add_subcommand(
      "reference",
      "Run one MoE layer of a checkpoint on the exact CPU reference. The input holds 'hidden' "
      "[T, H] BF16 and optionally 'topk_ids' [T, k] (I32/I64) with 'topk_weights' [T, k] (F32); "
      "the output holds 'output' [T, H] BF16 and the routing used.");
  app->add_option("--checkpoint", args->checkpoint, "checkpoint directory (config.json + tensors)")
      ->required();
  app->add_option("--layer", args->layer, "index L of the MoE layer model.layers.L.mlp")
      ->required();
  app->add_option("--input", args->input, "input .safetensors file")->required();
  app->add_option("--output", args->output, "output .safetensors file")->required();
  app->add_option("--threads", args->threads, "CPU threads (0: all cores)");
  return {app, [args] { run_reference(*args); }};
}

}  // namespace megamoe::tool
