// `megamoe run --checkpoint DIR --layer L --input X.safetensors --output Y.safetensors
// [--deterministic] [--precision P] [--ep N]`: one MoE layer on the GPU (sm90 W4A16), with the
// arguments of `reference`. Routing, when the input gives no top-k, runs on the CPU
// (reference::route). --precision goes to the plan, which refuses a precision this build has no kernel for.
// --ep-loopback N: the same exchange over N virtual ranks on GPU 0 (EpLoopback), in this process.
// --ep N: expert parallelism over N GPUs of this host. The command starts one process per GPU
// itself (this executable again, with --ep-rank), gives each a contiguous share of the tokens
// (the last ones may get none) and gathers their outputs.
#include <cuda_runtime.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "commands.h"
#if MEGAMOE_HAS_EP
#include "megamoe/ep.h"
#endif
#include "megamoe/gpu.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "support/device_buffer.h"
#include "tools/megamoe/ep_launch.h"

namespace megamoe::tool {

namespace {

struct RunArgs {
  std::string checkpoint;
  int64_t layer = 0;
  std::string input;
  std::string output;
  bool deterministic = false;
  Precision precision = Precision::kW4a16;  // MoeProblem::precision, EpConfig::precision
  int ep = 0;                // world size; 0: one GPU, no expert parallelism
  int ep_loopback = 0;       // world size of virtual ranks on one GPU (EpLoopback); 0: none
  int ep_rank = -1;          // set by the launcher in the processes it starts
  std::string ep_id;         // the NCCL unique id, hex (launcher -> ranks)
  double ep_timeout = 60.0;  // seconds a rank waits for its peers in a run
};

// Token share of rank r: [first, end) of T, contiguous, ceil(T / R) each (the last may be short
// or empty).
std::pair<int64_t, int64_t> token_share(int64_t T, int R, int r) {
  const int64_t per = (T + R - 1) / R;
  return {std::min<int64_t>(T, r * per), std::min<int64_t>(T, (r + 1) * per)};
}

#if MEGAMOE_HAS_EP
// One rank (a process the launcher started): its experts, its tokens, its rows of the output
// written raw (bf16) to args.output.
void run_ep_rank(const RunArgs& args) {
  const int R = args.ep, r = args.ep_rank;
  MEGAMOE_CHECK(gpu::device_count() >= R, kUnsupported, "megamoe run --ep ", R, ": rank ", r, " sees only ",
                gpu::device_count(), " CUDA devices");
  gpu::check_cuda(cudaSetDevice(r), "cudaSetDevice");
  LayerJob job = load_layer_job(args.checkpoint, args.layer, args.input);
  const int64_t T = job.topk.tokens, H = job.layer.hidden_size, k = job.topk.k;
  job.layer.routing.top_k = static_cast<int>(k);
  const auto [first, end] = token_share(T, R, r);
  const int64_t t_r = end - first;
  EpConfig cfg;
  cfg.world_size = R;
  cfg.rank = r;
  cfg.device = r;
  cfg.max_tokens_per_rank = std::max<int64_t>(1, (T + R - 1) / R);
  cfg.timeout_seconds = args.ep_timeout;
  cfg.precision = args.precision;
  const EpExpertRange range = ep_expert_range(job.layer.num_experts, R, r);
  MoeEpLayer layer = MoeEpLayer::create(ep_local_layer(job.layer, range), job.layer.num_experts, cfg,
                                        EpUniqueId::from_hex(args.ep_id), args.deterministic);
  auto slice = [&](const auto& v, int64_t width) {
    using T = typename std::decay_t<decltype(v)>::value_type;
    return std::vector<T>(v.begin() + first * width, v.begin() + end * width);
  };
  const support::DeviceBuffer<uint16_t> hidden(slice(job.hidden, H));
  const support::DeviceBuffer<int32_t> ids(slice(job.topk.ids, k));
  const support::DeviceBuffer<float> weights(slice(job.topk.weights, k));
  support::DeviceBuffer<uint16_t> out(static_cast<size_t>(t_r * H));
  out.poison();
  MoeRunArgs run_args;
  run_args.hidden = hidden.get();
  run_args.topk_ids = ids.get();
  run_args.topk_weights = weights.get();
  run_args.tokens = t_r;
  run_args.output = out.get();
  layer.run(run_args, nullptr);
  layer.check(nullptr);
  const int64_t invalid = layer.invalid_id_count(nullptr);
  MEGAMOE_CHECK(invalid == 0, kInternal, invalid, " top-k ids were out of range on rank ", r);
  const std::vector<uint16_t> rows = out.download();
  std::ofstream f(args.output, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(rows.data()), static_cast<std::streamsize>(rows.size() * 2));
  MEGAMOE_CHECK(f.good(), kIo, "megamoe run --ep: rank ", r, " could not write '", args.output, "'");
  std::fprintf(stderr, "megamoe run --ep %d: rank %d: experts [%lld, %lld), tokens [%lld, %lld), %.2f GB on GPU %d\n", R,
               r, (long long)range.first, (long long)(range.first + range.count), (long long)first, (long long)end,
               (layer.device_bytes() + layer.group().device_bytes()) / 1e9, r);
}

// The launcher: starts the R ranks, waits for all of them (a rank that fails ends the others),
// then writes the gathered output.
void run_ep_launcher(const RunArgs& args) {
  check_distinct_files(args.input, args.output);
  const int R = args.ep;
  MEGAMOE_CHECK(R >= 1 && R <= 8, kInvalidArgument, "megamoe run --ep ", R, ": the world size must be 1..8");
  MEGAMOE_CHECK(gpu::device_count() >= R, kUnsupported, "megamoe run --ep ", R, " needs ", R,
                " CUDA devices; this host has ", gpu::device_count());
  // Loaded once, here: the output must not be one of its inputs (the ranks read them while the
  // launcher writes), and it gives the token shares and the output file's routing afterwards.
  const LayerJob job = load_layer_job(args.checkpoint, args.layer, args.input);
  check_output_is_not_an_input(args.output, job.input_files);
  const EpUniqueId id = EpUniqueId::create();
  std::string dir_template = (std::filesystem::temp_directory_path() / "megamoe-ep-XXXXXX").string();
  MEGAMOE_CHECK(mkdtemp(dir_template.data()) != nullptr, kIo, "megamoe run --ep: could not create a temporary "
                "directory in ", std::filesystem::temp_directory_path().string());
  const std::filesystem::path dir = dir_template;
  EpRankLaunch launch;
  launch.command = "megamoe run --ep " + std::to_string(R);
  launch.world_size = R;
  launch.rank_argv = [&](int r) {
    std::vector<std::string> argv = {"megamoe", "run", "--checkpoint", args.checkpoint, "--layer",
                                     std::to_string(args.layer), "--input", args.input, "--output",
                                     (dir / ("rank" + std::to_string(r) + ".bin")).string(), "--ep",
                                     std::to_string(R), "--ep-rank", std::to_string(r), "--ep-id", id.to_hex(),
                                     "--ep-timeout", std::to_string(args.ep_timeout)};
    if (args.deterministic) argv.push_back("--deterministic");
    argv.insert(argv.end(), {"--precision", precision_name(args.precision)});
    return argv;
  };
  try {
    run_ep_ranks(launch);
  } catch (...) {
    std::filesystem::remove_all(dir);
    throw;
  }
  const int64_t T = job.topk.tokens, H = job.layer.hidden_size;
  std::vector<uint16_t> result(static_cast<size_t>(T * H));
  for (int r = 0; r < R; ++r) {
    const auto [first, end] = token_share(T, R, r);
    std::ifstream f(dir / ("rank" + std::to_string(r) + ".bin"), std::ios::binary);
    f.read(reinterpret_cast<char*>(result.data() + first * H), static_cast<std::streamsize>((end - first) * H * 2));
    MEGAMOE_CHECK(f.gcount() == (end - first) * H * 2, kInternal, "megamoe run --ep: rank ", r,
                  " wrote a short output");
  }
  std::filesystem::remove_all(dir);
  write_layer_output(args.output, job, result);
  std::fprintf(stderr, "megamoe run --ep %d: %lld tokens through layer %lld on %d GPUs (%s) -> '%s'\n", R,
               (long long)T, (long long)args.layer, R, job.routing_name(), args.output.c_str());
}

// R virtual ranks on GPU 0 (EpLoopback), in this process: each rank its experts, its token share
// and its SMs; the same exchange as --ep R.
void run_ep_loopback(const RunArgs& args) {
  check_distinct_files(args.input, args.output);
  const int R = args.ep_loopback;
  MEGAMOE_CHECK(gpu::device_count() > 0, kUnsupported, "megamoe run --ep-loopback: no CUDA device found");
  const LayerJob job = load_layer_job(args.checkpoint, args.layer, args.input);
  check_output_is_not_an_input(args.output, job.input_files);
  MoeLayer layer = job.layer;
  const int64_t T = job.topk.tokens, H = layer.hidden_size, k = job.topk.k;
  layer.routing.top_k = static_cast<int>(k);
  const EpLoopback loopback = EpLoopback::create(R, 0);
  EpConfig cfg;
  cfg.world_size = R;
  cfg.max_tokens_per_rank = std::max<int64_t>(1, (T + R - 1) / R);
  cfg.timeout_seconds = args.ep_timeout;
  cfg.precision = args.precision;
  std::vector<MoeEpLayer> ranks;
  for (int r = 0; r < R; ++r) {
    cfg.rank = r;
    ranks.push_back(MoeEpLayer::create(ep_local_layer(layer, ep_expert_range(layer.num_experts, R, r)),
                                       layer.num_experts, cfg, loopback, args.deterministic));
  }
  const support::DeviceBuffer<uint16_t> hidden(job.hidden);
  const support::DeviceBuffer<int32_t> ids(job.topk.ids);
  const support::DeviceBuffer<float> weights(job.topk.weights);
  support::DeviceBuffer<uint16_t> out(static_cast<size_t>(T * H));
  out.poison();
  // The ranks' streams do not wait for the null stream's copies.
  gpu::check_cuda(cudaDeviceSynchronize(), "megamoe run --ep-loopback");
  for (int r = 0; r < R; ++r) {
    const auto [first, end] = token_share(T, R, r);
    MoeRunArgs a;
    a.tokens = end - first;
    if (a.tokens > 0) {
      a.hidden = hidden.get() + first * H;
      a.topk_ids = ids.get() + first * k;
      a.topk_weights = weights.get() + first * k;
      a.output = out.get() + first * H;
    }
    ranks[r].run(a, loopback.stream(r));
  }
  int64_t invalid = 0;
  for (int r = 0; r < R; ++r) invalid += ranks[r].invalid_id_count(loopback.stream(r));
  MEGAMOE_CHECK(invalid == 0, kInternal, invalid, " top-k ids were out of range on the device");
  write_layer_output(args.output, job, out.download());
  std::fprintf(stderr, "megamoe run --ep-loopback %d: %lld tokens through layer %lld on %d virtual ranks of GPU 0 "
               "(%d SMs each; %s) -> '%s'\n", R, (long long)T, (long long)args.layer, R, loopback.sms_per_rank(),
               job.routing_name(), args.output.c_str());
}
#endif

void run_gpu(const RunArgs& args) {
  if (args.ep_loopback > 0) {
    MEGAMOE_CHECK(args.ep == 0 && args.ep_rank < 0, kInvalidArgument,
                  "megamoe run: --ep-loopback runs virtual ranks on one GPU; it cannot be combined with --ep");
#if MEGAMOE_HAS_EP
    return run_ep_loopback(args);
#else
    MEGAMOE_FAIL(kUnsupported, "megamoe run --ep-loopback: this build has no expert parallelism (configured with "
                 "-DMEGAMOE_EP=OFF)");
#endif
  }
  if (args.ep > 0 || args.ep_rank >= 0) {
#if MEGAMOE_HAS_EP
    if (args.ep_rank >= 0) return run_ep_rank(args);
    return run_ep_launcher(args);
#else
    MEGAMOE_FAIL(kUnsupported, "megamoe run --ep: this build has no expert parallelism (configured with "
                 "-DMEGAMOE_EP=OFF)");
#endif
  }
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
  problem.precision = args.precision;
  const MoePlan plan = MoePlan::create(problem);
  const MoeDeviceWeights weights = MoeDeviceWeights::upload(job.layer);
  const support::DeviceBuffer<uint8_t> workspace(plan.workspace_bytes());
  const support::DeviceBuffer<uint16_t> hidden(job.hidden);
  const support::DeviceBuffer<int32_t> ids(job.topk.ids);
  const support::DeviceBuffer<float> topk_weights(job.topk.weights);
  const support::DeviceBuffer<uint16_t> out(static_cast<size_t>(T * H));

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
  add_precision_option(*app, args->precision,
                       "w4a16: the exact W4A16 path (the default); w4a8: fp8 activations, where this "
                       "build has a W4A8 GPU kernel (the plan says if not; its CPU emulation: `megamoe "
                       "reference --precision w4a8`); auto: per T, the built kernels' choice");
  app->add_option("--ep", args->ep,
                  "expert parallelism over N GPUs of this host (one process per GPU, started by this command)")
      ->check(CLI::Range(1, 8));
  app->add_option("--ep-loopback", args->ep_loopback,
                  "expert parallelism over N virtual ranks on GPU 0, each on its own share of the SMs (for "
                  "debugging where fewer GPUs are at hand: the output equals --ep N's)")
      ->check(CLI::Range(1, 8));
  app->add_option("--ep-timeout", args->ep_timeout, "seconds a rank waits for its peers before it fails")
      ->check(CLI::Range(0.001, 3600.0));
  // Set by the launcher for the processes it starts.
  app->add_option("--ep-rank", args->ep_rank)->group("")->check(CLI::Range(0, 7));
  app->add_option("--ep-id", args->ep_id)->group("");
  return {app, [args] { run_gpu(*args); }};
}

}  // namespace megamoe::tool
