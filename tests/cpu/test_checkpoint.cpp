// Checkpoints: single files, directories and sharded index.json sets; HF config.json of both
// supported architectures and the NVFP4 quantization formats; the MoE layer loader on tiny
// hand-built ModelOpt and compressed-tensors checkpoints (H=32, I=16, E=4) with random codes,
// random valid ue4m3 scales and a different global scale per projection; MoeLayer::validate.

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "megamoe/reference.h"

#include "megamoe/checkpoint.h"
#include "megamoe/dtype.h"
#include "megamoe/moe.h"
#include "megamoe/safetensors.h"
#include "megamoe/status.h"
#include "tests/common/error_matchers.h"
#include "tests/common/test_util.h"

namespace {

namespace fs = std::filesystem;
using megamoe::Checkpoint;
using megamoe::DType;
using megamoe::Error;
using megamoe::ErrorCode;
using megamoe::ModelConfig;
using megamoe::MoeLayer;
using megamoe::Nvfp4Linear;
using megamoe::QuantFormat;
using megamoe::RoutingKind;
using megamoe::TensorSpec;
using nlohmann::json;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();


// ---- building checkpoints in memory

struct Tensor {
  DType dtype = DType::U8;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
using TensorMap = std::map<std::string, Tensor>;

template <typename T>
std::vector<uint8_t> as_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

Tensor f32_tensor(std::vector<float> v, std::vector<int64_t> shape) {
  return {DType::F32, std::move(shape), as_bytes(v)};
}

void write_tensors(const std::string& path, const TensorMap& tensors) {
  std::vector<std::pair<TensorSpec, std::span<const uint8_t>>> list;
  for (const auto& [name, t] : tensors) list.emplace_back(TensorSpec{name, t.dtype, t.shape}, t.bytes);
  megamoe::write_safetensors(path, list);
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

enum class Layout { kModelOpt, kCompressedTensors };

// One NVFP4 linear as the test generated it.
struct LinearData {
  int64_t out = 0, in = 0;
  std::vector<uint8_t> codes;   // [out, in/2]
  std::vector<uint8_t> scales;  // [out, in/16]
  float weight_scale_2 = 1.0f;  // ModelOpt meaning
  float input_scale = 0.0f;
};

// The same linear as the loader must see it in each layout: compressed-tensors stores 1/s.
float expected_scale(float s, Layout layout) {
  return layout == Layout::kModelOpt ? s : 1.0f / (1.0f / s);
}

void add_linear(TensorMap& m, const std::string& p, const LinearData& d, Layout layout,
                bool scalar_as_1d) {
  const std::vector<int64_t> scalar = scalar_as_1d ? std::vector<int64_t>{1} : std::vector<int64_t>{};
  const bool mo = layout == Layout::kModelOpt;
  m[p + (mo ? ".weight" : ".weight_packed")] = {DType::U8, {d.out, d.in / 2}, d.codes};
  m[p + ".weight_scale"] = {DType::F8_E4M3, {d.out, d.in / 16}, d.scales};
  if (mo) {
    m[p + ".weight_scale_2"] = f32_tensor({d.weight_scale_2}, scalar);
    m[p + ".input_scale"] = f32_tensor({d.input_scale}, scalar);
  } else {
    m[p + ".weight_global_scale"] = f32_tensor({1.0f / d.weight_scale_2}, scalar);
    m[p + ".input_global_scale"] = f32_tensor({1.0f / d.input_scale}, scalar);
  }
}

// Random test data: every byte of the codes random, block scales random over all valid ue4m3
// codes (subnormals included), global scales log-uniform so each projection gets its own.
class Rng {
 public:
  explicit Rng(uint32_t seed) : gen_(seed) {}
  uint8_t byte() { return static_cast<uint8_t>(gen_()); }
  uint8_t valid_ue4m3() {
    for (;;) {
      const uint8_t b = byte() & 0x7F;
      if (b != 0x7F) return b;
    }
  }
  float log_uniform(float lo_exp, float hi_exp) {
    return std::exp2(std::uniform_real_distribution<float>(lo_exp, hi_exp)(gen_));
  }
  int uniform_int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen_); }
  LinearData linear(int64_t out, int64_t in) {
    LinearData d;
    d.out = out;
    d.in = in;
    d.codes.resize(static_cast<size_t>(out * in / 2));
    for (auto& b : d.codes) b = byte();
    d.scales.resize(static_cast<size_t>(out * in / 16));
    for (auto& b : d.scales) b = valid_ue4m3();
    d.weight_scale_2 = log_uniform(-14, -4);
    d.input_scale = log_uniform(-12, -2);
    return d;
  }
  // k * 2^-7 with |k| < 256: exactly representable in bf16 and f16, so widening must return it.
  float exact_small() { return static_cast<float>(uniform_int(-255, 255)) / 128.0f; }

 private:
  std::mt19937 gen_;
};

constexpr int64_t kH = 32, kI = 16, kE = 4;
constexpr int kLayer = 1;
const std::string kMlp = "model.layers.1.mlp";

json deepseek_config() {
  return json{{"architectures", {"DeepseekV3ForCausalLM"}},
              {"model_type", "deepseek_v3"},
              {"hidden_size", kH},
              {"moe_intermediate_size", kI},
              {"n_routed_experts", kE},
              {"num_experts_per_tok", 2},
              {"n_shared_experts", 2},
              {"num_hidden_layers", 3},
              {"first_k_dense_replace", 1},
              {"moe_layer_freq", 1},
              {"norm_topk_prob", true},
              {"scoring_func", "sigmoid"},
              {"topk_method", "noaux_tc"},
              {"n_group", 2},
              {"topk_group", 1},
              {"routed_scaling_factor", 2.5},
              {"hidden_act", "silu"}};
}

json qwen3_config() {
  return json{{"architectures", {"Qwen3MoeForCausalLM"}},
              {"model_type", "qwen3_moe"},
              {"hidden_size", kH},
              {"moe_intermediate_size", kI},
              {"num_experts", kE},
              {"num_experts_per_tok", 2},
              {"norm_topk_prob", true},
              {"decoder_sparse_step", 1},
              {"mlp_only_layers", {0}},
              {"num_hidden_layers", 3},
              {"hidden_act", "silu"}};
}

// A MoE layer's worth of random data and the expected widened router parameters.
struct LayerData {
  std::vector<std::array<LinearData, 3>> experts;  // gate, up, down
  std::optional<std::array<LinearData, 3>> shared;
  std::vector<float> router;  // [E, H], exact in the stored dtype
  std::vector<float> bias;    // [E]
};

LayerData random_layer(Rng& rng, int64_t shared_i) {
  LayerData d;
  for (int64_t e = 0; e < kE; ++e) {
    d.experts.push_back({rng.linear(kI, kH), rng.linear(kI, kH), rng.linear(kH, kI)});
  }
  if (shared_i > 0) {
    d.shared = std::array{rng.linear(shared_i, kH), rng.linear(shared_i, kH),
                          rng.linear(kH, shared_i)};
  }
  for (int64_t i = 0; i < kE * kH; ++i) d.router.push_back(rng.exact_small());
  for (int64_t i = 0; i < kE; ++i) d.bias.push_back(rng.exact_small());
  return d;
}

std::vector<uint8_t> encode(const std::vector<float>& v, DType t) {
  std::vector<uint8_t> out;
  for (float x : v) {
    if (t == DType::F32) {
      const auto b = as_bytes(std::vector<float>{x});
      out.insert(out.end(), b.begin(), b.end());
    } else {
      const uint16_t h = t == DType::BF16 ? megamoe::f32_to_bf16(x) : megamoe::f32_to_f16(x);
      out.push_back(static_cast<uint8_t>(h));
      out.push_back(static_cast<uint8_t>(h >> 8));
    }
  }
  return out;
}

TensorMap layer_tensors(const LayerData& d, Layout layout, DType router_dtype = DType::BF16,
                        DType bias_dtype = DType::F32) {
  TensorMap m;
  const char* names[] = {"gate_proj", "up_proj", "down_proj"};
  for (size_t e = 0; e < d.experts.size(); ++e) {
    for (int j = 0; j < 3; ++j) {
      add_linear(m, kMlp + ".experts." + std::to_string(e) + "." + names[j], d.experts[e][j],
                 layout, (e + j) % 2 == 1);
    }
  }
  if (d.shared) {
    for (int j = 0; j < 3; ++j) {
      add_linear(m, kMlp + ".shared_experts." + names[j], (*d.shared)[j], layout, j == 1);
    }
  }
  m[kMlp + ".gate.weight"] = {router_dtype, {kE, kH}, encode(d.router, router_dtype)};
  m[kMlp + ".gate.e_score_correction_bias"] = {bias_dtype, {kE}, encode(d.bias, bias_dtype)};
  return m;
}

// A fresh directory per test, removed at the end, and a fresh seed named in every failure.
class CheckpointTest : public testing::Test {
 protected:
  // dir_/name/{model.safetensors, config.json}; returns the directory.
  std::string write_checkpoint(const std::string& name, const TensorMap& tensors,
                               const json& config) {
    const fs::path d = dir_ / name;
    fs::create_directories(d);
    write_tensors((d / "model.safetensors").string(), tensors);
    write_text(d / "config.json", config.dump(2));
    return d.string();
  }

  // dir_/name/config.json (and hf_quant_config.json when given); returns the directory.
  std::string write_config(const std::string& name, const std::string& config,
                           const std::optional<std::string>& hf_quant = std::nullopt) {
    const fs::path d = dir_ / name;
    fs::create_directories(d);
    write_text(d / "config.json", config);
    if (hf_quant) write_text(d / "hf_quant_config.json", *hf_quant);
    return d.string();
  }

  static MoeLayer load(const std::string& dir, int64_t layer = kLayer) {
    return megamoe::load_moe_layer(Checkpoint::open(dir), megamoe::load_model_config(dir), layer);
  }

  const megamoe::testing::ScratchDir scratch_{"megamoe_ckpt"};
  const fs::path dir_ = scratch_.path();
  const megamoe::testing::SeedTrace seed_;
  Rng rng_{static_cast<uint32_t>(seed_)};
};

void expect_linear(const Nvfp4Linear& got, const LinearData& want, Layout layout,
                   const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(got.out_features, want.out);
  EXPECT_EQ(got.in_features, want.in);
  ASSERT_NE(got.weight, nullptr);
  ASSERT_NE(got.weight_scale, nullptr);
  EXPECT_EQ(std::memcmp(got.weight, want.codes.data(), want.codes.size()), 0);
  EXPECT_EQ(std::memcmp(got.weight_scale, want.scales.data(), want.scales.size()), 0);
  EXPECT_EQ(got.weight_scale_2, expected_scale(want.weight_scale_2, layout));
  EXPECT_EQ(got.input_scale, expected_scale(want.input_scale, layout));
  EXPECT_NE(got.owner, nullptr);
}

// =============================================================================================
// Checkpoint::open

using CheckpointOpen = CheckpointTest;

TEST_F(CheckpointOpen, SingleFileFindGetAndNames) {
  const std::string p = (dir_ / "one.safetensors").string();
  const auto a = rng_.linear(2, 16).codes;
  write_tensors(p, {{"z.w", {DType::U8, {2, 8}, a}}, {"a.b", f32_tensor({1.5f, -2.0f}, {2})}});
  const Checkpoint c = Checkpoint::open(p);
  EXPECT_EQ(c.path(), p);
  EXPECT_EQ(c.files().size(), 1u);
  EXPECT_EQ(c.tensor_names(), (std::vector<std::string>{"a.b", "z.w"}));
  const auto ref = c.find("z.w");
  ASSERT_TRUE(ref.has_value());
  EXPECT_EQ(ref->info->name, "z.w");
  EXPECT_EQ(ref->file->path(), p);
  EXPECT_TRUE(std::equal(ref->bytes.begin(), ref->bytes.end(), a.begin(), a.end()));
  EXPECT_FALSE(c.find("z").has_value());
  EXPECT_FALSE(c.find("zz.w").has_value());
  EXPECT_EQ(c.get("a.b").info->shape, std::vector<int64_t>{2});
  EXPECT_MEGAMOE_ERROR(c.get("missing.weight"), kNotFound, "'missing.weight'", p);
}

TEST_F(CheckpointOpen, DirectoryWithOneFile) {
  write_tensors((dir_ / "weights.safetensors").string(), {{"t", f32_tensor({3.0f}, {})}});
  write_text(dir_ / "config.json", "{}");
  const Checkpoint c = Checkpoint::open(dir_.string());
  EXPECT_EQ(c.tensor_names(), std::vector<std::string>{"t"});
  EXPECT_EQ(c.get("t").file->path(), (dir_ / "weights.safetensors").string());
}

TEST_F(CheckpointOpen, RejectsAmbiguousEmptyAndMissing) {
  EXPECT_MEGAMOE_ERROR(Checkpoint::open(dir_.string()), kNotFound, dir_.string(),
                       "no model.safetensors.index.json and no *.safetensors");
  write_tensors((dir_ / "a.safetensors").string(), {});
  write_tensors((dir_ / "b.safetensors").string(), {});
  EXPECT_MEGAMOE_ERROR(Checkpoint::open(dir_.string()), kInvalidCheckpoint, dir_.string(),
                       "2 *.safetensors files (a.safetensors, b.safetensors)",
                       "no model.safetensors.index.json");
  const std::string absent = (dir_ / "nope").string();
  EXPECT_MEGAMOE_ERROR(Checkpoint::open(absent), kNotFound, absent, "does not exist");
  // A corrupt file is reported by the reader, naming the file.
  const std::string bad = (dir_ / "bad.bin").string();
  write_text(bad, "abc");
  EXPECT_MEGAMOE_ERROR(Checkpoint::open(bad), kInvalidCheckpoint, bad, "truncated");
}

// Three shards; each linear's weight and its scales sit in different shards.
TEST_F(CheckpointOpen, ShardedIndex) {
  const LinearData d = rng_.linear(kI, kH);
  TensorMap all;
  add_linear(all, "m.proj", d, Layout::kModelOpt, false);
  all["m.other"] = f32_tensor({0.25f}, {1});
  json weight_map = json::object();
  std::map<std::string, TensorMap> shards;
  int i = 0;
  for (const auto& [name, t] : all) {
    const std::string shard = "model-0000" + std::to_string(i % 3 + 1) + "-of-00003.safetensors";
    shards[shard][name] = t;
    weight_map[name] = shard;
    ++i;
  }
  for (const auto& [shard, tensors] : shards) write_tensors((dir_ / shard).string(), tensors);
  // A tensor present in a shard but absent from weight_map is not part of the checkpoint.
  shards.begin()->second["unlisted"] = f32_tensor({1.0f}, {});
  write_tensors((dir_ / shards.begin()->first).string(), shards.begin()->second);
  write_text(dir_ / "model.safetensors.index.json",
             json{{"metadata", {{"total_size", 1234}}}, {"weight_map", weight_map}}.dump());

  std::optional<Checkpoint> c = Checkpoint::open(dir_.string());
  EXPECT_EQ(c->files().size(), 3u);
  std::vector<std::string> names;
  for (const auto& [name, t] : all) names.push_back(name);
  EXPECT_EQ(c->tensor_names(), names);
  EXPECT_FALSE(c->find("unlisted").has_value());
  for (const auto& [name, t] : all) {
    const auto ref = c->get(name);
    EXPECT_EQ(ref.file->path(), (dir_ / weight_map[name].get<std::string>()).string());
    EXPECT_TRUE(std::equal(ref.bytes.begin(), ref.bytes.end(), t.bytes.begin(), t.bytes.end()))
        << name;
  }
  const Nvfp4Linear lin = megamoe::load_nvfp4_linear(*c, "m.proj", kI, kH);
  EXPECT_NE(c->get("m.proj.weight").file, c->get("m.proj.weight_scale").file);
  // The linear keeps both of its shards mapped after the checkpoint is gone.
  c.reset();
  expect_linear(lin, d, Layout::kModelOpt, "m.proj");
}

TEST_F(CheckpointOpen, IndexErrors) {
  write_tensors((dir_ / "s1.safetensors").string(), {{"a", f32_tensor({1.0f}, {})}});
  const fs::path index = dir_ / "model.safetensors.index.json";
  const std::string ip = index.string();

  write_text(index, json{{"weight_map", {{"a", "s1.safetensors"}, {"b", "s2.safetensors"}}}}.dump());
  EXPECT_MEGAMOE_ERROR(Checkpoint::open(dir_.string()), kNotFound, "s2.safetensors", ip,
                       "tensor 'b'", "does not exist");

  write_text(index, json{{"weight_map", {{"a", "s1.safetensors"}, {"c", "s1.safetensors"}}}}.dump());
  EXPECT_MEGAMOE_ERROR(Checkpoint::open(dir_.string()), kInvalidCheckpoint, ip, "tensor 'c'",
                       "s1.safetensors", "does not contain it");

  write_text(index, "{\"weight_map\": {");
  EXPECT_MEGAMOE_ERROR(Checkpoint::open(dir_.string()), kInvalidCheckpoint, ip, "not valid JSON");

  write_text(index, json{{"metadata", json::object()}}.dump());
  EXPECT_MEGAMOE_ERROR(Checkpoint::open(dir_.string()), kInvalidCheckpoint, ip, "weight_map");

  write_text(index, json{{"weight_map", json::array({"a", "s1.safetensors"})}}.dump());
  EXPECT_MEGAMOE_ERROR(Checkpoint::open(dir_.string()), kInvalidCheckpoint, ip, "weight_map");

  write_text(index, json{{"weight_map", {{"a", 1}}}}.dump());
  EXPECT_MEGAMOE_ERROR(Checkpoint::open(dir_.string()), kInvalidCheckpoint, ip, "tensor 'a'",
                       "expected a shard file name");

  for (const char* shard : {"../s1.safetensors", "/etc/passwd", "sub/s1.safetensors", ".."}) {
    write_text(index, json{{"weight_map", {{"a", shard}}}}.dump());
    EXPECT_MEGAMOE_ERROR(Checkpoint::open(dir_.string()), kInvalidCheckpoint, ip, shard,
                         "plain file names");
  }
}

// =============================================================================================
// load_model_config

using ModelConfigTest = CheckpointTest;

TEST_F(ModelConfigTest, DeepseekV3) {
  json j = deepseek_config();
  // The real DeepSeek-V3 values.
  j.update({{"hidden_size", 7168}, {"moe_intermediate_size", 2048}, {"n_routed_experts", 256},
            {"num_experts_per_tok", 8}, {"n_shared_experts", 1}, {"num_hidden_layers", 61},
            {"first_k_dense_replace", 3}, {"n_group", 8}, {"topk_group", 4},
            {"routed_scaling_factor", 2.5}, {"vocab_size", 129280}});
  const ModelConfig c = megamoe::load_model_config(write_config("ds", j.dump()));
  EXPECT_EQ(c.architecture, "DeepseekV3ForCausalLM");
  EXPECT_EQ(c.model_type, "deepseek_v3");
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.num_hidden_layers, 61);
  EXPECT_EQ(c.first_k_dense_replace, 3);
  EXPECT_EQ(c.moe_layer_freq, 1);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.scoring_func, "sigmoid");
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_EQ(c.routed_scaling_factor, 2.5f);
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_FALSE(c.swiglu_limit.has_value());
  EXPECT_EQ(c.quant_format, QuantFormat::kUnquantized);

  for (int64_t l : {-1, 0, 1, 2, 61, 62}) EXPECT_FALSE(c.is_moe_layer(l)) << l;
  for (int64_t l : {3, 4, 30, 60}) EXPECT_TRUE(c.is_moe_layer(l)) << l;

  const megamoe::RoutingConfig r = c.routing();
  EXPECT_EQ(r.kind, RoutingKind::kNoauxTc);
  EXPECT_EQ(r.top_k, 8);
  EXPECT_TRUE(r.renormalize);
  EXPECT_EQ(r.n_group, 8);
  EXPECT_EQ(r.topk_group, 4);
  EXPECT_EQ(r.routed_scaling_factor, 2.5f);
}

TEST_F(ModelConfigTest, DeepseekV3LayerFrequencyLimitAndDefaults) {
  json j = deepseek_config();
  j.update({{"moe_layer_freq", 2}, {"first_k_dense_replace", 3}, {"num_hidden_layers", 10},
            {"norm_topk_prob", false}, {"swiglu_limit", 10}, {"routed_scaling_factor", 1}});
  const ModelConfig c = megamoe::load_model_config(write_config("freq", j.dump()));
  for (int64_t l = -2; l < 12; ++l) {
    EXPECT_EQ(c.is_moe_layer(l), l >= 3 && l < 10 && l % 2 == 0) << l;
  }
  ASSERT_TRUE(c.swiglu_limit.has_value());
  EXPECT_EQ(*c.swiglu_limit, 10.0f);
  EXPECT_FALSE(c.routing().renormalize);
  EXPECT_EQ(c.routing().routed_scaling_factor, 1.0f);

  // Fields HF gives defaults to take transformers' DeepseekV3Config defaults (null = absent).
  json minimal = {{"architectures", {"DeepseekV3ForCausalLM"}}, {"hidden_size", 7168},
                  {"moe_intermediate_size", 2048}, {"n_routed_experts", 256},
                  {"num_experts_per_tok", 8}, {"num_hidden_layers", 61},
                  {"swiglu_limit", nullptr}, {"quantization_config", nullptr}};
  const ModelConfig d = megamoe::load_model_config(write_config("defaults", minimal.dump()));
  EXPECT_EQ(d.model_type, "deepseek_v3");
  EXPECT_EQ(d.n_shared_experts, 1);
  EXPECT_EQ(d.first_k_dense_replace, 3);
  EXPECT_EQ(d.moe_layer_freq, 1);
  EXPECT_TRUE(d.norm_topk_prob);
  EXPECT_EQ(d.n_group, 8);
  EXPECT_EQ(d.topk_group, 4);
  EXPECT_EQ(d.routed_scaling_factor, 2.5f);
  EXPECT_EQ(d.scoring_func, "sigmoid");
  EXPECT_EQ(d.topk_method, "noaux_tc");
  EXPECT_FALSE(d.swiglu_limit.has_value());
  EXPECT_EQ(d.quant_format, QuantFormat::kUnquantized);
}

TEST_F(ModelConfigTest, Qwen3Moe) {
  json j = qwen3_config();
  j.update({{"hidden_size", 4096}, {"moe_intermediate_size", 1536}, {"num_experts", 128},
            {"num_experts_per_tok", 8}, {"num_hidden_layers", 12}, {"decoder_sparse_step", 2},
            {"mlp_only_layers", {3, 7}}});
  const ModelConfig c = megamoe::load_model_config(write_config("qwen", j.dump()));
  EXPECT_EQ(c.architecture, "Qwen3MoeForCausalLM");
  EXPECT_EQ(c.model_type, "qwen3_moe");
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.moe_intermediate_size, 1536);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.n_shared_experts, 0);
  EXPECT_EQ(c.decoder_sparse_step, 2);
  EXPECT_EQ(c.mlp_only_layers, (std::vector<int64_t>{3, 7}));
  EXPECT_TRUE(c.norm_topk_prob);
  for (int64_t l = -2; l < 14; ++l) {
    const bool want = l >= 0 && l < 12 && l != 3 && l != 7 && (l + 1) % 2 == 0;
    EXPECT_EQ(c.is_moe_layer(l), want) << l;
  }
  const megamoe::RoutingConfig r = c.routing();
  EXPECT_EQ(r.kind, RoutingKind::kSoftmaxTopK);
  EXPECT_EQ(r.top_k, 8);
  EXPECT_TRUE(r.renormalize);
  EXPECT_EQ(r.routed_scaling_factor, 1.0f);

  // transformers 5 names the expert count num_local_experts.
  json v5 = qwen3_config();
  v5.erase("num_experts");
  v5["num_local_experts"] = 96;
  EXPECT_EQ(megamoe::load_model_config(write_config("qwen_v5", v5.dump())).num_experts, 96);

  // transformers' Qwen3MoeConfig defaults: norm_topk_prob false, every layer sparse.
  json minimal = {{"architectures", {"Qwen3MoeForCausalLM"}}, {"hidden_size", 2048},
                  {"moe_intermediate_size", 768}, {"num_experts", 128},
                  {"num_experts_per_tok", 8}, {"num_hidden_layers", 48},
                  {"mlp_only_layers", nullptr}};
  const ModelConfig d = megamoe::load_model_config(write_config("qwen_min", minimal.dump()));
  EXPECT_FALSE(d.norm_topk_prob);
  EXPECT_FALSE(d.routing().renormalize);
  EXPECT_TRUE(d.mlp_only_layers.empty());
  for (int64_t l = 0; l < 48; ++l) EXPECT_TRUE(d.is_moe_layer(l)) << l;
}

TEST_F(ModelConfigTest, RejectsMissingAndMalformedFiles) {
  const std::string none = (dir_ / "none").string();
  EXPECT_MEGAMOE_ERROR(megamoe::load_model_config(none), kNotFound, "config.json",
                       "does not exist");
  std::string d = write_config("notjson", "{\"hidden_size\": ");
  EXPECT_MEGAMOE_ERROR(megamoe::load_model_config(d), kInvalidCheckpoint, d + "/config.json",
                       "not valid JSON");
  d = write_config("array", "[1]");
  EXPECT_MEGAMOE_ERROR(megamoe::load_model_config(d), kInvalidCheckpoint, d + "/config.json",
                       "JSON object");
}

TEST_F(ModelConfigTest, RejectsUnsupportedArchitectures) {
  json j = deepseek_config();
  j["architectures"] = {"LlamaForCausalLM"};
  std::string d = write_config("llama", j.dump());
  EXPECT_MEGAMOE_ERROR(megamoe::load_model_config(d), kUnsupported, d + "/config.json",
                       "LlamaForCausalLM", "DeepseekV3ForCausalLM, Qwen3MoeForCausalLM");
  j.erase("architectures");
  d = write_config("no_arch", j.dump());
  EXPECT_MEGAMOE_ERROR(megamoe::load_model_config(d), kInvalidCheckpoint, d + "/config.json",
                       "'architectures' is missing");
  j["architectures"] = "DeepseekV3ForCausalLM";
  d = write_config("arch_string", j.dump());
  EXPECT_MEGAMOE_ERROR(megamoe::load_model_config(d), kInvalidCheckpoint, "'architectures'",
                       "array of strings");

  ModelConfig unknown;
  unknown.architecture = "MixtralForCausalLM";
  unknown.num_hidden_layers = 4;
  EXPECT_MEGAMOE_ERROR(unknown.is_moe_layer(1), kUnsupported, "MixtralForCausalLM",
                       "DeepseekV3ForCausalLM, Qwen3MoeForCausalLM");
  EXPECT_MEGAMOE_ERROR(unknown.routing(), kUnsupported, "MixtralForCausalLM");
}

TEST_F(ModelConfigTest, RejectsMissingRequiredFields) {
  const std::pair<json, std::vector<const char*>> cases[] = {
      {deepseek_config(), {"hidden_size", "moe_intermediate_size", "n_routed_experts",
                           "num_experts_per_tok", "num_hidden_layers"}},
      {qwen3_config(), {"hidden_size", "moe_intermediate_size", "num_experts",
                        "num_experts_per_tok", "num_hidden_layers"}}};
  for (const auto& [base, fields] : cases) {
    for (const char* field : fields) {
      json j = base;
      j.erase(field);
      const std::string d = write_config(std::string("missing_") + field, j.dump());
      EXPECT_MEGAMOE_ERROR(megamoe::load_model_config(d), kInvalidCheckpoint, d + "/config.json",
                           std::string("field '") + field + "' is missing");
      j[field] = nullptr;
      write_config(std::string("missing_") + field, j.dump());
      EXPECT_MEGAMOE_ERROR(megamoe::load_model_config(d), kInvalidCheckpoint,
                           std::string("field '") + field + "' is missing");
    }
  }
}

TEST_F(ModelConfigTest, RejectsMistypedAndOutOfRangeFields) {
  struct Case {
    bool deepseek;
    const char* field;
    json value;
    ErrorCode code;
    std::vector<std::string> parts;
  };
  const Case cases[] = {
      {true, "hidden_size", "7168", ErrorCode::kInvalidCheckpoint, {"'hidden_size'", "must be an integer"}},
      {true, "hidden_size", 7168.0, ErrorCode::kInvalidCheckpoint, {"'hidden_size'", "must be an integer"}},
      {true, "hidden_size", 0, ErrorCode::kInvalidCheckpoint, {"'hidden_size' is 0", "allowed: 1 to"}},
      {true, "hidden_size", -32, ErrorCode::kInvalidCheckpoint, {"'hidden_size' is -32"}},
      {true, "hidden_size", 18446744073709551615ull, ErrorCode::kInvalidCheckpoint, {"'hidden_size'", "must be an integer"}},
      {true, "n_routed_experts", json::array(), ErrorCode::kInvalidCheckpoint, {"'n_routed_experts'", "must be an integer"}},
      {true, "num_experts_per_tok", 5, ErrorCode::kInvalidCheckpoint, {"num_experts_per_tok (5) exceeds n_routed_experts (4)"}},
      {true, "num_experts_per_tok", 0, ErrorCode::kInvalidCheckpoint, {"'num_experts_per_tok' is 0"}},
      {true, "n_shared_experts", -1, ErrorCode::kInvalidCheckpoint, {"'n_shared_experts' is -1"}},
      {true, "first_k_dense_replace", "1", ErrorCode::kInvalidCheckpoint, {"'first_k_dense_replace'", "integer"}},
      {true, "moe_layer_freq", 0, ErrorCode::kInvalidCheckpoint, {"'moe_layer_freq' is 0"}},
      {true, "norm_topk_prob", "true", ErrorCode::kInvalidCheckpoint, {"'norm_topk_prob'", "true or false"}},
      {true, "norm_topk_prob", 1, ErrorCode::kInvalidCheckpoint, {"'norm_topk_prob'", "true or false"}},
      {true, "routed_scaling_factor", "2.5", ErrorCode::kInvalidCheckpoint, {"'routed_scaling_factor'", "must be a number"}},
      {true, "routed_scaling_factor", 0, ErrorCode::kInvalidCheckpoint, {"'routed_scaling_factor'", "finite number > 0"}},
      {true, "routed_scaling_factor", 1e300, ErrorCode::kInvalidCheckpoint, {"'routed_scaling_factor'", "finite number > 0"}},
      {true, "swiglu_limit", -7, ErrorCode::kInvalidCheckpoint, {"'swiglu_limit'", "finite number > 0"}},
      {true, "scoring_func", 1, ErrorCode::kInvalidCheckpoint, {"'scoring_func'", "must be a string"}},
      {true, "scoring_func", "softmax", ErrorCode::kUnsupported, {"scoring_func 'softmax'", "sigmoid", "noaux_tc"}},
      {true, "topk_method", "greedy", ErrorCode::kUnsupported, {"topk_method 'greedy'"}},
      {true, "n_group", 0, ErrorCode::kInvalidCheckpoint, {"'n_group' is 0"}},
      {true, "n_group", 3, ErrorCode::kInvalidCheckpoint, {"n_routed_experts (4) is not a multiple of n_group (3)"}},
      {true, "topk_group", 3, ErrorCode::kInvalidCheckpoint, {"topk_group (3) exceeds n_group (2)"}},
      {true, "hidden_act", "gelu", ErrorCode::kUnsupported, {"hidden_act 'gelu'", "silu"}},
      {true, "model_type", 3, ErrorCode::kInvalidCheckpoint, {"'model_type'", "must be a string"}},
      {false, "num_experts", 0, ErrorCode::kInvalidCheckpoint, {"'num_experts' is 0"}},
      {false, "num_experts_per_tok", 9, ErrorCode::kInvalidCheckpoint, {"num_experts_per_tok (9) exceeds num_experts (4)"}},
      {false, "decoder_sparse_step", 0, ErrorCode::kInvalidCheckpoint, {"'decoder_sparse_step' is 0"}},
      {false, "mlp_only_layers", {0, -1}, ErrorCode::kInvalidCheckpoint, {"'mlp_only_layers'", "non-negative layer indices"}},
      {false, "mlp_only_layers", 3, ErrorCode::kInvalidCheckpoint, {"'mlp_only_layers'"}},
      {false, "norm_topk_prob", "yes", ErrorCode::kInvalidCheckpoint, {"'norm_topk_prob'"}},
      {false, "hidden_act", "relu", ErrorCode::kUnsupported, {"hidden_act 'relu'"}},
  };
  int n = 0;
  for (const Case& c : cases) {
    json j = c.deepseek ? deepseek_config() : qwen3_config();
    j[c.field] = c.value;
    const std::string d = write_config("case" + std::to_string(n++), j.dump());
    SCOPED_TRACE(std::string(c.field) + " = " + c.value.dump());
    try {
      megamoe::load_model_config(d);
      ADD_FAILURE() << "did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), c.code) << e.what();
      EXPECT_NE(std::string(e.what()).find(d + "/config.json"), std::string::npos) << e.what();
      for (const auto& p : c.parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  }
  // top_k larger than the experts of the topk_group best groups (2 groups of 2, top-1 group).
  json j = deepseek_config();
  j["num_experts_per_tok"] = 3;
  const std::string d = write_config("selectable", j.dump());
  EXPECT_MEGAMOE_ERROR(megamoe::load_model_config(d), kInvalidCheckpoint,
                       "num_experts_per_tok (3) exceeds the 2 experts");
}

TEST_F(ModelConfigTest, QuantizationFormats) {
  const json modelopt = {{"quant_method", "modelopt"},
                         {"quant_algo", "NVFP4"},
                         {"config_groups",
                          {{"group_0",
                            {{"weights", {{"num_bits", 4}, {"type", "float"}, {"group_size", 16}}},
                             {"targets", {"Linear"}}}}}},
                         {"ignore", {"lm_head"}}};
  const json compressed = {
      {"quant_method", "compressed-tensors"},
      {"format", "nvfp4-pack-quantized"},
      {"config_groups",
       {{"group_0",
         {{"weights", {{"num_bits", 4}, {"type", "float"}, {"strategy", "tensor_group"},
                       {"group_size", 16}, {"symmetric", true}}},
          {"input_activations", {{"num_bits", 4}, {"type", "float"}, {"group_size", 16}}},
          {"targets", {"Linear"}}}}}}};
  const std::string hf_quant =
      json{{"producer", {{"name", "modelopt"}}},
           {"quantization", {{"quant_algo", "NVFP4"}, {"kv_cache_quant_algo", nullptr},
                             {"group_size", 16}, {"exclude_modules", {"lm_head", "*.mlp.gate"}}}}}
          .dump();
  const auto config_with = [&](const json& qc) {
    json j = deepseek_config();
    j["quantization_config"] = qc;
    return j.dump();
  };
  int n = 0;
  const auto load = [&](const std::string& config, const std::optional<std::string>& hq) {
    return megamoe::load_model_config(write_config("q" + std::to_string(n++), config, hq));
  };

  EXPECT_EQ(load(config_with(modelopt), std::nullopt).quant_format, QuantFormat::kModelOptNvfp4);
  EXPECT_EQ(load(config_with(modelopt), hf_quant).quant_format, QuantFormat::kModelOptNvfp4);
  EXPECT_EQ(load(deepseek_config().dump(), hf_quant).quant_format, QuantFormat::kModelOptNvfp4);
  EXPECT_EQ(load(config_with(compressed), std::nullopt).quant_format,
            QuantFormat::kCompressedTensorsNvfp4);
  EXPECT_EQ(load(deepseek_config().dump(), std::nullopt).quant_format, QuantFormat::kUnquantized);

  struct Bad {
    std::string config;
    std::optional<std::string> hf_quant;
    ErrorCode code;
    std::vector<std::string> parts;
  };
  json modelopt_fp8 = modelopt;
  modelopt_fp8["quant_algo"] = "FP8";
  json modelopt_g32 = modelopt;
  modelopt_g32["config_groups"]["group_0"]["weights"]["group_size"] = 32;
  json ct_int4 = compressed;
  ct_int4["config_groups"]["group_0"]["weights"]["type"] = "int";
  json ct_fp8 = compressed;
  ct_fp8["config_groups"]["group_0"]["weights"]["num_bits"] = 8;
  json ct_g32 = compressed;
  ct_g32["config_groups"]["group_0"]["weights"]["group_size"] = 32;
  json ct_no_group = compressed;
  ct_no_group["config_groups"]["group_0"]["weights"].erase("group_size");
  json ct_no_groups = compressed;
  ct_no_groups.erase("config_groups");
  const json fp8 = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"weight_block_size", {128, 128}}};
  const json no_method = {{"quant_algo", "NVFP4"}};
  const auto hq = [](const json& q) { return json{{"quantization", q}}.dump(); };

  const Bad bad[] = {
      {config_with(modelopt_fp8), std::nullopt, ErrorCode::kUnsupported, {"quant_algo 'FP8'", "NVFP4"}},
      {config_with(modelopt_g32), std::nullopt, ErrorCode::kUnsupported, {"group_size 32", "16"}},
      {config_with(ct_int4), std::nullopt, ErrorCode::kUnsupported, {"4-bit int", "not NVFP4"}},
      {config_with(ct_fp8), std::nullopt, ErrorCode::kUnsupported, {"8-bit float", "not NVFP4"}},
      {config_with(ct_g32), std::nullopt, ErrorCode::kUnsupported, {"group_size 32"}},
      {config_with(ct_no_group), std::nullopt, ErrorCode::kInvalidCheckpoint, {"group_size' is missing"}},
      {config_with(ct_no_groups), std::nullopt, ErrorCode::kInvalidCheckpoint, {"config_groups' is missing"}},
      {config_with(fp8), std::nullopt, ErrorCode::kUnsupported, {"quant_method 'fp8'", "modelopt", "compressed-tensors"}},
      {config_with(no_method), std::nullopt, ErrorCode::kInvalidCheckpoint, {"quantization_config.quant_method' is missing"}},
      {config_with("NVFP4"), std::nullopt, ErrorCode::kInvalidCheckpoint, {"'quantization_config' must be a JSON object"}},
      {deepseek_config().dump(), hq({{"quant_algo", "FP8"}}), ErrorCode::kUnsupported, {"hf_quant_config.json", "quant_algo 'FP8'"}},
      {deepseek_config().dump(), hq({{"quant_algo", "NVFP4"}, {"group_size", 32}}), ErrorCode::kUnsupported, {"hf_quant_config.json", "group_size 32"}},
      {deepseek_config().dump(), hq({{"quant_algo", "NVFP4"}, {"group_size", "16"}}), ErrorCode::kInvalidCheckpoint, {"hf_quant_config.json", "group_size", "integer"}},
      {deepseek_config().dump(), hq({{"quant_algo", "NVFP4"}, {"exclude_modules", "lm_head"}}), ErrorCode::kInvalidCheckpoint, {"hf_quant_config.json", "exclude_modules", "array of strings"}},
      {deepseek_config().dump(), hq({{"group_size", 16}}), ErrorCode::kInvalidCheckpoint, {"hf_quant_config.json", "quant_algo' is missing"}},
      {deepseek_config().dump(), json{{"producer", 1}}.dump(), ErrorCode::kInvalidCheckpoint, {"hf_quant_config.json", "'quantization' is missing"}},
      {deepseek_config().dump(), std::string("{"), ErrorCode::kInvalidCheckpoint, {"hf_quant_config.json", "not valid JSON"}},
      {config_with(compressed), hf_quant, ErrorCode::kInvalidCheckpoint, {"declares compressed-tensors-nvfp4", "declares modelopt-nvfp4"}},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.config + " / " + b.hf_quant.value_or("no hf_quant_config.json"));
    try {
      load(b.config, b.hf_quant);
      ADD_FAILURE() << "did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), b.code) << e.what();
      for (const auto& p : b.parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  }
}

// =============================================================================================
// load_moe_layer / load_nvfp4_linear

using LoadMoeLayer = CheckpointTest;

void expect_layer(const MoeLayer& got, const LayerData& want, Layout layout) {
  ASSERT_EQ(got.experts.size(), want.experts.size());
  const char* names[] = {"gate", "up", "down"};
  for (size_t e = 0; e < want.experts.size(); ++e) {
    const Nvfp4Linear* lins[] = {&got.experts[e].gate, &got.experts[e].up, &got.experts[e].down};
    for (int j = 0; j < 3; ++j) {
      expect_linear(*lins[j], want.experts[e][j], layout,
                    "expert " + std::to_string(e) + " " + names[j]);
    }
  }
  ASSERT_EQ(got.shared_expert.has_value(), want.shared.has_value());
  if (want.shared) {
    expect_linear(got.shared_expert->gate, (*want.shared)[0], layout, "shared gate");
    expect_linear(got.shared_expert->up, (*want.shared)[1], layout, "shared up");
    expect_linear(got.shared_expert->down, (*want.shared)[2], layout, "shared down");
  }
  EXPECT_EQ(got.router_weight, want.router);
}

TEST_F(LoadMoeLayer, ModelOptDeepseekLoadsBytesInPlace) {
  const LayerData d = random_layer(rng_, 2 * kI);  // n_shared_experts = 2
  const std::string dir = write_checkpoint("mo", layer_tensors(d, Layout::kModelOpt), deepseek_config());
  const Checkpoint ckpt = Checkpoint::open(dir);
  const MoeLayer layer = megamoe::load_moe_layer(ckpt, megamoe::load_model_config(dir), kLayer);
  EXPECT_EQ(layer.hidden_size, kH);
  EXPECT_EQ(layer.intermediate_size, kI);
  EXPECT_EQ(layer.num_experts, kE);
  expect_layer(layer, d, Layout::kModelOpt);
  EXPECT_EQ(layer.shared_expert->intermediate_size(), 2 * kI);
  EXPECT_EQ(layer.e_score_correction_bias, d.bias);
  EXPECT_EQ(layer.routing.kind, RoutingKind::kNoauxTc);
  EXPECT_EQ(layer.routing.top_k, 2);
  EXPECT_EQ(layer.routing.n_group, 2);
  EXPECT_EQ(layer.routing.topk_group, 1);
  EXPECT_EQ(layer.routing.routed_scaling_factor, 2.5f);
  EXPECT_TRUE(layer.routing.renormalize);
  EXPECT_FALSE(layer.swiglu_limit.has_value());
  // No copy: the codes point into the mapped file.
  const auto ref = ckpt.get(kMlp + ".experts.3.down_proj.weight");
  EXPECT_EQ(layer.experts[3].down.weight, ref.bytes.data());
  EXPECT_EQ(layer.experts[3].down.owner.get(), static_cast<const void*>(ref.file.get()));
  // Gate and up of an expert keep their own global scales.
  EXPECT_NE(layer.experts[0].gate.weight_scale_2, layer.experts[0].up.weight_scale_2);
}

TEST_F(LoadMoeLayer, CompressedTensorsMatchesModelOpt) {
  const LayerData d = random_layer(rng_, 2 * kI);
  json config = deepseek_config();
  config["swiglu_limit"] = 7.5;
  const MoeLayer mo = load(write_checkpoint("mo", layer_tensors(d, Layout::kModelOpt), config));
  const MoeLayer ct =
      load(write_checkpoint("ct", layer_tensors(d, Layout::kCompressedTensors), config));
  expect_layer(ct, d, Layout::kCompressedTensors);
  ASSERT_TRUE(ct.swiglu_limit.has_value());
  EXPECT_EQ(*ct.swiglu_limit, 7.5f);
  // Both layouts give bit-identical codes and scales; global scales differ at most by the
  // rounding of the stored reciprocal.
  for (int64_t e = 0; e < kE; ++e) {
    for (auto proj : {&megamoe::ExpertWeights::gate, &megamoe::ExpertWeights::up,
                      &megamoe::ExpertWeights::down}) {
      const Nvfp4Linear& a = mo.experts[e].*proj;
      const Nvfp4Linear& b = ct.experts[e].*proj;
      EXPECT_EQ(std::memcmp(a.weight, b.weight, size_t(a.out_features * a.in_features / 2)), 0);
      EXPECT_EQ(std::memcmp(a.weight_scale, b.weight_scale, size_t(a.out_features * a.in_features / 16)), 0);
      EXPECT_NEAR(a.weight_scale_2, b.weight_scale_2, a.weight_scale_2 * 2e-7f);
    }
  }
}

// compressed-tensors' stored 2688/amax style scale becomes ModelOpt's multiplier by 1/g.
TEST_F(LoadMoeLayer, CompressedTensorsReciprocalIsExact) {
  TensorMap m;
  const LinearData d = rng_.linear(kI, kH);
  add_linear(m, "p", d, Layout::kCompressedTensors, false);
  const float g = rng_.log_uniform(6, 14);
  m["p.weight_global_scale"] = f32_tensor({g}, {});
  m["p.input_global_scale"] = f32_tensor({448.0f}, {1});
  const std::string f = (dir_ / "ct.safetensors").string();
  write_tensors(f, m);
  const Nvfp4Linear lin = megamoe::load_nvfp4_linear(Checkpoint::open(f), "p", kI, kH);
  EXPECT_EQ(lin.weight_scale_2, 1.0f / g);
  EXPECT_EQ(lin.input_scale, 1.0f / 448.0f);
}

TEST_F(LoadMoeLayer, Qwen3SoftmaxWithF32Router) {
  const LayerData d = random_layer(rng_, 0);
  TensorMap m = layer_tensors(d, Layout::kModelOpt, DType::F32);
  // Qwen3 has no correction bias; an extra tensor in the file is simply not used.
  const MoeLayer layer = load(write_checkpoint("qwen", m, qwen3_config()));
  expect_layer(layer, d, Layout::kModelOpt);
  EXPECT_TRUE(layer.e_score_correction_bias.empty());
  EXPECT_EQ(layer.routing.kind, RoutingKind::kSoftmaxTopK);
  EXPECT_TRUE(layer.routing.renormalize);
  EXPECT_EQ(layer.routing.routed_scaling_factor, 1.0f);

  // Without router and without input scales the layer still loads (callers may route).
  for (auto it = m.begin(); it != m.end();) {
    const bool drop = it->first.find(".gate.") != std::string::npos ||
                      it->first.ends_with(".input_scale");
    it = drop ? m.erase(it) : std::next(it);
  }
  const MoeLayer bare = load(write_checkpoint("qwen_bare", m, qwen3_config()));
  EXPECT_TRUE(bare.router_weight.empty());
  EXPECT_EQ(bare.experts[2].up.input_scale, 0.0f);
}

TEST_F(LoadMoeLayer, RouterF16AndBiasBF16WidenExactly) {
  const LayerData d = random_layer(rng_, 2 * kI);
  const MoeLayer layer = load(write_checkpoint(
      "f16", layer_tensors(d, Layout::kModelOpt, DType::F16, DType::BF16), deepseek_config()));
  EXPECT_EQ(layer.router_weight, d.router);
  EXPECT_EQ(layer.e_score_correction_bias, d.bias);
}

TEST_F(LoadMoeLayer, RejectsMissingTensors) {
  const LayerData d = random_layer(rng_, 2 * kI);
  for (const Layout layout : {Layout::kModelOpt, Layout::kCompressedTensors}) {
    const bool mo = layout == Layout::kModelOpt;
    const TensorMap full = layer_tensors(d, layout);
    const std::string p = kMlp + ".experts.2.up_proj";
    for (const std::string& name :
         {p + ".weight_scale", p + (mo ? ".weight_scale_2" : ".weight_global_scale"),
          kMlp + ".shared_experts.down_proj.weight_scale"}) {
      TensorMap m = full;
      ASSERT_EQ(m.erase(name), 1u) << name;
      const std::string dir = write_checkpoint("missing", m, deepseek_config());
      EXPECT_MEGAMOE_ERROR(load(dir), kNotFound, dir, "no tensor '" + name + "'");
    }
    TensorMap m = full;
    m.erase(p + (mo ? ".weight" : ".weight_packed"));
    const std::string dir = write_checkpoint("missing_weight", m, deepseek_config());
    EXPECT_MEGAMOE_ERROR(load(dir), kNotFound, dir, "no NVFP4 weight for '" + p + "'",
                         "neither");
  }
}

TEST_F(LoadMoeLayer, RejectsWrongDtypes) {
  const LayerData d = random_layer(rng_, 2 * kI);
  const std::string p = kMlp + ".experts.1.gate_proj";
  const struct {
    std::string name;
    DType dtype;
    const char* expected;
  } cases[] = {{p + ".weight", DType::I8, "expected U8"},
               {p + ".weight_scale", DType::U8, "expected F8_E4M3"},
               {p + ".weight_scale", DType::F8_E5M2, "expected F8_E4M3"},
               {kMlp + ".gate.weight", DType::U8, "expected BF16 or F16 or F32"},
               {kMlp + ".gate.e_score_correction_bias", DType::I8, "expected F32 or BF16"}};
  for (const auto& c : cases) {
    TensorMap m = layer_tensors(d, Layout::kModelOpt);
    Tensor& t = m.at(c.name);
    int64_t numel = 1;
    for (int64_t x : t.shape) numel *= x;
    t.dtype = c.dtype;
    t.bytes.resize(static_cast<size_t>(numel * megamoe::dtype_size(c.dtype)), 0x22);
    const std::string dir = write_checkpoint("dtype", m, deepseek_config());
    EXPECT_MEGAMOE_ERROR(load(dir), kInvalidCheckpoint, dir, "'" + c.name + "'",
                         std::string("has dtype ") + megamoe::dtype_name(c.dtype), c.expected);
  }
  // A global scale must be F32, even when another dtype holds the same 4 bytes.
  TensorMap m = layer_tensors(d, Layout::kModelOpt);
  m[p + ".weight_scale_2"] = {DType::BF16, {2}, encode({0.5f, 0.5f}, DType::BF16)};
  const std::string dir = write_checkpoint("scalar_dtype", m, deepseek_config());
  EXPECT_MEGAMOE_ERROR(load(dir), kInvalidCheckpoint, p + ".weight_scale_2", "has dtype BF16",
                       "expected F32");
}

TEST_F(LoadMoeLayer, RejectsWrongShapes) {
  const LayerData d = random_layer(rng_, 2 * kI);
  const std::string p = kMlp + ".experts.0.down_proj";
  const auto reshape = [&](const std::string& name, std::vector<int64_t> shape,
                           const std::vector<std::string>& parts) {
    TensorMap m = layer_tensors(d, Layout::kModelOpt);
    Tensor& t = m.at(name);
    int64_t numel = 1;
    for (int64_t x : shape) numel *= x;
    t.bytes.resize(static_cast<size_t>(numel * megamoe::dtype_size(t.dtype)), 0x11);
    t.shape = std::move(shape);
    const std::string dir = write_checkpoint("shape", m, deepseek_config());
    try {
      load(dir);
      ADD_FAILURE() << name << ": did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidCheckpoint) << e.what();
      for (const auto& part : parts) {
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
      }
    }
  };
  reshape(p + ".weight", {kH, kI / 2 - 1}, {p + ".weight'", "has shape [32, 7]", "expected [32, 8]"});
  reshape(p + ".weight", {kI / 2, kH}, {"has shape [8, 32]", "expected [32, 8]"});
  reshape(p + ".weight", {kH * kI / 2}, {"has shape [256]"});
  reshape(p + ".weight_scale", {kH, 2}, {p + ".weight_scale'", "has shape [32, 2]", "expected [32, 1]"});
  reshape(p + ".weight_scale_2", {2}, {p + ".weight_scale_2'", "shape [2]", "expected a scalar"});
  reshape(p + ".weight_scale_2", {1, 1}, {"shape [1, 1]", "expected a scalar"});
  reshape(p + ".input_scale", {2}, {p + ".input_scale'", "expected a scalar"});
  reshape(kMlp + ".gate.weight", {kH, kE}, {".gate.weight'", "has shape [32, 4]", "expected [4, 32]"});
  reshape(kMlp + ".gate.e_score_correction_bias", {kE, 1}, {"has shape [4, 1]", "expected [4]"});
  // The shared expert's width comes from its tensors and must equal n_shared_experts * I.
  TensorMap m = layer_tensors(random_layer(rng_, kI), Layout::kModelOpt);
  const std::string dir = write_checkpoint("shared_width", m, deepseek_config());
  EXPECT_MEGAMOE_ERROR(load(dir), kInvalidCheckpoint, ".shared_experts.gate_proj.weight'",
                       "has 16 rows", "n_shared_experts (2) x moe_intermediate_size (16) = 32");
}

TEST_F(LoadMoeLayer, RejectsKNotMultipleOf16) {
  const LayerData d = random_layer(rng_, 2 * kI);
  json config = deepseek_config();
  config["hidden_size"] = 40;
  std::string dir = write_checkpoint("h40", layer_tensors(d, Layout::kModelOpt), config);
  EXPECT_MEGAMOE_ERROR(load(dir), kInvalidCheckpoint, dir, "hidden_size 40",
                       "multiple of the NVFP4 block size 16");
  config = deepseek_config();
  config["moe_intermediate_size"] = 24;
  dir = write_checkpoint("i24", layer_tensors(d, Layout::kModelOpt), config);
  EXPECT_MEGAMOE_ERROR(load(dir), kInvalidCheckpoint, "moe_intermediate_size 24");

  TensorMap m;
  m["p.weight"] = {DType::U8, {4, 20}, std::vector<uint8_t>(80, 0x21)};
  const std::string f = (dir_ / "k40.safetensors").string();
  write_tensors(f, m);
  const Checkpoint c = Checkpoint::open(f);
  EXPECT_MEGAMOE_ERROR(megamoe::load_nvfp4_linear(c, "p", 4, 40), kInvalidArgument, "'p'",
                       "in_features (K) 40", "multiple of the NVFP4 block size 16");
  EXPECT_MEGAMOE_ERROR(megamoe::load_nvfp4_linear(c, "p", 0, 32), kInvalidArgument, "'p'", ">= 1");
}

// Every one of the 256 scale bytes, at a random position of its own linear "p{byte}" (all in one
// file): only finite non-negative e4m3 codes load.
TEST_F(LoadMoeLayer, EveryScaleByte) {
  TensorMap m;
  std::array<int, 256> position{};
  for (int b = 0; b < 256; ++b) {
    LinearData d = rng_.linear(2, 32);  // 4 scale bytes: rows 0-1, blocks 0-1
    position[b] = rng_.uniform_int(0, 3);
    d.scales[position[b]] = static_cast<uint8_t>(b);
    add_linear(m, "p" + std::to_string(b), d, Layout::kModelOpt, false);
  }
  const std::string f = (dir_ / "scales.safetensors").string();
  write_tensors(f, m);
  const Checkpoint c = Checkpoint::open(f);
  for (int b = 0; b < 256; ++b) {
    const std::string p = "p" + std::to_string(b);
    const int at = position[b];
    // Valid ue4m3: sign clear and not the NaN code 0x7F (0x00, the zero scale, is valid).
    if (b < 0x7F) {
      const Nvfp4Linear lin = megamoe::load_nvfp4_linear(c, p, 2, 32);
      EXPECT_EQ(lin.weight_scale[at], b);
    } else {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "0x%02X", b);
      EXPECT_MEGAMOE_ERROR(megamoe::load_nvfp4_linear(c, p, 2, 32), kInvalidCheckpoint, f,
                           "'" + p + ".weight_scale'", hex,
                           "row " + std::to_string(at / 2) + ", block " + std::to_string(at % 2),
                           (b & 0x7F) == 0x7F ? "NaN" : "negative");
    }
  }
}

TEST_F(LoadMoeLayer, RejectsNaNAndNegativeScaleBytesWithPosition) {
  const LayerData d = random_layer(rng_, 2 * kI);
  const std::string p = kMlp + ".experts.3.gate_proj";  // [16, 32]: scales [16, 2]
  const uint8_t negative = static_cast<uint8_t>(0x80 | rng_.uniform_int(0x01, 0x7E));
  for (const auto& [byte, what] : {std::pair<uint8_t, const char*>{0x7F, "NaN"},
                                   {0xFF, "NaN"},
                                   {negative, "negative"},
                                   {0x80, "negative"}}) {
    TensorMap m = layer_tensors(d, Layout::kModelOpt);
    m[p + ".weight_scale"].bytes[5 * 2 + 1] = byte;
    // A later bad byte must not hide the first one.
    m[p + ".weight_scale"].bytes[9 * 2] = 0x7F;
    const std::string dir = write_checkpoint("bad_scale", m, deepseek_config());
    char hex[8];
    std::snprintf(hex, sizeof(hex), "0x%02X", byte);
    EXPECT_MEGAMOE_ERROR(load(dir), kInvalidCheckpoint, dir, "'" + p + ".weight_scale'", hex,
                         "row 5, block 1 (elements 16 to 31)", what,
                         "must be finite and non-negative");
  }
  // Same in a compressed-tensors shared expert.
  TensorMap m = layer_tensors(d, Layout::kCompressedTensors);
  m[kMlp + ".shared_experts.down_proj.weight_scale"].bytes[0] = 0xB8;
  const std::string dir = write_checkpoint("bad_scale_ct", m, deepseek_config());
  EXPECT_MEGAMOE_ERROR(load(dir), kInvalidCheckpoint, ".shared_experts.down_proj.weight_scale'",
                       "0xB8", "row 0, block 0", "negative (-1)");
}

// ModelOpt's export of an all-zero weight: weight_scale_2 = 0, NaN block scales (0x7F from a GPU
// export, 0xFF from a CPU one), codes 0x77.
// It loads (with a warning naming it) as zero codes and zero scales with weight_scale_2 = 1, the
// rest of the layer untouched; anything short of the exact signature is still refused.
TEST_F(LoadMoeLayer, ModelOptZeroWeightSignatureLoadsAsZeros) {
  const LayerData d = random_layer(rng_, 2 * kI);
  const std::string p = kMlp + ".experts.2.gate_proj";  // [16, 32]
  auto with_signature = [&](uint8_t code, uint8_t scale, float s2, uint8_t nan = 0xFF) {
    TensorMap m = layer_tensors(d, Layout::kModelOpt);
    std::fill(m[p + ".weight"].bytes.begin(), m[p + ".weight"].bytes.end(), uint8_t{0x77});
    std::fill(m[p + ".weight_scale"].bytes.begin(), m[p + ".weight_scale"].bytes.end(), nan);
    m[p + ".weight"].bytes[7] = code;
    m[p + ".weight_scale"].bytes[3] = scale;
    m[p + ".weight_scale_2"] = f32_tensor({s2}, {});
    return m;
  };
  // The GPU's NaN is accepted the same way.
  testing::internal::CaptureStderr();
  const MoeLayer gpu = load(write_checkpoint("zero_gpu", with_signature(0x77, 0x7F, 0.0f, 0x7F),
                                             deepseek_config()));
  EXPECT_EQ(gpu.experts[2].gate.weight_scale_2, 1.0f);
  EXPECT_EQ(gpu.experts[2].gate.weight_scale[0], 0x00);
  const std::string dir = write_checkpoint("zero", with_signature(0x77, 0xFF, 0.0f),
                                           deepseek_config());
  const MoeLayer layer = load(dir);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("warning: '" + p + "'"), std::string::npos) << err;
  EXPECT_NE(err.find("all-zero weight"), std::string::npos) << err;
  const Nvfp4Linear& z = layer.experts[2].gate;
  EXPECT_EQ(z.out_features, kI);
  EXPECT_EQ(z.in_features, kH);
  EXPECT_EQ(z.weight_scale_2, 1.0f);
  EXPECT_EQ(z.input_scale, d.experts[2][0].input_scale);
  EXPECT_TRUE(std::all_of(z.weight, z.weight + kI * kH / 2, [](uint8_t b) { return b == 0; }));
  EXPECT_TRUE(std::all_of(z.weight_scale, z.weight_scale + kI * kH / 16,
                          [](uint8_t b) { return b == 0; }));
  std::vector<float> w(kI * kH, 1.0f);
  megamoe::format::dequantize(z.view(), w);
  EXPECT_TRUE(std::all_of(w.begin(), w.end(), [](float v) { return v == 0.0f; }));
  // Everything else is as in the file.
  expect_linear(layer.experts[2].up, d.experts[2][1], Layout::kModelOpt, "expert 2 up");
  expect_linear(layer.experts[1].gate, d.experts[1][0], Layout::kModelOpt, "expert 1 gate");

  // One byte off, or a global scale that is not 0: the NaN scales are invalid again.
  EXPECT_MEGAMOE_ERROR(load(write_checkpoint("z1", with_signature(0x76, 0xFF, 0.0f),
                                             deepseek_config())),
                       kInvalidCheckpoint, "'" + p + ".weight_scale'", "0xFF", "NaN",
                       "only in ModelOpt's all-zero weight");
  EXPECT_MEGAMOE_ERROR(load(write_checkpoint("z2", with_signature(0x77, 0x38, 0.0f),
                                             deepseek_config())),
                       kInvalidCheckpoint, "'" + p + ".weight_scale'", "0xFF", "NaN");
  EXPECT_MEGAMOE_ERROR(load(write_checkpoint("z3", with_signature(0x77, 0xFF, 1e-30f),
                                             deepseek_config())),
                       kInvalidCheckpoint, "'" + p + ".weight_scale'", "0xFF", "NaN");
  EXPECT_MEGAMOE_ERROR(load(write_checkpoint("z4", with_signature(0x77, 0x38, 0.0f, 0x38),
                                             deepseek_config())),
                       kInvalidCheckpoint, "'" + p + ".weight_scale_2'", "is 0;");
  // compressed-tensors has no such signature: NaN scales there are refused.
  TensorMap ct = layer_tensors(d, Layout::kCompressedTensors);
  std::fill(ct[p + ".weight_scale"].bytes.begin(), ct[p + ".weight_scale"].bytes.end(),
            uint8_t{0xFF});
  std::fill(ct[p + ".weight_packed"].bytes.begin(), ct[p + ".weight_packed"].bytes.end(),
            uint8_t{0x77});
  EXPECT_MEGAMOE_ERROR(load(write_checkpoint("z5", ct, deepseek_config())), kInvalidCheckpoint,
                       "'" + p + ".weight_scale'", "NaN");
}

TEST_F(LoadMoeLayer, RejectsBadGlobalScales) {
  const LayerData d = random_layer(rng_, 2 * kI);
  const std::string p = kMlp + ".experts.2.down_proj";
  const float tiny = std::numeric_limits<float>::denorm_min();
  const struct {
    Layout layout;
    std::string tensor;
    float value;
    std::string shown;
  } cases[] = {
      {Layout::kModelOpt, p + ".weight_scale_2", 0.0f, "is 0;"},
      {Layout::kModelOpt, p + ".weight_scale_2", -0.0f, "is -0;"},
      {Layout::kModelOpt, p + ".weight_scale_2", -0.25f, "is -0.25;"},
      {Layout::kModelOpt, p + ".weight_scale_2", kNaN, "is nan;"},
      {Layout::kModelOpt, p + ".weight_scale_2", kInf, "is inf;"},
      {Layout::kModelOpt, p + ".input_scale", kNaN, "is nan;"},
      {Layout::kModelOpt, p + ".input_scale", 0.0f, "is 0;"},
      {Layout::kCompressedTensors, p + ".weight_global_scale", 0.0f, "is 0;"},
      {Layout::kCompressedTensors, p + ".weight_global_scale", -448.0f, "is -448;"},
      {Layout::kCompressedTensors, p + ".weight_global_scale", kNaN, "is nan;"},
      {Layout::kCompressedTensors, p + ".weight_global_scale", -kInf, "is -inf;"},
      // 1/denorm_min overflows: the reciprocal itself must be a usable scale.
      {Layout::kCompressedTensors, p + ".weight_global_scale", tiny, "reciprocal of the global scale) is inf"},
      {Layout::kCompressedTensors, p + ".input_global_scale", 0.0f, "is 0;"},
      {Layout::kCompressedTensors, p + ".input_global_scale", tiny, "reciprocal of the input scale) is inf"},
  };
  for (const auto& c : cases) {
    TensorMap m = layer_tensors(d, c.layout);
    m[c.tensor] = f32_tensor({c.value}, {});
    const std::string dir = write_checkpoint("global", m, deepseek_config());
    EXPECT_MEGAMOE_ERROR(load(dir), kInvalidCheckpoint, dir, "'" + c.tensor + "'", c.shown,
                         "must be finite and > 0");
  }
}

TEST_F(LoadMoeLayer, RejectsBadRouterValues) {
  const LayerData d = random_layer(rng_, 2 * kI);
  TensorMap m = layer_tensors(d, Layout::kModelOpt, DType::F32);
  std::vector<float> router = d.router;
  router[2 * kH + 5] = kNaN;
  m[kMlp + ".gate.weight"] = f32_tensor(router, {kE, kH});
  std::string dir = write_checkpoint("router_nan", m, deepseek_config());
  EXPECT_MEGAMOE_ERROR(load(dir), kInvalidCheckpoint, ".gate.weight'", "nan at index [2, 5]",
                       "must be finite");
  m = layer_tensors(d, Layout::kModelOpt);
  std::vector<float> bias = d.bias;
  bias[3] = -kInf;
  m[kMlp + ".gate.e_score_correction_bias"] = f32_tensor(bias, {kE});
  dir = write_checkpoint("bias_inf", m, deepseek_config());
  EXPECT_MEGAMOE_ERROR(load(dir), kInvalidCheckpoint, ".e_score_correction_bias'",
                       "-inf at index [3]", "must be finite");
}

TEST_F(LoadMoeLayer, NoauxTcRequiresCorrectionBias) {
  const LayerData d = random_layer(rng_, 2 * kI);
  TensorMap m = layer_tensors(d, Layout::kModelOpt);
  m.erase(kMlp + ".gate.e_score_correction_bias");
  const std::string dir = write_checkpoint("no_bias", m, deepseek_config());
  EXPECT_MEGAMOE_ERROR(load(dir), kNotFound, dir, "'" + kMlp + ".gate.e_score_correction_bias'",
                       "noaux_tc");
}

TEST_F(LoadMoeLayer, RejectsNonMoeLayers) {
  const LayerData d = random_layer(rng_, 2 * kI);
  const std::string dir = write_checkpoint("ds", layer_tensors(d, Layout::kModelOpt), deepseek_config());
  for (int64_t l : {0, 3, -1, 100}) {
    EXPECT_MEGAMOE_ERROR(load(dir, l), kInvalidArgument, dir,
                         "layer " + std::to_string(l) + " of the DeepseekV3ForCausalLM model",
                         "not a MoE layer", "first_k_dense_replace 1");
  }
  json q = qwen3_config();
  q["mlp_only_layers"] = {1};
  const std::string qdir = write_checkpoint("qwen", layer_tensors(random_layer(rng_, 0), Layout::kModelOpt), q);
  EXPECT_MEGAMOE_ERROR(load(qdir, 1), kInvalidArgument, "layer 1 of the Qwen3MoeForCausalLM",
                       "not a MoE layer", "mlp_only_layers [1]");
}

TEST_F(LoadMoeLayer, RejectsAmbiguousLayout) {
  const LayerData d = random_layer(rng_, 2 * kI);
  TensorMap m = layer_tensors(d, Layout::kModelOpt);
  const std::string p = kMlp + ".experts.0.gate_proj";
  m[p + ".weight_packed"] = m[p + ".weight"];
  const std::string dir = write_checkpoint("both", m, deepseek_config());
  EXPECT_MEGAMOE_ERROR(load(dir), kInvalidCheckpoint, "'" + p + ".weight' (ModelOpt)",
                       "'" + p + ".weight_packed' (compressed-tensors)");
}

// =============================================================================================
// MoeLayer, make_owned_linear, names

Nvfp4Linear owned(Rng& rng, int64_t out, int64_t in) {
  LinearData d = rng.linear(out, in);
  return megamoe::make_owned_linear(out, in, d.codes, d.scales, d.weight_scale_2, d.input_scale);
}

MoeLayer owned_layer(Rng& rng) {
  MoeLayer l;
  l.hidden_size = kH;
  l.intermediate_size = kI;
  l.num_experts = kE;
  for (int64_t e = 0; e < kE; ++e) {
    l.experts.push_back({owned(rng, kI, kH), owned(rng, kI, kH), owned(rng, kH, kI)});
  }
  l.shared_expert = megamoe::ExpertWeights{owned(rng, 48, kH), owned(rng, 48, kH), owned(rng, kH, 48)};
  l.router_weight.assign(kE * kH, 0.5f);
  l.e_score_correction_bias.assign(kE, 0.25f);
  l.routing = {RoutingKind::kNoauxTc, 2, true, 2, 1, 2.5f};
  l.swiglu_limit = 10.0f;
  return l;
}

using MoeLayerValidate = CheckpointTest;

TEST_F(MoeLayerValidate, MakeOwnedLinear) {
  const LinearData d = rng_.linear(kI, kH);
  const Nvfp4Linear lin =
      megamoe::make_owned_linear(kI, kH, d.codes, d.scales, d.weight_scale_2, d.input_scale);
  expect_linear(lin, d, Layout::kModelOpt, "owned");
  const auto v = lin.view();
  EXPECT_EQ(v.rows, kI);
  EXPECT_EQ(v.cols, kH);
  EXPECT_EQ(v.codes, lin.weight);
  EXPECT_EQ(v.scales, lin.weight_scale);
  EXPECT_EQ(v.global_scale, d.weight_scale_2);
  // The bytes live as long as any copy of the linear.
  Nvfp4Linear copy;
  {
    const Nvfp4Linear original =
        megamoe::make_owned_linear(kI, kH, d.codes, d.scales, d.weight_scale_2);
    copy = original;
  }
  EXPECT_EQ(std::memcmp(copy.weight, d.codes.data(), d.codes.size()), 0);
  EXPECT_EQ(std::memcmp(copy.weight_scale, d.scales.data(), d.scales.size()), 0);

  EXPECT_MEGAMOE_ERROR(megamoe::make_owned_linear(kI, 40, {}, {}, 1.0f), kInvalidArgument,
                       "make_owned_linear", "[16, 40]", "multiple of 16");
  EXPECT_MEGAMOE_ERROR(megamoe::make_owned_linear(0, kH, {}, {}, 1.0f), kInvalidArgument, "[0, 32]");
  EXPECT_MEGAMOE_ERROR(megamoe::make_owned_linear(kI, kH, std::vector<uint8_t>(255), d.scales, 1.0f),
                       kInvalidArgument, "weight has 255 bytes", "needs 256");
  EXPECT_MEGAMOE_ERROR(megamoe::make_owned_linear(kI, kH, d.codes, std::vector<uint8_t>(33), 1.0f),
                       kInvalidArgument, "weight_scale has 33 bytes", "needs 32");
  for (float bad : {0.0f, -1.0f, kNaN, kInf}) {
    EXPECT_MEGAMOE_ERROR(megamoe::make_owned_linear(kI, kH, d.codes, d.scales, bad),
                         kInvalidArgument, "weight_scale_2", "finite and > 0");
  }
  for (float bad : {-1.0f, kNaN, kInf}) {
    EXPECT_MEGAMOE_ERROR(megamoe::make_owned_linear(kI, kH, d.codes, d.scales, 1.0f, bad),
                         kInvalidArgument, "input_scale");
  }
}

TEST_F(MoeLayerValidate, AcceptsConsistentLayer) {
  MoeLayer l = owned_layer(rng_);
  EXPECT_NO_THROW(l.validate());
  l.shared_expert.reset();
  l.router_weight.clear();
  l.e_score_correction_bias.clear();
  l.swiglu_limit.reset();
  l.routing = {RoutingKind::kSoftmaxTopK, kE, false, 1, 1, 1.0f};
  EXPECT_NO_THROW(l.validate());
}

TEST_F(MoeLayerValidate, RejectsEachInconsistency) {
  const MoeLayer good = owned_layer(rng_);
  const struct {
    std::function<void(MoeLayer&)> edit;
    std::vector<std::string> parts;
  } cases[] = {
      {[](MoeLayer& l) { l.hidden_size = 40; }, {"hidden_size is 40", "multiple of 16"}},
      {[](MoeLayer& l) { l.intermediate_size = 0; }, {"intermediate_size is 0"}},
      {[](MoeLayer& l) { l.num_experts = 0; }, {"num_experts is 0"}},
      {[](MoeLayer& l) { l.experts.pop_back(); }, {"has 3 experts; num_experts is 4"}},
      {[&](MoeLayer& l) { l.experts[2].up = owned(rng_, kI, 2 * kH); },
       {"expert 2 up_proj has shape [16, 64]; expected [16, 32]"}},
      {[&](MoeLayer& l) { l.experts[1].down = owned(rng_, kI, kH); },
       {"expert 1 down_proj has shape [16, 32]; expected [32, 16]"}},
      {[](MoeLayer& l) { l.experts[3].gate.weight = nullptr; }, {"expert 3 gate_proj", "null weight pointer"}},
      {[](MoeLayer& l) { l.experts[0].down.weight_scale = nullptr; }, {"expert 0 down_proj", "null weight_scale pointer"}},
      {[](MoeLayer& l) { l.experts[1].gate.weight_scale_2 = kNaN; }, {"expert 1 gate_proj", "weight_scale_2 nan"}},
      {[](MoeLayer& l) { l.experts[1].gate.weight_scale_2 = 0.0f; }, {"weight_scale_2 0"}},
      {[](MoeLayer& l) { l.experts[1].gate.weight_scale_2 = -2.0f; }, {"weight_scale_2 -2"}},
      {[](MoeLayer& l) { l.experts[1].up.input_scale = -1.0f; }, {"expert 1 up_proj has input_scale -1"}},
      {[&](MoeLayer& l) { l.shared_expert->down = owned(rng_, kH, 32); },
       {"shared expert down_proj has shape [32, 32]; expected [32, 48]"}},
      {[&](MoeLayer& l) { l.shared_expert->gate.weight_scale_2 = kInf; }, {"shared expert gate_proj", "weight_scale_2 inf"}},
      {[](MoeLayer& l) { l.router_weight.pop_back(); }, {"router_weight has 127 values", "expected 128"}},
      {[](MoeLayer& l) { l.e_score_correction_bias.push_back(0); }, {"e_score_correction_bias has 5 values"}},
      {[](MoeLayer& l) { l.routing.top_k = 0; }, {"top_k is 0"}},
      {[](MoeLayer& l) { l.routing.top_k = 5; }, {"top_k is 5", "num_experts = 4"}},
      {[](MoeLayer& l) { l.routing.routed_scaling_factor = 0.0f; }, {"routed_scaling_factor is 0"}},
      {[](MoeLayer& l) { l.routing.n_group = 3; }, {"n_group is 3", "divide num_experts (4)"}},
      {[](MoeLayer& l) { l.routing.topk_group = 3; }, {"topk_group is 3", "n_group = 2"}},
      {[](MoeLayer& l) { l.routing.top_k = 3; }, {"top_k (3) exceeds the 2 experts"}},
      {[](MoeLayer& l) { l.swiglu_limit = 0.0f; }, {"swiglu_limit is 0"}},
      {[](MoeLayer& l) { l.swiglu_limit = kNaN; }, {"swiglu_limit is nan"}},
  };
  for (const auto& c : cases) {
    MoeLayer l = good;
    c.edit(l);
    try {
      l.validate();
      ADD_FAILURE() << "did not throw: " << c.parts[0];
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      for (const auto& p : c.parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  }
}

TEST(MegamoeNames, RoutingKindAndQuantFormat) {
  EXPECT_STREQ(megamoe::routing_kind_name(RoutingKind::kSoftmaxTopK), "softmax_topk");
  EXPECT_STREQ(megamoe::routing_kind_name(RoutingKind::kNoauxTc), "noaux_tc");
  EXPECT_STREQ(megamoe::quant_format_name(QuantFormat::kUnquantized), "unquantized");
  EXPECT_STREQ(megamoe::quant_format_name(QuantFormat::kModelOptNvfp4), "modelopt-nvfp4");
  EXPECT_STREQ(megamoe::quant_format_name(QuantFormat::kCompressedTensorsNvfp4),
               "compressed-tensors-nvfp4");
}


// =============================================================================================
// Hardening (issue 36): hostile JSON, special files, absurd counts, disagreeing metadata

// A value nested deeper than the parser allows is refused by the parser; one within the limit
// is quoted briefly. Either way the message stays short (a full dump once overflowed the stack).
TEST_F(ModelConfigTest, DeepOrLargeValuesGiveShortMessages) {
  const auto message_of = [&](const std::string& dir) -> std::string {
    try {
      megamoe::load_model_config(dir);
    } catch (const Error& e) {
      return e.what();
    }
    return "did not throw";
  };
  std::string text = deepseek_config().dump();
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  std::string d = write_config("deep", text.substr(0, text.size() - 1) + ",\"x\":" + deep + "}");
  std::string m = message_of(d);
  EXPECT_NE(m.find("more than 64 levels deep"), std::string::npos) << m;
  EXPECT_LT(m.size(), 300u) << m;

  json j = deepseek_config();
  json nested = 7;
  for (int i = 0; i < 60; ++i) nested = json::array({nested});
  j["hidden_size"] = nested;
  m = message_of(write_config("nested", j.dump()));
  EXPECT_NE(m.find("'hidden_size' must be an integer, but is [[[... 1 elements]]]"), std::string::npos) << m;
  EXPECT_LT(m.size(), 300u) << m;

  j = deepseek_config();
  j["architectures"] = json::array();
  for (int i = 0; i < 10000; ++i) j["architectures"].push_back(std::string(1000, 'A'));
  m = message_of(write_config("wide", j.dump()));
  EXPECT_NE(m.find("architectures [\"AAAA"), std::string::npos) << m;
  EXPECT_NE(m.find("(1000 bytes)"), std::string::npos) << m;
  EXPECT_LT(m.size(), 500u) << m;

  // A key twice in config.json is refused like in a safetensors header.
  text = deepseek_config().dump();
  d = write_config("dup", text.substr(0, text.size() - 1) + ",\"hidden_size\":64}");
  EXPECT_MEGAMOE_ERROR(megamoe::load_model_config(d), kInvalidCheckpoint, "config.json",
                       "key 'hidden_size' twice");
}

// FIFOs and directories where a JSON file or a shard belongs: a clear "not a regular file", not
// "does not exist", and no blocking open (a blocked open would hang this test).
TEST_F(ModelConfigTest, FifosAndDirectoriesAsCheckpointFiles) {
  std::string d = (dir_ / "fifo_config").string();
  fs::create_directories(d);
  ASSERT_EQ(::mkfifo((fs::path(d) / "config.json").c_str(), 0600), 0);
  EXPECT_MEGAMOE_ERROR(megamoe::load_model_config(d), kInvalidArgument, d + "/config.json",
                       "not a regular file");
  d = (dir_ / "dir_config").string();
  fs::create_directories(fs::path(d) / "config.json");
  EXPECT_MEGAMOE_ERROR(megamoe::load_model_config(d), kInvalidArgument, d + "/config.json",
                       "not a regular file");
  d = write_config("fifo_hq", deepseek_config().dump());
  ASSERT_EQ(::mkfifo((fs::path(d) / "hf_quant_config.json").c_str(), 0600), 0);
  EXPECT_MEGAMOE_ERROR(megamoe::load_model_config(d), kInvalidArgument, "hf_quant_config.json",
                       "not a regular file");

  const fs::path sharded = dir_ / "sharded";
  fs::create_directories(sharded);
  write_tensors((sharded / "s1.safetensors").string(), {{"a", f32_tensor({1.0f}, {})}});
  write_text(sharded / "model.safetensors.index.json",
             json{{"weight_map", {{"a", "s1.safetensors"}, {"b", "s2.safetensors"}}}}.dump());
  ASSERT_EQ(::mkfifo((sharded / "s2.safetensors").c_str(), 0600), 0);
  EXPECT_MEGAMOE_ERROR(Checkpoint::open(sharded.string()), kInvalidArgument, "s2.safetensors",
                       "not a regular file");
  fs::remove(sharded / "s2.safetensors");
  fs::create_directories(sharded / "s2.safetensors");
  EXPECT_MEGAMOE_ERROR(Checkpoint::open(sharded.string()), kInvalidArgument, "s2.safetensors",
                       "not a regular file");
  fs::remove(sharded / "model.safetensors.index.json");
  ASSERT_EQ(::mkfifo((sharded / "model.safetensors.index.json").c_str(), 0600), 0);
  EXPECT_MEGAMOE_ERROR(Checkpoint::open(sharded.string()), kInvalidArgument,
                       "model.safetensors.index.json", "not a regular file");
}

TEST_F(ModelConfigTest, RejectsAbsurdWidths) {
  for (const char* field : {"hidden_size", "moe_intermediate_size"}) {
    json j = deepseek_config();
    j[field] = (int64_t(1) << 24) + 16;
    const std::string d = write_config(field, j.dump());
    EXPECT_MEGAMOE_ERROR(megamoe::load_model_config(d), kInvalidCheckpoint, field,
                         "16777232", "allowed: 1 to 16777216");
  }
}

// An expert count the checkpoint does not hold is refused before anything is sized by it (2^31 - 1
// experts once asked for 360 GB and died with a bare std::bad_alloc).
TEST_F(LoadMoeLayer, RejectsExpertCountBeyondTheCheckpoint) {
  const LayerData d = random_layer(rng_, 0);
  for (const int64_t experts : {int64_t(2147483647), kE + 1}) {
    json config = qwen3_config();
    config["num_experts"] = experts;
    const std::string dir = write_checkpoint("experts", layer_tensors(d, Layout::kModelOpt), config);
    EXPECT_MEGAMOE_ERROR(load(dir), kInvalidCheckpoint, dir,
                         "declares " + std::to_string(experts) + " routed experts",
                         "experts." + std::to_string(experts - 1) + ".down_proj.weight",
                         "must match the checkpoint");
  }
}

// Judged (README): a quantization method in the config that disagrees with the tensor names is
// refused (the names decide how the global scale is read); a config naming none is accepted and
// the names decide.
TEST_F(LoadMoeLayer, ConfigQuantMethodMustAgreeWithTensorNames) {
  const LayerData d = random_layer(rng_, 0);
  const json modelopt = {{"quant_method", "modelopt"}, {"quant_algo", "NVFP4"}};
  const json compressed = {
      {"quant_method", "compressed-tensors"},
      {"config_groups",
       {{"group_0", {{"weights", {{"num_bits", 4}, {"type", "float"}, {"group_size", 16}}}}}}}};
  int n = 0;
  for (const Layout layout : {Layout::kModelOpt, Layout::kCompressedTensors}) {
    const bool mo = layout == Layout::kModelOpt;
    json config = qwen3_config();
    config["quantization_config"] = mo ? compressed : modelopt;
    std::string dir = write_checkpoint("q" + std::to_string(n++), layer_tensors(d, layout), config);
    EXPECT_MEGAMOE_ERROR(load(dir), kInvalidCheckpoint, dir,
                         mo ? "declares compressed-tensors-nvfp4" : "declares modelopt-nvfp4",
                         mo ? "use modelopt-nvfp4 names" : "use compressed-tensors-nvfp4 names",
                         "must agree");
    config["quantization_config"] = mo ? modelopt : compressed;
    dir = write_checkpoint("q" + std::to_string(n++), layer_tensors(d, layout), config);
    EXPECT_NO_THROW(load(dir));
    dir = write_checkpoint("q" + std::to_string(n++), layer_tensors(d, layout), qwen3_config());
    EXPECT_NO_THROW(load(dir));
  }
}

// Judged (README): a global scale above FLT_MAX/2688 (no finite amax gives it; its largest weight
// is not a finite fp32) is refused; a large one below it is accepted, and what the layer then
// computes may overflow bf16 (Inf or NaN in the output), as the same layer in bf16 would.
TEST_F(LoadMoeLayer, HugeGlobalScales) {
  const LayerData d = random_layer(rng_, 0);
  const std::string p = kMlp + ".experts.1.up_proj";
  const float limit = std::numeric_limits<float>::max() / 2688.0f;
  TensorMap m = layer_tensors(d, Layout::kModelOpt);
  m[p + ".weight_scale_2"] = f32_tensor({std::numeric_limits<float>::max()}, {});
  std::string dir = write_checkpoint("max", m, qwen3_config());
  EXPECT_MEGAMOE_ERROR(load(dir), kInvalidCheckpoint, p, "FLT_MAX/2688", "not a finite fp32");
  m = layer_tensors(d, Layout::kCompressedTensors);
  m[p + ".weight_global_scale"] = f32_tensor({1.0f / (4.0f * limit)}, {});
  dir = write_checkpoint("recip", m, qwen3_config());
  EXPECT_MEGAMOE_ERROR(load(dir), kInvalidCheckpoint, p, "FLT_MAX/2688");

  m = layer_tensors(d, Layout::kModelOpt);
  for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
    m[kMlp + ".experts.0." + proj + ".weight_scale_2"] = f32_tensor({limit}, {});
  }
  dir = write_checkpoint("large", m, qwen3_config());
  const MoeLayer layer = load(dir);
  EXPECT_EQ(layer.experts[0].up.weight_scale_2, limit);
  const std::vector<uint16_t> hidden(kH, megamoe::f32_to_bf16(1.0f));
  megamoe::reference::TopK topk;
  topk.tokens = 1;
  topk.k = 2;
  topk.ids = {0, 1};
  topk.weights = {0.5f, 0.5f};
  const std::vector<float> out = megamoe::reference::moe_forward_f32(layer, hidden, 1, topk);
  EXPECT_TRUE(std::any_of(out.begin(), out.end(), [](float v) { return !std::isfinite(v); }));
}

}  // namespace
