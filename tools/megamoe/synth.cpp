// `megamoe synth --preset NAME OUT_DIR [--seed N] [--num-experts N] [--shared-experts N] [--threads N]`: a synthetic
// ModelOpt NVFP4 checkpoint directory holding one MoE layer of a model preset (docs/design.md §4).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "commands.h"
#include "megamoe/presets.h"

namespace megamoe::tool {

namespace {

struct SynthArgs {
  std::string preset;
  std::string out_dir;
  SynthOptions options;
};

void run_synth(const SynthArgs& args) {
  const ModelPreset& preset = find_preset(args.preset);
  const auto start = std::chrono::steady_clock::now();
  SynthOptions options = args.options;
  options.progress = true;
  synth_checkpoint(preset, args.out_dir, options);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto model = std::filesystem::path(args.out_dir) / "model.safetensors";
  std::fprintf(stderr, "megamoe synth: wrote %s (layer %lld of %s, %s) in %.1f s\n",
               args.out_dir.c_str(), (long long)preset.layer, preset.name.c_str(),
               human_bytes(std::filesystem::file_size(model)).c_str(), secs);
}

}  // namespace

Command add_synth_command(CLI::App& parent) {
  auto args = std::make_shared<SynthArgs>();
  std::string names;
  for (const ModelPreset& p : model_presets()) names += (names.empty() ? "" : ", ") + p.name;
  CLI::App* app = parent.add_subcommand(
      "synth",
      "Write a checkpoint directory (config.json, hf_quant_config.json, model.safetensors) holding "
      "one MoE layer of a model preset with realistic random ModelOpt NVFP4 weights.");
  app->add_option("--preset", args->preset, "model preset: " + names)->required();
  app->add_option("out_dir", args->out_dir, "output checkpoint directory")->required();
  app->add_option("--seed", args->options.seed, "random seed (weights are a function of it)")
      ->capture_default_str();
  app->add_option("--num-experts", args->options.num_experts,
                  "routed experts to write (0: the preset's; fewer make small test layers)")
      ->capture_default_str();
  app->add_option("--shared-experts", args->options.shared_experts,
                  "shared experts to write (-1: the preset's, 0: none, the routed-only layer)")
      ->capture_default_str();
  app->add_option("--threads", args->options.threads, "threads (0: all cores)")
      ->capture_default_str();
  return {app, [args] { run_synth(*args); }};
}

}  // namespace megamoe::tool
