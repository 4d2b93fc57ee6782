// `megamoe dequantize IN OUT`: every NVFP4 linear (ModelOpt or compressed-tensors names) back to
// one BF16 `*.weight`, each element e2m1 * ue4m3 * global scale rounded once to bf16, streamed
// row chunk by row chunk; every other tensor copied.
#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "commands.h"
#include "megamoe/checkpoint.h"
#include "megamoe/format.h"
#include "megamoe/safetensors.h"
#include "megamoe/status.h"

namespace megamoe::tool {

namespace {

struct DequantizeArgs {
  std::string input;
  std::string output;
};

constexpr int64_t kChunkElements = int64_t(8) << 20;
constexpr uint64_t kCopyChunkBytes = uint64_t(64) << 20;

// The companions of an NVFP4 linear `base`: consumed by dequantization, never copied. Static
// activation scales describe the quantized layer only, so they go too.
constexpr const char* kCompanionSuffixes[] = {".weight_scale", ".weight_scale_2",
                                              ".weight_global_scale", ".input_scale",
                                              ".input_global_scale"};

struct Item {
  TensorRef tensor;
  std::optional<std::string> nvfp4_base;  // set: dequantize linear `base` into base.weight
};

void dequantize_linear(const Checkpoint& ckpt, const TensorRef& packed, const std::string& base,
                       SafetensorsWriter& out, Progress& progress, uint64_t& done_bytes) {
  const std::vector<int64_t>& shape = packed.info->shape;  // 2-D, checked when planning
  const int64_t rows = shape[0];
  const int64_t cols = 2 * shape[1];
  // Validates the scales (dtype, shape, every ue4m3 byte, the global scale) and resolves the
  // ModelOpt or compressed-tensors (reciprocal) global scale into weight_scale_2; ModelOpt's
  // all-zero weight comes back as zeros (with a warning naming it).
  const Nvfp4Linear lin = load_nvfp4_linear(ckpt, base, rows, cols);
  const int64_t k16 = cols / format::kNvfp4BlockSize;
  const int64_t chunk_rows = std::max<int64_t>(1, kChunkElements / cols);
  std::vector<uint16_t> bf16;
  for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
    const int64_t n = std::min(chunk_rows, rows - r0);
    bf16.resize(size_t(n * cols));
    parallel_ranges(n, 0, [&](int64_t a, int64_t b) {
      const format::Nvfp4View part{b - a, cols, lin.weight + (r0 + a) * cols / 2,
                                   lin.weight_scale + (r0 + a) * k16, lin.weight_scale_2};
      // One rounding, from the exact product to bf16 (not through fp32).
      format::dequantize_to_bf16(
          part, std::span<uint16_t>(bf16).subspan(size_t(a * cols), size_t((b - a) * cols)));
    });
    out.append(base + ".weight", byte_view(std::span<const uint16_t>(bf16)));
    done_bytes += uint64_t(n * cols / 2);
    progress.update(done_bytes, packed.info->name);
  }
}

void run_dequantize(const DequantizeArgs& args) {
  check_distinct_files(args.input, args.output);
  const Checkpoint ckpt = Checkpoint::open(args.input);
  check_output_is_not_an_input(args.output, checkpoint_input_files(ckpt));

  // Input order (file by file, by offset) is kept; each linear is written where its codes were.
  std::vector<Item> items;
  std::map<std::string, std::string> metadata;
  for (const auto& file : ckpt.files()) {
    metadata.insert(file->metadata().begin(), file->metadata().end());
    for (const TensorInfo& t : file->tensors()) {
      items.push_back({TensorRef{&t, file, file->bytes(t)}, nvfp4_linear_base(ckpt, t)});
    }
  }
  std::set<std::string> companion;  // names consumed by some linear
  for (const Item& it : items) {
    if (!it.nvfp4_base) continue;
    for (const char* s : kCompanionSuffixes) companion.insert(*it.nvfp4_base + s);
    if (it.tensor.info->name != *it.nvfp4_base + ".weight") {
      MEGAMOE_CHECK(!ckpt.find(*it.nvfp4_base + ".weight"), kInvalidCheckpoint, "'", args.input,
                    "' holds both '", it.tensor.info->name, "' and '", *it.nvfp4_base,
                    ".weight', so the dequantized weight would collide with an existing tensor.");
    }
  }

  std::vector<TensorSpec> specs;
  uint64_t total_bytes = 0;
  size_t linears = 0;
  size_t copied = 0;
  for (const Item& it : items) {
    const TensorInfo& t = *it.tensor.info;
    if (it.nvfp4_base) {
      MEGAMOE_CHECK(t.shape.size() == 2, kInvalidCheckpoint, "NVFP4 tensor '", t.name, "' in '",
                    it.tensor.file->path(), "' has shape ", shape_string(t.shape),
                    "; dequantize handles 2-D linear weights [out, in/2].");
      // The BF16 weight is [out, 2 * in/2]: its width must fit in int64.
      MEGAMOE_CHECK(t.shape[1] <= INT64_MAX / 2, kInvalidCheckpoint, "NVFP4 tensor '", t.name,
                    "' in '", it.tensor.file->path(), "' has shape ", shape_string(t.shape),
                    "; in/2 may be at most ", INT64_MAX / 2, " (the dequantized width 2 x in/2 "
                    "must fit in int64).");
      specs.push_back({*it.nvfp4_base + ".weight", DType::BF16, {t.shape[0], 2 * t.shape[1]}});
      ++linears;
    } else if (!companion.count(t.name)) {
      specs.push_back({t.name, t.dtype, t.shape});
      ++copied;
    }
    total_bytes += t.nbytes();
  }

  SafetensorsWriter out(args.output, std::move(specs), metadata);
  Progress progress("dequantize", total_bytes);
  uint64_t done_bytes = 0;
  for (const Item& it : items) {
    const TensorInfo& t = *it.tensor.info;
    if (it.nvfp4_base) {
      dequantize_linear(ckpt, it.tensor, *it.nvfp4_base, out, progress, done_bytes);
      continue;
    }
    if (companion.count(t.name)) {
      done_bytes += t.nbytes();
      continue;
    }
    for (uint64_t off = 0; off < it.tensor.bytes.size(); off += kCopyChunkBytes) {
      const uint64_t n = std::min<uint64_t>(kCopyChunkBytes, it.tensor.bytes.size() - off);
      out.append(t.name, it.tensor.bytes.subspan(off, n));
      done_bytes += n;
      progress.update(done_bytes, t.name);
    }
  }
  out.finish();
  progress.finish("wrote '" + args.output + "': " + std::to_string(linears) +
                  " NVFP4 weights dequantized to BF16, " + std::to_string(copied) +
                  " tensors copied");
}

}  // namespace

Command add_dequantize_command(CLI::App& parent) {
  auto args = std::make_shared<DequantizeArgs>();
  CLI::App* app = parent.add_subcommand(
      "dequantize",
      "Dequantize every NVFP4 weight (ModelOpt weight/weight_scale/weight_scale_2 or "
      "compressed-tensors weight_packed/weight_scale/weight_global_scale) to one BF16 '*.weight'; "
      "drop input scales; copy every other tensor.");
  app->add_option("input", args->input, "input .safetensors file (or checkpoint directory)")
      ->required();
  app->add_option("output", args->output, "output .safetensors file")->required();
  return {app, [args] { run_dequantize(*args); }};
}

}  // namespace megamoe::tool
