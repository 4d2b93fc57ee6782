// Tensor-parallel shards of a MoE layer (include/megamoe/tp.h), on the CPU: the slices byte for
// byte against the whole tensors, the ranks' reference partial outputs summed against the whole
// layer's reference, the loader of one rank's slice (which must not read the other ranks' bytes)
// and every error. Fresh random data each run; the seed is in every failure's trace.
#include <gtest/gtest.h>


#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tests/common/error_matchers.h"
#include "megamoe/checkpoint.h"
#include "megamoe/dtype.h"
#include "megamoe/moe.h"
#include "megamoe/reference.h"
#include "megamoe/safetensors.h"
#include "megamoe/status.h"
#include "megamoe/tp.h"
#include "tests/common/test_util.h"

namespace megamoe {
namespace {

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// Ranges

TEST(TpRange, SplitsEvenlyInRankOrder) {
  for (int R : {1, 2, 4, 8}) {
    int64_t next = 0;
    for (int r = 0; r < R; ++r) {
      const TpRange t = tp_range(2048, TpConfig{R, r});  // DeepSeek-V3's I
      EXPECT_EQ(t.first, next);
      EXPECT_EQ(t.count, 2048 / R);
      next = t.first + t.count;
    }
    EXPECT_EQ(next, 2048);
  }
}

TEST(TpRange, RejectsEveryInvalidSplitNamingTheValues) {
  EXPECT_MEGAMOE_ERROR(tp_range(2048, TpConfig{0, 0}), kInvalidArgument, "world size 0",
                       "1..8");
  EXPECT_MEGAMOE_ERROR(tp_range(2048, TpConfig{9, 0}), kInvalidArgument, "world size 9",
                       "1..8");
  EXPECT_MEGAMOE_ERROR(tp_range(2048, TpConfig{4, 4}), kInvalidArgument, "rank 4", "0..3");
  EXPECT_MEGAMOE_ERROR(tp_range(2048, TpConfig{4, -1}), kInvalidArgument, "rank -1", "0..3");
  EXPECT_MEGAMOE_ERROR(tp_range(768 + 64, TpConfig{3, 0}), kInvalidArgument,
                       "intermediate_size = 832", "over 3 ranks");
  // 768 (Qwen3-30B-A3B's I) over 8: slices of 96, whole NVFP4 blocks but not the kernels' 64.
  EXPECT_MEGAMOE_ERROR(tp_range(768, TpConfig{8, 0}), kInvalidArgument,
                       "intermediate_size = 768 over 8 ranks gives slices of 96",
                       "not a multiple of 64");
  EXPECT_MEGAMOE_ERROR(tp_range(64, TpConfig{2, 1}), kInvalidArgument, "slices of 32");
  EXPECT_MEGAMOE_ERROR(tp_range(0, TpConfig{1, 0}), kInvalidArgument, "intermediate_size = 0");
  EXPECT_MEGAMOE_ERROR(tp_range(320, TpConfig{2, 0}, "the shared expert's intermediate size"),
                       kInvalidArgument, "the shared expert's intermediate size = 320",
                       "slices of 160");
  EXPECT_NO_THROW(tp_range(768, TpConfig{4, 3}));  // 192
}

// ---------------------------------------------------------------------------------------------
// Slices

// Every byte of `got`'s rows against rows [row0, row0 + got.out) and code bytes / scale bytes from
// column `col0` of `whole`.
void expect_slice_bytes(const Nvfp4Linear& got, const Nvfp4Linear& whole, int64_t row0,
                        int64_t col0, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_LE(row0 + got.out_features, whole.out_features);
  ASSERT_LE(col0 + got.in_features, whole.in_features);
  EXPECT_EQ(got.weight_scale_2, whole.weight_scale_2);  // global scales unchanged
  EXPECT_EQ(got.input_scale, whole.input_scale);
  const int64_t gc = got.in_features / 2, wc = whole.in_features / 2;
  const int64_t gs = got.in_features / 16, ws = whole.in_features / 16;
  int64_t code_mismatch = 0, scale_mismatch = 0;
  for (int64_t r = 0; r < got.out_features; ++r) {
    code_mismatch += std::memcmp(got.weight + r * gc, whole.weight + (row0 + r) * wc + col0 / 2,
                                 static_cast<size_t>(gc)) != 0;
    scale_mismatch += std::memcmp(got.weight_scale + r * gs,
                                  whole.weight_scale + (row0 + r) * ws + col0 / 16,
                                  static_cast<size_t>(gs)) != 0;
  }
  EXPECT_EQ(code_mismatch, 0) << "rows whose code bytes differ";
  EXPECT_EQ(scale_mismatch, 0) << "rows whose scale bytes differ";
}

TEST(TpSlice, EveryRanksSliceIsTheWholeTensorsBytes) {
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t H = 128, I = 512, E = 3, Is = 1024;
  MoeLayer layer = testing::random_layer(rng, H, I, E, 2, Is, 7.0f);
  layer.router_weight.assign(static_cast<size_t>(E * H), 0.25f);
  for (ExpertWeights& x : layer.experts) x.down.input_scale = 0.125f;  // carried unchanged
  for (int R : {1, 2, 4, 8}) {
    for (int r = 0; r < R; ++r) {
      SCOPED_TRACE(::testing::Message() << "rank " << r << " of " << R);
      const MoeLayer local = tp_local_layer(layer, TpConfig{R, r});
      EXPECT_NO_THROW(local.validate());
      EXPECT_EQ(local.hidden_size, H);
      EXPECT_EQ(local.intermediate_size, I / R);
      EXPECT_EQ(local.num_experts, E);
      EXPECT_EQ(local.routing.top_k, layer.routing.top_k);
      EXPECT_EQ(local.swiglu_limit, layer.swiglu_limit);
      EXPECT_EQ(local.router_weight, layer.router_weight);  // every rank routes every token
      for (int64_t e = 0; e < E; ++e) {
        const ExpertWeights& w = layer.experts[static_cast<size_t>(e)];
        const ExpertWeights& l = local.experts[static_cast<size_t>(e)];
        const std::string ex = "expert " + std::to_string(e);
        // gate/up: views (no copy) at row r·I/R; down: an owned copy of columns r·I/R.
        EXPECT_EQ(l.gate.weight, w.gate.weight + r * (I / R) * (H / 2));
        EXPECT_EQ(l.up.weight_scale, w.up.weight_scale + r * (I / R) * (H / 16));
        EXPECT_EQ(l.gate.owner, w.gate.owner);
        EXPECT_EQ(l.down.out_features, H);
        EXPECT_EQ(l.down.in_features, I / R);
        expect_slice_bytes(l.gate, w.gate, r * (I / R), 0, ex + " gate");
        expect_slice_bytes(l.up, w.up, r * (I / R), 0, ex + " up");
        expect_slice_bytes(l.down, w.down, 0, r * (I / R), ex + " down");
      }
      ASSERT_TRUE(local.shared_expert.has_value());
      EXPECT_EQ(local.shared_expert->intermediate_size(), Is / R);
      expect_slice_bytes(local.shared_expert->gate, layer.shared_expert->gate, r * (Is / R), 0,
                         "shared gate");
      expect_slice_bytes(local.shared_expert->up, layer.shared_expert->up, r * (Is / R), 0,
                         "shared up");
      expect_slice_bytes(local.shared_expert->down, layer.shared_expert->down, 0, r * (Is / R),
                         "shared down");
    }
  }
}

TEST(TpSlice, RejectsWhatCannotBeSliced) {
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  // A shared expert whose I splits over 2 but not into multiples of 64.
  const MoeLayer odd_shared = testing::random_layer(rng, 64, 256, 2, 1, 320);
  EXPECT_NO_THROW(tp_local_layer(odd_shared, TpConfig{1, 0}));
  EXPECT_MEGAMOE_ERROR(tp_local_layer(odd_shared, TpConfig{2, 0}), kInvalidArgument,
                       "the shared expert's intermediate size = 320", "slices of 160");
  const MoeLayer layer = testing::random_layer(rng, 64, 256, 2, 1);
  EXPECT_MEGAMOE_ERROR(tp_local_layer(layer, TpConfig{8, 0}), kInvalidArgument,
                       "intermediate_size = 256 over 8 ranks gives slices of 32");
  EXPECT_MEGAMOE_ERROR(tp_local_layer(layer, TpConfig{3, 0}), kInvalidArgument, "over 3 ranks");
  EXPECT_MEGAMOE_ERROR(tp_local_layer(layer, TpConfig{2, 2}), kInvalidArgument, "rank 2");
  EXPECT_MEGAMOE_ERROR(tp_local_layer(layer, TpConfig{16, 0}), kInvalidArgument, "world size 16");
  MoeLayer broken = layer;
  broken.experts.pop_back();  // an invalid layer is refused before it is sliced
  EXPECT_MEGAMOE_ERROR(tp_local_layer(broken, TpConfig{2, 0}), kInvalidArgument, "has 1 experts");
}

// ---------------------------------------------------------------------------------------------
// The reference: Σ of the ranks' partial outputs against the whole layer

// bf16 values as integers in value order (+0 and -0 both 0): their difference counts ulps.
int32_t bf16_order(uint16_t b) { return (b & 0x8000) ? -int32_t(b & 0x7FFF) : int32_t(b); }

struct SumCase {
  int64_t H, I, E, Is;
  std::vector<int> world_sizes;
};

// For every R: the partials of R ranks (reference::moe_forward_f32 of each tp_local_layer), then
//  - fp32: |combine - whole| <= 2^-24·(Σ_r|p_r| + |combine| + |whole|) per element (each rank
//    rounds its double sum to fp32 once, and each side rounds its total once; the double sums'
//    reassociation, ~2^-53 per exact term, is covered by a slack of 1e-9 of the outputs' RMS),
//    and the relative L2 error <= 1e-6 (the bound above summed: about 3·2^-24 ≈ 1.8e-7 unless
//    the partials cancel);
//  - bf16 (reference::tp_combine vs reference::moe_forward, one rounding each): no element more
//    than one ulp apart, and one ulp only where the two straddle a rounding boundary, which an
//    fp32-sized difference does with probability ~2^-16 per element;
//  - R == 1: the rank's layer is the whole layer, so its fp32 output is the whole one, bitwise.
void check_partials_sum_to_whole(const MoeLayer& layer, const std::vector<uint16_t>& hidden,
                                 const reference::TopK& topk, const std::vector<int>& world_sizes,
                                 double* worst_rel_l2) {
  const int64_t T = topk.tokens;
  const std::vector<float> whole32 = reference::moe_forward_f32(layer, hidden, T, topk);
  const std::vector<uint16_t> whole16 = reference::moe_forward(layer, hidden, T, topk);
  double rms = 0;
  for (float v : whole32) rms += double(v) * v;
  rms = std::sqrt(rms / double(whole32.size()));
  for (int R : world_sizes) {
    SCOPED_TRACE(::testing::Message() << "R=" << R);
    std::vector<std::vector<float>> partials;
    for (int r = 0; r < R; ++r) {
      partials.push_back(
          reference::moe_forward_f32(tp_local_layer(layer, TpConfig{R, r}), hidden, T, topk));
    }
    const std::vector<float> sum32 = reference::tp_combine_f32(partials);
    const std::vector<uint16_t> sum16 = reference::tp_combine(partials);
    ASSERT_EQ(sum32.size(), whole32.size());
    if (R == 1) {
      EXPECT_EQ(0, std::memcmp(sum32.data(), whole32.data(), sum32.size() * sizeof(float)))
          << "one rank's partial is the whole layer's fp32 output";
    }
    int64_t over_bound = 0, one_ulp = 0, more = 0;
    for (size_t i = 0; i < sum32.size(); ++i) {
      double abs_partials = 0;
      for (const auto& p : partials) abs_partials += std::fabs(double(p[i]));
      const double diff = std::fabs(double(sum32[i]) - double(whole32[i]));
      const double bound =
          std::ldexp(abs_partials + std::fabs(double(sum32[i])) + std::fabs(double(whole32[i])),
                     -24) * (1 + 1e-6) + 1e-9 * rms;
      if (diff > bound) {
        if (over_bound++ < 5) {
          ADD_FAILURE() << "element " << i << ": combined " << sum32[i] << ", whole " << whole32[i]
                        << ", |diff| " << diff << " > bound " << bound;
        }
      }
      // Where the partials cancel (the output far below their magnitudes), bf16 ulps are tiny and
      // the fp32 difference allowed above spans many of them: there the rounded outputs must
      // agree within one bf16 ulp of the partials' magnitude instead (docs/design.md §7.1).
      const int32_t ulps = std::abs(bf16_order(sum16[i]) - bf16_order(whole16[i]));
      const double rounded_diff = std::fabs(double(bf16_to_f32(sum16[i])) - double(bf16_to_f32(whole16[i])));
      const bool cancelled = rounded_diff <= std::ldexp(abs_partials, -8);
      one_ulp += ulps == 1;
      more += ulps > 1 && !cancelled;
    }
    const double rel_l2 = testing::rel_l2(sum32, whole32);
    *worst_rel_l2 = std::max(*worst_rel_l2, rel_l2);
    EXPECT_EQ(over_bound, 0);
    EXPECT_LE(rel_l2, 1e-6);
    EXPECT_EQ(more, 0) << "bf16 elements more than one ulp apart";
    EXPECT_LE(one_ulp, 2 + int64_t(sum16.size()) / 1000) << "bf16 elements one ulp apart";
  }
}

TEST(TpReference, PartialsSumToTheWholeLayer) {
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t T = 6;
  // Shapes like the presets' (I a multiple of 64·R, the shared expert 1x or 2x I), small enough
  // for a few seconds: up to 4-way TP at I = 256, 8-way at I = 512.
  const std::vector<SumCase> cases = {{128, 256, 8, 256, {1, 2, 4}},
                                      {64, 512, 12, 1024, {1, 2, 4, 8}}};
  double worst = 0;
  for (const SumCase& c : cases) {
    for (bool shared : {false, true}) {
      for (bool clamp : {false, true}) {
        for (int k = 1; k <= 8; ++k) {
          SCOPED_TRACE(::testing::Message() << "H=" << c.H << " I=" << c.I << " E=" << c.E
                                            << " shared=" << shared << " clamp=" << clamp
                                            << " k=" << k);
          // A clamp of 0.75 cuts a large part of g and u (both ~N(0, 1) here): the clamp is
          // element-wise on gate and up, so slicing I keeps it exact.
          const MoeLayer layer =
              testing::random_layer(rng, c.H, c.I, c.E, k, shared ? c.Is : 0,
                                    clamp ? std::optional<float>(0.75f) : std::nullopt);
          const auto hidden = testing::random_hidden(rng, T, c.H);
          const auto topk = testing::random_topk(rng, T, c.E, k);
          check_partials_sum_to_whole(layer, hidden, topk, c.world_sizes, &worst);
          if (::testing::Test::HasFatalFailure()) return;
        }
      }
    }
  }
  std::printf("[ TP sums     ] worst relative L2 of Σ partials (fp32) vs the whole layer: %.3g\n",
              worst);
}

// Repeated ids count twice on every rank, and a routing weight of 0 leaves only the shared
// expert: both distribute over the ranks like any other weight.
TEST(TpReference, RepeatedIdsAndZeroWeightsDistributeOverRanks) {
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const MoeLayer layer = testing::random_layer(rng, 64, 256, 4, 3, 256);
  const auto hidden = testing::random_hidden(rng, 3, 64);
  reference::TopK topk;
  topk.tokens = 3;
  topk.k = 3;
  topk.ids = {1, 1, 2, 0, 3, 3, 2, 2, 2};
  topk.weights = {0.5f, 0.25f, 0.25f, 0.0f, 0.0f, 0.0f, 1.0f, -0.5f, 2.0f};
  double worst = 0;
  check_partials_sum_to_whole(layer, hidden, topk, {1, 2, 4}, &worst);
}

TEST(TpReference, CombineSumsInDoubleAndRoundsOnce) {
  // 1 + 2^-8 is the midpoint between bf16 1 and 1 + 2^-7; a second partial of 2^-30 is below half
  // an fp32 ulp of 1, so an fp32 sum would drop it and round the tie to even (1.0); the double sum
  // keeps it and rounds up, once.
  const std::vector<std::vector<float>> partials = {{1.0f + 0x1p-8f, -3.0f},
                                                    {0x1p-30f, 1.0f}};
  EXPECT_EQ(reference::tp_combine(partials), (std::vector<uint16_t>{0x3F81, 0xC000}));
  EXPECT_EQ(reference::tp_combine_f32(partials), (std::vector<float>{1.0f + 0x1p-8f, -2.0f}));
  // Ranks in order: with one rank the combine is that rank's values.
  EXPECT_EQ(reference::tp_combine_f32(std::vector<std::vector<float>>{{0.1f, -7.5f}}),
            (std::vector<float>{0.1f, -7.5f}));
  EXPECT_TRUE(reference::tp_combine(std::vector<std::vector<float>>{{}, {}}).empty());
  EXPECT_MEGAMOE_ERROR(reference::tp_combine({}), kInvalidArgument, "no partial outputs");
  const std::vector<std::vector<float>> ragged = {{1, 2, 3}, {1, 2, 3}, {1, 2}};
  EXPECT_MEGAMOE_ERROR(reference::tp_combine(ragged), kInvalidArgument,
                       "rank 2's partial output has 2 values; rank 0's has 3");
  EXPECT_MEGAMOE_ERROR(reference::tp_combine_f32(ragged), kInvalidArgument, "rank 2");
}

// ---------------------------------------------------------------------------------------------
// Loading one rank's slice

constexpr int64_t kLayer = 1;

// Which blocks of a checkpoint to spoil: (tensor prefix, row, block) -> poison?
struct Poison {
  std::function<bool(const std::string&, int64_t, int64_t)> at;
};

// A scratch directory and a fresh seed (in every failure's trace) per test.
class TpLoad : public ::testing::Test {
 protected:

  // dir_/name: a DeepSeek-V3-style checkpoint (config.json + model.safetensors, ModelOpt names)
  // of one MoE layer holding the bytes of `layer`, except that every block `poison` names gets a
  // NaN scale byte (0x7F) and scrambled code bytes. Returns the directory.
  std::string write(const std::string& name, const MoeLayer& layer, const Poison* poison) {
    const fs::path d = dir_ / name;
    fs::create_directories(d);
    std::ofstream(d / "config.json")
        << "{\"architectures\": [\"DeepseekV3ForCausalLM\"], \"model_type\": \"deepseek_v3\","
        << " \"hidden_size\": " << layer.hidden_size
        << ", \"moe_intermediate_size\": " << layer.intermediate_size
        << ", \"n_routed_experts\": " << layer.num_experts
        << ", \"num_experts_per_tok\": " << layer.routing.top_k
        << ", \"n_shared_experts\": "
        << (layer.shared_expert ? layer.shared_expert->intermediate_size() / layer.intermediate_size : 0)
        << ", \"num_hidden_layers\": 2, \"first_k_dense_replace\": 1, \"moe_layer_freq\": 1,"
        << " \"norm_topk_prob\": true, \"scoring_func\": \"sigmoid\", \"topk_method\": \"noaux_tc\","
        << " \"n_group\": 1, \"topk_group\": 1, \"routed_scaling_factor\": 2.5,"
        << " \"hidden_act\": \"silu\"}\n";
    std::vector<std::pair<TensorSpec, std::vector<uint8_t>>> tensors;
    const std::string mlp = "model.layers." + std::to_string(kLayer) + ".mlp";
    auto add_linear = [&](const std::string& prefix, const Nvfp4Linear& w) {
      const int64_t N = w.out_features, K = w.in_features;
      std::vector<uint8_t> codes(w.weight, w.weight + N * K / 2);
      std::vector<uint8_t> scales(w.weight_scale, w.weight_scale + N * K / 16);
      if (poison) {
        for (int64_t r = 0; r < N; ++r) {
          for (int64_t b = 0; b < K / 16; ++b) {
            if (!poison->at(prefix, r, b)) continue;
            scales[static_cast<size_t>(r * (K / 16) + b)] = 0x7F;
            for (int64_t j = 0; j < 8; ++j) {
              codes[static_cast<size_t>(r * (K / 2) + b * 8 + j)] ^= 0x5A;
            }
          }
        }
      }
      tensors.push_back({{prefix + ".weight", DType::U8, {N, K / 2}}, std::move(codes)});
      tensors.push_back({{prefix + ".weight_scale", DType::F8_E4M3, {N, K / 16}}, std::move(scales)});
      std::vector<uint8_t> s2(4);
      std::memcpy(s2.data(), &w.weight_scale_2, 4);
      tensors.push_back({{prefix + ".weight_scale_2", DType::F32, {}}, std::move(s2)});
    };
    for (size_t e = 0; e < layer.experts.size(); ++e) {
      const std::string p = mlp + ".experts." + std::to_string(e);
      add_linear(p + ".gate_proj", layer.experts[e].gate);
      add_linear(p + ".up_proj", layer.experts[e].up);
      add_linear(p + ".down_proj", layer.experts[e].down);
    }
    if (layer.shared_expert) {
      add_linear(mlp + ".shared_experts.gate_proj", layer.shared_expert->gate);
      add_linear(mlp + ".shared_experts.up_proj", layer.shared_expert->up);
      add_linear(mlp + ".shared_experts.down_proj", layer.shared_expert->down);
    }
    std::vector<uint8_t> router, bias;
    for (float v : layer.router_weight) {
      const uint16_t b = f32_to_bf16(v);
      router.push_back(static_cast<uint8_t>(b));
      router.push_back(static_cast<uint8_t>(b >> 8));
    }
    for (float v : layer.e_score_correction_bias) {
      uint8_t b[4];
      std::memcpy(b, &v, 4);
      bias.insert(bias.end(), b, b + 4);
    }
    tensors.push_back({{mlp + ".gate.weight", DType::BF16, {layer.num_experts, layer.hidden_size}},
                       std::move(router)});
    tensors.push_back(
        {{mlp + ".gate.e_score_correction_bias", DType::F32, {layer.num_experts}}, std::move(bias)});
    std::vector<std::pair<TensorSpec, std::span<const uint8_t>>> spans;
    for (const auto& [spec, bytes] : tensors) spans.push_back({spec, bytes});
    write_safetensors((d / "model.safetensors").string(), spans);
    return d.string();
  }

  // A layer the checkpoint can hold exactly: a bf16 router, the noaux_tc routing of the config.
  MoeLayer random_layer(int64_t H, int64_t I, int64_t E, int k, int64_t Is) {
    MoeLayer layer = testing::random_layer(rng_, H, I, E, k, Is);
    std::normal_distribution<float> n(0.0f, 0.1f);
    for (int64_t i = 0; i < E * H; ++i) layer.router_weight.push_back(bf16_to_f32(f32_to_bf16(n(rng_))));
    for (int64_t i = 0; i < E; ++i) layer.e_score_correction_bias.push_back(n(rng_));
    layer.routing.kind = RoutingKind::kNoauxTc;
    layer.routing.routed_scaling_factor = 2.5f;
    return layer;
  }

  static std::pair<Checkpoint, ModelConfig> open(const std::string& dir) {
    return {Checkpoint::open(dir), load_model_config(dir)};
  }

  const testing::ScratchDir scratch_{"megamoe_tp"};
  const fs::path dir_ = scratch_.path();
  const testing::SeedTrace seed_;
  testing::Rng rng_{seed_};
};

void expect_same_linear(const Nvfp4Linear& a, const Nvfp4Linear& b, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(a.out_features, b.out_features);
  ASSERT_EQ(a.in_features, b.in_features);
  EXPECT_EQ(a.weight_scale_2, b.weight_scale_2);
  EXPECT_EQ(0, std::memcmp(a.weight, b.weight, static_cast<size_t>(a.out_features * a.in_features / 2)));
  EXPECT_EQ(0, std::memcmp(a.weight_scale, b.weight_scale,
                           static_cast<size_t>(a.out_features * a.in_features / 16)));
}

void expect_same_layer(const MoeLayer& a, const MoeLayer& b) {
  ASSERT_EQ(a.experts.size(), b.experts.size());
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  for (size_t e = 0; e < a.experts.size(); ++e) {
    expect_same_linear(a.experts[e].gate, b.experts[e].gate, "gate " + std::to_string(e));
    expect_same_linear(a.experts[e].up, b.experts[e].up, "up " + std::to_string(e));
    expect_same_linear(a.experts[e].down, b.experts[e].down, "down " + std::to_string(e));
  }
  ASSERT_EQ(a.shared_expert.has_value(), b.shared_expert.has_value());
  if (a.shared_expert) {
    expect_same_linear(a.shared_expert->gate, b.shared_expert->gate, "shared gate");
    expect_same_linear(a.shared_expert->up, b.shared_expert->up, "shared up");
    expect_same_linear(a.shared_expert->down, b.shared_expert->down, "shared down");
  }
  EXPECT_EQ(a.router_weight, b.router_weight);
  EXPECT_EQ(a.e_score_correction_bias, b.e_score_correction_bias);
}

TEST_F(TpLoad, RankLoadIsTheSliceOfTheWholeLoad) {
  const MoeLayer layer = random_layer(64, 256, 4, 2, 512);
  const std::string dir = write("clean", layer, nullptr);
  // Named, not a structured binding: lambdas below capture them (clang 14 cannot capture bindings).
  const auto opened = open(dir);
  const Checkpoint& ckpt = opened.first;
  const ModelConfig& config = opened.second;
  const MoeLayer whole = load_moe_layer(ckpt, config, kLayer);
  for (int R : {1, 2, 4}) {
    for (int r = 0; r < R; ++r) {
      SCOPED_TRACE(::testing::Message() << "rank " << r << " of " << R);
      const MoeLayer rank = load_moe_layer_tp(ckpt, config, kLayer, TpConfig{R, r});
      expect_same_layer(rank, tp_local_layer(whole, TpConfig{R, r}));
      // gate/up stay views into the mapped file.
      EXPECT_EQ(rank.experts[1].gate.weight, whole.experts[1].gate.weight + r * (256 / R) * 32);
    }
  }
  EXPECT_MEGAMOE_ERROR(load_moe_layer_tp(ckpt, config, kLayer, TpConfig{8, 0}), kInvalidArgument,
                       "moe_intermediate_size = 256 over 8 ranks gives slices of 32");
  EXPECT_MEGAMOE_ERROR(load_moe_layer_tp(ckpt, config, kLayer, TpConfig{2, 5}), kInvalidArgument,
                       "rank 5");
}

// The loader checks block scales eagerly, but for a TP rank only its slice's: NaN scales (and
// scrambled codes) in every other rank's part of every expert do not stop rank 0 from loading,
// and its reference output is the clean checkpoint's bitwise (it never read those bytes); the
// whole-layer load and the other ranks' loads report the bad scale in whole-tensor coordinates.
TEST_F(TpLoad, RankReadsOnlyItsSlice) {
  const int64_t H = 64, I = 256, E = 4, Is = 512;
  const int R = 4;
  const MoeLayer layer = random_layer(H, I, E, 2, Is);
  // Poison everything outside rank 0's slice: gate/up rows >= I/R, down blocks >= I/(16R).
  Poison outside_rank0{[&](const std::string& prefix, int64_t row, int64_t block) {
    const bool shared = prefix.find("shared") != std::string::npos;
    const int64_t slice = (shared ? Is : I) / R;
    if (prefix.ends_with("down_proj")) return block >= slice / 16;
    return row >= slice;
  }};
  const auto [clean_ckpt, clean_config] = open(write("clean", layer, nullptr));
  const auto opened = open(write("poisoned", layer, &outside_rank0));
  const Checkpoint& ckpt = opened.first;
  const ModelConfig& config = opened.second;

  EXPECT_MEGAMOE_ERROR(load_moe_layer(ckpt, config, kLayer), kInvalidCheckpoint,
                       "has block scale 0x7F at row 64, block 0", "NaN");
  const MoeLayer rank0 = load_moe_layer_tp(ckpt, config, kLayer, TpConfig{R, 0});
  const MoeLayer clean0 = load_moe_layer_tp(clean_ckpt, clean_config, kLayer, TpConfig{R, 0});
  expect_same_layer(rank0, clean0);

  const int64_t T = 5;
  const auto hidden = testing::random_hidden(rng_, T, H);
  const auto logits = reference::router_logits(rank0, hidden, T);
  const auto topk = reference::route(rank0.routing, logits, T, E, rank0.e_score_correction_bias);
  const auto got = reference::moe_forward_f32(rank0, hidden, T, topk);
  const auto want = reference::moe_forward_f32(tp_local_layer(layer, TpConfig{R, 0}), hidden, T, topk);
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)));

  // Rank 1's slice holds the poison: the first bad byte, named where it is in the whole tensor.
  EXPECT_MEGAMOE_ERROR(load_moe_layer_tp(ckpt, config, kLayer, TpConfig{R, 1}), kInvalidCheckpoint,
                       "experts.0.gate_proj.weight_scale", "at row 64, block 0");
  // One block of one expert's down poisoned, in rank 2's columns (blocks 8..11 of 16): only rank
  // 2 reads it.
  Poison down_rank2{[&](const std::string& prefix, int64_t row, int64_t block) {
    return prefix.ends_with("experts.3.down_proj") && row == 17 && block == 2 * (I / R / 16) + 1;
  }};
  const auto opened2 = open(write("down", layer, &down_rank2));
  const Checkpoint& ckpt2 = opened2.first;
  const ModelConfig& config2 = opened2.second;
  for (int r = 0; r < R; ++r) {
    if (r == 2) {
      EXPECT_MEGAMOE_ERROR(load_moe_layer_tp(ckpt2, config2, kLayer, TpConfig{R, r}),
                           kInvalidCheckpoint, "experts.3.down_proj.weight_scale",
                           "at row 17, block 9 (elements 144 to 159)");
    } else {
      EXPECT_NO_THROW(load_moe_layer_tp(ckpt2, config2, kLayer, TpConfig{R, r})) << "rank " << r;
    }
  }
}

}  // namespace
}  // namespace megamoe
