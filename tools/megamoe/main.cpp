// The `megamoe` command-line tool: quantize, dequantize, inspect, synth and reference.
// Exit codes: 0 success, 1 a failed command (the library's error on stderr), 2 a bad command line.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <vector>

#include "commands.h"
#include "megamoe/status.h"

int main(int argc, char** argv) {
  using namespace megamoe::tool;
  CLI::App app{"megamoe: NVFP4 Mixture-of-Experts checkpoints and the exact CPU reference."};
  app.require_subcommand(1);
  const std::vector<Command> commands = {
      add_quantize_command(app), add_dequantize_command(app), add_inspect_command(app),
      add_synth_command(app),    add_reference_command(app), add_run_command(app),
      add_bench_command(app),
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help is a ParseError too, with exit code 0: it prints the help and succeeds.
    return app.exit(e) == 0 ? 0 : 2;
  }
  for (const Command& c : commands) {
    if (!c.app->parsed()) continue;
    try {
      c.run();
      return 0;
    } catch (const std::exception& e) {
      // megamoe::Error carries a complete sentence; anything else (out of memory, a filesystem
      // error) is reported the same way rather than aborting.
      std::fprintf(stderr, "megamoe %s: error: %s\n", c.app->get_name().c_str(), e.what());
      return 1;
    }
  }
  return 2;  // unreachable: require_subcommand(1) makes the parse fail without a subcommand
}
