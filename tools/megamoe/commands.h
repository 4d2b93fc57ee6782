// The `megamoe` tool: one file per subcommand, each registering its options on the top-level
// parser and returning the action that runs it; plus the helpers they share (common.cpp).
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>

#include "megamoe/checkpoint.h"
#include "megamoe/dtype.h"
#include "megamoe/precision.h"
#include "megamoe/reference.h"
#include <vector>

namespace megamoe::tool {

// A subcommand's parser (owned by the parent CLI::App) and the action to run once it is parsed.
// Actions report failures by throwing megamoe::Error; main() prints and maps them to exit codes.
struct Command {
  CLI::App* app = nullptr;
  std::function<void()> run;
};

Command add_quantize_command(CLI::App& parent);
Command add_dequantize_command(CLI::App& parent);
Command add_inspect_command(CLI::App& parent);
Command add_synth_command(CLI::App& parent);
Command add_reference_command(CLI::App& parent);
Command add_run_command(CLI::App& parent);    // GPU (sm90)
Command add_bench_command(CLI::App& parent);  // GPU (sm90)

// ---- shared helpers

// One MoE layer and its input, as `reference` and `run` take them: --checkpoint DIR --layer L
// --input X.safetensors holding `hidden` [T, H] BF16 and optionally `topk_ids` [T, k] (I32/I64)
// with `topk_weights` [T, k] (F32); without them the layer's router and config route (CPU).
struct LayerJob {
  int64_t layer_index = 0;
  MoeLayer layer;
  std::vector<uint16_t> hidden;  // [T, H] bf16
  reference::TopK topk;          // given, or routed
  bool given_routing = false;
  std::vector<std::string> input_files;  // every file read: the output must be none of them
  const char* routing_name() const {
    return given_routing ? "given routing" : routing_kind_name(layer.routing.kind);
  }
};
LayerJob load_layer_job(const std::string& checkpoint, int64_t layer_index, const std::string& input);
// Writes `output` [T, H] BF16 with the routing used (`topk_ids` I32, `topk_weights` F32).
void write_layer_output(const std::string& path, const LayerJob& job, const std::vector<uint16_t>& out);

// `--precision w4a16|w4a8|auto` on `app` (parse_precision's names), stored in `precision`, which
// keeps its value (the default) when the option is absent. A bad value is a command-line error
// (exit 2) that lists the allowed values. `what` says what each value does for this command.
CLI::Option* add_precision_option(CLI::App& app, Precision& precision, const std::string& what);

// Progress of a long job on stderr by bytes processed: at most one line a second, so a
// checkpoint of 100k tensors does not flood the terminal.
class Progress {
 public:
  Progress(std::string command, uint64_t total_bytes);
  void update(uint64_t done_bytes, const std::string& current);
  // The closing summary line (always printed).
  void finish(const std::string& summary);

 private:
  std::string command_;
  uint64_t total_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_;
};

// "1.23 GB" style sizes (powers of 1000) for messages.
std::string human_bytes(uint64_t bytes);

// True for the dtypes quantize accepts as unquantized weights.
bool is_wide_float(DType t);

// Widens `count` consecutive elements of a BF16/F16/F32 buffer to fp32 (exact).
void widen_to_f32(DType t, const uint8_t* src, int64_t count, float* dst);

// Runs fn(begin, end) over [0, n) split into contiguous ranges on up to `threads` threads
// (0: all cores); rethrows the first exception a range threw.
void parallel_ranges(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& fn);

// Throws megamoe::Error(kInvalidArgument) when `out` names the same file as `in`: the output is
// written while the input is memory-mapped, and truncating a mapped file kills the process.
void check_distinct_files(const std::string& in, const std::string& out);

// Throws megamoe::Error(kInvalidArgument) when `out` exists and is the same file (by device and
// inode, so also through a link or another path) as one of `inputs`: writing it would truncate a
// file that is memory-mapped (SIGBUS) or still to be read (garbage), or destroy a checkpoint.
void check_output_is_not_an_input(const std::string& out, const std::vector<std::string>& inputs);

// The files a checkpoint at `path` is read from: its safetensors files and, for a directory,
// config.json, hf_quant_config.json and model.safetensors.index.json where they exist.
std::vector<std::string> checkpoint_input_files(const Checkpoint& ckpt);

// The NVFP4 linear whose packed codes `t` holds, if any: a ModelOpt `base.weight` (U8, with an
// F8_E4M3 `base.weight_scale`) or a compressed-tensors `base.weight_packed`. Returns `base`.
std::optional<std::string> nvfp4_linear_base(const Checkpoint& ckpt, const TensorInfo& t);

// Views of plain data as bytes, for SafetensorsWriter::append.
template <typename T>
std::span<const uint8_t> byte_view(std::span<const T> v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size_bytes()};
}

}  // namespace megamoe::tool
