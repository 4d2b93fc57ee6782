// `megamoe inspect PATH [--json]`: what a checkpoint holds: its tensors, the statistics of its
// NVFP4 block scales, its quantization format and the MoE layers it contains.
#include <array>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "commands.h"
#include "megamoe/checkpoint.h"
#include "megamoe/format.h"
#include "megamoe/status.h"

namespace megamoe::tool {

namespace {

using nlohmann::json;

struct InspectArgs {
  std::string path;
  bool json = false;
};

// Block-scale statistics of one NVFP4 linear, from a histogram of its ue4m3 bytes.
struct ScaleStats {
  std::string base;  // the linear's name prefix
  int64_t rows = 0;
  int64_t cols = 0;                   // unpacked K
  std::optional<float> global_scale;  // weight_scale_2 (or 1/weight_global_scale)
  uint64_t count = 0;
  uint64_t zero = 0;                            // code 0x00
  uint64_t subnormal = 0;                       // codes 0x01-0x07: m * 2^-9
  uint64_t invalid = 0;                         // negative or NaN: not a ue4m3 scale
  float min = 0.0f, median = 0.0f, max = 0.0f;  // over the valid scales
};

struct MoeLayerInfo {
  int64_t layer = 0;
  std::set<int64_t> experts;
  int64_t hidden_size = 0;  // 0: unknown (no gate_proj found)
  int64_t intermediate_size = 0;
  bool shared_expert = false;
  bool router = false;
};

// A scalar F32/F16/BF16 tensor's value, or nothing when it is not one.
std::optional<float> scalar_value(const Checkpoint& ckpt, const std::string& name) {
  const auto t = ckpt.find(name);
  if (!t || t->info->numel() != 1 || !is_wide_float(t->info->dtype)) return std::nullopt;
  return load_as_f32(t->info->dtype, t->bytes.data(), 0);
}

// The unpacked width 2 x [in/2] of packed e2m1 codes; a header may declare any width for an
// empty tensor, so the doubling is checked.
int64_t packed_width_to_cols(const TensorInfo& t) {
  MEGAMOE_CHECK(t.shape[1] <= INT64_MAX / 2, kInvalidCheckpoint, "packed e2m1 tensor '", t.name,
                "' has shape ", shape_string(t.shape), "; in/2 may be at most ", INT64_MAX / 2,
                " (the unpacked width 2 x in/2 must fit in int64).");
  return 2 * t.shape[1];
}

ScaleStats scale_stats(const Checkpoint& ckpt, const TensorRef& packed, const std::string& base) {
  ScaleStats s;
  s.base = base;
  if (packed.info->shape.size() == 2) {
    s.rows = packed.info->shape[0];
    s.cols = packed_width_to_cols(*packed.info);
  }
  if (auto g = scalar_value(ckpt, base + ".weight_scale_2")) {
    s.global_scale = *g;
  } else if (auto r = scalar_value(ckpt, base + ".weight_global_scale")) {
    s.global_scale = 1.0f / *r;  // compressed-tensors stores the reciprocal
  }
  std::array<uint64_t, 256> hist{};
  for (const uint8_t b : ckpt.get(base + ".weight_scale").bytes) ++hist[b];
  // Valid ue4m3 codes are 0x00-0x7E, and their values increase with the code: order statistics
  // can be read off the histogram in code order.
  uint64_t valid = 0;
  for (int c = 0; c < 256; ++c) {
    s.count += hist[size_t(c)];
    if (!format::ue4m3_is_valid(uint8_t(c))) {
      s.invalid += hist[size_t(c)];
      continue;
    }
    valid += hist[size_t(c)];
    if (c == 0) s.zero += hist[0];
    if (c >= 0x01 && c <= 0x07) s.subnormal += hist[size_t(c)];
  }
  uint64_t seen = 0;
  for (int c = 0; c < 0x7F; ++c) {
    if (hist[size_t(c)] == 0) continue;
    const float v = format::e4m3_to_f32(uint8_t(c));
    if (seen == 0) s.min = v;
    if (seen < (valid + 1) / 2 && seen + hist[size_t(c)] >= (valid + 1) / 2) s.median = v;
    s.max = v;
    seen += hist[size_t(c)];
  }
  return s;
}

// model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.{weight,weight_packed}; indices of up to
// nine digits, so that they always fit std::stoll.
const std::regex& expert_weight_regex() {
  static const std::regex re(R"(^model\.layers\.(\d{1,9})\.mlp\.experts\.(\d{1,9})\.)"
                             R"((gate_proj|up_proj|down_proj)\.(weight|weight_packed)$)");
  return re;
}

std::vector<MoeLayerInfo> find_moe_layers(const Checkpoint& ckpt,
                                          const std::vector<std::string>& names) {
  std::map<int64_t, MoeLayerInfo> layers;
  for (const std::string& name : names) {
    std::smatch m;
    if (!std::regex_match(name, m, expert_weight_regex())) continue;
    const int64_t l = std::stoll(m[1]);
    const int64_t e = std::stoll(m[2]);
    MoeLayerInfo& info = layers[l];
    info.layer = l;
    info.experts.insert(e);
    // H and I from the first gate_proj seen: [I, H], or [I, H/2] when packed e2m1.
    if (m[3] == "gate_proj" && info.hidden_size == 0) {
      const TensorInfo& t = *ckpt.get(name).info;
      if (t.shape.size() == 2) {
        const bool packed = t.dtype == DType::U8;
        info.intermediate_size = t.shape[0];
        info.hidden_size = packed ? packed_width_to_cols(t) : t.shape[1];
      }
    }
  }
  std::vector<MoeLayerInfo> out;
  for (auto& [l, info] : layers) {
    const std::string mlp = "model.layers." + std::to_string(l) + ".mlp";
    for (const char* shared :
         {".shared_experts.gate_proj.weight", ".shared_experts.gate_proj.weight_packed",
          ".shared_expert.gate_proj.weight"}) {
      info.shared_expert = info.shared_expert || ckpt.find(mlp + shared).has_value();
    }
    info.router = ckpt.find(mlp + ".gate.weight").has_value();
    out.push_back(info);
  }
  return out;
}

std::string format_label(QuantFormat f) {
  switch (f) {
    case QuantFormat::kModelOptNvfp4:
      return "ModelOpt NVFP4";
    case QuantFormat::kCompressedTensorsNvfp4:
      return "compressed-tensors NVFP4";
    case QuantFormat::kUnquantized:
      return "unquantized";
  }
  return "unknown";
}

// The format the tensor names show: compressed-tensors names its codes weight_packed, ModelOpt
// keeps weight next to a weight_scale_2.
QuantFormat detect_format(const std::vector<ScaleStats>& linears, const Checkpoint& ckpt) {
  QuantFormat f = QuantFormat::kUnquantized;
  for (const ScaleStats& s : linears) {
    if (ckpt.find(s.base + ".weight_packed")) return QuantFormat::kCompressedTensorsNvfp4;
    f = QuantFormat::kModelOptNvfp4;
  }
  return f;
}

std::string routing_label(const RoutingConfig& r) {
  std::string s = detail::concat(routing_kind_name(r.kind), " top-", r.top_k);
  if (r.kind == RoutingKind::kNoauxTc) {
    s += detail::concat(", n_group ", r.n_group, ", topk_group ", r.topk_group);
  }
  s += detail::concat(r.renormalize ? ", renormalized" : "", ", routed_scaling_factor ",
                      r.routed_scaling_factor);
  return s;
}

void run_inspect(const InspectArgs& args) {
  const Checkpoint ckpt = Checkpoint::open(args.path);
  const std::vector<std::string> names = ckpt.tensor_names();

  std::vector<ScaleStats> linears;
  uint64_t total_bytes = 0;
  for (const std::string& name : names) {
    const TensorRef t = ckpt.get(name);
    total_bytes += t.info->nbytes();
    if (const auto base = nvfp4_linear_base(ckpt, *t.info);
        base && ckpt.find(*base + ".weight_scale")) {
      linears.push_back(scale_stats(ckpt, t, *base));
    }
  }
  const QuantFormat format = detect_format(linears, ckpt);
  const std::vector<MoeLayerInfo> moe = find_moe_layers(ckpt, names);

  // The config describes the model when PATH is a checkpoint directory; a config this library
  // cannot use is reported, not fatal: inspect is how one finds out what is wrong.
  std::optional<ModelConfig> config;
  std::string config_error;
  std::error_code ec;
  if (std::filesystem::is_directory(args.path, ec) &&
      std::filesystem::exists(std::filesystem::path(args.path) / "config.json", ec)) {
    try {
      config = load_model_config(args.path);
    } catch (const Error& e) {
      config_error = e.what();
    }
  }

  if (args.json) {
    json j;
    j["path"] = args.path;
    j["format"] = quant_format_name(format);
    j["total_bytes"] = total_bytes;
    j["tensors"] = json::array();
    for (const std::string& name : names) {
      const TensorInfo& t = *ckpt.get(name).info;
      j["tensors"].push_back({{"name", name},
                              {"dtype", dtype_name(t.dtype)},
                              {"shape", t.shape},
                              {"bytes", t.nbytes()}});
    }
    j["nvfp4"] = json::array();
    for (const ScaleStats& s : linears) {
      j["nvfp4"].push_back(
          {{"name", s.base},
           {"rows", s.rows},
           {"cols", s.cols},
           {"global_scale", s.global_scale ? json(*s.global_scale) : json(nullptr)},
           {"block_scales",
            {{"count", s.count},
             {"min", s.min},
             {"median", s.median},
             {"max", s.max},
             {"zero", s.zero},
             {"subnormal", s.subnormal},
             {"invalid", s.invalid}}}});
    }
    j["moe_layers"] = json::array();
    for (const MoeLayerInfo& m : moe) {
      j["moe_layers"].push_back({{"layer", m.layer},
                                 {"experts", m.experts.size()},
                                 {"hidden_size", m.hidden_size},
                                 {"intermediate_size", m.intermediate_size},
                                 {"shared_expert", m.shared_expert},
                                 {"router", m.router}});
    }
    if (config) {
      j["config"] = {{"architecture", config->architecture},
                     {"model_type", config->model_type},
                     {"hidden_size", config->hidden_size},
                     {"moe_intermediate_size", config->moe_intermediate_size},
                     {"num_experts", config->num_experts},
                     {"num_experts_per_tok", config->num_experts_per_tok},
                     {"n_shared_experts", config->n_shared_experts},
                     {"num_hidden_layers", config->num_hidden_layers},
                     {"routing", routing_label(config->routing())},
                     {"quant_format", quant_format_name(config->quant_format)}};
      if (config->swiglu_limit) j["config"]["swiglu_limit"] = *config->swiglu_limit;
    } else if (!config_error.empty()) {
      j["config_error"] = config_error;
    }
    std::cout << j.dump(2) << '\n';
    return;
  }

  std::printf("checkpoint: %s (%zu tensors in %zu file%s, %s)\n", args.path.c_str(), names.size(),
              ckpt.files().size(), ckpt.files().size() == 1 ? "" : "s",
              human_bytes(total_bytes).c_str());
  std::printf("format: %s\n", format_label(format).c_str());
  if (config) {
    std::printf(
        "config: %s (%s), hidden %lld, moe intermediate %lld, %lld experts, %d shared, "
        "%lld layers, %s%s, quantization %s\n",
        config->architecture.c_str(), config->model_type.c_str(), (long long)config->hidden_size,
        (long long)config->moe_intermediate_size, (long long)config->num_experts,
        config->n_shared_experts, (long long)config->num_hidden_layers,
        routing_label(config->routing()).c_str(),
        config->swiglu_limit ? detail::concat(", swiglu_limit ", *config->swiglu_limit).c_str()
                             : "",
        format_label(config->quant_format).c_str());
  } else if (!config_error.empty()) {
    std::printf("config: not usable: %s\n", config_error.c_str());
  }

  size_t width = 4;
  for (const std::string& n : names) width = std::max(width, n.size());
  std::printf("\ntensors:\n  %-*s  %-7s  %-16s  %s\n", int(width), "name", "dtype", "shape",
              "size");
  for (const std::string& name : names) {
    const TensorInfo& t = *ckpt.get(name).info;
    std::printf("  %-*s  %-7s  %-16s  %s\n", int(width), name.c_str(), dtype_name(t.dtype),
                shape_string(t.shape).c_str(), human_bytes(t.nbytes()).c_str());
  }

  if (!linears.empty()) {
    std::printf(
        "\nNVFP4 weights (ue4m3 block scales: min / median / max, zero, subnormal, "
        "invalid; global scale):\n");
    for (const ScaleStats& s : linears) {
      const std::string global = s.global_scale ? detail::concat(*s.global_scale) : "missing";
      std::printf(
          "  %-*s  [%lld, %lld]  %g / %g / %g  zero %llu  subnormal %llu  invalid %llu  "
          "global %s\n",
          int(width), s.base.c_str(), (long long)s.rows, (long long)s.cols, s.min, s.median, s.max,
          (unsigned long long)s.zero, (unsigned long long)s.subnormal,
          (unsigned long long)s.invalid, global.c_str());
    }
  }

  std::printf("\nMoE layers:%s\n", moe.empty() ? " none found" : "");
  for (const MoeLayerInfo& m : moe) {
    std::printf("  layer %lld: %zu experts, H %lld, I %lld, shared expert %s, router %s\n",
                (long long)m.layer, m.experts.size(), (long long)m.hidden_size,
                (long long)m.intermediate_size, m.shared_expert ? "yes" : "no",
                m.router ? "yes" : "no");
  }
}

}  // namespace

Command add_inspect_command(CLI::App& parent) {
  auto args = std::make_shared<InspectArgs>();
  CLI::App* app = parent.add_subcommand(
      "inspect",
      "Show a checkpoint's tensors, NVFP4 block-scale statistics, quantization format and MoE "
      "layers.");
  app->add_option("path", args->path, "a .safetensors file or a checkpoint directory")->required();
  app->add_flag("--json", args->json, "print one JSON object instead of text");
  return {app, [args] { run_inspect(*args); }};
}

}  // namespace megamoe::tool
