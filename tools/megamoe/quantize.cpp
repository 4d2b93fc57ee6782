// `megamoe quantize IN.safetensors OUT.safetensors [--include REGEX] [--exclude REGEX]
// [--export-device gpu|cpu]`: BF16/F16/F32 linear weights to ModelOpt NVFP4
// (docs/design.md §2) with the exporter's fused groups, bit for bit, streamed.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
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
  std::string device = format::export_device_name(format::kDefaultExportDevice);
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
  float amax = 0.0f;          // of this tensor (quantized tensors only)
  float global_scale = 0.0f;  // weight_scale_2, from its fused group's amax
};

// ModelOpt's exporter gives linears that read the same input one amax, the group's max, and so
// one weight_scale_2 (and one input_scale): it finds them by running the model, and a tensor file
// has only names, so these are the names of the groups it forms in the supported models. A name
// "<prefix>.<member>.weight" belongs to the group named by <prefix>. Matched by suffix, in time
// linear in the name (no regex: a name may be as long as the header allows).
struct FusedGroupRule {
  const char* members;                // for messages
  std::vector<std::string> suffixes;  // ".<member>.weight"
};
const std::vector<FusedGroupRule>& fused_group_rules() {
  static const std::vector<FusedGroupRule> rules = {
      // MLP / expert / shared expert: gate and up read the same hidden state.
      {"gate_proj, up_proj", {".gate_proj.weight", ".up_proj.weight"}},
      // Attention: q, k and v read the same normalised hidden state.
      {"q_proj, k_proj, v_proj", {".q_proj.weight", ".k_proj.weight", ".v_proj.weight"}},
      // DeepSeek's multi-head latent attention: both down-projections read the hidden state.
      {"q_a_proj, kv_a_proj_with_mqa", {".q_a_proj.weight", ".kv_a_proj_with_mqa.weight"}},
  };
  return rules;
}

// The fused group of a quantized tensor ("<prefix> (<members>)"), or nothing.
std::optional<std::string> fused_group(const std::string& name) {
  for (const FusedGroupRule& rule : fused_group_rules()) {
    for (const std::string& suffix : rule.suffixes) {
      if (name.ends_with(suffix)) {
        return name.substr(0, name.size() - suffix.size()) + " (" + rule.members + ")";
      }
    }
  }
  return std::nullopt;
}

// amax(|W|) of one tensor, checking every value is finite (pass 1 of the recipe).
float tensor_amax(const SafetensorsFile& in, const TensorInfo& t) {
  const int64_t rows = t.shape[0];
  const int64_t cols = t.shape[1];
  const std::span<const uint8_t> src = in.bytes(t);
  const int esize = dtype_size(t.dtype);
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
  return amax;
}

// Pass 2 of the recipe for one tensor, with its group's global scale: row chunks give the same
// bytes as the whole matrix because every block lies within one row. Codes go out chunk by
// chunk; the scales (1/32 of the fp32 size) are held until the codes are written.
void quantize_tensor(const SafetensorsFile& in, const TensorInfo& t, float global_scale,
                     format::ExportDevice device, SafetensorsWriter& out, Progress& progress,
                     uint64_t& done_bytes) {
  const int64_t rows = t.shape[0];
  const int64_t cols = t.shape[1];
  const std::span<const uint8_t> src = in.bytes(t);
  const int esize = dtype_size(t.dtype);
  const int64_t chunk_rows = std::max<int64_t>(1, kChunkElements / std::max<int64_t>(cols, 1));

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
          std::span<uint8_t>(scales).subspan(size_t((r0 + a) * k16), size_t((b - a) * k16)),
          device);
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

  // Pass 1 over every quantized tensor: amax, then one global scale per fused group (a group
  // forms only among the tensors being quantized, and only where they share K: linears that
  // read the same input do).
  const format::ExportDevice device =
      args.device == "cpu" ? format::ExportDevice::kCpu : format::ExportDevice::kGpu;
  std::map<std::string, std::vector<Plan*>> groups;
  for (Plan& p : plan) {
    if (!p.quantize) continue;
    p.amax = tensor_amax(*in, *p.tensor);
    const std::optional<std::string> group = fused_group(p.tensor->name);
    groups[group ? *group : "\n" + p.tensor->name].push_back(&p);  // "\n": never a group name
  }
  size_t fused = 0;
  for (auto& [name, members] : groups) {
    const int64_t k = members.front()->tensor->shape[1];
    const bool same_k = std::all_of(members.begin(), members.end(),
                                    [&](const Plan* p) { return p->tensor->shape[1] == k; });
    if (members.size() > 1 && !same_k) {
      std::fprintf(stderr,
                   "megamoe quantize: warning: the tensors of %s have different input sizes, so "
                   "they cannot read one input; each gets its own global scale.\n",
                   name.c_str());
    }
    float group_amax = 0.0f;
    for (const Plan* p : members) group_amax = std::max(group_amax, p->amax);
    for (Plan* p : members) {
      const float amax = (members.size() > 1 && same_k) ? group_amax : p->amax;
      p->global_scale = format::modelopt_global_scale(amax, device);
      if (amax == 0.0f) {
        std::fprintf(stderr,
                     "megamoe quantize: warning: '%s' is all zero%s; it is written as ModelOpt "
                     "writes it (weight_scale_2 = 0, every block scale NaN 0x%02X, every code "
                     "0x77), which megamoe loads as a zero weight.\n",
                     p->tensor->name.c_str(), members.size() > 1 ? " (and so is its group)" : "",
                     device == format::ExportDevice::kCpu ? format::kZeroWeightScaleByteCpu
                                                          : format::kZeroWeightScaleByteGpu);
      }
    }
    if (members.size() > 1 && same_k) fused += members.size();
  }

  SafetensorsWriter out(args.output, std::move(specs), in->metadata());
  Progress progress("quantize", total_bytes);
  uint64_t done_bytes = 0;
  for (const Plan& p : plan) {
    if (p.quantize) {
      quantize_tensor(*in, *p.tensor, p.global_scale, device, out, progress, done_bytes);
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
                  " tensors quantized to NVFP4 (" + std::to_string(fused) +
                  " of them in fused groups sharing a global scale; as exported on the " +
                  format::export_device_name(device) + "), " +
                  std::to_string(plan.size() - quantized) + " copied");
}

}  // namespace

Command add_quantize_command(CLI::App& parent) {
  auto args = std::make_shared<QuantizeArgs>();
  CLI::App* app = parent.add_subcommand(
      "quantize",
      "Quantize every 2-D BF16/F16/F32 '*.weight' tensor whose last dimension is a multiple of 16 "
      "to ModelOpt NVFP4 (weight, weight_scale, weight_scale_2) as ModelOpt's exporter does: "
      "gate_proj/up_proj, q_proj/k_proj/v_proj and q_a_proj/kv_a_proj_with_mqa of one module "
      "share the group's global scale; "
      "copy every other tensor.");
  app->add_option("input", args->input, "input .safetensors file")->required();
  app->add_option("output", args->output, "output .safetensors file")->required();
  app->add_option("--include", args->include,
                  "quantize only tensors whose name matches this regex (searched anywhere in the "
                  "name; the ECMAScript subset of the README)");
  app->add_option("--exclude", args->exclude,
                  "do not quantize tensors whose name matches this regex (searched anywhere in "
                  "the name; the ECMAScript subset of the README)");
  app->add_option("--export-device", args->device,
                  "write the bytes of a ModelOpt export run on this device: 'gpu' (default, where "
                  "published checkpoints are exported) computes weight_scale_2 as amax * "
                  "fl32(1/2688) and gives all-zero weights NaN scales 0x7F; 'cpu' divides amax / "
                  "2688 exactly and writes 0xFF (x86)")
      ->check(CLI::IsMember({"gpu", "cpu"}));
  return {app, [args] { run_quantize(*args); }};
}

}  // namespace megamoe::tool
