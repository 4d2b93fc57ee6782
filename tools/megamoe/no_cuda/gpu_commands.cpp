// The GPU subcommands of a CPU-only build (MEGAMOE_CUDA=OFF): `run` and `bench` stay listed, take
// any arguments, and fail with a message that says why, instead of a parse error that would
// suggest the command never existed or that its arguments were wrong.
#include <memory>
#include <string>

#include "megamoe/status.h"
#include "tools/megamoe/commands.h"

namespace megamoe::tool {

namespace {

Command gpu_only_command(CLI::App& parent, const std::string& name, const std::string& what) {
  CLI::App* app = parent.add_subcommand(
      name, what + " Not available: this megamoe was built without CUDA (MEGAMOE_CUDA=OFF).");
  // Whatever a user passes, the answer is the same: the build has no GPU code.
  app->allow_extras();
  return {app, [name] {
            MEGAMOE_FAIL(kUnsupported, "`megamoe ", name,
                         "` needs the GPU code, and this megamoe was built without CUDA "
                         "(MEGAMOE_CUDA=OFF, or no CUDA toolkit found at configure time); rebuild "
                         "with the CUDA 13 toolkit and MEGAMOE_CUDA=ON, or use `megamoe "
                         "reference` for the CPU reference of a layer.");
          }};
}

}  // namespace

Command add_run_command(CLI::App& parent) {
  return gpu_only_command(parent, "run", "Run one MoE layer of a checkpoint on the GPU.");
}

Command add_bench_command(CLI::App& parent) {
  return gpu_only_command(parent, "bench", "Benchmark the GPU MoE layer.");
}

}  // namespace megamoe::tool
