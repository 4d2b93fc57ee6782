// `megamoe quantize IN.safetensors OUT.safetensors [--include REGEX] [--exclude REGEX]`:
// BF16/F16/F32 linear weights to ModelOpt NVFP4 (DESIGN.md §2), bit for bit, streamed.
#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/name_pattern.h"
#include "commands.h"
#include "megamoe/format.h"
#include "megamoe/safetensors.h"
#include "megamoe/status.h"

namespace megamoe::tool {

namespace {

struct QuantizeArgs {
  std::string input;
  std::string output;
  std::string include;  // empty: every tensor
  std::string exclude;  // empty: none
};

constexpr std::string_view kWeightSuffix = ".weight";
// Rows are widened and quantized in chunks of about this many elements (32 MB of fp32), so
// memory stays bounded however large one tensor is.
constexpr int64_t kChunkElements = int64_t(8) << 20;
constexpr uint64_t kCopyChunkBytes = uint64_t(64) << 20;

// Names are matched by NamePattern (linear time, no recursion): a user's pattern must not
// backtrack forever, nor a 200,000-character tensor name overflow the stack.
std::optional<NamePattern> compile_pattern(const std::string& text, const char* option) {
  if (text.empty()) return std::nullopt;
  return NamePattern::compile(text, option);
}

// A tensor the recipe applies to: a 2-D float `*.weight` whose K is a whole number of blocks.
bool is_quantizable(const TensorInfo& t) {
  return t.name.size() > kWeightSuffix.size() && t.name.ends_with(kWeightSuffix) &&
         is_wide_float(t.dtype) && t.shape.size() == 2 && t.shape[1] % format::kNvfp4BlockSize == 0;
}

struct Plan {
  const TensorInfo* tensor;
  bool quantize;
};

// Streams one tensor through the ModelOpt recipe. Pass 1 finds amax (so the global scale is the
// one quantize_weight_modelopt would compute); pass 2 quantizes row chunks with that scale, which
// gives the same bytes because every block lies within one row. Codes go out chunk by chunk;
// the scales (1/32 of the fp32 size) are held until the codes are written.
void quantize_tensor(const SafetensorsFile& in, const TensorInfo& t, SafetensorsWriter& out,
                     Progress& progress, uint64_t& done_bytes) {
  const int64_t rows = t.shape[0];
  const int64_t cols = t.shape[1];
  const std::span<const uint8_t> src = in.bytes(t);
  const int esize = dtype_size(t.dtype);
  const int64_t chunk_rows = std::max<int64_t>(1, kChunkElements / std::max<int64_t>(cols, 1));

  float amax = 0.0f;
  std::mutex amax_mu;
  parallel_ranges(rows, 0, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(static_cast<size_t>(cols));
    float local = 0.0f;
    for (int64_t r = r0; r < r1; ++r) {
      widen_to_f32(t.dtype, src.data() + r * cols * esize, cols, row.data());
      for (int64_t c = 0; c < cols; ++c) {
        MEGAMOE_CHECK(std::isfinite(row[size_t(c)]), kInvalidCheckpoint, "tensor '", t.name,
                      "' of '", in.path(), "' holds a non-finite value at [", r, ", ", c,
                      "]; NVFP4 can only encode finite weights.");
        local = std::max(local, std::fabs(row[size_t(c)]));
      }
    }
    std::lock_guard<std::mutex> lock(amax_mu);
    amax = std::max(amax, local);
  });
  const float global_scale = format::modelopt_global_scale(amax);

  const std::string base = t.name.substr(0, t.name.size() - kWeightSuffix.size());
  std::vector<uint8_t> scales(size_t(rows * (cols / format::kNvfp4BlockSize)));
  std::vector<float> wide;
  std::vector<uint8_t> codes;
  for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
    const int64_t n = std::min(chunk_rows, rows - r0);
    wide.resize(size_t(n * cols));
    codes.resize(size_t(n * cols / 2));
    parallel_ranges(n, 0, [&](int64_t a, int64_t b) {
      const int64_t k16 = cols / format::kNvfp4BlockSize;
      widen_to_f32(t.dtype, src.data() + (r0 + a) * cols * esize, (b - a) * cols,
                   wide.data() + a * cols);
      format::quantize_weight_with_global_scale(
          std::span<const float>(wide).subspan(size_t(a * cols), size_t((b - a) * cols)), b - a,
          cols, global_scale,
          std::span<uint8_t>(codes).subspan(size_t(a * cols / 2), size_t((b - a) * cols / 2)),
          std::span<uint8_t>(scales).subspan(size_t((r0 + a) * k16), size_t((b - a) * k16)));
    });
    out.append(t.name, codes);
    done_bytes += uint64_t(n * cols * esize);
    progress.update(done_bytes, t.name);
  }
  out.append(base + ".weight_scale", scales);
  out.append(base + ".weight_scale_2", byte_view(std::span<const float>(&global_scale, 1)));
}

void run_quantize(const QuantizeArgs& args) {
  check_distinct_files(args.input, args.output);
  const std::optional<NamePattern> include = compile_pattern(args.include, "--include");
  const std::optional<NamePattern> exclude = compile_pattern(args.exclude, "--exclude");
  const std::shared_ptr<const SafetensorsFile> in = SafetensorsFile::open(args.input);

  std::set<std::string> input_names;
  for (const TensorInfo& t : in->tensors()) input_names.insert(t.name);

  std::vector<Plan> plan;
  std::vector<TensorSpec> specs;
  uint64_t total_bytes = 0;
  size_t quantized = 0;
  for (const TensorInfo& t : in->tensors()) {
    const bool selected = (!include || include->search(t.name)) &&
                          !(exclude && exclude->search(t.name));
    const bool quantize = selected && is_quantizable(t);
    plan.push_back({&t, quantize});
    total_bytes += t.nbytes();
    if (!quantize) {
      specs.push_back({t.name, t.dtype, t.shape});
      continue;
    }
    ++quantized;
    const std::string base = t.name.substr(0, t.name.size() - kWeightSuffix.size());
    for (const char* suffix : {".weight_scale", ".weight_scale_2"}) {
      MEGAMOE_CHECK(!input_names.count(base + suffix), kInvalidArgument, "quantizing tensor '",
                    t.name, "' would write '", base + suffix, "', but '", args.input,
                    "' already holds a tensor of that name; leave '", t.name,
                    "' out with --exclude or remove the existing tensor.");
    }
    const int64_t rows = t.shape[0];
    const int64_t cols = t.shape[1];
    specs.push_back({t.name, DType::U8, {rows, cols / 2}});
    specs.push_back(
        {base + ".weight_scale", DType::F8_E4M3, {rows, cols / format::kNvfp4BlockSize}});
    specs.push_back({base + ".weight_scale_2", DType::F32, {}});
  }

  SafetensorsWriter out(args.output, std::move(specs), in->metadata());
  Progress progress("quantize", total_bytes);
  uint64_t done_bytes = 0;
  for (const Plan& p : plan) {
    if (p.quantize) {
      quantize_tensor(*in, *p.tensor, out, progress, done_bytes);
      continue;
    }
    // Copied through in slices so that progress keeps moving on very large tensors.
    const std::span<const uint8_t> bytes = in->bytes(*p.tensor);
    for (uint64_t off = 0; off < bytes.size(); off += kCopyChunkBytes) {
      const uint64_t n = std::min<uint64_t>(kCopyChunkBytes, bytes.size() - off);
      out.append(p.tensor->name, bytes.subspan(off, n));
      done_bytes += n;
      progress.update(done_bytes, p.tensor->name);
    }
  }
  out.finish();
  progress.finish("wrote '" + args.output + "': " + std::to_string(quantized) +
                  " tensors quantized to NVFP4, " + std::to_string(plan.size() - quantized) +
                  " copied");
}

}  // namespace

Command add_quantize_command(CLI::App& parent) {
  auto args = std::make_shared<QuantizeArgs>();
  CLI::App* app = parent.add_subcommand(
      "quantize",
      "Quantize every 2-D BF16/F16/F32 '*.weight' tensor whose last dimension is a multiple of 16 "
      "to ModelOpt NVFP4 (weight, weight_scale, weight_scale_2); copy every other tensor.");
  app->add_option("input", args->input, "input .safetensors file")->required();
  app->add_option("output", args->output, "output .safetensors file")->required();
  app->add_option("--include", args->include,
                  "quantize only tensors whose name matches this regex (searched anywhere in the "
                  "name; the ECMAScript subset of the README)");
  app->add_option("--exclude", args->exclude,
                  "do not quantize tensors whose name matches this regex (searched anywhere in "
                  "the name; the ECMAScript subset of the README)");
  return {app, [args] { run_quantize(*args); }};
}

}  // namespace megamoe::tool
