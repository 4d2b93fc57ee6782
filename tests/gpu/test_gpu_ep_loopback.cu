// The expert-parallel layer (include/megamoe/ep.h) on one GPU through the loopback transport: R
// virtual ranks, each on its own SM partition and stream, run the same device code as over NCCL.
// Every rank's output (poisoned first) is checked against the CPU reference of the whole layer
// over all ranks' tokens; fresh random data each run. Written so that nothing needs more than one
// GPU: the multi-GPU runs of the NCCL transport are `megamoe run/bench --ep R`.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <cstdio>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "megamoe/ep.h"
#include "megamoe/gpu.h"
#include "megamoe/reference.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "tests/common/error_matchers.h"
#include "tests/common/test_util.h"

namespace megamoe {
namespace {

using testing::kMaxRelL2;
using support::DeviceBuffer;

__global__ void record_sm_kernel(int32_t* sm_of_block) {
  if (threadIdx.x == 0) {
    int32_t sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    sm_of_block[blockIdx.x] = sm;
    // Long enough that the blocks of every rank are resident together.
    const auto start = clock64();
    while (clock64() - start < 200000) {
    }
  }
}

// Holds its stream for `ns` nanoseconds: an injected delay of one rank.
__global__ void delay_kernel(uint64_t ns) {
  uint64_t start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start >= ns) break;
  }
}

// Counts the elements of `got` that differ bitwise from `want`.
__global__ void count_mismatches_kernel(const uint16_t* got, const uint16_t* want, int64_t n,
                                        unsigned long long* mismatches) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    if (got[i] != want[i]) atomicAdd(mismatches, 1ull);
  }
}

bool loopback_available(int R) {
  // The test's own kernels are loaded before any rank spin-waits (a lazily loaded kernel's first
  // launch waits for the running ones).
  cudaFuncAttributes a{};
  for (const void* k : {reinterpret_cast<const void*>(&record_sm_kernel), reinterpret_cast<const void*>(&delay_kernel),
                        reinterpret_cast<const void*>(&count_mismatches_kernel)}) {
    gpu::check_cuda(cudaFuncGetAttributes(&a, k), "load test kernel");
  }
  try {
    EpLoopback::create(R);
    return true;
  } catch (const Error& e) {
    std::printf("[ SKIPPED  ] loopback R=%d: %s\n", R, e.what());
    return false;
  }
}

// One rank's inputs on the device and its output.
struct RankIo {
  int64_t tokens = 0;
  std::vector<uint16_t> hidden;
  reference::TopK topk;
  std::optional<DeviceBuffer<uint16_t>> d_hidden, d_out;
  std::optional<DeviceBuffer<int32_t>> d_ids;
  std::optional<DeviceBuffer<float>> d_w;

  MoeRunArgs args() const {
    MoeRunArgs a{};
    a.tokens = tokens;
    if (tokens > 0) {
      a.hidden = d_hidden->get();
      a.topk_ids = d_ids->get();
      a.topk_weights = d_w->get();
      a.output = d_out->get();
    }
    return a;
  }
};

// R virtual ranks of one layer.
struct LoopbackLayer {
  EpLoopback loopback;
  std::vector<MoeEpLayer> ranks;

  LoopbackLayer(const MoeLayer& layer, int R, int64_t max_t, bool deterministic, double timeout = 60.0,
                bool early_start = true)
      : loopback(EpLoopback::create(R)) {
    for (int r = 0; r < R; ++r) {
      EpConfig cfg;
      cfg.world_size = R;
      cfg.rank = r;
      cfg.max_tokens_per_rank = max_t;
      cfg.timeout_seconds = timeout;
      cfg.early_start = early_start;
      const EpExpertRange range = ep_expert_range(layer.num_experts, R, r);
      ranks.push_back(MoeEpLayer::create(ep_local_layer(layer, range), layer.num_experts, cfg, loopback,
                                         deterministic));
    }
  }
  int world() const { return loopback.world_size(); }
  // Poisons the outputs, then runs every rank. The ranks' streams are non-blocking: the uploads
  // and the poison (on the null stream) are waited for first.
  void run(std::vector<RankIo>& io) {
    for (int r = 0; r < world(); ++r) {
      if (io[r].tokens > 0) io[r].d_out->poison();
    }
    gpu::check_cuda(cudaDeviceSynchronize(), "inputs");
    for (int r = 0; r < world(); ++r) ranks[r].run(io[r].args(), loopback.stream(r));
    for (int r = 0; r < world(); ++r) ranks[r].check(loopback.stream(r));
  }
};

std::vector<RankIo> draw_inputs(testing::Rng& rng, const std::vector<int64_t>& tokens, int64_t H, int64_t E, int k,
                                int only_expert = -1) {
  std::vector<RankIo> io(tokens.size());
  for (size_t r = 0; r < tokens.size(); ++r) {
    RankIo& x = io[r];
    x.tokens = tokens[r];
    x.hidden = testing::random_hidden(rng, x.tokens, H);
    x.topk = testing::random_topk(rng, x.tokens, E, k, only_expert);
    if (x.tokens == 0) continue;
    x.d_hidden.emplace(x.hidden);
    x.d_ids.emplace(x.topk.ids);
    x.d_w.emplace(x.topk.weights);
    x.d_out.emplace(static_cast<size_t>(x.tokens * H));
  }
  return io;
}

// Every rank's output against the reference of the whole layer over all ranks' tokens, in rank
// order, rounded to bf16 as the layer's output is (so that the bound measures the layer's error,
// not the draw's rounding: a rare draw cannot fail it); ids outside [0, E) are dropped there
// (weight 0), as the layer skips them.
void expect_matches_reference(const MoeLayer& layer, const std::vector<RankIo>& io, const std::string& what) {
  std::vector<uint16_t> hidden, got;
  reference::TopK all;
  all.k = io[0].topk.k;
  for (const RankIo& x : io) {
    hidden.insert(hidden.end(), x.hidden.begin(), x.hidden.end());
    for (size_t i = 0; i < x.topk.ids.size(); ++i) {
      const bool valid = x.topk.ids[i] >= 0 && x.topk.ids[i] < layer.num_experts;
      all.ids.push_back(valid ? x.topk.ids[i] : 0);
      all.weights.push_back(valid ? x.topk.weights[i] : 0.0f);
    }
    all.tokens += x.tokens;
    if (x.tokens > 0) {
      const std::vector<uint16_t> out = x.d_out->download();
      got.insert(got.end(), out.begin(), out.end());
    }
  }
  if (all.tokens == 0) return;
  const auto want = testing::widen(reference::moe_forward(layer, hidden, all.tokens, all));
  const testing::ErrorStats e = testing::compare(got, want);
  EXPECT_EQ(e.nonfinite, 0) << what << ": non-finite or unwritten outputs";
  EXPECT_LE(e.rel_l2, kMaxRelL2) << what;
  std::printf("[ loopback ] %s: %lld tokens, rel_l2 %.3g\n", what.c_str(), (long long)all.tokens, e.rel_l2);
}

TEST(GpuEpLoopback, RanksRunOnDisjointSms) {
  MEGAMOE_REQUIRE_GPU();
  for (int R : {2, 4, 8}) {
    if (!loopback_available(R)) continue;
    const EpLoopback lb = EpLoopback::create(R);
    const int blocks = 4 * lb.sms_per_rank();
    std::vector<std::unique_ptr<DeviceBuffer<int32_t>>> sms;
    for (int r = 0; r < R; ++r) {
      sms.push_back(std::make_unique<DeviceBuffer<int32_t>>(static_cast<size_t>(blocks)));
      sms.back()->poison();
    }
    gpu::check_cuda(cudaDeviceSynchronize(), "poison");  // the ranks' streams do not wait for the null stream
    for (int r = 0; r < R; ++r) {
      record_sm_kernel<<<blocks, 32, 0, lb.stream(r)>>>(sms[r]->get());
      gpu::check_cuda(cudaGetLastError(), "record_sm_kernel");
    }
    std::set<int32_t> seen_by_others;
    for (int r = 0; r < R; ++r) {
      gpu::check_cuda(cudaStreamSynchronize(lb.stream(r)), "record_sm_kernel");
      const std::vector<int32_t> got = sms[r]->download();
      const std::set<int32_t> mine(got.begin(), got.end());
      EXPECT_LE(static_cast<int>(mine.size()), lb.sms_per_rank()) << "R=" << R << " rank " << r;
      for (int32_t sm : mine) {
        EXPECT_GE(sm, 0) << "R=" << R << " rank " << r << ": a block did not run";
        EXPECT_EQ(seen_by_others.count(sm), 0u) << "R=" << R << " rank " << r << " ran on SM " << sm
                                                 << ", which another rank's partition holds";
      }
      seen_by_others.insert(mine.begin(), mine.end());
    }
    std::printf("[ loopback ] R=%d: %d SMs per rank, %zu SMs used in all\n", R, lb.sms_per_rank(),
                seen_by_others.size());
  }
}

// Random tokens per rank (0 and max_t included), an invalid id, with and without the shared
// expert, both combines.
TEST(GpuEpLoopback, MatchesTheReferenceOverAllRanks) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t H = 256, I = 256, E = 32, max_t = 24;
  const int k = 4;
  for (int R : {2, 4, 8}) {
    if (!loopback_available(R)) continue;
    for (int64_t shared_I : {int64_t{0}, int64_t{512}}) {
      for (bool deterministic : {false, true}) {
        const MoeLayer layer = testing::random_layer(rng, H, I, E, k, shared_I, 4.0f);
        LoopbackLayer lb(layer, R, max_t, deterministic);
        std::vector<int64_t> tokens(R);
        for (int r = 0; r < R; ++r) tokens[r] = rng.uniform_int(0, static_cast<int>(max_t));
        tokens[0] = max_t;
        tokens[R - 1] = 0;
        std::vector<RankIo> io = draw_inputs(rng, tokens, H, E, k);
        // An id past E and a negative one: counted and skipped.
        io[0].topk.ids[1] = static_cast<int32_t>(E);
        io[0].topk.ids[k + 2] = -3;
        io[0].d_ids->upload(io[0].topk.ids);
        lb.run(io);
        const std::string what = "R=" + std::to_string(R) + " shared_I=" + std::to_string(shared_I) +
                                 (deterministic ? " deterministic" : " atomic");
        expect_matches_reference(layer, io, what);
        EXPECT_EQ(lb.ranks[0].invalid_id_count(lb.loopback.stream(0)), 2) << what;
        // All tokens of every rank on the experts of one rank.
        const int owner = static_cast<int>(rng.uniform_int(0, R - 1));
        std::vector<RankIo> one = draw_inputs(rng, std::vector<int64_t>(R, max_t), H, E, 1,
                                              static_cast<int>(owner * (E / R)));
        const MoeLayer k1 = [&] {
          MoeLayer l = layer;
          l.routing.top_k = 1;
          return l;
        }();
        LoopbackLayer lb1(k1, R, max_t, deterministic);
        lb1.run(one);
        expect_matches_reference(k1, one, what + " all tokens to rank " + std::to_string(owner));
      }
    }
  }
}

// Rows wider than one pass of the exchange's row copies (256 threads x 8 vectors of 16 bytes:
// bf16 rows past H = 16384, fp32 partial sums past H = 8192) cross in several passes; the stage
// stamps of the run come in stage order on every rank.
TEST(GpuEpLoopback, WideRowsCrossInSeveralPasses) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t H = 16384 + 512, I = 128, E = 8, max_t = 5;
  const int k = 2, R = 2;
  if (!loopback_available(R)) return;
  const MoeLayer layer = testing::random_layer(rng, H, I, E, k, 128, 4.0f);
  LoopbackLayer lb(layer, R, max_t, /*deterministic=*/false);
  std::vector<RankIo> io = draw_inputs(rng, {max_t, 3}, H, E, k);
  lb.run(io);
  expect_matches_reference(layer, io, "H=" + std::to_string(H));
  for (int r = 0; r < R; ++r) {
    const MoeEpLayer::StageStamps st = lb.ranks[r].stage_stamps(lb.loopback.stream(r));
    EXPECT_GT(st.send_begin, 0u) << "rank " << r;
    // Each stage's end follows its start (send_end and return_end are stamped after their release
    // stores, so the gate may open, and the partial sums arrive, first); the combine's grid, which
    // runs the return, waits for the local experts.
    EXPECT_LE(st.send_begin, st.send_end) << "rank " << r;
    EXPECT_LE(st.send_begin, st.gate_open) << "rank " << r;
    EXPECT_LE(st.gate_begin, st.gate_open) << "rank " << r;
    EXPECT_LE(st.gate_open, st.return_begin) << "rank " << r;
    EXPECT_LE(st.gate_open, st.combine_begin) << "rank " << r;
    EXPECT_LE(st.return_begin, st.return_end) << "rank " << r;
    EXPECT_LE(st.return_begin, st.partials_arrived) << "rank " << r;
    EXPECT_LE(st.combine_begin, st.partials_arrived) << "rank " << r;
    EXPECT_LE(st.partials_arrived, st.combine_end) << "rank " << r;
  }
}

// With world size 1 the layer is the single-GPU layer: the same bits as MoePlan + run.
TEST(GpuEpLoopback, WorldSizeOneIsTheSingleGpuLayer) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t H = 256, I = 512, E = 16, T = 9;
  const int k = 4;
  const MoeLayer layer = testing::random_layer(rng, H, I, E, k, 512);
  LoopbackLayer lb(layer, 1, T, /*deterministic=*/true);
  std::vector<RankIo> io = draw_inputs(rng, {T}, H, E, k);
  lb.run(io);
  MoeTuning tuning;
  tuning.num_sms = lb.loopback.sms_per_rank();
  testing::GpuMoe single(layer, T, /*deterministic=*/true, tuning);
  EXPECT_EQ(io[0].d_out->download(), single.run(io[0].hidden, io[0].topk));
  expect_matches_reference(layer, io, "R=1");
}

// Two layers of different shapes on one group per rank (one window, one scratch), run in turns
// as a model's layers are: each matches its reference, and the second layer, smaller in H, E,
// top-k and no larger in I (the workspace's L1 buffers scale with I), adds no window or scratch.
TEST(GpuEpLoopback, LayersShareOneGroup) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int R = 4;
  if (!loopback_available(R)) return;
  const int64_t max_t = 8;
  const MoeLayer big = testing::random_layer(rng, 512, 256, 32, 6, 256);
  const MoeLayer small = testing::random_layer(rng, 256, 256, 16, 4);
  const EpLoopback loopback = EpLoopback::create(R);
  std::vector<EpGroup> groups;
  std::vector<MoeEpLayer> first, second;
  for (int r = 0; r < R; ++r) {
    EpConfig cfg;
    cfg.world_size = R;
    cfg.rank = r;
    cfg.max_tokens_per_rank = max_t;
    groups.push_back(EpGroup::create(cfg, loopback, big.hidden_size, big.routing.top_k));
    first.push_back(MoeEpLayer::create(ep_local_layer(big, ep_expert_range(32, R, r)), 32, groups[r], true));
  }
  const size_t group_bytes = groups[0].device_bytes();
  for (int r = 0; r < R; ++r) {
    second.push_back(MoeEpLayer::create(ep_local_layer(small, ep_expert_range(16, R, r)), 16, groups[r], true));
  }
  EXPECT_EQ(groups[0].device_bytes(), group_bytes) << "the smaller layer fits the first one's window and scratch";
  for (int round = 0; round < 3; ++round) {
    for (const bool use_big : {true, false}) {
      const MoeLayer& layer = use_big ? big : small;
      std::vector<MoeEpLayer>& ranks = use_big ? first : second;
      std::vector<int64_t> tokens(R);
      for (int r = 0; r < R; ++r) tokens[r] = rng.uniform_int(0, static_cast<int>(max_t));
      std::vector<RankIo> io = draw_inputs(rng, tokens, layer.hidden_size, layer.num_experts, layer.routing.top_k);
      for (int r = 0; r < R; ++r) {
        if (io[r].tokens > 0) io[r].d_out->poison();
      }
      gpu::check_cuda(cudaDeviceSynchronize(), "inputs");
      for (int r = 0; r < R; ++r) ranks[r].run(io[r].args(), loopback.stream(r));
      for (int r = 0; r < R; ++r) ranks[r].check(loopback.stream(r));
      expect_matches_reference(layer, io, std::string(use_big ? "first" : "second") + " layer, round " +
                                              std::to_string(round));
    }
  }
  const MoeLayer wide = testing::random_layer(rng, 1024, 256, 32, 6);
  EXPECT_MEGAMOE_ERROR(MoeEpLayer::create(ep_local_layer(wide, ep_expert_range(32, R, 0)), 32, groups[0]),
                       kInvalidArgument, "exceed its group's window");
}

// A layer's experts (routed ones only, or the shared expert as a one-expert layer) in the stacked
// layout on the device, prepacked in place: the weights a rank holds once (EpLocalWeights).
struct HeldExperts {
  HeldExperts(const std::vector<ExpertWeights>& experts, int64_t H) {
    const int64_t I = experts[0].intermediate_size();
    std::vector<uint8_t> w13, w13s, w2, w2s;
    std::vector<float> g13, g2;
    auto append = [](std::vector<uint8_t>& v, const uint8_t* p, int64_t n) { v.insert(v.end(), p, p + n); };
    for (const ExpertWeights& x : experts) {
      append(w13, x.gate.weight, I * H / 2);
      append(w13, x.up.weight, I * H / 2);
      append(w13s, x.gate.weight_scale, I * H / 16);
      append(w13s, x.up.weight_scale, I * H / 16);
      append(w2, x.down.weight, H * I / 2);
      append(w2s, x.down.weight_scale, H * I / 16);
      g13.insert(g13.end(), {x.gate.weight_scale_2, x.up.weight_scale_2});
      g2.push_back(x.down.weight_scale_2);
    }
    d_w13.emplace(w13);
    d_w13s.emplace(w13s);
    d_w2.emplace(w2);
    d_w2s.emplace(w2s);
    d_g13.emplace(g13);
    d_g2.emplace(g2);
    b.hidden_size = H;
    b.intermediate_size = I;
    b.num_experts = static_cast<int64_t>(experts.size());
    b.w13 = d_w13->get();
    b.w13_scale = d_w13s->get();
    b.w13_scale_2 = d_g13->get();
    b.w2 = d_w2->get();
    b.w2_scale = d_w2s->get();
    b.w2_scale_2 = d_g2->get();
  }
  MoeDeviceWeights prepack() { return MoeDeviceWeights::prepack_in_place(b); }
  std::optional<DeviceBuffer<uint8_t>> d_w13, d_w13s, d_w2, d_w2s;
  std::optional<DeviceBuffer<float>> d_g13, d_g2;
  StackedNvfp4Buffers b;
};

// A rank's layer over weights it holds (prepacked in place) runs bitwise as the layer that
// uploads its own copy; mismatched weights are refused.
TEST(GpuEpLoopback, LayerOverHeldWeightsIsTheUploadedLayer) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int R = 4;
  if (!loopback_available(R)) return;
  const int64_t H = 256, I = 128, E = 16, Is = 256, max_t = 12;
  const int k = 4;
  const MoeLayer layer = testing::random_layer(rng, H, I, E, k, Is, 3.0f);
  LoopbackLayer uploaded(layer, R, max_t, /*deterministic=*/true);
  std::vector<std::unique_ptr<HeldExperts>> held;
  std::vector<MoeEpLayer> ranks;
  for (int r = 0; r < R; ++r) {
    EpConfig cfg;
    cfg.world_size = R;
    cfg.rank = r;
    cfg.max_tokens_per_rank = max_t;
    const EpGroup group = EpGroup::create(cfg, uploaded.loopback, H, k);
    const MoeLayer local = ep_local_layer(layer, ep_expert_range(E, R, r));
    held.push_back(std::make_unique<HeldExperts>(local.experts, H));
    held.push_back(std::make_unique<HeldExperts>(std::vector<ExpertWeights>{*layer.shared_expert}, H));
    EpLocalWeights w{held[2 * r]->prepack(), held[2 * r + 1]->prepack()};
    EXPECT_TRUE(w.routed.views_caller_memory());
    EpLayerOptions o;
    o.num_experts = E;
    o.top_k = k;
    o.swiglu_limit = 3.0f;
    o.deterministic = true;
    ranks.push_back(MoeEpLayer::create(std::move(w), o, group));
    EXPECT_LT(ranks.back().device_bytes(), size_t{4096}) << "the layer holds no copy of its weights";
  }
  for (int round = 0; round < 2; ++round) {
    std::vector<int64_t> tokens(R);
    for (int r = 0; r < R; ++r) tokens[r] = rng.uniform_int(0, static_cast<int>(max_t));
    std::vector<RankIo> a = draw_inputs(rng, tokens, H, E, k);
    std::vector<RankIo> b = draw_inputs(rng, tokens, H, E, k);
    for (int r = 0; r < R; ++r) {
      b[r].hidden = a[r].hidden;
      b[r].topk = a[r].topk;
      if (tokens[r] > 0) {
        b[r].d_hidden->upload(a[r].hidden);
        b[r].d_ids->upload(a[r].topk.ids);
        b[r].d_w->upload(a[r].topk.weights);
      }
    }
    uploaded.run(a);
    for (int r = 0; r < R; ++r) {
      if (b[r].tokens > 0) b[r].d_out->poison();
    }
    gpu::check_cuda(cudaDeviceSynchronize(), "inputs");
    for (int r = 0; r < R; ++r) ranks[r].run(b[r].args(), uploaded.loopback.stream(r));
    for (int r = 0; r < R; ++r) ranks[r].check(uploaded.loopback.stream(r));
    for (int r = 0; r < R; ++r) {
      if (tokens[r] > 0) EXPECT_EQ(a[r].d_out->download(), b[r].d_out->download()) << "rank " << r;
    }
    expect_matches_reference(layer, b, "held weights, round " + std::to_string(round));
  }

  EpConfig cfg;
  cfg.world_size = R;
  cfg.rank = 1;
  cfg.max_tokens_per_rank = max_t;
  const EpGroup group = EpGroup::create(cfg, uploaded.loopback, H, k);
  EpLayerOptions o;
  o.num_experts = E;
  o.top_k = k;
  HeldExperts too_many(std::vector<ExpertWeights>(layer.experts.begin(), layer.experts.begin() + 8), H);
  EXPECT_MEGAMOE_ERROR(MoeEpLayer::create(EpLocalWeights{too_many.prepack(), std::nullopt}, o, group),
                       kInvalidArgument, "the routed weights hold 8 experts; rank 1 of 4 owns 4");
  HeldExperts routed(ep_local_layer(layer, ep_expert_range(E, R, 1)).experts, H);
  HeldExperts two(std::vector<ExpertWeights>(layer.experts.begin(), layer.experts.begin() + 2), H);
  EXPECT_MEGAMOE_ERROR(MoeEpLayer::create(EpLocalWeights{routed.prepack(), two.prepack()}, o, group),
                       kInvalidArgument, "the shared weights must be a one-expert layer");
}

// The local experts' configuration for a rank's run of `hint` tokens (MoeEpLayer configures its
// gated plan so): the rank's experts, deterministic, the bound R * max_t, the rank's SM share.
std::string local_config(const MoeLayer& layer, int R, int64_t max_t, int sms, int64_t hint) {
  MoeProblem p;
  p.hidden_size = layer.hidden_size;
  p.intermediate_size = layer.intermediate_size;
  p.num_experts = layer.num_experts / R;
  p.top_k = layer.routing.top_k;
  p.max_tokens = R * max_t;
  p.deterministic = true;
  MoeTuning tuning;
  tuning.num_sms = sms;
  return MoePlan::create(p, tuning).describe(hint);
}

// Early start on gated rows (docs/design.md §7): the GEMM CTAs schedule their first items from
// the received ids while the dispatch runs, where the rows that arrived make a tiny batch (at most
// 32 valid ids among at most 256), and wait for the dispatch otherwise. Bitwise the output of the
// same layer with early start off, and the reference's, for batches on both sides of the limit:
// one token per rank (most received ids are other ranks', so the batch is compacted), up to 4
// per rank (near the limit), and every token on one rank's experts (not tiny). Each with a bound
// R * max_t * k that the one-CTA dispatch serves and one that needs the two-kernel dispatch.
TEST(GpuEpLoopback, EarlyStartOnGatedRowsIsBitwiseTheSame) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t H = 256, E = 64;  // at least k experts per rank at R = 8
  const int k = 8;
  for (int R : {2, 4, 8}) {
    if (!loopback_available(R)) continue;
    const int sms = EpLoopback::create(R).sms_per_rank();
    // A layer whose local plan runs fused with early start at one token (the waves of L1 items
    // per rank depend on I and the SM share).
    int64_t I = 0;
    for (int64_t candidate : {256, 512, 1024, 2048}) {
      const std::string c = local_config(testing::random_layer(rng, H, candidate, E, k, 0), R, 8, sms, 1);
      if (c.find(" fused") != std::string::npos && c.find("early-start") != std::string::npos) {
        I = candidate;
        break;
      }
    }
    ASSERT_GT(I, 0) << "R=" << R << ": no test layer runs its local experts fused with early start at T=1";
    const MoeLayer layer = testing::random_layer(rng, H, I, E, k, 256, 4.0f);
    const int64_t two_kernel_max_t = 4096 / (R * k) + 1;  // R * max_t * k past the one-CTA dispatch
    for (int64_t max_t : {int64_t{8}, two_kernel_max_t}) {
      ASSERT_NE(local_config(layer, R, max_t, sms, 4).find("early-start"), std::string::npos);
      LoopbackLayer on(layer, R, max_t, /*deterministic=*/true);
      LoopbackLayer off(layer, R, max_t, /*deterministic=*/true, 60.0, /*early_start=*/false);
      for (int pattern = 0; pattern < 3; ++pattern) {
        std::vector<int64_t> tokens(R, pattern == 2 ? 4 : 1);
        if (pattern == 1) {
          for (int r = 0; r < R; ++r) tokens[r] = rng.uniform_int(0, 4);
        }
        std::vector<RankIo> io = draw_inputs(rng, tokens, H, E, k);
        if (pattern == 2) {
          // Every id on rank 0's experts (with repeats): 32 * R valid ids arrive there.
          for (RankIo& x : io) {
            for (int32_t& id : x.topk.ids) id = static_cast<int32_t>(rng.uniform_int(0, static_cast<int>(E / R) - 1));
            x.d_ids->upload(x.topk.ids);
          }
        }
        const std::string what = "R=" + std::to_string(R) + " max_t=" + std::to_string(max_t) +
                                 (pattern == 0   ? " one token per rank"
                                  : pattern == 1 ? " 0-4 tokens per rank"
                                                 : " 4 tokens per rank, all to rank 0 (not tiny)");
        on.run(io);
        expect_matches_reference(layer, io, what + ", early start");
        std::vector<std::vector<uint16_t>> got(R);
        for (int r = 0; r < R; ++r) {
          if (tokens[r] > 0) got[r] = io[r].d_out->download();
        }
        off.run(io);
        for (int r = 0; r < R; ++r) {
          if (tokens[r] > 0) EXPECT_EQ(got[r], io[r].d_out->download()) << what << ": rank " << r;
        }
      }
    }
  }
}

// Ranks delayed at random before they run still give the reference's answer.
TEST(GpuEpLoopback, InjectedDelaysChangeNothing) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t H = 256, I = 256, E = 32, max_t = 8;
  const int k = 4, R = 4;
  if (!loopback_available(R)) return;
  const MoeLayer layer = testing::random_layer(rng, H, I, E, k, 256);
  LoopbackLayer lb(layer, R, max_t, /*deterministic=*/true);
  for (int round = 0; round < 4; ++round) {
    std::vector<int64_t> tokens(R);
    for (int r = 0; r < R; ++r) tokens[r] = rng.uniform_int(1, static_cast<int>(max_t));
    std::vector<RankIo> io = draw_inputs(rng, tokens, H, E, k);
    for (int r = 0; r < R; ++r) io[r].d_out->poison();
    gpu::check_cuda(cudaDeviceSynchronize(), "inputs");
    for (int r = 0; r < R; ++r) {
      const uint64_t ns = static_cast<uint64_t>(rng.uniform_int(0, 2000)) * 1000;  // up to 2 ms
      delay_kernel<<<1, 1, 0, lb.loopback.stream(r)>>>(ns);
      lb.ranks[r].run(io[r].args(), lb.loopback.stream(r));
    }
    for (int r = 0; r < R; ++r) lb.ranks[r].check(lb.loopback.stream(r));
    expect_matches_reference(layer, io, "delays, round " + std::to_string(round));
  }
}

// Each rank's run captured in a graph with a bitwise comparison to the eager output; 10,000
// replays of every rank together.
TEST(GpuEpLoopback, GraphReplaysAreBitwiseIdentical) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t H = 256, I = 256, E = 32, max_t = 6;
  const int k = 4, R = 8, replays = 10000;
  if (!loopback_available(R)) return;
  const MoeLayer layer = testing::random_layer(rng, H, I, E, k, 256);
  LoopbackLayer lb(layer, R, max_t, /*deterministic=*/true);
  std::vector<int64_t> tokens(R);
  for (int r = 0; r < R; ++r) tokens[r] = rng.uniform_int(0, static_cast<int>(max_t));
  tokens[1] = max_t;
  std::vector<RankIo> io = draw_inputs(rng, tokens, H, E, k);
  lb.run(io);
  expect_matches_reference(layer, io, "eager, before the graphs");
  std::vector<std::vector<uint16_t>> eager(R);
  std::vector<std::optional<DeviceBuffer<uint16_t>>> want(R);
  DeviceBuffer<unsigned long long> mismatches(static_cast<size_t>(R));
  mismatches.upload(std::vector<unsigned long long>(R, 0));
  gpu::check_cuda(cudaDeviceSynchronize(), "inputs");
  std::vector<cudaGraphExec_t> graphs(R, nullptr);
  for (int r = 0; r < R; ++r) {
    const cudaStream_t s = lb.loopback.stream(r);
    if (tokens[r] > 0) {
      eager[r] = io[r].d_out->download();
      want[r].emplace(eager[r]);
    }
    cudaGraph_t g = nullptr;
    gpu::check_cuda(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "capture");
    lb.ranks[r].run(io[r].args(), s);
    if (tokens[r] > 0) {
      count_mismatches_kernel<<<8, 256, 0, s>>>(io[r].d_out->get(), want[r]->get(), tokens[r] * H,
                                                mismatches.get() + r);
    }
    gpu::check_cuda(cudaStreamEndCapture(s, &g), "capture");
    gpu::check_cuda(cudaGraphInstantiate(&graphs[r], g, 0), "instantiate");
    cudaGraphDestroy(g);
  }
  gpu::check_cuda(cudaDeviceSynchronize(), "graphs");
  for (int i = 0; i < replays; ++i) {
    for (int r = 0; r < R; ++r) gpu::check_cuda(cudaGraphLaunch(graphs[r], lb.loopback.stream(r)), "replay");
  }
  for (int r = 0; r < R; ++r) lb.ranks[r].check(lb.loopback.stream(r));
  const std::vector<unsigned long long> bad = mismatches.download();
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(bad[r], 0u) << "rank " << r << ": elements that differed from the eager output over " << replays
                          << " replays";
    cudaGraphExecDestroy(graphs[r]);
  }
  expect_matches_reference(layer, io, "after 10,000 replays");
}

// Combine grids of more CTAs than a rank's partition holds at once (one per token, 256 threads:
// at most 8 per SM): the CTA that runs first, not CTA 0, publishes the return, and the CTAs that
// wait for a slot run once the resident ones finish. Several runs, so the claim moves with the
// epoch.
TEST(GpuEpLoopback, CombineGridsLargerThanAPartition) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t H = 128, I = 64, E = 16, max_t = 600;
  const int k = 2, R = 8;
  if (!loopback_available(R)) return;
  const MoeLayer layer = testing::random_layer(rng, H, I, E, k, 128);
  LoopbackLayer lb(layer, R, max_t, /*deterministic=*/false);
  ASSERT_LT(int64_t{8} * lb.loopback.sms_per_rank(), max_t) << "a partition would hold the whole combine grid";
  for (int round = 0; round < 3; ++round) {
    std::vector<int64_t> tokens(R);
    for (int r = 0; r < R; ++r) tokens[r] = rng.uniform_int(0, static_cast<int>(max_t));
    tokens[round] = max_t;
    tokens[R - 1 - round] = 0;
    std::vector<RankIo> io = draw_inputs(rng, tokens, H, E, k);
    lb.run(io);
    expect_matches_reference(layer, io, "round " + std::to_string(round));
  }
}

// A rank that never runs: every rank that does fails within about one timeout, naming the stage,
// and nothing hangs.
TEST(GpuEpLoopback, ARankThatNeverArrivesFailsLoudly) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t H = 256, I = 256, E = 32, max_t = 4;
  const int k = 4, R = 4;
  if (!loopback_available(R)) return;
  const double timeout = 0.5;
  const MoeLayer layer = testing::random_layer(rng, H, I, E, k);
  LoopbackLayer lb(layer, R, max_t, /*deterministic=*/false, timeout);
  std::vector<RankIo> io = draw_inputs(rng, std::vector<int64_t>(R, max_t), H, E, k);
  gpu::check_cuda(cudaDeviceSynchronize(), "inputs");
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r + 1 < R; ++r) lb.ranks[r].run(io[r].args(), lb.loopback.stream(r));  // rank R-1 never runs
  for (int r = 0; r + 1 < R; ++r) {
    try {
      lb.ranks[r].check(lb.loopback.stream(r));
      ADD_FAILURE() << "rank " << r << " did not report the missing peer";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kCuda);
      const std::string m = e.what();
      EXPECT_TRUE(m.find("never arrived") != std::string::npos || m.find("gave up") != std::string::npos) << m;
      EXPECT_NE(m.find("(dispatch)"), std::string::npos) << m;
    }
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(waited, 1.8 * timeout + 0.5) << "the ranks waited more than about one timeout";
  // A failed layer refuses to run again.
  EXPECT_MEGAMOE_ERROR(lb.ranks[0].run(io[0].args(), lb.loopback.stream(0)), kCuda, "earlier run failed");
}

// A run that fails on the host after its send was queued (here: a stage event that is not an
// event) leaves its group unusable, loudly, and its peer fails within its timeout.
TEST(GpuEpLoopback, AHostFailureMidRunIsLatched) {
  MEGAMOE_REQUIRE_GPU();
  if (!loopback_available(2)) return;
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const MoeLayer layer = testing::random_layer(rng, 256, 256, 8, 2);
  LoopbackLayer lb(layer, 2, 4, /*deterministic=*/true, /*timeout=*/0.3);
  std::vector<RankIo> io = draw_inputs(rng, {4, 4}, 256, 8, 2);
  gpu::check_cuda(cudaDeviceSynchronize(), "inputs");
  cudaEvent_t start = nullptr;
  gpu::check_cuda(cudaEventCreate(&start), "cudaEventCreate");
  const MoeEpLayer::StageEvents bad{start, nullptr, nullptr, nullptr};
  EXPECT_THROW(lb.ranks[0].run(io[0].args(), lb.loopback.stream(0), bad), Error);
  lb.ranks[1].run(io[1].args(), lb.loopback.stream(1));
  EXPECT_MEGAMOE_ERROR(lb.ranks[0].check(lb.loopback.stream(0)), kCuda, "after it had started the exchange");
  EXPECT_MEGAMOE_ERROR(lb.ranks[0].run(io[0].args(), lb.loopback.stream(0)), kCuda, "earlier run failed");
  EXPECT_MEGAMOE_ERROR(lb.ranks[1].check(lb.loopback.stream(1)), kCuda, "(combine)");
  cudaEventDestroy(start);
}

TEST(GpuEpLoopback, RefusesAWrongStreamOrConfig) {
  MEGAMOE_REQUIRE_GPU();
  if (!loopback_available(2)) return;
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const MoeLayer layer = testing::random_layer(rng, 256, 256, 8, 2);
  LoopbackLayer lb(layer, 2, 4, false);
  std::vector<RankIo> io = draw_inputs(rng, {4, 4}, 256, 8, 2);
  EXPECT_MEGAMOE_ERROR(lb.ranks[0].run(io[0].args(), nullptr), kInvalidArgument, "EpLoopback::stream(0)");
  EpConfig cfg;
  cfg.world_size = 4;
  cfg.max_tokens_per_rank = 4;
  EXPECT_MEGAMOE_ERROR(MoeEpLayer::create(ep_local_layer(layer, ep_expert_range(8, 4, 0)), 8, cfg, lb.loopback), kInvalidArgument, "the loopback has 2 virtual ranks");
  EXPECT_MEGAMOE_ERROR(EpLoopback::create(9), kInvalidArgument, "1..8");
  EXPECT_MEGAMOE_ERROR(lb.loopback.stream(2), kInvalidArgument, "out of range");
}

}  // namespace
}  // namespace megamoe
