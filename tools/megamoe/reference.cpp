// `megamoe reference --checkpoint DIR --layer L --input X.safetensors --output Y.safetensors
// [--threads N] [--precision w4a16|w4a8|auto]`: one MoE layer through the exact CPU reference
// (the oracle of every GPU test): W4A16's (reference::moe_forward), or W4A8's exact emulation
// (reference::moe_forward_w4a8, docs/w4a8.md).
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
  Precision precision = Precision::kW4a16;
};

// auto on the CPU is W4A16: the CPU has no speed to trade for accuracy, and the GPU's choice
// depends on T and the device (MoePlan::resolved_precision; W4A16 at every T while no W4A8
// kernel exists). To check a GPU run made with auto, ask the reference for the precision the
// plan resolved.
Precision cpu_precision(Precision asked) { return asked == Precision::kAuto ? Precision::kW4a16 : asked; }

void run_reference(const ReferenceArgs& args) {
  MEGAMOE_CHECK(args.threads >= 0, kInvalidArgument, "--threads is ", args.threads,
                "; use 0 for all cores or a positive count.");
  check_distinct_files(args.input, args.output);
  const LayerJob job = load_layer_job(args.checkpoint, args.layer, args.input);
  check_output_is_not_an_input(args.output, job.input_files);
  const Precision precision = cpu_precision(args.precision);
  const reference::ForwardOptions options{.threads = args.threads};
  const std::vector<uint16_t> out =
      precision == Precision::kW4a8
          ? reference::moe_forward_w4a8(job.layer, job.hidden, job.topk.tokens, job.topk, options)
          : reference::moe_forward(job.layer, job.hidden, job.topk.tokens, job.topk, options);
  write_layer_output(args.output, job, out);
  std::fprintf(
      stderr,
      "megamoe reference: %lld tokens through layer %lld (%lld experts, top-%lld, %s, %s%s) -> '%s'\n",
      (long long)job.topk.tokens, (long long)args.layer, (long long)job.layer.num_experts,
      (long long)job.topk.k, job.routing_name(), precision_name(precision),
      args.precision == Precision::kAuto ? " (auto)" : "", args.output.c_str());
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
  add_precision_option(*app, args->precision,
                       "w4a16: the exact W4A16 reference (the default); w4a8: the exact emulation of "
                       "W4A8 (fp8 activations, weights rounded to e4m3: docs/w4a8.md); auto: w4a16 "
                       "on the CPU");
  return {app, [args] { run_reference(*args); }};
}

}  // namespace megamoe::tool
