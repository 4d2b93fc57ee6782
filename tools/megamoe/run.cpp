// `megamoe run --checkpoint DIR --layer L --input X.safetensors --output Y.safetensors
// [--deterministic]`: one MoE layer on the GPU (sm90 W4A16), with the arguments of `reference`.
// Routing, when the input gives no top-k, runs on the CPU (reference::route).
#include <cuda_runtime.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "megamoe/gpu.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"

namespace megamoe::tool {

namespace {

struct RunArgs {
  std::string checkpoint;
  int64_t layer = 0;
  std::string input;
  std::string output;
  bool deterministic = false;
};

void run_gpu(const RunArgs& args) {
  check_distinct_files(args.input, args.output);
  MEGAMOE_CHECK(gpu::device_count() > 0, kUnsupported,
                "no CUDA device found; `megamoe run` needs a Hopper GPU (use `megamoe reference` "
                "for the CPU reference).");
  const LayerJob job = load_layer_job(args.checkpoint, args.layer, args.input);
  check_output_is_not_an_input(args.output, job.input_files);
  const int64_t T = job.topk.tokens, H = job.layer.hidden_size;

  MoeProblem problem = MoeProblem::from_layer(job.layer, T);
  problem.top_k = job.topk.k;
  problem.deterministic = args.deterministic;
  const MoePlan plan = MoePlan::create(problem);
  const MoeDeviceWeights weights = MoeDeviceWeights::upload(job.layer);
  const gpu::DeviceBuffer<uint8_t> workspace(plan.workspace_bytes());
  const gpu::DeviceBuffer<uint16_t> hidden(job.hidden);
  const gpu::DeviceBuffer<int32_t> ids(job.topk.ids);
  const gpu::DeviceBuffer<float> topk_weights(job.topk.weights);
  const gpu::DeviceBuffer<uint16_t> out(static_cast<size_t>(T * H));

  MoeRunArgs run_args;
  run_args.hidden = hidden.get();
  run_args.topk_ids = ids.get();
  run_args.topk_weights = topk_weights.get();
  run_args.tokens = T;
  run_args.output = out.get();
  run_args.workspace = workspace.get();
  run(plan, weights, run_args, nullptr);
  gpu::check_cuda(cudaDeviceSynchronize(), "megamoe run");
  if (T > 0) {
    const int64_t invalid = plan.invalid_id_count(workspace.get(), nullptr);
    MEGAMOE_CHECK(invalid == 0, kInternal, invalid, " top-k ids were out of range on the device");
  }
  const std::vector<uint16_t> result = out.download();
  write_layer_output(args.output, job, result);
  std::fprintf(stderr, "megamoe run: %lld tokens through layer %lld on the GPU (%s; %s) -> '%s'\n",
               (long long)T, (long long)args.layer, plan.describe(T).c_str(), job.routing_name(),
               args.output.c_str());
}

}  // namespace

Command add_run_command(CLI::App& parent) {
  auto args = std::make_shared<RunArgs>();
  CLI::App* app = parent.add_subcommand(
      "run",
      "Run one MoE layer of a checkpoint on the GPU (Hopper, NVFP4 weights decoded in registers). "
      "Same input and output as 'reference'.");
  app->add_option("--checkpoint", args->checkpoint, "checkpoint directory (config.json + tensors)")
      ->required();
  app->add_option("--layer", args->layer, "index L of the MoE layer model.layers.L.mlp")->required();
  app->add_option("--input", args->input, "input .safetensors file")->required();
  app->add_option("--output", args->output, "output .safetensors file")->required();
  app->add_flag("--deterministic", args->deterministic, "fixed-order combine (bitwise reproducible)");
  return {app, [args] { run_gpu(*args); }};
}

}  // namespace megamoe::tool
