// The HF config.json of DeepSeek-V3-style and Qwen3-MoE-style models, read with HF's field names
// and meanings (fields HF gives a default are optional here, with HF's default), and the NVFP4
// quantization format from config.json's quantization_config or ModelOpt's hf_quant_config.json.

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "megamoe/checkpoint.h"
#include "checkpoint/json_file.h"
#include "megamoe/status.h"

namespace megamoe {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kDeepseekV3 = "DeepseekV3ForCausalLM";
constexpr const char* kQwen3Moe = "Qwen3MoeForCausalLM";
constexpr const char* kSupportedArchitectures = "DeepseekV3ForCausalLM, Qwen3MoeForCausalLM";
constexpr int kIntMax = std::numeric_limits<int>::max();
// The widest hidden_size / moe_intermediate_size accepted (real models: at most tens of
// thousands). The bound keeps every product the loader and the reference form from these
// (n_shared_experts x I, E x H, T x H, ...) far from int64 overflow.
constexpr int64_t kMaxWidth = int64_t(1) << 24;

using checkpoint_detail::json_brief;
using checkpoint_detail::read_json_file;

// Typed access to the fields of one JSON object, with messages naming the file and the field.
// A null value counts as absent (HF writes null for unset optional fields).
class Fields {
 public:
  Fields(const json& obj, std::string file, std::string scope = "")
      : obj_(obj), file_(std::move(file)), scope_(std::move(scope)) {}

  bool has(const char* key) const { return obj_.contains(key) && !obj_[key].is_null(); }

  const json& required(const char* key) const {
    MEGAMOE_CHECK(has(key), kInvalidCheckpoint, "'", file_, "': field '", scope_, key,
                  "' is missing.");
    return obj_[key];
  }

  int64_t integer(const char* key, int64_t lo, int64_t hi) const {
    const json& v = required(key);
    // Integral JSON numbers only: 7168.0 or "7168" in a shape field is a broken config.
    const bool fits = v.is_number_integer() &&
                      !(v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX));
    MEGAMOE_CHECK(fits, kInvalidCheckpoint, "'", file_, "': field '", scope_, key,
                  "' must be an integer, but is ", json_brief(v), ".");
    const int64_t x = v.get<int64_t>();
    MEGAMOE_CHECK(x >= lo && x <= hi, kInvalidCheckpoint, "'", file_, "': field '", scope_, key,
                  "' is ", x, "; allowed: ", lo, " to ", hi, ".");
    return x;
  }
  int64_t integer_or(const char* key, int64_t lo, int64_t hi, int64_t fallback) const {
    return has(key) ? integer(key, lo, hi) : fallback;
  }

  // Any finite JSON number (HF writes 2.5 or 1) above zero that fits a float.
  float positive_number(const char* key) const {
    const json& v = required(key);
    MEGAMOE_CHECK(v.is_number(), kInvalidCheckpoint, "'", file_, "': field '", scope_, key,
                  "' must be a number, but is ", json_brief(v), ".");
    const double x = v.get<double>();
    MEGAMOE_CHECK(std::isfinite(x) && x > 0.0 && x <= std::numeric_limits<float>::max(),
                  kInvalidCheckpoint, "'", file_, "': field '", scope_, key, "' is ", json_brief(v),
                  "; it must be a finite number > 0.");
    return static_cast<float>(x);
  }

  bool boolean_or(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    const json& v = obj_[key];
    MEGAMOE_CHECK(v.is_boolean(), kInvalidCheckpoint, "'", file_, "': field '", scope_, key,
                  "' must be true or false, but is ", json_brief(v), ".");
    return v.get<bool>();
  }

  std::string string(const char* key) const {
    const json& v = required(key);
    MEGAMOE_CHECK(v.is_string(), kInvalidCheckpoint, "'", file_, "': field '", scope_, key,
                  "' must be a string, but is ", json_brief(v), ".");
    return v.get<std::string>();
  }
  std::string string_or(const char* key, const std::string& fallback) const {
    return has(key) ? string(key) : fallback;
  }

  const json& object(const char* key) const {
    const json& v = required(key);
    MEGAMOE_CHECK(v.is_object(), kInvalidCheckpoint, "'", file_, "': field '", scope_, key,
                  "' must be a JSON object, but is ", json_brief(v), ".");
    return v;
  }

  const std::string& file() const { return file_; }

 private:
  const json& obj_;
  std::string file_;
  std::string scope_;  // "quantization_config." etc., prefixed to field names in messages
};

constexpr const char* kSupportedQuant =
    "supported: quant_method 'modelopt' with quant_algo 'NVFP4', or 'compressed-tensors' with "
    "4-bit float weights in groups of 16 (nvfp4-pack-quantized)";

void check_group_size(const Fields& f, const char* key) {
  if (!f.has(key)) return;
  const int64_t g = f.integer(key, 1, INT64_MAX);
  MEGAMOE_CHECK(g == 16, kUnsupported, "'", f.file(), "': group_size ", g,
                " is not supported; NVFP4 uses one ue4m3 scale per 16 elements (group_size 16).");
}

// config.json "quantization_config".
QuantFormat parse_quantization_config(const json& qc, const std::string& file) {
  MEGAMOE_CHECK(qc.is_object(), kInvalidCheckpoint, "'", file,
                "': field 'quantization_config' must be a JSON object, but is ", json_brief(qc), ".");
  const Fields f(qc, file, "quantization_config.");
  const std::string method = f.string("quant_method");
  if (method == "modelopt") {
    const std::string algo = f.string("quant_algo");
    MEGAMOE_CHECK(algo == "NVFP4", kUnsupported, "'", file, "': ModelOpt quant_algo '", algo,
                  "' is not supported; ", kSupportedQuant, ".");
    check_group_size(f, "group_size");
    if (f.has("config_groups")) {
      for (const auto& [name, group] : f.object("config_groups").items()) {
        if (group.is_object() && group.contains("weights") && group["weights"].is_object()) {
          const std::string scope = "quantization_config.config_groups." + name + ".weights.";
          check_group_size(Fields(group["weights"], file, scope), "group_size");
        }
      }
    }
    return QuantFormat::kModelOptNvfp4;
  }
  if (method == "compressed-tensors") {
    // compressed-tensors describes the scheme per group of targets; NVFP4 is 4-bit float weights
    // with one scale per 16 ("tensor_group" strategy), whatever the group is called.
    const json& groups = f.object("config_groups");
    MEGAMOE_CHECK(!groups.empty(), kInvalidCheckpoint, "'", file,
                  "': quantization_config.config_groups is empty.");
    for (const auto& [name, group] : groups.items()) {
      const std::string scope = "quantization_config.config_groups." + name + ".";
      MEGAMOE_CHECK(group.is_object(), kInvalidCheckpoint, "'", file, "': field '", scope,
                    "' must be a JSON object, but is ", json_brief(group), ".");
      const Fields g(group, file, scope);
      const Fields w(g.object("weights"), file, scope + "weights.");
      const int64_t bits = w.integer("num_bits", 1, 64);
      const std::string type = w.string("type");
      MEGAMOE_CHECK(bits == 4 && type == "float", kUnsupported, "'", file,
                    "': compressed-tensors group '", name, "' quantizes weights to ", bits,
                    "-bit ", type, ", which is not NVFP4; ", kSupportedQuant, ".");
      MEGAMOE_CHECK(w.has("group_size"), kInvalidCheckpoint, "'", file, "': field '", scope,
                    "weights.group_size' is missing; NVFP4 needs group_size 16.");
      check_group_size(w, "group_size");
    }
    return QuantFormat::kCompressedTensorsNvfp4;
  }
  MEGAMOE_FAIL(kUnsupported, "'", file, "': quant_method '", method, "' is not supported; ",
               kSupportedQuant, ".");
}

// ModelOpt's hf_quant_config.json: {"quantization": {"quant_algo": "NVFP4", "group_size": 16,
// "exclude_modules": [...]}}.
QuantFormat parse_hf_quant_config(const json& root, const std::string& file) {
  MEGAMOE_CHECK(root.is_object(), kInvalidCheckpoint, "'", file,
                "' must hold a JSON object, but holds ", json_brief(root), ".");
  const json& q = Fields(root, file).object("quantization");
  const Fields f(q, file, "quantization.");
  const std::string algo = f.string("quant_algo");
  MEGAMOE_CHECK(algo == "NVFP4", kUnsupported, "'", file, "': quant_algo '", algo,
                "' is not supported; only NVFP4 is.");
  check_group_size(f, "group_size");
  if (f.has("exclude_modules")) {
    const json& ex = q["exclude_modules"];
    bool all_strings = ex.is_array();
    for (const json& m : ex) all_strings = all_strings && m.is_string();
    MEGAMOE_CHECK(all_strings, kInvalidCheckpoint, "'", file,
                  "': field 'quantization.exclude_modules' must be an array of strings, but is ",
                  json_brief(ex), ".");
  }
  return QuantFormat::kModelOptNvfp4;
}

void load_deepseek_v3(const Fields& f, ModelConfig& c) {
  c.hidden_size = f.integer("hidden_size", 1, kMaxWidth);
  c.moe_intermediate_size = f.integer("moe_intermediate_size", 1, kMaxWidth);
  c.num_experts = f.integer("n_routed_experts", 1, kIntMax);
  c.num_experts_per_tok = static_cast<int>(f.integer("num_experts_per_tok", 1, kIntMax));
  c.num_hidden_layers = f.integer("num_hidden_layers", 1, INT64_MAX);
  MEGAMOE_CHECK(c.num_experts_per_tok <= c.num_experts, kInvalidCheckpoint, "'", f.file(),
                "': num_experts_per_tok (", c.num_experts_per_tok, ") exceeds n_routed_experts (",
                c.num_experts, ").");
  // Defaults are transformers' DeepseekV3Config defaults.
  c.n_shared_experts = static_cast<int>(f.integer_or("n_shared_experts", 0, kIntMax, 1));
  c.first_k_dense_replace = static_cast<int>(f.integer_or("first_k_dense_replace", 0, kIntMax, 3));
  c.moe_layer_freq = static_cast<int>(f.integer_or("moe_layer_freq", 1, kIntMax, 1));
  c.norm_topk_prob = f.boolean_or("norm_topk_prob", true);
  c.scoring_func = f.string_or("scoring_func", "sigmoid");
  c.topk_method = f.string_or("topk_method", "noaux_tc");
  c.n_group = static_cast<int>(f.integer_or("n_group", 1, kIntMax, 8));
  c.topk_group = static_cast<int>(f.integer_or("topk_group", 1, kIntMax, 4));
  c.routed_scaling_factor = f.has("routed_scaling_factor")
                                ? f.positive_number("routed_scaling_factor")
                                : 2.5f;
  if (f.has("swiglu_limit")) c.swiglu_limit = f.positive_number("swiglu_limit");

  MEGAMOE_CHECK(c.scoring_func == "sigmoid" && c.topk_method == "noaux_tc", kUnsupported, "'",
                f.file(), "': scoring_func '", c.scoring_func, "' with topk_method '",
                c.topk_method, "' is not supported for ", kDeepseekV3,
                "; supported: scoring_func 'sigmoid' with topk_method 'noaux_tc'.");
  MEGAMOE_CHECK(c.topk_group <= c.n_group, kInvalidCheckpoint, "'", f.file(), "': topk_group (",
                c.topk_group, ") exceeds n_group (", c.n_group, ").");
  MEGAMOE_CHECK(c.num_experts % c.n_group == 0, kInvalidCheckpoint, "'", f.file(),
                "': n_routed_experts (", c.num_experts, ") is not a multiple of n_group (",
                c.n_group, ").");
  const int64_t selectable = int64_t(c.topk_group) * (c.num_experts / c.n_group);
  MEGAMOE_CHECK(c.num_experts_per_tok <= selectable, kInvalidCheckpoint, "'", f.file(),
                "': num_experts_per_tok (", c.num_experts_per_tok, ") exceeds the ", selectable,
                " experts in topk_group (", c.topk_group, ") of n_group (", c.n_group,
                ") groups.");
}

void load_qwen3_moe(const Fields& f, const json& obj, ModelConfig& c) {
  c.hidden_size = f.integer("hidden_size", 1, kMaxWidth);
  c.moe_intermediate_size = f.integer("moe_intermediate_size", 1, kMaxWidth);
  // transformers 4 writes the expert count as `num_experts`, transformers 5 as
  // `num_local_experts`; accept either.
  c.num_experts = f.has("num_experts") || !f.has("num_local_experts")
                      ? f.integer("num_experts", 1, kIntMax)
                      : f.integer("num_local_experts", 1, kIntMax);
  c.num_experts_per_tok = static_cast<int>(f.integer("num_experts_per_tok", 1, kIntMax));
  c.num_hidden_layers = f.integer("num_hidden_layers", 1, INT64_MAX);
  MEGAMOE_CHECK(c.num_experts_per_tok <= c.num_experts, kInvalidCheckpoint, "'", f.file(),
                "': num_experts_per_tok (", c.num_experts_per_tok, ") exceeds num_experts (",
                c.num_experts, ").");
  // Defaults are transformers' Qwen3MoeConfig defaults.
  c.norm_topk_prob = f.boolean_or("norm_topk_prob", false);
  c.decoder_sparse_step = static_cast<int>(f.integer_or("decoder_sparse_step", 1, kIntMax, 1));
  if (f.has("mlp_only_layers")) {
    const json& layers = obj["mlp_only_layers"];
    bool ok = layers.is_array();
    for (const json& l : layers) {
      ok = ok && l.is_number_unsigned() && l.get<uint64_t>() <= uint64_t(INT64_MAX);
    }
    MEGAMOE_CHECK(ok, kInvalidCheckpoint, "'", f.file(),
                  "': field 'mlp_only_layers' must be an array of non-negative layer indices, but "
                  "is ", json_brief(layers), ".");
    for (const json& l : layers) c.mlp_only_layers.push_back(l.get<int64_t>());
  }
  c.scoring_func = "softmax";
  c.topk_method = "greedy";
}

}  // namespace

bool ModelConfig::is_moe_layer(int64_t layer) const {
  if (layer < 0 || layer >= num_hidden_layers) return false;
  if (architecture == kDeepseekV3) {
    return layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
  }
  if (architecture == kQwen3Moe) {
    for (int64_t dense : mlp_only_layers) {
      if (dense == layer) return false;
    }
    return (layer + 1) % decoder_sparse_step == 0;
  }
  MEGAMOE_FAIL(kUnsupported, "architecture '", architecture, "' is not supported; supported: ",
               kSupportedArchitectures, ".");
}

RoutingConfig ModelConfig::routing() const {
  RoutingConfig r;
  r.top_k = num_experts_per_tok;
  r.renormalize = norm_topk_prob;
  if (architecture == kDeepseekV3) {
    MEGAMOE_CHECK(scoring_func == "sigmoid" && topk_method == "noaux_tc", kUnsupported,
                  "DeepSeek-V3 routing with scoring_func '", scoring_func, "' and topk_method '",
                  topk_method, "' is not supported; supported: sigmoid with noaux_tc.");
    r.kind = RoutingKind::kNoauxTc;
    r.n_group = n_group;
    r.topk_group = topk_group;
    r.routed_scaling_factor = routed_scaling_factor;
    return r;
  }
  if (architecture == kQwen3Moe) {
    r.kind = RoutingKind::kSoftmaxTopK;
    r.n_group = 1;
    r.topk_group = 1;
    r.routed_scaling_factor = 1.0f;
    return r;
  }
  MEGAMOE_FAIL(kUnsupported, "architecture '", architecture, "' is not supported; supported: ",
               kSupportedArchitectures, ".");
}

ModelConfig load_model_config(const std::string& dir) {
  const fs::path config_path = fs::path(dir) / "config.json";
  std::error_code ec;
  const json root = read_json_file(config_path, "model config");
  const std::string file = config_path.string();
  MEGAMOE_CHECK(root.is_object(), kInvalidCheckpoint, "'", file,
                "' must hold a JSON object, but holds ", json_brief(root), ".");
  const Fields f(root, file);

  ModelConfig c;
  const json& archs = f.required("architectures");
  MEGAMOE_CHECK(archs.is_array(), kInvalidCheckpoint, "'", file,
                "': field 'architectures' must be an array of strings, but is ", json_brief(archs), ".");
  for (const json& a : archs) {
    if (a.is_string() && (a == kDeepseekV3 || a == kQwen3Moe)) {
      c.architecture = a.get<std::string>();
      break;
    }
  }
  MEGAMOE_CHECK(!c.architecture.empty(), kUnsupported, "'", file, "': architectures ",
                json_brief(archs), " are not supported; supported: ", kSupportedArchitectures, ".");

  if (c.architecture == kDeepseekV3) {
    c.model_type = f.string_or("model_type", "deepseek_v3");
    load_deepseek_v3(f, c);
  } else {
    c.model_type = f.string_or("model_type", "qwen3_moe");
    load_qwen3_moe(f, root, c);
  }
  c.hidden_act = f.string_or("hidden_act", "silu");
  MEGAMOE_CHECK(c.hidden_act == "silu", kUnsupported, "'", file, "': hidden_act '", c.hidden_act,
                "' is not supported; the experts' activation must be silu (SwiGLU).");

  std::optional<QuantFormat> from_config;
  if (f.has("quantization_config")) {
    from_config = parse_quantization_config(root["quantization_config"], file);
  }
  std::optional<QuantFormat> from_hf_quant;
  const fs::path hf_quant_path = fs::path(dir) / "hf_quant_config.json";
  if (fs::exists(hf_quant_path, ec)) {
    from_hf_quant = parse_hf_quant_config(read_json_file(hf_quant_path, "quantization config"),
                                          hf_quant_path.string());
  }
  MEGAMOE_CHECK(!from_config || !from_hf_quant || *from_config == *from_hf_quant,
                kInvalidCheckpoint, "'", file, "' declares ",
                quant_format_name(from_config.value_or(QuantFormat::kUnquantized)), " but '",
                hf_quant_path.string(), "' declares ",
                quant_format_name(from_hf_quant.value_or(QuantFormat::kUnquantized)), ".");
  c.quant_format = from_config.value_or(from_hf_quant.value_or(QuantFormat::kUnquantized));
  return c;
}

}  // namespace megamoe
