// The synthetic-checkpoint generator, the model presets and the `megamoe` tool. The tool is run
// as a process (MEGAMOE_TOOL_PATH) on temporary directories, and every result is compared with the
// library called directly: quantize bit for bit with format::quantize_weight_modelopt, dequantize
// with format::dequantize, reference with reference::moe_forward/route on the loaded layer.

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "megamoe/checkpoint.h"
#if MEGAMOE_HAS_CUDA
#include "megamoe/gpu.h"
#endif
#include "megamoe/dtype.h"
#include "megamoe/format.h"
#include "megamoe/presets.h"
#include "megamoe/reference.h"
#include "megamoe/safetensors.h"
#include "megamoe/status.h"
#include "tests/common/test_util.h"

namespace {

namespace fs = std::filesystem;
using megamoe::Checkpoint;
using megamoe::DType;
using megamoe::SafetensorsFile;
using megamoe::TensorSpec;
using nlohmann::json;

// ---- helpers ---------------------------------------------------------------------------------

struct ToolResult {
  int code = -1;
  std::string output;  // stdout and stderr together
};

// Runs `megamoe ARGS` and captures its exit code and output.
ToolResult run_tool(const std::string& args) {
  const std::string cmd = std::string("'") + MEGAMOE_TOOL_PATH + "' " + args + " 2>&1";
  ToolResult r;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) r.output.append(buf, n);
  const int status = pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string q(const fs::path& p) { return "'" + p.string() + "'"; }

// A CUDA device this build can use: never in a CPU-only build (MEGAMOE_CUDA=OFF).
int gpu_count() {
#if MEGAMOE_HAS_CUDA
  return megamoe::gpu::device_count();
#else
  return 0;
#endif
}

template <typename T>
std::span<const uint8_t> bytes_of(const std::vector<T>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T)};
}

template <typename T>
std::vector<T> read_tensor(const SafetensorsFile& f, const std::string& name) {
  const megamoe::TensorInfo* t = f.find(name);
  if (t == nullptr) {
    ADD_FAILURE() << "tensor '" << name << "' missing from " << f.path();
    return {};
  }
  const auto b = f.bytes(*t);
  std::vector<T> v(b.size() / sizeof(T));
  std::memcpy(v.data(), b.data(), v.size() * sizeof(T));
  return v;
}

std::vector<uint8_t> raw_bytes(const SafetensorsFile& f, const std::string& name) {
  return read_tensor<uint8_t>(f, name);
}

// Random weights with a different magnitude per row and per 16-block, as raw BF16/F16/F32 bytes
// (and their exact fp32 values).
struct RandomTensor {
  std::vector<uint8_t> bytes;
  std::vector<float> values;
};
RandomTensor random_tensor(std::mt19937_64& rng, DType dtype, int64_t rows, int64_t cols) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_scale(-8.0f, 2.0f);
  RandomTensor t;
  t.values.resize(size_t(rows * cols));
  t.bytes.resize(t.values.size() * size_t(megamoe::dtype_size(dtype)));
  for (int64_t r = 0; r < rows; ++r) {
    const float row_scale = std::exp2(log_scale(rng));
    float block_scale = 1.0f;
    for (int64_t c = 0; c < cols; ++c) {
      if (c % 16 == 0) block_scale = std::exp2(0.5f * log_scale(rng));
      const size_t i = size_t(r * cols + c);
      const float x = row_scale * block_scale * normal(rng);
      if (dtype == DType::BF16) {
        const uint16_t h = megamoe::f32_to_bf16(x);
        std::memcpy(&t.bytes[2 * i], &h, 2);
        t.values[i] = megamoe::bf16_to_f32(h);
      } else if (dtype == DType::F16) {
        const uint16_t h = megamoe::f32_to_f16(x);
        std::memcpy(&t.bytes[2 * i], &h, 2);
        t.values[i] = megamoe::f16_to_f32(h);
      } else {
        std::memcpy(&t.bytes[4 * i], &x, 4);
        t.values[i] = x;
      }
    }
  }
  return t;
}

// A named tensor held in memory, for write_safetensors.
struct Owned {
  TensorSpec spec;
  std::vector<uint8_t> bytes;
};
void write_file(const fs::path& path, const std::vector<Owned>& tensors,
                const std::map<std::string, std::string>& metadata = {}) {
  std::vector<std::pair<TensorSpec, std::span<const uint8_t>>> list;
  for (const Owned& t : tensors) list.emplace_back(t.spec, t.bytes);
  megamoe::write_safetensors(path.string(), list, metadata);
}
template <typename T>
std::vector<uint8_t> to_bytes(const std::vector<T>& v) {
  const auto b = bytes_of(v);
  return {b.begin(), b.end()};
}

class TempDir : public testing::Test {
 protected:
  const megamoe::testing::ScratchDir scratch_{"megamoe_tool_test"};
  const fs::path dir_ = scratch_.path();
};

// ---- presets and synth_weight ------------------------------------------------------------------

TEST(SynthPresets, DesignTableAndLookup) {
  struct Row {
    const char* name;
    int64_t h, i, e;
    int k, shared;
    megamoe::RoutingKind kind;
    int n_group, topk_group;
    float scaling;
    int64_t layer;
  };
  const megamoe::RoutingKind noaux = megamoe::RoutingKind::kNoauxTc;
  const megamoe::RoutingKind softmax = megamoe::RoutingKind::kSoftmaxTopK;
  const Row rows[] = {{"deepseek-v3", 7168, 2048, 256, 8, 1, noaux, 8, 4, 2.5f, 3},
                      {"deepseek-v4-flash", 4096, 2048, 256, 6, 1, noaux, 1, 1, 1.5f, 3},
                      {"kimi-k2", 7168, 2048, 384, 8, 1, noaux, 1, 1, 2.827f, 1},
                      {"qwen3-235b-a22b", 4096, 1536, 128, 8, 0, softmax, 1, 1, 1.0f, 0},
                      {"qwen3-30b-a3b", 2048, 768, 128, 8, 0, softmax, 1, 1, 1.0f, 0}};
  ASSERT_EQ(megamoe::model_presets().size(), std::size(rows));
  for (const Row& r : rows) {
    SCOPED_TRACE(r.name);
    const megamoe::ModelPreset& p = megamoe::find_preset(r.name);
    EXPECT_EQ(p.name, r.name);
    EXPECT_EQ(p.hidden_size, r.h);
    EXPECT_EQ(p.intermediate_size, r.i);
    EXPECT_EQ(p.num_experts, r.e);
    EXPECT_EQ(p.top_k, r.k);
    EXPECT_EQ(p.routing.top_k, r.k);
    EXPECT_EQ(p.n_shared_experts, r.shared);
    EXPECT_EQ(p.routing.kind, r.kind);
    EXPECT_TRUE(p.routing.renormalize);
    EXPECT_EQ(p.routing.n_group, r.n_group);
    EXPECT_EQ(p.routing.topk_group, r.topk_group);
    EXPECT_EQ(p.routing.routed_scaling_factor, r.scaling);
    EXPECT_EQ(p.layer, r.layer);
    EXPECT_EQ(p.architecture, r.kind == noaux ? "DeepseekV3ForCausalLM" : "Qwen3MoeForCausalLM");
    EXPECT_EQ(p.swiglu_limit.has_value(), std::string(r.name) == "deepseek-v4-flash");
  }
  EXPECT_EQ(*megamoe::find_preset("deepseek-v4-flash").swiglu_limit, 10.0f);
  EXPECT_EQ(megamoe::moe_prefix(3), "model.layers.3.mlp");
  try {
    megamoe::find_preset("deepseek-v2");
    ADD_FAILURE() << "find_preset accepted an unknown name";
  } catch (const megamoe::Error& e) {
    EXPECT_EQ(e.code(), megamoe::ErrorCode::kInvalidArgument);
    const std::string what = e.what();
    EXPECT_NE(what.find("'deepseek-v2'"), std::string::npos) << what;
    for (const Row& r : rows) EXPECT_NE(what.find(r.name), std::string::npos) << what;
  }
}

TEST(SynthWeight, PureDeterministicAndNameDependent) {
  const megamoe::testing::SeedTrace seed;
  const std::string name = "model.layers.0.mlp.experts.5.gate_proj.weight";
  const std::vector<float> a = megamoe::synth_weight(seed, name, 37, 96);
  // Other tensors generated in between change nothing: there is no generator state.
  (void)megamoe::synth_weight(seed, "something.else.weight", 64, 64);
  const std::vector<float> b = megamoe::synth_weight(seed, name, 37, 96);
  ASSERT_EQ(a.size(), size_t(37 * 96));
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);

  auto differing = [&](const std::vector<float>& other) {
    size_t n = 0;
    for (size_t i = 0; i < a.size(); ++i) n += a[i] != other[i];
    return n;
  };
  EXPECT_GT(differing(megamoe::synth_weight(seed, name + "x", 37, 96)), a.size() * 9 / 10);
  EXPECT_GT(differing(megamoe::synth_weight(seed + 1, name, 37, 96)), a.size() * 9 / 10);
  for (const float v : a) {
    ASSERT_TRUE(std::isfinite(v));
    ASSERT_EQ(megamoe::round_to_bf16(v), v) << "not a bf16 value";
  }
  EXPECT_TRUE(megamoe::synth_weight(seed, name, 0, 16).empty());
  EXPECT_THROW(megamoe::synth_weight(seed, name, -1, 16), megamoe::Error);
}

TEST(SynthWeight, RealisticDistribution) {
  const megamoe::testing::SeedTrace seed;
  const int64_t rows = 512, cols = 2048;
  const std::vector<float> w =
      megamoe::synth_weight(seed, "model.layers.0.mlp.experts.0.gate_proj.weight", rows, cols);

  double sum_sq = 0.0;
  std::vector<double> row_rms(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0.0;
    for (int64_t c = 0; c < cols; ++c)
      s += double(w[size_t(r * cols + c)]) * w[size_t(r * cols + c)];
    sum_sq += s;
    row_rms[size_t(r)] = std::sqrt(s / double(cols));
  }
  const double std_all = std::sqrt(sum_sq / double(rows * cols));
  EXPECT_GT(std_all, 0.01);  // scaled like trained weights (std ~0.02)
  EXPECT_LT(std_all, 0.05);
  const auto [lo, hi] = std::minmax_element(row_rms.begin(), row_rms.end());
  EXPECT_GT(*hi / *lo, 2.0) << "rows should differ in magnitude";

  // Rare outliers: far beyond what the bulk of a row reaches, and about 1e-4 of the elements.
  // Dead blocks: blocks whose magnitude is a tiny fraction of their row's.
  int64_t outliers = 0, dead_blocks = 0;
  std::vector<double> block_rms_in_row0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < cols / 16; ++b) {
      double s = 0.0;
      for (int64_t c = b * 16; c < b * 16 + 16; ++c) {
        const double x = w[size_t(r * cols + c)];
        s += x * x;
        outliers += std::fabs(x) > 9.0 * row_rms[size_t(r)];
      }
      const double rms = std::sqrt(s / 16.0);
      dead_blocks += rms < 0.01 * row_rms[size_t(r)];
      if (r == 0) block_rms_in_row0.push_back(rms);
    }
  }
  EXPECT_GT(outliers, 0);
  EXPECT_LT(outliers, rows * cols / 1000);
  EXPECT_GT(dead_blocks, 0);
  EXPECT_LT(dead_blocks, rows * cols / 16 / 100);
  std::sort(block_rms_in_row0.begin(), block_rms_in_row0.end());
  EXPECT_GT(block_rms_in_row0[block_rms_in_row0.size() * 9 / 10] /
                block_rms_in_row0[block_rms_in_row0.size() / 10],
            1.4)
      << "16-blocks along a row should differ in magnitude";
}

// ---- synth_checkpoint --------------------------------------------------------------------------

class SynthCheckpoint : public TempDir {};

TEST_F(SynthCheckpoint, LayerLoadsWithRecipeBytesAndDistinctGlobalScales) {
  const megamoe::testing::SeedTrace seed;
  // A small DeepSeek-style preset: grouped noaux_tc, a shared expert twice as wide, a clamp.
  megamoe::ModelPreset p = megamoe::find_preset("deepseek-v3");
  p.name = "tiny-deepseek";
  p.hidden_size = 256;
  p.intermediate_size = 64;
  p.num_experts = 16;
  p.top_k = p.routing.top_k = 6;
  p.routing.n_group = 4;
  p.routing.topk_group = 2;
  p.n_shared_experts = 2;
  p.swiglu_limit = 7.0f;
  p.layer = 2;
  megamoe::synth_checkpoint(p, dir_.string(), {.seed = seed, .num_experts = 0, .threads = 3});

  const megamoe::ModelConfig config = megamoe::load_model_config(dir_.string());
  EXPECT_EQ(config.architecture, "DeepseekV3ForCausalLM");
  EXPECT_EQ(config.quant_format, megamoe::QuantFormat::kModelOptNvfp4);
  EXPECT_EQ(config.num_hidden_layers, 3);
  EXPECT_EQ(config.first_k_dense_replace, 2);
  EXPECT_EQ(config.swiglu_limit, std::optional<float>(7.0f));
  const megamoe::RoutingConfig r = config.routing();
  EXPECT_EQ(r.kind, megamoe::RoutingKind::kNoauxTc);
  EXPECT_EQ(r.top_k, 6);
  EXPECT_EQ(r.n_group, 4);
  EXPECT_EQ(r.topk_group, 2);
  EXPECT_EQ(r.routed_scaling_factor, 2.5f);
  const json hf = json::parse(std::ifstream(dir_ / "hf_quant_config.json"));
  EXPECT_EQ(hf["quantization"]["quant_algo"], "NVFP4");
  EXPECT_EQ(hf["quantization"]["group_size"], 16);
  EXPECT_EQ(hf["quantization"]["exclude_modules"], json({"lm_head", "model.layers.2.mlp.gate"}));
  EXPECT_EQ(hf["producer"]["name"], "megamoe");

  const Checkpoint ckpt = Checkpoint::open(dir_.string());
  const megamoe::MoeLayer layer = megamoe::load_moe_layer(ckpt, config, 2);
  ASSERT_EQ(layer.experts.size(), 16u);
  ASSERT_TRUE(layer.shared_expert.has_value());
  EXPECT_EQ(layer.shared_expert->intermediate_size(), 128);
  EXPECT_EQ(layer.router_weight.size(), size_t(16 * 256));
  ASSERT_EQ(layer.e_score_correction_bias.size(), 16u);
  std::set<float> biases(layer.e_score_correction_bias.begin(),
                         layer.e_score_correction_bias.end());
  // Drawn per expert from a normal on a grid of ~10^4 likely values: two of 16 experts share one
  // in ~1% of seeds (the earlier "all 16 distinct" failed ~3 seeds in 400).
  EXPECT_GE(biases.size(), 12u) << "the experts get their own correction biases";
  const auto router = ckpt.get("model.layers.2.mlp.gate.weight");
  EXPECT_EQ(router.info->dtype, DType::BF16);
  EXPECT_EQ(ckpt.get("model.layers.2.mlp.gate.e_score_correction_bias").info->dtype, DType::F32);

  std::set<float> gate_scales;
  for (size_t e = 0; e <= layer.experts.size(); ++e) {
    const megamoe::ExpertWeights& x =
        e < layer.experts.size() ? layer.experts[e] : *layer.shared_expert;
    SCOPED_TRACE(testing::Message() << "expert " << e);
    // Clearly different global scales for gate, up and down of every expert.
    EXPECT_GT(x.up.weight_scale_2 / x.gate.weight_scale_2, 1.3f);
    EXPECT_LT(x.up.weight_scale_2 / x.gate.weight_scale_2, 1.7f);
    EXPECT_GT(std::fabs(x.down.weight_scale_2 / x.gate.weight_scale_2 - 1.0f), 0.1f);
    gate_scales.insert(x.gate.weight_scale_2);
    // Gate and up see the same input, so they share a static input scale; down has its own.
    EXPECT_GT(x.gate.input_scale, 0.0f);
    EXPECT_EQ(x.gate.input_scale, x.up.input_scale);
    EXPECT_NE(x.down.input_scale, x.gate.input_scale);
  }
  EXPECT_GT(gate_scales.size(), 10u) << "experts should differ in global scale";

  // The bytes are the ModelOpt recipe applied to synth_weight, so the weights can be regenerated.
  for (const std::string proj : {"experts.11.up_proj", "shared_experts.down_proj"}) {
    SCOPED_TRACE(proj);
    const std::string prefix = "model.layers.2.mlp." + proj;
    const megamoe::Nvfp4Linear lin =
        megamoe::load_nvfp4_linear(ckpt, prefix, proj.starts_with("shared") ? 256 : 64,
                                   proj.starts_with("shared") ? 128 : 256);
    const std::vector<float> w =
        megamoe::synth_weight(seed, prefix + ".weight", lin.out_features, lin.in_features);
    std::vector<uint8_t> codes(w.size() / 2), scales(w.size() / 16);
    const float s2 = megamoe::format::quantize_weight_modelopt(w, lin.out_features, lin.in_features,
                                                               codes, scales);
    EXPECT_EQ(s2, lin.weight_scale_2);
    EXPECT_EQ(std::memcmp(codes.data(), lin.weight, codes.size()), 0);
    EXPECT_EQ(std::memcmp(scales.data(), lin.weight_scale, scales.size()), 0);
  }
  const std::vector<float> router_w =
      megamoe::synth_weight(seed, "model.layers.2.mlp.gate.weight", 16, 256);
  EXPECT_EQ(layer.router_weight, router_w);
}

TEST_F(SynthCheckpoint, ReducedExpertCountKeepsAValidRouting) {
  // 6 experts cannot form deepseek-v3's 8 groups: routing falls back to ungrouped, top-6.
  megamoe::ModelPreset p = megamoe::find_preset("deepseek-v3");
  p.hidden_size = 64;
  p.intermediate_size = 32;
  megamoe::synth_checkpoint(p, dir_.string(), {.seed = 1, .num_experts = 6, .threads = 1});
  const megamoe::ModelConfig c = megamoe::load_model_config(dir_.string());
  EXPECT_EQ(c.num_experts, 6);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_EQ(c.num_experts_per_tok, 6);
  // 16 experts still form 8 groups of 2, and 4 groups offer the 8 experts top-8 needs.
  megamoe::synth_checkpoint(p, dir_.string(), {.seed = 1, .num_experts = 16, .threads = 2});
  const megamoe::ModelConfig d = megamoe::load_model_config(dir_.string());
  EXPECT_EQ(d.n_group, 8);
  EXPECT_EQ(d.topk_group, 4);
  EXPECT_EQ(d.num_experts_per_tok, 8);
  EXPECT_NO_THROW(megamoe::load_moe_layer(Checkpoint::open(dir_.string()), d, 3));
}

TEST_F(SynthCheckpoint, SharedExpertsOverrideDropsOrKeepsTheSharedExpert) {
  // docs/design.md §4's floors and peer figures are for the routed experts only: --shared-experts 0
  // writes that layer; the routed experts are the same tensors as in the full layer.
  megamoe::ModelPreset p = megamoe::find_preset("deepseek-v3");
  p.hidden_size = 64;
  p.intermediate_size = 32;
  const std::filesystem::path routed_dir = dir_ / "routed", full_dir = dir_ / "full";
  megamoe::synth_checkpoint(p, routed_dir.string(), {.seed = 3, .num_experts = 16, .shared_experts = 0, .threads = 2});
  megamoe::synth_checkpoint(p, full_dir.string(), {.seed = 3, .num_experts = 16, .threads = 2});
  const megamoe::MoeLayer without = megamoe::load_moe_layer(
      Checkpoint::open(routed_dir.string()), megamoe::load_model_config(routed_dir.string()), 3);
  const megamoe::MoeLayer with = megamoe::load_moe_layer(Checkpoint::open(full_dir.string()),
                                                         megamoe::load_model_config(full_dir.string()), 3);
  EXPECT_FALSE(without.shared_expert.has_value());
  ASSERT_EQ(without.experts.size(), 16u);
  ASSERT_TRUE(with.shared_expert.has_value());
  EXPECT_EQ(with.shared_expert->intermediate_size(), p.n_shared_experts * p.intermediate_size);
  const size_t bytes = size_t(p.hidden_size) * size_t(p.intermediate_size) / 2;
  EXPECT_EQ(std::memcmp(with.experts[5].down.weight, without.experts[5].down.weight, bytes), 0);
  // Qwen3-MoE cannot take one; a count below -1 names the allowed values.
  const megamoe::ModelPreset& q = megamoe::find_preset("qwen3-30b-a3b");
  EXPECT_THROW(megamoe::synth_checkpoint(q, dir_.string(), {.num_experts = 2, .shared_experts = 1}), megamoe::Error);
  EXPECT_THROW(megamoe::synth_checkpoint(p, dir_.string(), {.num_experts = 2, .shared_experts = -2}), megamoe::Error);
}

TEST_F(SynthCheckpoint, RejectsBadOptionsAndPresets) {
  const megamoe::ModelPreset& p = megamoe::find_preset("qwen3-30b-a3b");
  EXPECT_THROW(megamoe::synth_checkpoint(p, dir_.string(), {.num_experts = -1}), megamoe::Error);
  EXPECT_THROW(megamoe::synth_checkpoint(p, dir_.string(), {.threads = -2}), megamoe::Error);
  EXPECT_THROW(megamoe::synth_checkpoint(p, "", {}), megamoe::Error);
  megamoe::ModelPreset bad = p;
  bad.hidden_size = 100;  // not a multiple of 16
  EXPECT_THROW(megamoe::synth_checkpoint(bad, dir_.string(), {.num_experts = 2}), megamoe::Error);
  bad = p;
  bad.n_shared_experts = 1;  // Qwen3-MoE has no shared expert
  EXPECT_THROW(megamoe::synth_checkpoint(bad, dir_.string(), {.num_experts = 2}), megamoe::Error);
  bad = p;
  bad.architecture = "MixtralForCausalLM";
  EXPECT_THROW(megamoe::synth_checkpoint(bad, dir_.string(), {.num_experts = 2}), megamoe::Error);
  // A file where the directory should be.
  std::ofstream(dir_ / "file") << "x";
  EXPECT_THROW(megamoe::synth_checkpoint(p, (dir_ / "file").string(), {.num_experts = 2}),
               megamoe::Error);
}

// ---- the tool: bench options that are rejected before any GPU work -----------------------------

TEST(ToolBench, RejectsOptionsThatDoNotApply) {
  if (!MEGAMOE_HAS_CUDA) GTEST_SKIP() << "CPU-only build: `megamoe bench` is not built";
  // --shared-experts and --num-experts shape a synthesized layer, not a given checkpoint.
  ToolResult r = run_tool("bench --checkpoint /nonexistent --shared-experts 0");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("--shared-experts"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--checkpoint"), std::string::npos) << r.output;
  r = run_tool("bench --checkpoint /nonexistent --num-experts 4");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("--num-experts"), std::string::npos) << r.output;
  // The flush modes are named.
  r = run_tool("bench --flush sometimes");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("clean"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("dirty"), std::string::npos) << r.output;
  // Every timed point is checked: at least one token, and a bounded CPU cost.
  for (const char* n : {"0", "65"}) {
    r = run_tool(std::string("bench --check-tokens ") + n);
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("--check-tokens"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("1..64"), std::string::npos) << r.output;
  }
  // The warm-up load is bounded.
  for (const char* ms : {"-1", "60001"}) {
    r = run_tool(std::string("bench --warm-ms ") + ms);
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("--warm-ms"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("0..60000"), std::string::npos) << r.output;
  }
}

// `megamoe bench --timeline` records the kernels of a build configured with -DMEGAMOE_TIMELINE=ON;
// any other build says so, before any GPU work.
TEST(ToolBench, TimelineNeedsATimelineBuild) {
  if (!MEGAMOE_HAS_CUDA) GTEST_SKIP() << "CPU-only build: `megamoe bench` is not built";
  if (MEGAMOE_TIMELINE) {
    GTEST_SKIP() << "a -DMEGAMOE_TIMELINE=ON build: its kernels record (tests/gpu/test_gpu_timeline.cpp)";
  }
  const ToolResult r = run_tool("bench --tokens 1 --timeline timeline.json");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("bench --timeline"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("configure a build directory with -DMEGAMOE_TIMELINE=ON"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("no CUDA device"), std::string::npos) << r.output;
}

// `megamoe bench --ep N` refuses, before any GPU work, what it cannot run: options of the
// single-GPU benchmark that have no meaning for it, and more ranks than GPUs (here: no GPU at all,
// or fewer than 8).
TEST(ToolBench, ExpertParallelRefusals) {
  if (!MEGAMOE_HAS_CUDA) GTEST_SKIP() << "CPU-only build: `megamoe bench` is not built";
  struct Case {
    std::string args;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {"--ep 2 --tokens 4", {"--tokens-per-rank"}},
      {"--ep 2 --fused on", {"--fused", "no tuning overrides"}},
      {"--ep 2 --warm-ms 10", {"--warm-ms"}},
      {"--ep 2 --timeline t.json", {"--timeline", "without --ep"}},
      {"--ep 2 --iters 5", {"--iters", ">= 20"}},
      {"--ep 3", {"256 routed experts", "3 ranks"}},
      {"--ep 9", {"1..8"}},
      {"--ep 2 --tokens-per-rank 1,70000", {"70000"}},
      {"--tokens-per-rank 4", {"--tokens-per-rank needs --ep N"}},
      {"--ep 8 --num-experts 16", {"2 experts per rank", "top_k = 8"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    const ToolResult r = run_tool("bench " + c.args);
    EXPECT_EQ(r.code, 1) << r.output;
    for (const std::string& s : c.says) EXPECT_NE(r.output.find(s), std::string::npos) << r.output;
  }
  if (gpu_count() < 8) {
    const ToolResult r = run_tool("bench --ep 8 --preset kimi-k2");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("needs 8 CUDA devices"), std::string::npos) << r.output;
  }
}

// ---- the tool: synth, inspect, reference -------------------------------------------------------

class ToolSynth : public TempDir {
 protected:
  void check_expert_parallel_run(const std::string& ep_flag);
  // qwen3-30b-a3b with 4 experts (H 2048, I 768): small enough for a test, real shapes.
  void synth() {
    ckpt_ = dir_ / "ckpt";
    const ToolResult r =
        run_tool("synth --preset qwen3-30b-a3b --num-experts 4 --threads 2 --seed " +
                 std::to_string(seed_) + " " + q(ckpt_));
    ASSERT_EQ(r.code, 0) << r.output;
  }
  // hidden [tokens, 2048] BF16 with a different magnitude per token.
  std::vector<uint16_t> random_hidden(std::mt19937_64& rng, int64_t tokens) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> log_scale(-2.0f, 2.0f);
    std::vector<uint16_t> h(size_t(tokens * 2048));
    for (int64_t t = 0; t < tokens; ++t) {
      const float s = std::exp2(log_scale(rng));
      for (int64_t c = 0; c < 2048; ++c)
        h[size_t(t * 2048 + c)] = megamoe::f32_to_bf16(s * normal(rng));
    }
    return h;
  }
  megamoe::MoeLayer load_layer() {
    return megamoe::load_moe_layer(Checkpoint::open(ckpt_.string()),
                                   megamoe::load_model_config(ckpt_.string()), 0);
  }
  const megamoe::testing::SeedTrace seed_;  // of the checkpoint and the inputs
  fs::path ckpt_;
};

TEST_F(ToolSynth, InspectFindsFormatAndLayer) {
  ASSERT_NO_FATAL_FAILURE(synth());
  const ToolResult text = run_tool("inspect " + q(ckpt_));
  ASSERT_EQ(text.code, 0) << text.output;
  EXPECT_NE(text.output.find("format: ModelOpt NVFP4"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("layer 0: 4 experts, H 2048, I 768, shared expert no, router yes"),
            std::string::npos)
      << text.output;
  EXPECT_NE(text.output.find("model.layers.0.mlp.experts.3.down_proj.weight_scale"),
            std::string::npos);

  const ToolResult r = run_tool("inspect --json " + q(ckpt_ / "model.safetensors"));
  ASSERT_EQ(r.code, 0) << r.output;
  const json j = json::parse(r.output);
  EXPECT_EQ(j["format"], "modelopt-nvfp4");
  ASSERT_EQ(j["moe_layers"].size(), 1u);
  EXPECT_EQ(j["moe_layers"][0], json({{"layer", 0},
                                      {"experts", 4},
                                      {"hidden_size", 2048},
                                      {"intermediate_size", 768},
                                      {"shared_expert", false},
                                      {"router", true}}));
  EXPECT_EQ(j["tensors"].size(), 49u);  // router + 4 experts x 3 projections x 4 tensors
  const auto file = SafetensorsFile::open((ckpt_ / "model.safetensors").string());
  ASSERT_EQ(j["nvfp4"].size(), 12u);
  for (const json& s : j["nvfp4"]) {
    const std::string base = s["name"];
    SCOPED_TRACE(base);
    EXPECT_EQ(s["global_scale"].get<float>(),
              read_tensor<float>(*file, base + ".weight_scale_2")[0]);
    const std::vector<uint8_t> scales = raw_bytes(*file, base + ".weight_scale");
    EXPECT_EQ(s["block_scales"]["count"], scales.size());
    EXPECT_EQ(s["rows"].get<int64_t>() * s["cols"].get<int64_t>() / 16, int64_t(scales.size()));
    std::vector<float> v;
    int64_t subnormal = 0;
    for (const uint8_t b : scales) {
      v.push_back(megamoe::format::e4m3_to_f32(b));
      subnormal += b >= 1 && b <= 7;
    }
    std::sort(v.begin(), v.end());
    EXPECT_EQ(s["block_scales"]["min"].get<float>(), v.front());
    EXPECT_EQ(s["block_scales"]["max"].get<float>(), v.back());
    EXPECT_EQ(s["block_scales"]["median"].get<float>(), v[(v.size() + 1) / 2 - 1]);
    EXPECT_EQ(s["block_scales"]["subnormal"].get<int64_t>(), subnormal);
    EXPECT_GT(subnormal, 0) << "synthetic layers carry some subnormal block scales";
    EXPECT_EQ(s["block_scales"]["invalid"], 0);
  }
}

// `megamoe run` (GPU) against `megamoe reference` (CPU) on the same checkpoint and inputs. Needs a
// Hopper GPU; skipped (visibly) elsewhere.
TEST_F(ToolSynth, RunOnGpuMatchesReference) {
  if (gpu_count() == 0) {
    GTEST_SKIP() << "no CUDA device: `megamoe run` test skipped (run it on the GPU machine)";
  }
  ASSERT_NO_FATAL_FAILURE(synth());
  std::mt19937_64 rng(seed_);
  const int64_t T = 37;
  const std::vector<uint16_t> hidden = random_hidden(rng, T);
  const fs::path x = dir_ / "x.safetensors";
  write_file(x, {{{"hidden", DType::BF16, {T, 2048}}, to_bytes(hidden)}});  // routed by the layer
  const std::string args = " --checkpoint " + q(ckpt_) + " --layer 0 --input " + q(x) + " --output ";
  const fs::path y_ref = dir_ / "ref.safetensors", y_gpu = dir_ / "gpu.safetensors",
                 y_det1 = dir_ / "det1.safetensors", y_det2 = dir_ / "det2.safetensors";
  ToolResult r = run_tool("reference" + args + q(y_ref));
  ASSERT_EQ(r.code, 0) << r.output;
  for (const auto& [out, flags] : {std::pair{y_gpu, ""}, std::pair{y_det1, " --deterministic"},
                                   std::pair{y_det2, " --deterministic"}}) {
    r = run_tool("run" + args + q(out) + flags);
    ASSERT_EQ(r.code, 0) << r.output;
  }
  const auto ref = SafetensorsFile::open(y_ref.string());
  const std::vector<uint16_t> want = read_tensor<uint16_t>(*ref, "output");
  for (const fs::path& p : {y_gpu, y_det1}) {
    const auto got_file = SafetensorsFile::open(p.string());
    EXPECT_EQ(read_tensor<int32_t>(*got_file, "topk_ids"), read_tensor<int32_t>(*ref, "topk_ids"));
    const std::vector<uint16_t> got = read_tensor<uint16_t>(*got_file, "output");
    ASSERT_EQ(got.size(), want.size());
    const megamoe::testing::ErrorStats e =
        megamoe::testing::compare(got, megamoe::testing::widen(want));
    EXPECT_EQ(e.nonfinite, 0) << p;
    EXPECT_LE(e.rel_l2, megamoe::testing::kMaxRelL2) << p;
  }
  EXPECT_EQ(raw_bytes(*SafetensorsFile::open(y_det1.string()), "output"),
            raw_bytes(*SafetensorsFile::open(y_det2.string()), "output"))
      << "--deterministic runs differ";
}

// `run --precision`: w4a8 runs the w4a8/sm_90 row (said on stderr) near the W4A8 emulation of
// `megamoe reference --precision w4a8` and away from the exact output; auto runs w4a16 (said on
// stderr) and gives the w4a16 output bit for bit. Needs a Hopper GPU; skipped (visibly) elsewhere.
TEST_F(ToolSynth, RunPrecisionW4a8RunsItsRowAutoRunsW4a16) {
  if (gpu_count() == 0) {
    GTEST_SKIP() << "no CUDA device: `megamoe run --precision` test skipped (run it on the GPU machine)";
  }
  ASSERT_NO_FATAL_FAILURE(synth());
  std::mt19937_64 rng(seed_);
  const int64_t T = 9;
  const fs::path x = dir_ / "x.safetensors";
  write_file(x, {{{"hidden", DType::BF16, {T, 2048}}, to_bytes(random_hidden(rng, T))}});
  const std::string args = "run --deterministic --checkpoint " + q(ckpt_) + " --layer 0 --input " + q(x) + " --output ";
  const fs::path y8 = dir_ / "w4a8.safetensors", y16 = dir_ / "w4a16.safetensors", ya = dir_ / "auto.safetensors";
  const fs::path r8 = dir_ / "ref_w4a8.safetensors";
  ToolResult r = run_tool(args + q(y8) + " --precision w4a8");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find(" w4a8 L1{"), std::string::npos) << r.output;
  r = run_tool("reference --checkpoint " + q(ckpt_) + " --layer 0 --input " + q(x) + " --output " + q(r8) +
               " --precision w4a8");
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_tool(args + q(y16) + " --precision w4a16");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find(" w4a16 L1{"), std::string::npos) << r.output;
  r = run_tool(args + q(ya) + " --precision auto");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find(" w4a16 (auto) L1{"), std::string::npos) << r.output;
  EXPECT_EQ(raw_bytes(*SafetensorsFile::open(ya.string()), "output"),
            raw_bytes(*SafetensorsFile::open(y16.string()), "output"));
  // docs/w4a8.md §4.1: no error of order 1 (a wrong row, scale or block); e4m3 itself puts W4A8
  // about 6% from the exact output (§7).
  const auto out_of = [](const fs::path& f) {
    return read_tensor<uint16_t>(*SafetensorsFile::open(f.string()), "output");
  };
  const std::vector<uint16_t> got8 = out_of(y8);
  EXPECT_LE(megamoe::testing::compare(got8, megamoe::testing::widen(out_of(r8))).rel_l2, 0.05);
  EXPECT_GE(megamoe::testing::compare(got8, megamoe::testing::widen(out_of(y16))).rel_l2, 0.01);
}

// `run --ep 2 --precision w4a8`: the launcher passes the precision to its ranks, whose layers
// refuse it (w4a8 runs on one GPU only). Needs two GPUs; skipped (visibly) elsewhere.
TEST_F(ToolSynth, RunExpertParallelPrecisionW4a8FailsClearly) {
  if (gpu_count() < 2) {
    GTEST_SKIP() << "fewer than 2 CUDA devices: `megamoe run --ep 2 --precision` test skipped (run it on a 2-GPU machine)";
  }
  ASSERT_NO_FATAL_FAILURE(synth());
  std::mt19937_64 rng(seed_);
  const fs::path x = dir_ / "x.safetensors", y = dir_ / "y.safetensors";
  // Given top-1 routing: each rank holds 2 of the 4 experts, fewer than the layer's top-k.
  const std::vector<int32_t> ids = {0, 3, 1, 2};
  const std::vector<float> weights = {1.0f, 0.5f, 0.25f, 2.0f};
  write_file(x, {{{"hidden", DType::BF16, {4, 2048}}, to_bytes(random_hidden(rng, 4))},
                 {{"topk_ids", DType::I32, {4, 1}}, to_bytes(ids)},
                 {{"topk_weights", DType::F32, {4, 1}}, to_bytes(weights)}});
  const ToolResult r = run_tool("run --ep 2 --precision w4a8 --checkpoint " + q(ckpt_) + " --layer 0 --input " +
                                q(x) + " --output " + q(y));
  EXPECT_EQ(r.code, 1) << r.output;
  for (const char* part : {"precision w4a8 runs on one GPU only", "w4a16", "failed (exit status 1)"})
    EXPECT_NE(r.output.find(part), std::string::npos) << part << " in " << r.output;
  EXPECT_FALSE(fs::exists(y));
}

// `megamoe run --ep 2` (expert parallelism over two GPUs, one process each) against `megamoe
// reference` on the whole layer: uneven token shares (37 tokens: 19 + 18; one token: rank 1 has
// none), the layer's router, given top-1 ids, every token on rank 0's experts, the shared expert;
// --deterministic bitwise over repeated runs. And a rank whose peer never starts fails within its
// timeout. Needs two GPUs; skipped (visibly) elsewhere.
// `megamoe run` with `ep_flag` (--ep 2, or --ep-loopback 2 on one GPU) against `megamoe reference`
// on routed and given top-k, all tokens on rank 0's experts, and --deterministic twice bitwise.
void ToolSynth::check_expert_parallel_run(const std::string& ep_flag) {
  ckpt_ = dir_ / "ckpt16";
  // DeepSeek-V4-Flash's shapes (H 4096, I 2048, top-6, a shared expert, SwiGLU clamp) with 16
  // experts: 8 per rank (a rank's local layer takes a token's k ids).
  ToolResult r = run_tool("synth --preset deepseek-v4-flash --num-experts 16 --threads 2 --seed " +
                          std::to_string(seed_) + " " + q(ckpt_));
  ASSERT_EQ(r.code, 0) << r.output;
  std::mt19937_64 rng(seed_);
  struct Case {
    std::string name;
    int64_t T;
    int k;             // 0: the layer's router
    int64_t id_range;  // given ids drawn from [0, id_range)
  };
  for (const Case& c : {Case{"router, 37 tokens", 37, 0, 0}, Case{"router, one token", 1, 0, 0},
                        Case{"given top-1", 20, 1, 16}, Case{"all on rank 0", 12, 6, 8}}) {
    SCOPED_TRACE(c.name);
    constexpr int64_t H = 4096;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<uint16_t> hidden(static_cast<size_t>(c.T * H));
    for (uint16_t& v : hidden) v = megamoe::f32_to_bf16(normal(rng));
    std::vector<Owned> tensors = {{{"hidden", DType::BF16, {c.T, H}}, to_bytes(hidden)}};
    if (c.k > 0) {
      std::vector<int32_t> ids;
      std::vector<float> w;
      for (int64_t t = 0; t < c.T; ++t) {
        std::vector<int32_t> perm(static_cast<size_t>(c.id_range));
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int j = 0; j < c.k; ++j) {
          ids.push_back(perm[static_cast<size_t>(j)]);
          w.push_back(std::uniform_real_distribution<float>(0.1f, 1.0f)(rng));
        }
      }
      tensors.push_back({{"topk_ids", DType::I32, {c.T, c.k}}, to_bytes(ids)});
      tensors.push_back({{"topk_weights", DType::F32, {c.T, c.k}}, to_bytes(w)});
    }
    const fs::path x = dir_ / "x.safetensors", y_ref = dir_ / "ref.safetensors", y_ep = dir_ / "ep.safetensors";
    write_file(x, tensors);
    const std::string args = " --checkpoint " + q(ckpt_) + " --layer 3 --input " + q(x) + " --output ";
    r = run_tool("reference" + args + q(y_ref));
    ASSERT_EQ(r.code, 0) << r.output;
    r = run_tool("run" + args + q(y_ep) + " " + ep_flag);
    ASSERT_EQ(r.code, 0) << r.output;
    const auto ref = SafetensorsFile::open(y_ref.string());
    const auto got_file = SafetensorsFile::open(y_ep.string());
    EXPECT_EQ(read_tensor<int32_t>(*got_file, "topk_ids"), read_tensor<int32_t>(*ref, "topk_ids"));
    const std::vector<uint16_t> want = read_tensor<uint16_t>(*ref, "output");
    const std::vector<uint16_t> got = read_tensor<uint16_t>(*got_file, "output");
    ASSERT_EQ(got.size(), want.size());
    const megamoe::testing::ErrorStats e =
        megamoe::testing::compare(got, megamoe::testing::widen(want));
    EXPECT_EQ(e.nonfinite, 0);
    EXPECT_LE(e.rel_l2, megamoe::testing::kMaxRelL2);
    if (c.T == 37) {
      const fs::path d1 = dir_ / "det1.safetensors", d2 = dir_ / "det2.safetensors";
      for (const fs::path& d : {d1, d2}) {
        r = run_tool("run" + args + q(d) + " " + ep_flag + " --deterministic");
        ASSERT_EQ(r.code, 0) << r.output;
      }
      EXPECT_EQ(raw_bytes(*SafetensorsFile::open(d1.string()), "output"),
                raw_bytes(*SafetensorsFile::open(d2.string()), "output"))
          << ep_flag << " --deterministic runs differ";
    }
  }
}

TEST_F(ToolSynth, RunExpertParallelMatchesReference) {
  if (gpu_count() < 2) {
    GTEST_SKIP() << "fewer than 2 CUDA devices: `megamoe run --ep 2` test skipped (run it on a 2-GPU machine)";
  }
  check_expert_parallel_run("--ep 2");
  ToolResult r;
  // Rank 0 alone, with an id no launcher made and no peer: a clear failure within the timeout, not
  // a hang.
  const fs::path x = dir_ / "x.safetensors";
  const auto start = std::chrono::steady_clock::now();
  r = run_tool("run --checkpoint " + q(ckpt_) + " --layer 3 --input " + q(x) + " --output " +
               q(dir_ / "lonely.bin") + " --ep 2 --ep-rank 0 --ep-timeout 5 --ep-id " + std::string(256, 'a'));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("NCCL"), std::string::npos) << r.output;
  EXPECT_LT(seconds, 60.0) << r.output;
}

// The same over 2 virtual ranks on one GPU (EpLoopback): the same exchange, one process.
TEST_F(ToolSynth, RunExpertParallelLoopbackMatchesReference) {
  if (gpu_count() < 1) {
    GTEST_SKIP() << "no CUDA device: `megamoe run --ep-loopback 2` test skipped (run it on the GPU machine)";
  }
  check_expert_parallel_run("--ep-loopback 2");
}

// `megamoe bench --ep 2` end to end on a small layer (DeepSeek-V4-Flash's shapes, 16 experts: 8 per
// rank, a shared expert): every rank's output of the EP layer against the CPU reference, baseline
// (a) against the EP layer, (b) against the reference, all passed; the JSON has every point with
// both ranks' figures and the floors. A token count per rank above what an expert tile holds (33)
// and one token. Needs two GPUs; skipped (visibly) elsewhere.
TEST_F(ToolSynth, BenchExpertParallel) {
  if (gpu_count() < 2) {
    GTEST_SKIP() << "fewer than 2 CUDA devices: `megamoe bench --ep 2` test skipped (run it on a 2-GPU machine)";
  }
  const fs::path out = dir_ / "ep.json";
  const ToolResult r = run_tool("bench --ep 2 --preset deepseek-v4-flash --num-experts 16 --tokens-per-rank 1,33 "
                                "--iters 20 --check-tokens 3 --ep-deadline 500 --work-dir " + q(dir_ / "ckpt") +
                                " --json " + q(out));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.find(" FAIL"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("expert weights per GPU"), std::string::npos) << r.output;
  std::ifstream f(out);
  const json report = json::parse(f);
  EXPECT_EQ(report["mode"], "ep");
  EXPECT_EQ(report["ep"]["world_size"], 2);
  EXPECT_EQ(report["ep"]["max_tokens_per_rank"], 33);
  EXPECT_EQ(report["check_pass"], true);
  ASSERT_EQ(report["ranks"].size(), 2u);
  for (const json& rank : report["ranks"]) {
    EXPECT_GT(rank["peer_gbps"].get<double>(), 10.0) << rank.dump();
    EXPECT_GT(rank["ep_device_bytes"].get<double>(), 8 * 0.5625 * 3 * 4096 * 2048) << rank.dump();
  }
  EXPECT_EQ(report["weight_estimates"].size(), 4u);
  ASSERT_EQ(report["points"].size(), 2u);
  for (const json& p : report["points"]) {
    SCOPED_TRACE(p.dump());
    EXPECT_EQ(p["check_pass"], true);
    EXPECT_GT(p["us"].get<double>(), 0.0);
    EXPECT_GT(p["floor_us"].get<double>(), 0.0);
    ASSERT_EQ(p["ranks"].size(), 2u);
    EXPECT_LE(p["ranks"][0]["check_rel_l2"].get<double>(), megamoe::testing::kMaxRelL2);
    EXPECT_LE(p["ranks"][1]["unfused_rel_l2_vs_ep"].get<double>(), megamoe::testing::kMaxRelL2);
    EXPECT_GT(p["unfused"]["us"].get<double>(), p["unfused"]["compute_us"].get<double>());
    EXPECT_EQ(p["single_gpu"]["ran"], true);
    EXPECT_EQ(p["tokens"].get<int64_t>(), 2 * p["tokens_per_rank"].get<int64_t>());
  }
}

// `megamoe bench` with an override that runs at some of its T only (the fused launch: up to 24
// tokens per expert): the others are reported as skipped with the reason, the rest are timed and
// checked, and the run succeeds. Needs a Hopper GPU; skipped (visibly) elsewhere.
TEST_F(ToolSynth, BenchSkipsPointsAnOverrideCannotRun) {
  if (gpu_count() == 0) {
    GTEST_SKIP() << "no CUDA device: `megamoe bench` test skipped (run it on the GPU machine)";
  }
  ASSERT_NO_FATAL_FAILURE(synth());
  const fs::path out = dir_ / "bench.json";
  // 4 experts: T=1 puts at most 1 token on an expert, T=64 puts 64 * top_k / 4 on one on average,
  // past the fused launch's 24.
  const ToolResult r = run_tool("bench --checkpoint " + q(ckpt_) + " --no-baseline --replays 20 --check-tokens 2 "
                                "--fused on --tokens 1,64 --json " + q(out));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("accuracy vs CPU reference (T=2)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("     64 skipped: MoeTuning.fused"), std::string::npos) << r.output;
  std::ifstream f(out);
  const json report = json::parse(f);
  ASSERT_EQ(report["points"].size(), 2u);
  const json& timed = report["points"][0];
  EXPECT_EQ(timed["tokens"], 1);
  EXPECT_GT(timed["us"].get<double>(), 0.0);
  EXPECT_EQ(timed["check_pass"], true);
  EXPECT_NE(timed["config"].get<std::string>().find("fused"), std::string::npos) << timed.dump();
  // The SM clock over the timed replays (NVML, which the GPU machine's driver installs).
  ASSERT_TRUE(timed.contains("sm_clock")) << timed.dump();
  EXPECT_GT(timed["sm_clock"]["samples"].get<int>(), 0);
  EXPECT_GT(timed["sm_clock"]["mean_mhz"].get<double>(), 100.0);
  EXPECT_LT(timed["sm_clock"]["mean_mhz"].get<double>(), 4000.0);
  EXPECT_LE(timed["sm_clock"]["min_mhz"].get<double>(), timed["sm_clock"]["mean_mhz"].get<double>());
  const json& skipped = report["points"][1];
  EXPECT_EQ(skipped["tokens"], 64);
  EXPECT_NE(skipped["skipped"].get<std::string>().find("MoeTuning.fused"), std::string::npos) << skipped.dump();
  EXPECT_FALSE(skipped.contains("us"));

  // Early start holds up to 32 routed selections: the accuracy line at T=40 runs the heuristic's
  // configuration (and says so), the point at T=40 is skipped, the point at T=1 is timed.
  const ToolResult e = run_tool("bench --checkpoint " + q(ckpt_) + " --no-baseline --replays 20 --check-tokens 40 "
                                "--early-start on --tokens 1,40");
  ASSERT_EQ(e.code, 0) << e.output;
  EXPECT_NE(e.output.find("the check at T=40 runs the heuristic's configuration"), std::string::npos) << e.output;
  EXPECT_NE(e.output.find("accuracy vs CPU reference (T=40): rel L2"), std::string::npos) << e.output;
  EXPECT_NE(e.output.find("     40 skipped: MoeTuning.early_start"), std::string::npos) << e.output;
  EXPECT_EQ(e.output.find(" FAIL"), std::string::npos) << e.output;
}

// A timed point's inputs are a function of the seed and its T alone: the same T under another T
// list and another --check-tokens (which came before it in the old shared generator) draws the
// same tokens and routing (the JSON's fingerprint and active experts agree), and another T or seed
// draws others. (On a given checkpoint the baseline adds no draw: the cosine check runs only on a
// layer the bench synthesizes.) Needs a Hopper GPU; skipped (visibly) elsewhere.
TEST_F(ToolSynth, BenchPointInputsDependOnSeedAndTOnly) {
  if (gpu_count() == 0) {
    GTEST_SKIP() << "no CUDA device: `megamoe bench` test skipped (run it on the GPU machine)";
  }
  ASSERT_NO_FATAL_FAILURE(synth());
  auto bench = [&](const std::string& name, const std::string& flags) {
    const fs::path out = dir_ / name;
    const ToolResult r = run_tool("bench --checkpoint " + q(ckpt_) + " --replays 20 " + flags + " --json " + q(out));
    EXPECT_EQ(r.code, 0) << r.output;
    std::ifstream f(out);
    return json::parse(f);
  };
  const json a = bench("a.json", "--no-baseline --check-tokens 2 --tokens 3,17");
  const json b = bench("b.json", "--check-tokens 5 --tokens 17");
  const json c = bench("c.json", "--no-baseline --check-tokens 2 --tokens 17 --seed 12345");
  ASSERT_EQ(a["points"].size(), 2u);
  ASSERT_EQ(b["points"].size(), 1u);
  ASSERT_EQ(c["points"].size(), 1u);
  const json& a3 = a["points"][0];
  const json& a17 = a["points"][1];
  const json& b17 = b["points"][0];
  ASSERT_EQ(a3["tokens"], 3);
  ASSERT_TRUE(a3.contains("inputs_fnv1a")) << a3.dump();
  ASSERT_EQ(a17["tokens"], 17);
  ASSERT_EQ(b17["tokens"], 17);
  EXPECT_EQ(a17["inputs_fnv1a"].get<std::string>().size(), 16u) << a17.dump();
  EXPECT_EQ(a17["inputs_fnv1a"], b17["inputs_fnv1a"]) << a17.dump() << "\n" << b17.dump();
  EXPECT_EQ(a17["active_experts"], b17["active_experts"]);
  EXPECT_NE(a17["inputs_fnv1a"], a3["inputs_fnv1a"]) << "T=3 and T=17 drew the same inputs";
  EXPECT_NE(a17["inputs_fnv1a"], c["points"][0]["inputs_fnv1a"]) << "another --seed drew the same inputs";
}

TEST_F(ToolSynth, ReferenceWithGivenAndComputedRouting) {
  ASSERT_NO_FATAL_FAILURE(synth());
  std::mt19937_64 rng(seed_);
  const int64_t T = 5;
  const std::vector<uint16_t> hidden = random_hidden(rng, T);
  const megamoe::MoeLayer layer = load_layer();

  // Given routing (I64 ids, one repeated id, weights of both signs and magnitudes).
  megamoe::reference::TopK given;
  given.tokens = T;
  given.k = 3;
  std::vector<int64_t> ids64;
  std::uniform_int_distribution<int> expert(0, 3);
  std::uniform_real_distribution<float> weight(-0.5f, 2.0f);
  for (int64_t i = 0; i < T * 3; ++i) {
    ids64.push_back(expert(rng));
    given.ids.push_back(int32_t(ids64.back()));
    given.weights.push_back(weight(rng));
  }
  const fs::path x1 = dir_ / "x1.safetensors", y1 = dir_ / "y1.safetensors";
  write_file(x1, {{{"hidden", DType::BF16, {T, 2048}}, to_bytes(hidden)},
                  {{"topk_ids", DType::I64, {T, 3}}, to_bytes(ids64)},
                  {{"topk_weights", DType::F32, {T, 3}}, to_bytes(given.weights)}});
  ToolResult r = run_tool("reference --checkpoint " + q(ckpt_) + " --layer 0 --input " + q(x1) +
                          " --output " + q(y1) + " --threads 2");
  ASSERT_EQ(r.code, 0) << r.output;
  {
    const auto y = SafetensorsFile::open(y1.string());
    EXPECT_EQ(y->find("output")->shape, (std::vector<int64_t>{T, 2048}));
    EXPECT_EQ(y->find("output")->dtype, DType::BF16);
    EXPECT_EQ(read_tensor<uint16_t>(*y, "output"),
              megamoe::reference::moe_forward(layer, hidden, T, given));
    EXPECT_EQ(y->find("topk_ids")->dtype, DType::I32);
    EXPECT_EQ(read_tensor<int32_t>(*y, "topk_ids"), given.ids);
    EXPECT_EQ(read_tensor<float>(*y, "topk_weights"), given.weights);
  }

  // The same ids as I32 give the same output.
  const fs::path x2 = dir_ / "x2.safetensors", y2 = dir_ / "y2.safetensors";
  write_file(x2, {{{"hidden", DType::BF16, {T, 2048}}, to_bytes(hidden)},
                  {{"topk_ids", DType::I32, {T, 3}}, to_bytes(given.ids)},
                  {{"topk_weights", DType::F32, {T, 3}}, to_bytes(given.weights)}});
  r = run_tool("reference --checkpoint " + q(ckpt_) + " --layer 0 --input " + q(x2) + " --output " +
               q(y2));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(raw_bytes(*SafetensorsFile::open(y1.string()), "output"),
            raw_bytes(*SafetensorsFile::open(y2.string()), "output"));

  // Routing from the layer's router and the config (softmax top-4 of 4, renormalised).
  const fs::path x3 = dir_ / "x3.safetensors", y3 = dir_ / "y3.safetensors";
  write_file(x3, {{{"hidden", DType::BF16, {T, 2048}}, to_bytes(hidden)}});
  r = run_tool("reference --checkpoint " + q(ckpt_) + " --layer 0 --input " + q(x3) + " --output " +
               q(y3));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::vector<float> logits = megamoe::reference::router_logits(layer, hidden, T);
  const megamoe::reference::TopK routed =
      megamoe::reference::route(layer.routing, logits, T, 4, layer.e_score_correction_bias);
  EXPECT_EQ(routed.k, 4);
  const auto y = SafetensorsFile::open(y3.string());
  EXPECT_EQ(read_tensor<int32_t>(*y, "topk_ids"), routed.ids);
  EXPECT_EQ(read_tensor<float>(*y, "topk_weights"), routed.weights);
  EXPECT_EQ(y->find("topk_ids")->shape, (std::vector<int64_t>{T, 4}));
  EXPECT_EQ(read_tensor<uint16_t>(*y, "output"),
            megamoe::reference::moe_forward(layer, hidden, T, routed));
}

// `reference --precision`: w4a8 is the W4A8 emulation (reference::moe_forward_w4a8) bit for bit,
// w4a16 and the default are moe_forward, auto is w4a16 on the CPU; w4a8 and w4a16 differ (e4m3
// rounding moves about a quarter of the weights, docs/w4a8.md §7).
TEST_F(ToolSynth, ReferencePrecisionW4a8IsTheEmulation) {
  ASSERT_NO_FATAL_FAILURE(synth());
  std::mt19937_64 rng(seed_);
  const int64_t T = 6;
  const std::vector<uint16_t> hidden = random_hidden(rng, T);
  megamoe::reference::TopK topk;
  topk.tokens = T;
  topk.k = 2;
  std::uniform_int_distribution<int> expert(0, 3);
  std::uniform_real_distribution<float> weight(0.1f, 1.0f);
  for (int64_t i = 0; i < T * topk.k; ++i) {
    topk.ids.push_back(expert(rng));
    topk.weights.push_back(weight(rng));
  }
  const fs::path x = dir_ / "x.safetensors";
  write_file(x, {{{"hidden", DType::BF16, {T, 2048}}, to_bytes(hidden)},
                 {{"topk_ids", DType::I32, {T, 2}}, to_bytes(topk.ids)},
                 {{"topk_weights", DType::F32, {T, 2}}, to_bytes(topk.weights)}});
  auto reference = [&](const std::string& name, const std::string& flags) {
    const fs::path y = dir_ / (name + ".safetensors");
    const ToolResult r = run_tool("reference --checkpoint " + q(ckpt_) + " --layer 0 --input " + q(x) +
                                  " --output " + q(y) + " --threads 2" + flags);
    EXPECT_EQ(r.code, 0) << r.output;
    return std::pair{r.output, read_tensor<uint16_t>(*SafetensorsFile::open(y.string()), "output")};
  };
  const auto [w4a8_log, w4a8] = reference("w4a8", " --precision w4a8");
  const auto [w4a16_log, w4a16] = reference("w4a16", " --precision w4a16");
  const auto [default_log, by_default] = reference("default", "");
  const auto [auto_log, automatic] = reference("auto", " --precision auto");
  const megamoe::MoeLayer layer = load_layer();
  EXPECT_EQ(w4a8, megamoe::reference::moe_forward_w4a8(layer, hidden, T, topk));
  EXPECT_EQ(w4a16, megamoe::reference::moe_forward(layer, hidden, T, topk));
  EXPECT_EQ(by_default, w4a16);
  EXPECT_EQ(automatic, w4a16);
  ASSERT_EQ(w4a8.size(), w4a16.size());
  size_t differ = 0;
  for (size_t i = 0; i < w4a8.size(); ++i) differ += w4a8[i] != w4a16[i];
  EXPECT_GT(differ, w4a8.size() / 2) << "w4a8 output equals w4a16's in most elements";
  // The summary line says which precision ran.
  EXPECT_NE(w4a8_log.find(", w4a8)"), std::string::npos) << w4a8_log;
  EXPECT_NE(default_log.find(", w4a16)"), std::string::npos) << default_log;
  EXPECT_NE(auto_log.find(", w4a16 (auto))"), std::string::npos) << auto_log;
}

TEST_F(ToolSynth, ReferenceRejectsBadInputs) {
  ASSERT_NO_FATAL_FAILURE(synth());
  std::mt19937_64 rng(seed_);
  const std::vector<uint16_t> hidden = random_hidden(rng, 2);
  const std::vector<int32_t> ids = {0, 3, 1, 2};
  const std::vector<float> weights = {0.5f, 0.5f, 0.25f, 0.75f};
  const fs::path x = dir_ / "x.safetensors", y = dir_ / "y.safetensors";
  auto expect_failure = [&](const std::vector<Owned>& input, std::vector<std::string> parts,
                            const std::string& extra = "") {
    write_file(x, input);
    const ToolResult r = run_tool("reference --checkpoint " + q(ckpt_) + " --layer 0 --input " +
                                  q(x) + " --output " + q(y) + extra);
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_EQ(r.output.rfind("megamoe reference: error: ", 0), 0u) << r.output;
    for (const std::string& p : parts)
      EXPECT_NE(r.output.find(p), std::string::npos) << p << " in " << r.output;
    EXPECT_FALSE(fs::exists(y));
  };
  const Owned good_hidden{{"hidden", DType::BF16, {2, 2048}}, to_bytes(hidden)};
  const Owned good_ids{{"topk_ids", DType::I32, {2, 2}}, to_bytes(ids)};
  const Owned good_weights{{"topk_weights", DType::F32, {2, 2}}, to_bytes(weights)};

  // H mismatch.
  expect_failure({{{"hidden", DType::BF16, {4, 1024}}, to_bytes(hidden)}},
                 {"'hidden'", "[4, 1024]", "hidden_size 2048"});
  expect_failure({{{"hidden", DType::F32, {1, 2048}}, to_bytes(hidden)}}, {"'hidden'", "BF16"});
  expect_failure({{{"x", DType::BF16, {2, 2048}}, to_bytes(hidden)}}, {"no tensor 'hidden'"});
  // Routing given by halves.
  expect_failure({good_hidden, good_ids}, {"'topk_ids' without 'topk_weights'"});
  expect_failure({good_hidden, good_weights}, {"'topk_weights' without 'topk_ids'"});
  // Ids out of range, on both sides.
  for (const int32_t bad : {4, -1}) {
    std::vector<int32_t> b = ids;
    b[3] = bad;
    expect_failure({good_hidden, {{"topk_ids", DType::I32, {2, 2}}, to_bytes(b)}, good_weights},
                   {"'topk_ids'", "expert id " + std::to_string(bad), "[1, 1]", "[0, 4)"});
  }
  const std::vector<int64_t> huge = {0, 1, int64_t(1) << 40, 2};
  expect_failure({good_hidden, {{"topk_ids", DType::I64, {2, 2}}, to_bytes(huge)}, good_weights},
                 {"'topk_ids'", "1099511627776"});
  // Shapes and dtypes of the routing.
  expect_failure({good_hidden, {{"topk_ids", DType::I32, {1, 4}}, to_bytes(ids)}, good_weights},
                 {"'topk_ids'", "[1, 4]", "[2, k]"});
  expect_failure({good_hidden, good_ids, {{"topk_weights", DType::F32, {4}}, to_bytes(weights)}},
                 {"'topk_weights'", "[4]", "[2, 2]"});
  expect_failure({good_hidden, {{"topk_ids", DType::F32, {2, 2}}, to_bytes(weights)}, good_weights},
                 {"'topk_ids'", "I32 or I64"});
  std::vector<float> nan_weights = weights;
  nan_weights[2] = std::nanf("");
  expect_failure(
      {good_hidden, good_ids, {{"topk_weights", DType::F32, {2, 2}}, to_bytes(nan_weights)}},
      {"'topk_weights'", "finite"});
  // A layer that is not a MoE layer, and a bad thread count.
  write_file(x, {good_hidden});
  ToolResult r = run_tool("reference --checkpoint " + q(ckpt_) + " --layer 1 --input " + q(x) +
                          " --output " + q(y));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("layer 1"), std::string::npos) << r.output;
  expect_failure({good_hidden}, {"--threads", "-1"}, " --threads -1");
  // Input and output the same file.
  r = run_tool("reference --checkpoint " + q(ckpt_) + " --layer 0 --input " + q(x) + " --output " +
               q(x));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("different file"), std::string::npos) << r.output;
  // Missing checkpoint and missing input.
  r = run_tool("reference --checkpoint " + q(dir_ / "nope") + " --layer 0 --input " + q(x) +
               " --output " + q(y));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find((dir_ / "nope").string()), std::string::npos) << r.output;
  r = run_tool("reference --checkpoint " + q(ckpt_) + " --layer 0 --input " + q(dir_ / "nox") +
               " --output " + q(y));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("does not exist"), std::string::npos) << r.output;
}

// ---- the tool: quantize and dequantize ---------------------------------------------------------

class ToolQuantize : public TempDir {
 protected:
  struct Expected {
    std::vector<uint8_t> codes, scales;
    float s2;
  };
  // A small checkpoint: quantizable tensors of each float dtype (one large enough to be
  // streamed in two row chunks) and tensors that must be copied unchanged for each reason.
  void make_input(uint64_t seed) {
    std::mt19937_64 rng(seed);
    auto add = [&](const std::string& name, DType dt, int64_t rows, int64_t cols) {
      RandomTensor t = random_tensor(rng, dt, rows, cols);
      values_[name] = t.values;
      input_.push_back({{name, dt, {rows, cols}}, std::move(t.bytes)});
    };
    add("a.weight", DType::BF16, 8, 64);
    add("b.weight", DType::F32, 5, 32);
    add("c.weight", DType::F16, 3, 48);
    add("big.weight", DType::BF16, 4100, 2048);  // 8.4 M elements: two row chunks
    add("d.weight", DType::BF16, 4, 24);         // K not a multiple of 16
    add("e.bias", DType::BF16, 2, 64);           // not *.weight
    add("xweight", DType::BF16, 2, 64);          // not *.weight either
    std::vector<uint8_t> three_d(2 * 2 * 16 * 2, 0x3c);
    input_.push_back({{"f.weight", DType::BF16, {2, 2, 16}}, three_d});
    std::vector<int32_t> ints(32);
    std::iota(ints.begin(), ints.end(), -7);
    input_.push_back({{"g.weight", DType::I32, {2, 16}}, to_bytes(ints)});
    input_.push_back({{"h.weight", DType::BF16, {16}}, std::vector<uint8_t>(32, 0x41)});
    input_.push_back({{"u8.weight", DType::U8, {2, 16}}, std::vector<uint8_t>(32, 7)});
    write_file(in_, input_, metadata_);
  }
  Expected expected(const std::string& name) {
    const std::vector<float>& w = values_.at(name);
    const Owned& t = *std::find_if(input_.begin(), input_.end(),
                                   [&](const Owned& o) { return o.spec.name == name; });
    const int64_t rows = t.spec.shape[0], cols = t.spec.shape[1];
    Expected e;
    e.codes.resize(size_t(rows * cols / 2));
    e.scales.resize(size_t(rows * cols / 16));
    e.s2 = megamoe::format::quantize_weight_modelopt(w, rows, cols, e.codes, e.scales);
    return e;
  }
  // Checks `out` against the input: `quantized` tensors by the recipe, all others copied.
  void check_output(const fs::path& out, const std::set<std::string>& quantized) {
    const auto f = SafetensorsFile::open(out.string());
    EXPECT_EQ(f->metadata(), metadata_);
    std::set<std::string> names, expected_names;
    for (const auto& t : f->tensors()) names.insert(t.name);
    for (const Owned& t : input_) {
      SCOPED_TRACE(t.spec.name);
      expected_names.insert(t.spec.name);
      const megamoe::TensorInfo* o = f->find(t.spec.name);
      ASSERT_NE(o, nullptr);
      if (!quantized.count(t.spec.name)) {
        EXPECT_EQ(o->dtype, t.spec.dtype);
        EXPECT_EQ(o->shape, t.spec.shape);
        EXPECT_EQ(raw_bytes(*f, t.spec.name), t.bytes);
        continue;
      }
      const std::string base = t.spec.name.substr(0, t.spec.name.size() - 7);
      expected_names.insert(base + ".weight_scale");
      expected_names.insert(base + ".weight_scale_2");
      const Expected e = expected(t.spec.name);
      const int64_t rows = t.spec.shape[0], cols = t.spec.shape[1];
      EXPECT_EQ(o->dtype, DType::U8);
      EXPECT_EQ(o->shape, (std::vector<int64_t>{rows, cols / 2}));
      EXPECT_TRUE(raw_bytes(*f, t.spec.name) == e.codes);
      const megamoe::TensorInfo* s = f->find(base + ".weight_scale");
      ASSERT_NE(s, nullptr);
      EXPECT_EQ(s->dtype, DType::F8_E4M3);
      EXPECT_EQ(s->shape, (std::vector<int64_t>{rows, cols / 16}));
      EXPECT_TRUE(raw_bytes(*f, base + ".weight_scale") == e.scales);
      const megamoe::TensorInfo* g = f->find(base + ".weight_scale_2");
      ASSERT_NE(g, nullptr);
      EXPECT_EQ(g->dtype, DType::F32);
      EXPECT_TRUE(g->shape.empty());
      EXPECT_EQ(read_tensor<float>(*f, base + ".weight_scale_2"), std::vector<float>{e.s2});
    }
    EXPECT_EQ(names, expected_names);
  }

  void SetUp() override {
    TempDir::SetUp();
    in_ = dir_ / "in.safetensors";
    out_ = dir_ / "out.safetensors";
  }
  fs::path in_, out_;
  std::vector<Owned> input_;
  std::map<std::string, std::vector<float>> values_;
  const std::map<std::string, std::string> metadata_ = {{"format", "pt"}, {"note", "kept as is"}};
};

TEST_F(ToolQuantize, MatchesRecipeBitForBitAndCopiesTheRest) {
  const megamoe::testing::SeedTrace seed;
  make_input(seed);
  ToolResult r = run_tool("quantize " + q(in_) + " " + q(out_));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("4 tensors quantized"), std::string::npos) << r.output;
  check_output(out_, {"a.weight", "b.weight", "c.weight", "big.weight"});

  r = run_tool("quantize " + q(in_) + " " + q(out_) + " --include '^a\\.'");
  ASSERT_EQ(r.code, 0) << r.output;
  check_output(out_, {"a.weight"});
  r = run_tool("quantize " + q(in_) + " " + q(out_) + " --exclude '^(a|big)\\.'");
  ASSERT_EQ(r.code, 0) << r.output;
  check_output(out_, {"b.weight", "c.weight"});
  r = run_tool("quantize " + q(in_) + " " + q(out_) + " --include 'b|c' --exclude '^b'");
  ASSERT_EQ(r.code, 0) << r.output;
  check_output(out_, {"c.weight"});
}

TEST_F(ToolQuantize, DequantizeRoundTripEqualsFormatDequantize) {
  const megamoe::testing::SeedTrace seed;
  make_input(seed);
  const fs::path back = dir_ / "back.safetensors";
  ToolResult r = run_tool("quantize " + q(in_) + " " + q(out_) + " --exclude big");
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_tool("dequantize " + q(out_) + " " + q(back));
  ASSERT_EQ(r.code, 0) << r.output;
  const auto f = SafetensorsFile::open(back.string());
  EXPECT_EQ(f->metadata(), metadata_);
  EXPECT_EQ(f->tensors().size(), input_.size());  // scales folded back in, nothing else
  for (const Owned& t : input_) {
    SCOPED_TRACE(t.spec.name);
    const megamoe::TensorInfo* o = f->find(t.spec.name);
    ASSERT_NE(o, nullptr);
    if (t.spec.name != "a.weight" && t.spec.name != "b.weight" && t.spec.name != "c.weight") {
      EXPECT_EQ(o->dtype, t.spec.dtype);
      EXPECT_EQ(raw_bytes(*f, t.spec.name), t.bytes);
      continue;
    }
    const Expected e = expected(t.spec.name);
    const int64_t rows = t.spec.shape[0], cols = t.spec.shape[1];
    // One rounding from the exact product (test_format checks it against a double oracle).
    std::vector<uint16_t> want(size_t(rows * cols));
    megamoe::format::dequantize_to_bf16({rows, cols, e.codes.data(), e.scales.data(), e.s2},
                                        want);
    EXPECT_EQ(o->dtype, DType::BF16);
    EXPECT_EQ(o->shape, t.spec.shape);
    EXPECT_EQ(read_tensor<uint16_t>(*f, t.spec.name), want);
  }
}

// Random NVFP4 linears in both layouts, with every byte value for codes and every valid scale
// code (subnormals included).
TEST_F(ToolQuantize, DequantizeBothLayoutsDropsInputScales) {
  const megamoe::testing::SeedTrace seed;
  std::mt19937_64 rng(seed);
  const int64_t rows = 24, cols = 128;
  auto random_codes = [&] {
    std::vector<uint8_t> v(size_t(rows * cols / 2));
    for (uint8_t& b : v) b = uint8_t(rng());
    return v;
  };
  auto random_scales = [&] {
    std::vector<uint8_t> v(size_t(rows * cols / 16));
    for (size_t i = 0; i < v.size(); ++i) v[i] = uint8_t(i < 0x7F ? i : rng() % 0x7F);
    std::shuffle(v.begin(), v.end(), rng);
    return v;
  };
  const std::vector<uint8_t> m_codes = random_codes(), m_scales = random_scales();
  const std::vector<uint8_t> c_codes = random_codes(), c_scales = random_scales();
  const float m_s2 = 0.000734f;
  const float c_global = 4096.0f;  // compressed-tensors' reciprocal, a power of two: 1/x exact
  const std::vector<uint16_t> other = {0x3f80, 0xbf80, 0x4000};
  write_file(in_,
             {{{"m.weight", DType::U8, {rows, cols / 2}}, m_codes},
              {{"m.weight_scale", DType::F8_E4M3, {rows, cols / 16}}, m_scales},
              {{"m.weight_scale_2", DType::F32, {1}}, to_bytes(std::vector<float>{m_s2})},
              {{"m.input_scale", DType::F32, {}}, to_bytes(std::vector<float>{0.01f})},
              {{"c.weight_packed", DType::U8, {rows, cols / 2}}, c_codes},
              {{"c.weight_scale", DType::F8_E4M3, {rows, cols / 16}}, c_scales},
              {{"c.weight_global_scale", DType::F32, {}}, to_bytes(std::vector<float>{c_global})},
              {{"c.input_global_scale", DType::F32, {}}, to_bytes(std::vector<float>{100.0f})},
              {{"norm.weight", DType::BF16, {3}}, to_bytes(other)}});
  ToolResult r = run_tool("inspect --json " + q(in_));
  ASSERT_EQ(r.code, 0) << r.output;
  const json j = json::parse(r.output);
  EXPECT_EQ(j["format"], "compressed-tensors-nvfp4");
  ASSERT_EQ(j["nvfp4"].size(), 2u);
  EXPECT_EQ(j["nvfp4"][0]["name"], "c");
  EXPECT_EQ(j["nvfp4"][0]["global_scale"].get<float>(), 1.0f / c_global);
  EXPECT_EQ(
      j["nvfp4"][0]["block_scales"]["subnormal"],
      std::count_if(c_scales.begin(), c_scales.end(), [](uint8_t b) { return b >= 1 && b <= 7; }));
  EXPECT_EQ(j["nvfp4"][0]["block_scales"]["zero"], std::count(c_scales.begin(), c_scales.end(), 0));
  EXPECT_EQ(j["nvfp4"][1]["global_scale"].get<float>(), m_s2);

  r = run_tool("dequantize " + q(in_) + " " + q(out_));
  ASSERT_EQ(r.code, 0) << r.output;
  const auto f = SafetensorsFile::open(out_.string());
  std::set<std::string> names;
  for (const auto& t : f->tensors()) names.insert(t.name);
  EXPECT_EQ(names, (std::set<std::string>{"m.weight", "c.weight", "norm.weight"}));
  EXPECT_EQ(read_tensor<uint16_t>(*f, "norm.weight"), other);
  r = run_tool("inspect --json " + q(out_));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(json::parse(r.output)["format"], "unquantized");
  for (const auto& [name, codes, scales, s2] :
       {std::tuple{"m.weight", &m_codes, &m_scales, m_s2},
        std::tuple{"c.weight", &c_codes, &c_scales, 1.0f / c_global}}) {
    SCOPED_TRACE(name);
    std::vector<uint16_t> want(size_t(rows * cols));
    megamoe::format::dequantize_to_bf16({rows, cols, codes->data(), scales->data(), s2}, want);
    EXPECT_EQ(f->find(name)->dtype, DType::BF16);
    EXPECT_EQ(f->find(name)->shape, (std::vector<int64_t>{rows, cols}));
    EXPECT_EQ(read_tensor<uint16_t>(*f, name), want);
  }
}

// ModelOpt's fused groups: gate_proj/up_proj (experts, shared expert, dense MLP),
// q_proj/k_proj/v_proj and DeepSeek's q_a_proj/kv_a_proj_with_mqa of one module share the
// group's amax, hence one weight_scale_2; other linears (down_proj, o_proj, q_b_proj) keep their
// own; a member left out by --exclude is not in the group;
// an all-zero group gets the exporter's zero signature. Checked for both global-scale divisions.
TEST_F(ToolQuantize, FusedGroupsShareOneGlobalScale) {
  using megamoe::format::ExportDevice;
  const megamoe::testing::SeedTrace seed;
  std::mt19937_64 rng(seed);
  const std::string e0 = "model.layers.1.mlp.experts.0.", sh = "model.layers.1.mlp.shared_experts.",
                    at = "model.layers.0.self_attn.", e1 = "model.layers.1.mlp.experts.1.";
  const std::vector<std::string> names = {
      e0 + "gate_proj.weight", e0 + "up_proj.weight",   e0 + "down_proj.weight",
      sh + "gate_proj.weight", sh + "up_proj.weight",   at + "q_proj.weight",
      at + "k_proj.weight",    at + "v_proj.weight",    at + "o_proj.weight",
      e1 + "gate_proj.weight", e1 + "up_proj.weight",   at + "q_a_proj.weight",
      at + "kv_a_proj_with_mqa.weight", at + "q_b_proj.weight"};
  std::vector<Owned> input;
  float own_amax_of_gate = -1.0f;
  auto own_amax = [](const RandomTensor& t) {
    float a = 0.0f;
    for (float v : t.values) a = std::max(a, std::fabs(v));
    return a;
  };
  for (const std::string& name : names) {
    const bool zero = name.starts_with(e1);
    RandomTensor t = random_tensor(rng, DType::BF16, 32, 64);
    // The grouping must matter: expert 0's up_proj gets an amax of its own (random tensors
    // share their largest value now and then).
    while (name == e0 + "up_proj.weight" && own_amax(t) == own_amax_of_gate) t = random_tensor(rng, DType::BF16, 32, 64);
    if (name == e0 + "gate_proj.weight") own_amax_of_gate = own_amax(t);
    if (zero) {
      std::fill(t.values.begin(), t.values.end(), 0.0f);
      std::fill(t.bytes.begin(), t.bytes.end(), uint8_t{0});
    }
    values_[name] = t.values;
    input.push_back({{name, DType::BF16, {32, 64}}, std::move(t.bytes)});
  }
  write_file(in_, input, metadata_);
  auto amax = [&](const std::string& name) {
    float a = 0.0f;
    for (float v : values_.at(name)) a = std::max(a, std::fabs(v));
    return a;
  };
  // The groups (with the shared expert's up_proj excluded below, so its gate_proj is alone).
  const std::vector<std::vector<std::string>> groups = {
      {e0 + "gate_proj.weight", e0 + "up_proj.weight"},
      {e0 + "down_proj.weight"},
      {sh + "gate_proj.weight"},
      {at + "q_proj.weight", at + "k_proj.weight", at + "v_proj.weight"},
      {at + "o_proj.weight"},
      {e1 + "gate_proj.weight", e1 + "up_proj.weight"},
      {at + "q_a_proj.weight", at + "kv_a_proj_with_mqa.weight"},
      {at + "q_b_proj.weight"}};
  // The data must make the grouping matter: members' own amax differ.
  ASSERT_NE(amax(groups[0][0]), amax(groups[0][1]));

  for (const auto& [flag, device] :
       {std::pair{std::string(), ExportDevice::kGpu},
        std::pair{std::string(" --export-device gpu"), ExportDevice::kGpu},
        std::pair{std::string(" --export-device cpu"), ExportDevice::kCpu}}) {
    SCOPED_TRACE("flags:" + flag);
    const ToolResult r =
        run_tool("quantize " + q(in_) + " " + q(out_) + " --exclude 'shared_experts\\.up'" + flag);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("13 tensors quantized to NVFP4 (9 of them in fused groups"),
              std::string::npos) << r.output;
    EXPECT_NE(r.output.find(std::string("as exported on the ") +
                            megamoe::format::export_device_name(device)),
              std::string::npos) << r.output;
    for (const char* zero : {"gate_proj.weight' is all zero", "up_proj.weight' is all zero"}) {
      EXPECT_NE(r.output.find(e1 + zero), std::string::npos) << r.output;
    }
    const auto f = SafetensorsFile::open(out_.string());
    EXPECT_EQ(raw_bytes(*f, sh + "up_proj.weight"),
              input[4].bytes);  // excluded: copied as it was
    for (const auto& group : groups) {
      float group_amax = 0.0f;
      for (const std::string& name : group) group_amax = std::max(group_amax, amax(name));
      const float s2 = megamoe::format::modelopt_global_scale(group_amax, device);
      for (const std::string& name : group) {
        SCOPED_TRACE(name);
        const std::string base = name.substr(0, name.size() - 7);
        std::vector<uint8_t> codes(32 * 32), scales(32 * 4);
        megamoe::format::quantize_weight_with_global_scale(values_.at(name), 32, 64, s2, codes,
                                                           scales, device);
        EXPECT_EQ(read_tensor<float>(*f, base + ".weight_scale_2"), std::vector<float>{s2});
        EXPECT_TRUE(raw_bytes(*f, name) == codes);
        EXPECT_TRUE(raw_bytes(*f, base + ".weight_scale") == scales);
      }
    }
    // The zero group is the exporter's signature.
    EXPECT_EQ(read_tensor<float>(*f, e1 + "up_proj.weight_scale_2"), std::vector<float>{0.0f});
    EXPECT_EQ(raw_bytes(*f, e1 + "up_proj.weight_scale"),
              std::vector<uint8_t>(32 * 4, device == ExportDevice::kCpu ? 0xFF : 0x7F));
    EXPECT_EQ(raw_bytes(*f, e1 + "up_proj.weight"), std::vector<uint8_t>(32 * 32, 0x77));
  }
  EXPECT_NE(run_tool("quantize " + q(in_) + " " + q(out_) + " --export-device tpu").code, 0);

  // dequantize: the zero signature comes back as zeros, with a warning naming the tensor.
  const fs::path back = dir_ / "back.safetensors";
  const ToolResult r = run_tool("dequantize " + q(out_) + " " + q(back));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("warning: '" + e1 + "gate_proj' in checkpoint"), std::string::npos)
      << r.output;
  const auto f = SafetensorsFile::open(back.string());
  EXPECT_EQ(read_tensor<uint16_t>(*f, e1 + "gate_proj.weight"), std::vector<uint16_t>(32 * 64, 0));
}

TEST_F(ToolQuantize, RejectsBadInputs) {
  auto expect_failure = [&](const std::string& cmd, const std::string& args,
                            std::vector<std::string> parts) {
    const ToolResult r = run_tool(cmd + " " + args);
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_EQ(r.output.rfind("megamoe " + cmd + ": error: ", 0), 0u) << r.output;
    for (const std::string& p : parts)
      EXPECT_NE(r.output.find(p), std::string::npos) << p << " in " << r.output;
  };
  const std::vector<float> w(32, 0.5f);
  // An output name that already exists in the input.
  write_file(in_, {{{"a.weight", DType::F32, {2, 16}}, to_bytes(w)},
                   {{"a.weight_scale", DType::F32, {1}}, to_bytes(std::vector<float>{1.0f})}});
  expect_failure("quantize", q(in_) + " " + q(out_), {"'a.weight_scale'", "already holds"});
  EXPECT_FALSE(fs::exists(out_));
  EXPECT_EQ(run_tool("quantize " + q(in_) + " " + q(out_) + " --exclude '^a'").code, 0);
  // Bad regex, same file twice, missing file, non-finite weights.
  expect_failure("quantize", q(in_) + " " + q(out_) + " --include '('", {"--include", "'('"});
  expect_failure("quantize", q(in_) + " " + q(in_), {"different file"});
  expect_failure("quantize", q(dir_ / "missing.safetensors") + " " + q(out_),
                 {(dir_ / "missing.safetensors").string(), "does not exist"});
  std::vector<float> inf = w;
  inf[17] = INFINITY;
  write_file(in_, {{{"n.weight", DType::F32, {2, 16}}, to_bytes(inf)}});
  expect_failure("quantize", q(in_) + " " + q(out_), {"'n.weight'", "[1, 1]", "non-finite"});

  // dequantize: NaN block scale, missing global scale, name collision, missing file.
  const std::vector<uint8_t> codes(16, 0x21), scales = {0x38, 0x7F};
  write_file(in_, {{{"m.weight", DType::U8, {1, 16}}, codes},
                   {{"m.weight_scale", DType::F8_E4M3, {1, 2}}, scales},
                   {{"m.weight_scale_2", DType::F32, {}}, to_bytes(std::vector<float>{1.0f})}});
  expect_failure("dequantize", q(in_) + " " + q(out_), {"'m.weight_scale'", "NaN"});
  write_file(in_, {{{"m.weight", DType::U8, {1, 16}}, codes},
                   {{"m.weight_scale", DType::F8_E4M3, {1, 2}}, std::vector<uint8_t>{1, 2}}});
  expect_failure("dequantize", q(in_) + " " + q(out_), {"m.weight_scale_2"});
  write_file(in_,
             {{{"m.weight_packed", DType::U8, {1, 16}}, codes},
              {{"m.weight", DType::BF16, {1, 1}}, std::vector<uint8_t>(2, 0)},
              {{"m.weight_scale", DType::F8_E4M3, {1, 2}}, std::vector<uint8_t>{1, 2}},
              {{"m.weight_global_scale", DType::F32, {}}, to_bytes(std::vector<float>{1.0f})}});
  expect_failure("dequantize", q(in_) + " " + q(out_), {"'m.weight_packed'", "'m.weight'"});
  expect_failure("dequantize", q(dir_ / "missing") + " " + q(out_), {"does not exist"});

  // inspect and synth.
  expect_failure("inspect", q(dir_ / "missing"), {(dir_ / "missing").string(), "does not exist"});
  expect_failure("synth", "--preset llama " + q(dir_ / "s"),
                 {"'llama'", "deepseek-v3", "deepseek-v4-flash", "kimi-k2", "qwen3-235b-a22b",
                  "qwen3-30b-a3b"});
  expect_failure("synth", "--preset qwen3-30b-a3b --num-experts -3 " + q(dir_ / "s"), {"-3"});
}

// A CPU-only build keeps `run` and `bench` as commands that say the build has no CUDA, whatever
// their arguments; a CUDA build parses them for real (no such message).
TEST(ToolCommandLine, GpuCommandsWithoutCuda) {
  for (const char* cmd : {"run --checkpoint /nonexistent --layer 0 --input a --output b",
                          "bench --tokens 1 --bogus-option"}) {
    const ToolResult r = run_tool(cmd);
    SCOPED_TRACE(cmd);
    EXPECT_NE(r.code, 0) << r.output;
    const bool says_no_cuda = r.output.find("built without CUDA") != std::string::npos;
    EXPECT_EQ(says_no_cuda, !MEGAMOE_HAS_CUDA) << r.output;
    if (!MEGAMOE_HAS_CUDA) EXPECT_EQ(r.code, 1) << r.output;
  }
}

// --precision takes w4a16, w4a8 or auto; anything else is a command-line error (exit 2, before
// any file is read) that lists the allowed values. `run` parses it the same way in a CUDA build.
TEST(ToolCommandLine, PrecisionOption) {
  for (const char* cmd : {"reference", "run"}) {
    SCOPED_TRACE(cmd);
    const ToolResult help = run_tool(std::string(cmd) + " --help");
    EXPECT_EQ(help.code, 0) << help.output;
    if (std::string(cmd) == "run" && !MEGAMOE_HAS_CUDA) continue;  // the no-CUDA stand-in has no options
    EXPECT_NE(help.output.find("--precision"), std::string::npos) << help.output;
    EXPECT_NE(help.output.find("w4a16|w4a8|auto"), std::string::npos) << help.output;
    for (const char* bad : {"bogus", "W4A8", "''"}) {
      const ToolResult r = run_tool(std::string(cmd) + " --checkpoint /nonexistent --layer 0 --input a --output b "
                                    "--precision " + bad);
      SCOPED_TRACE(bad);
      EXPECT_EQ(r.code, 2) << r.output;
      for (const char* part : {"--precision", "not one of the allowed values", "w4a16", "w4a8", "auto"})
        EXPECT_NE(r.output.find(part), std::string::npos) << part << " in " << r.output;
      EXPECT_EQ(r.output.find("/nonexistent"), std::string::npos) << "read files before parsing: " << r.output;
    }
  }
  const ToolResult r = run_tool("reference --checkpoint /nonexistent --layer 0 --input a --output b --precision bogus");
  EXPECT_NE(r.output.find("'bogus'"), std::string::npos) << r.output;
}

TEST(ToolCommandLine, HelpAndParseErrors) {
  ToolResult r = run_tool("--help");
  EXPECT_EQ(r.code, 0) << r.output;
  for (const char* sub : {"quantize", "dequantize", "inspect", "synth", "reference"}) {
    EXPECT_NE(r.output.find(sub), std::string::npos) << sub << " in " << r.output;
  }
  EXPECT_EQ(run_tool("reference --help").code, 0);
  EXPECT_EQ(run_tool("").code, 2);                               // no subcommand
  EXPECT_EQ(run_tool("frobnicate").code, 2);                     // unknown subcommand
  EXPECT_EQ(run_tool("quantize only-one.safetensors").code, 2);  // missing positional
  EXPECT_EQ(run_tool("inspect x --bogus").code, 2);              // unknown option
  EXPECT_EQ(run_tool("synth out").code, 2);                      // --preset is required
  r = run_tool("synth --preset qwen3-30b-a3b --seed abc out");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("seed"), std::string::npos) << r.output;
}


// ---- hardening (issue 36): outputs onto inputs, special files, absurd widths and counts -------

std::vector<uint8_t> file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// An output that is one of the inputs, by identity (the same file through any path or link), is
// refused before anything is written: writing it once killed the tool with SIGBUS (the input was
// still mapped), loaded a wrong "negative block scale" from a rewritten shard, or silently
// overwrote the checkpoint.
TEST_F(ToolSynth, RefusesAnOutputThatIsAnInput) {
  ASSERT_NO_FATAL_FAILURE(synth());
  const fs::path model = ckpt_ / "model.safetensors";
  const std::vector<uint8_t> before = file_bytes(model);
  const fs::path alias = dir_ / "alias.safetensors";
  fs::create_hard_link(model, alias);
  for (const fs::path& out : {model, alias}) {
    const ToolResult r = run_tool("dequantize " + q(ckpt_) + " " + q(out));
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("is the input file"), std::string::npos) << r.output;
  }
  std::mt19937_64 rng(seed_);
  const fs::path x = dir_ / "x.safetensors";
  write_file(x, {{{"hidden", DType::BF16, {1, 2048}}, to_bytes(random_hidden(rng, 1))}});
  for (const fs::path& out : {model, alias, ckpt_ / "config.json", x}) {
    const ToolResult r = run_tool("reference --checkpoint " + q(ckpt_) + " --layer 0 --input " +
                                  q(x) + " --output " + q(out));
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("is the input file"), std::string::npos) << r.output;
  }
  EXPECT_TRUE(file_bytes(model) == before) << "the checkpoint was modified";

  // One shard of a sharded checkpoint.
  const fs::path sharded = dir_ / "sharded";
  fs::create_directories(sharded);
  const std::vector<float> one = {1.0f};
  write_file(sharded / "s1.safetensors", {{{"a", DType::F32, {1}}, to_bytes(one)}});
  write_file(sharded / "s2.safetensors", {{{"b", DType::F32, {1}}, to_bytes(one)}});
  std::ofstream(sharded / "model.safetensors.index.json")
      << json{{"weight_map", {{"a", "s1.safetensors"}, {"b", "s2.safetensors"}}}}.dump();
  const std::vector<uint8_t> shard_before = file_bytes(sharded / "s2.safetensors");
  const ToolResult r = run_tool("dequantize " + q(sharded) + " " + q(sharded / "s2.safetensors"));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("s2.safetensors' is the input file"), std::string::npos) << r.output;
  EXPECT_TRUE(file_bytes(sharded / "s2.safetensors") == shard_before);
  // A new file beside the shards is fine.
  EXPECT_EQ(run_tool("dequantize " + q(sharded) + " " + q(sharded / "out.safetensors")).code, 0);
}

// The input of `reference`: an empty batch runs (and writes empty tensors); a top-k width is
// checked as the int64 it is stored as; a non-finite `hidden` is refused naming `hidden`,
// whatever the routing; a FIFO as --input is refused without blocking.
TEST_F(ToolSynth, ReferenceInputEdgeCases) {
  ASSERT_NO_FATAL_FAILURE(synth());
  const fs::path x = dir_ / "x.safetensors", y = dir_ / "y.safetensors";
  const auto reference = [&](const fs::path& input) {
    return run_tool("reference --checkpoint " + q(ckpt_) + " --layer 0 --input " + q(input) +
                    " --output " + q(y));
  };
  // T = 0, routed and given.
  write_file(x, {{{"hidden", DType::BF16, {0, 2048}}, {}}});
  ToolResult r = reference(x);
  ASSERT_EQ(r.code, 0) << r.output;
  auto out = SafetensorsFile::open(y.string());
  EXPECT_EQ(out->find("output")->shape, (std::vector<int64_t>{0, 2048}));
  write_file(x, {{{"hidden", DType::BF16, {0, 2048}}, {}},
                 {{"topk_ids", DType::I32, {0, 2}}, {}},
                 {{"topk_weights", DType::F32, {0, 2}}, {}}});
  r = reference(x);
  ASSERT_EQ(r.code, 0) << r.output;
  out = SafetensorsFile::open(y.string());
  EXPECT_EQ(out->find("topk_ids")->shape, (std::vector<int64_t>{0, 2}));

  // Widths beyond the 4 experts: 5, 2^31 and 2^32 + 1 (which an int once wrapped to 1).
  for (const int64_t k : {int64_t(5), int64_t(1) << 31, (int64_t(1) << 32) + 1}) {
    write_file(x, {{{"hidden", DType::BF16, {0, 2048}}, {}},
                   {{"topk_ids", DType::I32, {0, k}}, {}},
                   {{"topk_weights", DType::F32, {0, k}}, {}}});
    r = reference(x);
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("[0, " + std::to_string(k) + "]"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("1 <= k <= 4"), std::string::npos) << r.output;
  }
  // [1, 2^32 + 1] for real, in a sparse file of 34 GB: refused before any id is read.
  {
    const int64_t k = (int64_t(1) << 32) + 1;
    const uint64_t ids_bytes = uint64_t(k) * 4;
    std::string header = json{{"hidden", {{"dtype", "BF16"}, {"shape", {1, 2048}},
                                          {"data_offsets", {0, 4096}}}},
                              {"topk_ids", {{"dtype", "I32"}, {"shape", {1, k}},
                                            {"data_offsets", {4096, 4096 + ids_bytes}}}},
                              {"topk_weights", {{"dtype", "F32"}, {"shape", {1, k}},
                                                {"data_offsets", {4096 + ids_bytes, 4096 + 2 * ids_bytes}}}}}
                             .dump();
    header.append((8 - header.size() % 8) % 8, ' ');
    const fs::path sparse = dir_ / "sparse.safetensors";
    {
      std::ofstream f(sparse, std::ios::binary);
      for (int i = 0; i < 8; ++i) f.put(char(uint64_t(header.size()) >> (8 * i)));
      f << header;
    }
    ASSERT_EQ(::truncate(sparse.c_str(), off_t(8 + header.size() + 4096 + 2 * ids_bytes)), 0);
    r = reference(sparse);
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("1 <= k <= 4"), std::string::npos) << r.output;
  }

  // NaN and Inf in `hidden`, with given routing and through the router: `hidden` is named.
  std::mt19937_64 rng(seed_);
  for (const float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    std::vector<uint16_t> hidden = random_hidden(rng, 2);
    hidden[2048 + 5] = megamoe::f32_to_bf16(bad);
    for (const bool given : {true, false}) {
      std::vector<Owned> input = {{{"hidden", DType::BF16, {2, 2048}}, to_bytes(hidden)}};
      if (given) {
        input.push_back({{"topk_ids", DType::I32, {2, 1}}, to_bytes(std::vector<int32_t>{0, 1})});
        input.push_back(
            {{"topk_weights", DType::F32, {2, 1}}, to_bytes(std::vector<float>{1.0f, 1.0f})});
      }
      write_file(x, input);
      fs::remove(y);
      r = reference(x);
      EXPECT_EQ(r.code, 1) << r.output;
      EXPECT_NE(r.output.find("tensor 'hidden'"), std::string::npos) << r.output;
      EXPECT_NE(r.output.find("[1, 5]"), std::string::npos) << r.output;
      EXPECT_NE(r.output.find("must be finite"), std::string::npos) << r.output;
      EXPECT_FALSE(fs::exists(y));
    }
  }

  // A FIFO as the input (a blocking open would hang this test).
  const fs::path fifo = dir_ / "fifo.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  r = reference(fifo);
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("not a regular file"), std::string::npos) << r.output;
  r = run_tool("quantize " + q(fifo) + " " + q(y));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("not a regular file"), std::string::npos) << r.output;
}

// A 200,000-character tensor name (std::regex recursed once per character and crashed) and a
// pattern that makes a backtracking matcher run forever: both quick.
TEST_F(ToolQuantize, LongNamesAndPathologicalPatterns) {
  const std::string long_name = std::string(200000, 'a') + ".weight";
  const std::vector<float> w(32, 0.5f);
  write_file(in_, {{{long_name, DType::F32, {2, 16}}, to_bytes(w)},
                   {{"b.weight", DType::F32, {2, 16}}, to_bytes(w)}});
  ToolResult r = run_tool("quantize " + q(in_) + " " + q(out_) + " --exclude '(a*)*b'");
  ASSERT_EQ(r.code, 0) << r.output.substr(0, 2000);
  auto f = SafetensorsFile::open(out_.string());
  EXPECT_EQ(f->find(long_name)->dtype, DType::U8);   // not excluded: quantized
  EXPECT_EQ(f->find("b.weight")->dtype, DType::F32);  // excluded
  fs::remove(out_);
  r = run_tool("quantize " + q(in_) + " " + q(out_) + " --include '^(a|aa)+\\.weight$'");
  ASSERT_EQ(r.code, 0) << r.output.substr(0, 2000);
  f = SafetensorsFile::open(out_.string());
  EXPECT_EQ(f->find(long_name)->dtype, DType::U8);
  EXPECT_EQ(f->find("b.weight")->dtype, DType::F32);
  // Syntax outside the supported subset is named as such.
  r = run_tool("quantize " + q(in_) + " " + q(out_) + " --include '(?=a)'");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("--include '(?=a)' is not a supported pattern"), std::string::npos)
      << r.output;
}

// Packed codes declared [0, 2^62]: an empty tensor, valid as a file, whose unpacked width
// 2 x 2^62 does not fit in int64 (it once overflowed in dequantize and inspect).
TEST_F(ToolQuantize, AbsurdPackedWidths) {
  const int64_t half = int64_t(1) << 62;
  write_file(in_, {{{"m.weight", DType::U8, {0, half}}, {}},
                   {{"m.weight_scale", DType::F8_E4M3, {0, half / 8}}, {}},
                   {{"m.weight_scale_2", DType::F32, {}}, to_bytes(std::vector<float>{1.0f})}});
  for (const std::string cmd : {"dequantize " + q(in_) + " " + q(out_), "inspect " + q(in_)}) {
    const ToolResult r = run_tool(cmd);
    EXPECT_EQ(r.code, 1) << cmd << ": " << r.output;
    EXPECT_NE(r.output.find("'m.weight'"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("must fit in int64"), std::string::npos) << r.output;
  }
}

}  // namespace
