// The GPU router (route_topk) against the CPU reference (reference::route) on fresh random logits
// every run (a different scale per token, random correction biases): ids must be identical, in
// the same order; weights may differ by one fp32 ulp (the device's double exp() need not be the
// host's to the last bit). Ties are tested on purpose with logits from a small set of values,
// where every selection is decided by the lower-index rule. Outputs are poisoned before each run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "megamoe/reference.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "tests/common/test_util.h"

namespace megamoe {
namespace {

using testing::DeviceBuffer;

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Routed run_gpu(const RoutingConfig& cfg, const std::vector<float>& logits, int64_t T, int64_t E,
               const std::vector<float>& bias, cudaStream_t stream = nullptr) {
  DeviceBuffer<float> d_logits(logits);
  DeviceBuffer<float> d_bias(bias.empty() ? std::vector<float>(1) : bias);  // uploads >= 1
  DeviceBuffer<int32_t> d_ids(static_cast<size_t>(T * cfg.top_k));
  DeviceBuffer<float> d_weights(static_cast<size_t>(T * cfg.top_k));
  d_ids.poison();      // -1: an id never written fails the comparison
  d_weights.poison();  // NaN
  RouteArgs a;
  a.logits = d_logits.get();
  a.bias = bias.empty() ? nullptr : d_bias.get();
  a.tokens = T;
  a.num_experts = E;
  a.topk_ids = d_ids.get();
  a.topk_weights = d_weights.get();
  route_topk(cfg, a, stream);
  gpu::check_cuda(cudaStreamSynchronize(stream), "route_topk");
  return {d_ids.download(), d_weights.download()};
}

// Logits [T, E]: normal with a scale drawn per token (0.25 .. 8), so some rows are nearly flat
// and others peaked.
std::vector<float> random_logits(testing::Rng& rng, int64_t T, int64_t E) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> scale(0.25f, 8.0f);
  std::vector<float> l(static_cast<size_t>(T * E));
  for (int64_t t = 0; t < T; ++t) {
    const float s = scale(rng);
    for (int64_t e = 0; e < E; ++e) l[static_cast<size_t>(t * E + e)] = s * n(rng);
  }
  return l;
}

std::vector<float> random_bias(testing::Rng& rng, int64_t E) {
  std::uniform_real_distribution<float> u(-0.1f, 0.1f);
  std::vector<float> b(static_cast<size_t>(E));
  for (auto& v : b) v = u(rng);
  return b;
}

std::string describe(const RoutingConfig& cfg, int64_t T, int64_t E, bool bias) {
  std::ostringstream os;
  os << routing_kind_name(cfg.kind) << " T=" << T << " E=" << E << " k=" << cfg.top_k
     << " renormalize=" << cfg.renormalize << " n_group=" << cfg.n_group
     << " topk_group=" << cfg.topk_group << " scale=" << cfg.routed_scaling_factor
     << " bias=" << bias;
  return os.str();
}

// Ids equal to the reference's (same order); weights within one fp32 ulp. Prints the first
// mismatches with their token's logits of the experts involved.
void expect_matches_reference(const RoutingConfig& cfg, const std::vector<float>& logits,
                              int64_t T, int64_t E, const std::vector<float>& bias) {
  const reference::TopK ref = reference::route(cfg, logits, T, E, bias);
  const Routed got = run_gpu(cfg, logits, T, E, bias);
  const int k = cfg.top_k;
  int64_t id_mismatches = 0, weight_mismatches = 0;
  std::ostringstream details;
  for (int64_t t = 0; t < T; ++t) {
    for (int j = 0; j < k; ++j) {
      const size_t i = static_cast<size_t>(t * k + j);
      const int32_t want = ref.ids[i], have = got.ids[i];
      if (want != have) {
        if (id_mismatches++ < 5) {
          details << "\n  token " << t << " slot " << j << ": id " << have << " (logit "
                  << (have >= 0 && have < E ? logits[static_cast<size_t>(t * E + have)] : NAN)
                  << "), reference " << want << " (logit "
                  << logits[static_cast<size_t>(t * E + want)] << ")";
        }
        continue;
      }
      const float w = ref.weights[i];
      const float lo = std::nextafter(w, -INFINITY), hi = std::nextafter(w, INFINITY);
      if (!(got.weights[i] >= lo && got.weights[i] <= hi)) {
        if (weight_mismatches++ < 5) {
          details << "\n  token " << t << " slot " << j << " (expert " << want << "): weight "
                  << got.weights[i] << ", reference " << w;
        }
      }
    }
  }
  EXPECT_EQ(id_mismatches, 0) << "ids differ from the reference" << details.str();
  EXPECT_EQ(weight_mismatches, 0) << "weights differ by more than one fp32 ulp" << details.str();
}

struct Case {
  const char* name;
  RoutingKind kind;
  int64_t E;
  int k;
  bool renormalize = true;
  int n_group = 1;
  int topk_group = 1;
  float scale = 1.0f;
  bool bias = false;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

RoutingConfig config_of(const Case& c) {
  return {.kind = c.kind,
          .top_k = c.k,
          .renormalize = c.renormalize,
          .n_group = c.n_group,
          .topk_group = c.topk_group,
          .routed_scaling_factor = c.scale};
}

class GpuRoutingCases : public ::testing::TestWithParam<Case> {};

TEST_P(GpuRoutingCases, RandomLogitsMatchReference) {
  MEGAMOE_REQUIRE_GPU();
  const Case& c = GetParam();
  const RoutingConfig cfg = config_of(c);
  for (int64_t T : {1, 3, 17, 1000}) {
    SCOPED_TRACE(describe(cfg, T, c.E, c.bias));
    const testing::SeedTrace seed;
    testing::Rng rng(seed);
    const auto logits = random_logits(rng, T, c.E);
    const auto bias = c.bias ? random_bias(rng, c.E) : std::vector<float>{};
    expect_matches_reference(cfg, logits, T, c.E, bias);
  }
}

// Logits (and biases) from a handful of values: most selections are exact ties, decided by the
// lower expert (and group) index alone.
TEST_P(GpuRoutingCases, TiesGoToTheLowerIndexAsInTheReference) {
  MEGAMOE_REQUIRE_GPU();
  const Case& c = GetParam();
  const RoutingConfig cfg = config_of(c);
  const int64_t T = 257;
  SCOPED_TRACE(describe(cfg, T, c.E, c.bias));
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  std::uniform_int_distribution<int> pick(0, 4);
  std::vector<float> logits(static_cast<size_t>(T * c.E));
  for (auto& l : logits) l = 0.5f * static_cast<float>(pick(rng) - 2);  // {-1, -0.5, 0, 0.5, 1}
  std::vector<float> bias;
  if (c.bias) {
    for (int64_t e = 0; e < c.E; ++e) bias.push_back(pick(rng) < 2 ? 0.25f : 0.0f);
  }
  expect_matches_reference(cfg, logits, T, c.E, bias);
}

INSTANTIATE_TEST_SUITE_P(
    Configs, GpuRoutingCases,
    ::testing::Values(
        Case{"softmax_qwen3_E128_k8", RoutingKind::kSoftmaxTopK, 128, 8, true},
        Case{"softmax_no_renorm_E60_k4", RoutingKind::kSoftmaxTopK, 60, 4, false},
        Case{"softmax_E8_k1", RoutingKind::kSoftmaxTopK, 8, 1, true},
        Case{"softmax_scaled_E256_k6", RoutingKind::kSoftmaxTopK, 256, 6, true, 1, 1, 1.5f},
        Case{"softmax_E4096_k16", RoutingKind::kSoftmaxTopK, 4096, 16, true},
        Case{"softmax_k_equals_E", RoutingKind::kSoftmaxTopK, 5, 5, true},
        Case{"noaux_deepseek_v3", RoutingKind::kNoauxTc, 256, 8, true, 8, 4, 2.5f, true},
        Case{"noaux_deepseek_v3_no_bias", RoutingKind::kNoauxTc, 256, 8, true, 8, 4, 2.5f, false},
        Case{"noaux_kimi_k2_one_group", RoutingKind::kNoauxTc, 384, 8, true, 1, 1, 2.827f, true},
        Case{"noaux_no_renorm", RoutingKind::kNoauxTc, 64, 6, false, 4, 2, 1.0f, true},
        Case{"noaux_groups_of_two", RoutingKind::kNoauxTc, 64, 5, true, 32, 3, 1.0f, true},
        // 2048 groups: the per-warp scratch needs more than 48 KB of shared memory.
        Case{"noaux_E4096_G2048", RoutingKind::kNoauxTc, 4096, 16, true, 2048, 8, 1.0f, true}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// Softmax probabilities that underflow to exactly 0 tie; the zeros are chosen by lower index.
TEST(GpuRouting, UnderflowedSoftmaxProbabilitiesTieByIndex) {
  MEGAMOE_REQUIRE_GPU();
  const int64_t T = 4, E = 64;
  std::vector<float> logits(static_cast<size_t>(T * E));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      logits[static_cast<size_t>(t * E + e)] = (e % 7 == static_cast<int64_t>(t)) ? 0.0f : -2000.0f;
    }
  }
  RoutingConfig cfg;
  cfg.top_k = 16;  // more than the 9-10 finite probabilities of a row
  expect_matches_reference(cfg, logits, T, E, {});
}

// noaux_tc where every sigmoid underflows: all weights 0 (the reference's rule), ids by index.
TEST(GpuRouting, NoauxAllSigmoidsUnderflowGiveZeroWeights) {
  MEGAMOE_REQUIRE_GPU();
  const int64_t T = 3, E = 32;
  const std::vector<float> logits(static_cast<size_t>(T * E), -800.0f);
  const RoutingConfig cfg{
      .kind = RoutingKind::kNoauxTc, .top_k = 4, .n_group = 4, .topk_group = 2, .routed_scaling_factor = 2.5f};
  expect_matches_reference(cfg, logits, T, E, {});
  const Routed got = run_gpu(cfg, logits, T, E, {});
  for (float w : got.weights) EXPECT_EQ(w, 0.0f);
}

// Non-finite logits are outside the contract, but must never produce an id outside [0, E) or a
// repeated id in a row (the MoE kernels index weights with them).
TEST(GpuRouting, NonFiniteLogitsStillGiveDistinctValidIds) {
  MEGAMOE_REQUIRE_GPU();
  const int64_t T = 64, E = 32;
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  auto logits = random_logits(rng, T, E);
  const float specials[] = {NAN, INFINITY, -INFINITY};
  for (size_t i = 0; i < logits.size(); i += 3) logits[i] = specials[(i / 3) % 3];
  for (RoutingKind kind : {RoutingKind::kSoftmaxTopK, RoutingKind::kNoauxTc}) {
    RoutingConfig cfg;
    cfg.kind = kind;
    cfg.top_k = 6;
    cfg.n_group = kind == RoutingKind::kNoauxTc ? 4 : 1;
    cfg.topk_group = kind == RoutingKind::kNoauxTc ? 2 : 1;
    const Routed got = run_gpu(cfg, logits, T, E, {});
    for (int64_t t = 0; t < T; ++t) {
      std::set<int32_t> row;
      for (int j = 0; j < cfg.top_k; ++j) {
        const int32_t id = got.ids[static_cast<size_t>(t * cfg.top_k + j)];
        EXPECT_TRUE(id >= 0 && id < E) << routing_kind_name(kind) << " token " << t << " id " << id;
        row.insert(id);
      }
      EXPECT_EQ(row.size(), static_cast<size_t>(cfg.top_k)) << routing_kind_name(kind) << " token " << t;
    }
  }
}

TEST(GpuRouting, ZeroTokensIsANoOp) {
  MEGAMOE_REQUIRE_GPU();
  RoutingConfig cfg;
  RouteArgs a;
  a.tokens = 0;
  a.num_experts = 16;
  EXPECT_NO_THROW(route_topk(cfg, a, nullptr));
}

TEST(GpuRouting, GraphReplayEqualsEager) {
  MEGAMOE_REQUIRE_GPU();
  const int64_t T = 300, E = 256;
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const auto logits = random_logits(rng, T, E);
  const auto bias = random_bias(rng, E);
  const RoutingConfig cfg{
      .kind = RoutingKind::kNoauxTc, .top_k = 8, .n_group = 8, .topk_group = 4, .routed_scaling_factor = 2.5f};
  const Routed eager = run_gpu(cfg, logits, T, E, bias);

  DeviceBuffer<float> d_logits(logits), d_bias(bias);
  DeviceBuffer<int32_t> d_ids(static_cast<size_t>(T * cfg.top_k));
  DeviceBuffer<float> d_weights(static_cast<size_t>(T * cfg.top_k));
  d_ids.poison();
  d_weights.poison();
  RouteArgs a{d_logits.get(), d_bias.get(), T, E, d_ids.get(), d_weights.get()};
  cudaStream_t stream;
  gpu::check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  gpu::check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
  route_topk(cfg, a, stream);
  gpu::check_cuda(cudaStreamEndCapture(stream, &graph), "end capture");
  gpu::check_cuda(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  for (int rep = 0; rep < 3; ++rep) gpu::check_cuda(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
  gpu::check_cuda(cudaStreamSynchronize(stream), "replay");
  EXPECT_EQ(d_ids.download(), eager.ids);
  const auto replayed = d_weights.download();
  EXPECT_EQ(std::memcmp(replayed.data(), eager.weights.data(), replayed.size() * sizeof(float)), 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Every configuration the reference rejects, the GPU router rejects with kInvalidArgument.
TEST(GpuRouting, RejectsWhatTheReferenceRejects) {
  MEGAMOE_REQUIRE_GPU();
  DeviceBuffer<float> logits(64 * 4), bias(64);
  DeviceBuffer<int32_t> ids(64 * 4 * 64);
  DeviceBuffer<float> weights(64 * 4 * 64);
  auto attempt = [&](RoutingConfig cfg, int64_t T, int64_t E, bool with_bias,
                     const std::string& expected) {
    RouteArgs a{logits.get(), with_bias ? bias.get() : nullptr, T, E, ids.get(), weights.get()};
    try {
      route_topk(cfg, a, nullptr);
      ADD_FAILURE() << "no error; expected one mentioning '" << expected << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  RoutingConfig soft;
  soft.top_k = 2;
  RoutingConfig bad = soft;
  bad.top_k = 0;
  attempt(bad, 4, 64, false, "top_k");
  bad.top_k = 65;
  attempt(bad, 4, 64, false, "top_k");
  bad = soft;
  bad.routed_scaling_factor = 0.0f;
  attempt(bad, 4, 64, false, "routed_scaling_factor");
  bad.routed_scaling_factor = NAN;
  attempt(bad, 4, 64, false, "routed_scaling_factor");
  attempt(soft, 4, 64, true, "correction bias");
  attempt(soft, -1, 64, false, "tokens");
  attempt(soft, 4, 0, false, "num_experts");
  attempt(soft, 1, kRouteMaxExperts + 1, false, "num_experts");

  RoutingConfig noaux;
  noaux.kind = RoutingKind::kNoauxTc;
  noaux.top_k = 4;
  noaux.n_group = 8;
  noaux.topk_group = 4;
  bad = noaux;
  bad.n_group = 3;  // does not divide 64
  attempt(bad, 4, 64, true, "n_group");
  bad.n_group = 0;
  attempt(bad, 4, 64, true, "n_group");
  bad = noaux;
  bad.n_group = 64;  // groups of one expert
  bad.topk_group = 4;
  attempt(bad, 4, 64, true, "at least 2 experts");
  bad = noaux;
  bad.topk_group = 9;
  attempt(bad, 4, 64, true, "topk_group");
  bad.topk_group = 0;
  attempt(bad, 4, 64, true, "topk_group");
  bad = noaux;
  bad.topk_group = 1;
  bad.top_k = 9;  // one kept group of 8
  attempt(bad, 4, 64, true, "kept groups");
  bad = noaux;
  bad.kind = static_cast<RoutingKind>(7);
  attempt(bad, 4, 64, false, "unknown");

  RouteArgs null_out{logits.get(), nullptr, 4, 64, nullptr, weights.get()};
  EXPECT_THROW(route_topk(soft, null_out, nullptr), Error);
}

}  // namespace
}  // namespace megamoe
