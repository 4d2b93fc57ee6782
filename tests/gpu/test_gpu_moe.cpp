// The sm90 W4A16 MoE pipeline against the CPU reference (the oracle), on fresh random layers,
// hidden states and routings every run. Outputs are poisoned (bf16 NaN) before each run, so an
// unwritten element fails the NaN check.
#include <gtest/gtest.h>

#include "gpu_test_util.h"
#include "megamoe/reference.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "backends/sm90_w4a16/sm90_w4a16_heuristics.h"
#include "tests/common/test_util.h"
#include "tests/common/error_matchers.h"

namespace megamoe {
namespace {

using testing::DeviceBuffer;
using testing::GpuMoe;

using testing::kMaxRelL2;

struct Case {
  const char* name;
  int64_t H, I, E;
  int k;
  int64_t T;
  int64_t shared_I = 0;
  std::optional<float> limit = std::nullopt;
  int only_expert = -1;
  testing::ScaleCodes scale_codes = testing::ScaleCodes::kRealistic;
  std::vector<int> expert_tokens = {};  // if set: k = 1 and exactly this many tokens per expert
};

// gtest prints parameters in test names and failures: name the case instead of dumping bytes.
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

void check_case(const Case& c, bool deterministic, const MoeTuning& tuning = {}) {
  SCOPED_TRACE(::testing::Message() << c.name << " H=" << c.H << " I=" << c.I << " E=" << c.E
                                    << " k=" << c.k << " T=" << c.T);
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const MoeLayer layer = testing::random_layer(rng, c.H, c.I, c.E, c.k, c.shared_I, c.limit, {c.scale_codes});
  const auto hidden = testing::random_hidden(rng, c.T, c.H);
  const auto topk = c.expert_tokens.empty() ? testing::random_topk(rng, c.T, c.E, c.k, c.only_expert)
                                            : testing::counted_topk(rng, c.expert_tokens);
  ASSERT_EQ(topk.tokens, c.T) << "case " << c.name << ": T must be the sum of expert_tokens";
  ASSERT_EQ(topk.k, c.k);
  GpuMoe gpu(layer, c.T, deterministic, tuning);
  const auto got = gpu.run(hidden, topk);
  // The oracle's output is bf16, like ours: the error is what our arithmetic adds beyond the
  // one final rounding both make. (Against the fp32 sum, that rounding alone is ~1.5e-3.)
  const auto ref = testing::widen(reference::moe_forward(layer, hidden, c.T, topk));
  const auto stats = testing::compare(got, ref);
  const auto vs_f32 = testing::compare(got, reference::moe_forward_f32(layer, hidden, c.T, topk));
  EXPECT_EQ(stats.nonfinite, 0) << "non-finite or unwritten outputs";
  EXPECT_LE(stats.rel_l2, kMaxRelL2) << gpu.plan.describe(c.T);
  std::printf("[ %-28s] T=%-5lld %s rel_l2=%.3g (vs fp32 sum %.3g)\n", c.name,
              static_cast<long long>(c.T), gpu.plan.describe(c.T).c_str(), stats.rel_l2,
              vs_f32.rel_l2);
}

class GpuMoeCases : public ::testing::TestWithParam<Case> {};

TEST_P(GpuMoeCases, MatchesReference) {
  MEGAMOE_REQUIRE_GPU();
  check_case(GetParam(), /*deterministic=*/false);
}
TEST_P(GpuMoeCases, DeterministicMatchesReference) {
  MEGAMOE_REQUIRE_GPU();
  check_case(GetParam(), /*deterministic=*/true);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuMoeCases,
    ::testing::Values(
        Case{"small_T1", 256, 128, 8, 2, 1}, Case{"small_T3", 256, 128, 8, 2, 3},
        Case{"small_T17", 256, 128, 8, 2, 17},
        // 20, 32 and 45 tokens per expert: the 32-, 48- and 64-token tiles.
        Case{"small_T80_tile32", 256, 128, 8, 2, 80}, Case{"small_T128_tile48", 256, 128, 8, 2, 128},
        Case{"small_T180_tile64", 256, 128, 8, 2, 180},
        Case{"small_T1000_prefill", 256, 128, 8, 2, 1000},
        Case{"small_T4096", 256, 128, 16, 4, 4096},
        Case{"topk1", 128, 64, 16, 1, 33}, Case{"topk3", 128, 64, 16, 3, 33},
        Case{"topk5", 128, 64, 16, 5, 33}, Case{"topk8", 128, 64, 16, 8, 33},
        Case{"many_empty_experts", 128, 64, 128, 2, 3},
        Case{"all_on_one_expert", 192, 64, 8, 1, 300, 0, std::nullopt, 5},
        Case{"shared_expert_2x", 256, 64, 8, 2, 40, 128},
        Case{"swiglu_clamp", 256, 128, 8, 2, 64, 0, 0.25f},
        Case{"deepseek_v3_shape", 7168, 2048, 4, 2, 3, 2048},
        // Qwen3-30B's E, k and I at T=256 (16 tokens per expert): on 132 SMs the heuristic's
        // fused launch on the 32-token tile.
        Case{"qwen3_like_T256", 256, 768, 128, 8, 256},
        Case{"deepseek_v4_flash_shape", 4096, 2048, 4, 2, 3, 2048, 10.0f},
        Case{"qwen3_235b_shape", 4096, 1536, 8, 8, 5},
        Case{"qwen3_30b_shape", 2048, 768, 16, 8, 64},
        // Zero scales over nonzero codes, subnormal and maximal scales, in each mainloop.
        Case{"every_scale_code_decode", 512, 256, 8, 2, 5, 256, std::nullopt, -1,
             testing::ScaleCodes::kEveryCode},
        Case{"every_scale_code_middle", 512, 256, 8, 2, 100, 0, std::nullopt, -1,
             testing::ScaleCodes::kEveryCode},
        Case{"every_scale_code_prefill", 512, 256, 8, 2, 600, 0, std::nullopt, -1,
             testing::ScaleCodes::kEveryCode},
        // Each work item runs at the narrowest token width that holds its slots: expert counts
        // whose last tiles land on every width, at and just past each boundary, and an empty
        // expert. 128-token tile (120/expert): widths 32, 64, 96, 128.
        Case{"token_widths_prefill", 256, 128, 8, 1, 963, 0, std::nullopt, -1,
             testing::ScaleCodes::kRealistic, {129, 161, 225, 192, 96, 32, 0, 128}},
        // The overlapped 128-token tile (300/expert): last items of 1, 64 (width 64), 65, 128
        // and 30 tokens (width 128 but 30), whole tiles only, an empty expert.
        Case{"token_widths_overlapped", 256, 128, 8, 1, 2400, 0, std::nullopt, -1,
             testing::ScaleCodes::kRealistic, {257, 320, 321, 384, 448, 256, 0, 414}},
        // 48-token tile (32.5/expert): widths 16, 32, 48.
        Case{"token_widths_tile48", 256, 128, 8, 1, 260, 0, std::nullopt, -1,
             testing::ScaleCodes::kRealistic, {1, 16, 17, 32, 33, 48, 49, 64}},
        // The multi-CTA dispatch (more than 4096 selections): just past the single-CTA limit
        // (T * k = 4098: five CTAs, the last one a token short), with a shared expert, every
        // token on one expert (each CTA starts within the same expert), and 127 CTAs of 65
        // tokens, the last one of 10.
        Case{"dispatch_just_past_one_cta", 128, 64, 16, 2, 2049},
        Case{"dispatch_shared_expert", 128, 64, 16, 4, 1500, 128},
        // 2400 selections: the single-CTA dispatch stages the routed slots, then the shared ones.
        Case{"dispatch_staged_shared_expert", 128, 64, 16, 4, 600, 128},
        Case{"dispatch_all_on_one_expert", 128, 64, 8, 1, 5000, 0, std::nullopt, 3},
        Case{"dispatch_127_ctas", 64, 64, 32, 16, 8200}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// The decode tile with the launch forced either way (the heuristic picks one per T): the fused
// L1 + L2 launch and the two-launch pipeline; early start (the heuristic's choice up to
// T * k = 32) forced off in some.
struct TuningCase {
  Case c;
  bool fused;
  std::optional<bool> early_start = std::nullopt;
  std::optional<bool> absorbing_tile = std::nullopt;
  std::optional<int> fused_ctas_per_sm = std::nullopt;
};
void PrintTo(const TuningCase& tc, std::ostream* os) { *os << tc.c.name; }
MoeTuning tuning_of(const TuningCase& tc) {
  MoeTuning t;
  t.fused = tc.fused;
  t.early_start = tc.early_start;
  t.absorbing_tile = tc.absorbing_tile;
  t.fused_ctas_per_sm = tc.fused_ctas_per_sm;
  return t;
}

class GpuMoeTuning : public ::testing::TestWithParam<TuningCase> {};

TEST_P(GpuMoeTuning, MatchesReference) {
  MEGAMOE_REQUIRE_GPU();
  check_case(GetParam().c, /*deterministic=*/false, tuning_of(GetParam()));
}
TEST_P(GpuMoeTuning, DeterministicMatchesReference) {
  MEGAMOE_REQUIRE_GPU();
  check_case(GetParam().c, /*deterministic=*/true, tuning_of(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(
    Decode, GpuMoeTuning,
    ::testing::Values(
        TuningCase{Case{"fused_T1", 512, 256, 16, 4, 1, 256}, true},
        TuningCase{Case{"fused_T3", 512, 256, 16, 4, 3}, true},
        TuningCase{Case{"fused_T16", 512, 256, 16, 4, 16, 256}, true},
        TuningCase{Case{"fused_T40_many_experts", 512, 256, 64, 2, 40, 256}, true},
        TuningCase{Case{"unfused_T1", 512, 256, 16, 4, 1, 256}, false},
        TuningCase{Case{"unfused_T3", 512, 256, 16, 4, 3, 256}, false},
        TuningCase{Case{"unfused_T16", 512, 256, 16, 4, 16}, false},
        TuningCase{Case{"fused_deepseek_v3_T2", 7168, 2048, 8, 2, 2, 2048}, true},
        TuningCase{Case{"fused_every_scale_code", 512, 256, 8, 2, 5, 256, std::nullopt, -1,
                        testing::ScaleCodes::kEveryCode}, true},
        TuningCase{Case{"fused_all_on_one_expert", 192, 64, 8, 1, 13, 0, std::nullopt, 5}, true},
        TuningCase{Case{"fused_swiglu_clamp", 256, 128, 8, 2, 9, 0, 0.25f}, true},
        TuningCase{Case{"fused_T1_waiting", 512, 256, 16, 4, 1, 256}, true, false},
        // The fused grid held to one and two CTAs per SM (MoeTuning::fused_ctas_per_sm): each CTA
        // runs many L1 items, then L2 items that wait for other CTAs' L1 items.
        TuningCase{Case{"fused_T16_one_cta_per_sm", 512, 256, 16, 4, 16, 256}, true, std::nullopt, std::nullopt, 1},
        TuningCase{Case{"fused_T3_two_ctas_per_sm", 512, 256, 16, 4, 3}, true, std::nullopt, std::nullopt, 2},
        TuningCase{Case{"unfused_T3_waiting", 512, 256, 16, 4, 3, 256}, false, false},
        // Early start at its limits: 64 slots (T * (k + 8 shared slices)), 32 selections.
        TuningCase{Case{"fused_early_64_slots", 256, 64, 16, 8, 4, 512}, true},
        TuningCase{Case{"unfused_early_64_slots", 256, 64, 16, 8, 4, 512}, false},
        // 32 tokens on one expert: two n-tiles, so first items with n_tile = 1.
        TuningCase{Case{"fused_early_two_n_tiles", 192, 64, 4, 1, 32, 0, std::nullopt, 2}, true},
        TuningCase{Case{"unfused_early_two_n_tiles", 192, 64, 4, 1, 32, 0, std::nullopt, 2}, false},
        // 17-24 tokens per expert: the fused launch on the 32-token tile; at 24 per expert some
        // experts pass 32 tokens (two n-tiles), and the shared slices hold 96 (three).
        TuningCase{Case{"fused32_T80", 256, 128, 8, 2, 80}, true},
        TuningCase{Case{"fused32_T96_shared", 256, 128, 8, 2, 96, 256}, true},
        TuningCase{Case{"fused32_swiglu_clamp", 256, 128, 8, 2, 72, 0, 0.25f}, true},
        TuningCase{Case{"unfused32_T96_shared", 256, 128, 8, 2, 96, 256}, false},
        // The absorbing tile: an expert's last 128-token tile takes up to 32 tokens more. Experts
        // at every edge: empty, 1, 128, 129 and 160 (one tile), 161 (two), 288 (two, the last
        // 160), 289 and 300 (three). A shared expert of 600 slots: five tiles, the last 88.
        TuningCase{Case{"absorbing_edges", 512, 256, 9, 1, 1456, 0, std::nullopt, -1, testing::ScaleCodes::kRealistic,
                        {0, 1, 128, 129, 160, 161, 288, 289, 300}}, false, false, true},
        TuningCase{Case{"absorbing_shared_clamp", 256, 128, 8, 2, 600, 256, 0.25f}, false, false, true},
        TuningCase{Case{"absorbing_T3", 256, 128, 8, 2, 3}, false, false, true},
        // One token: L2 splits K in two slices of 3 chunks, an item shorter than the absorbing
        // tile's six stages (its K loop is all tail, its copies all prologue).
        TuningCase{Case{"absorbing_T1_odd_k_slices", 256, 384, 8, 2, 1}, false, false, true},
        // Two to three items per CTA (L1: 16 experts x 3 n-tiles x 5 m-blocks on one CTA per SM),
        // of 8 chunks in L1 and 10 in L2: each item leaves the six stage barriers at different
        // phases for the next (StageSync::kMbarriers).
        TuningCase{Case{"absorbing_many_items", 512, 640, 16, 4, 1200}, false, false, true},
        // Qwen3-30B's H and I (the heuristic's absorbing tile around 128 tokens per expert): L2
        // items of 12 chunks, L1 items of 32 over 6 row blocks.
        TuningCase{Case{"absorbing_qwen3_30b_shape", 2048, 768, 8, 2, 700}, false, false, true},
        // Four L2 items per CTA on 132 SMs (16 experts x 8 row blocks x 4 n-tiles of ~500 tokens,
        // items of one 6-chunk round): the L2 combine's slot table alternates its two buffers and
        // rewrites each two items later, across the item loop that has no CTA barrier.
        TuningCase{Case{"absorbing_l2_items_per_cta", 2048, 384, 16, 4, 2000}, false, false, true}),
    [](const ::testing::TestParamInfo<TuningCase>& info) { return std::string(info.param.c.name); });

// DeepGEMM's rule for a fused path: bitwise equal to the unfused pipeline of the library's own
// kernels. Deterministic mode makes both exact functions of the inputs, and the fused launch
// changes only when an item runs, never its arithmetic. At T=40 the two launches run the
// 32-token tile (the heuristic's, for the shared slice's 2 tiles instead of 3) and the fused
// launch the 16-token one: a token's column is the same bits whatever the wgmma's width. At T=80
// (20 tokens per expert) both run the 32-token tile.
TEST(GpuMoe, FusedIsBitwiseTheTwoLaunchPipeline) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t H = 512;
  const MoeLayer layer = testing::random_layer(rng, H, 256, 16, 4, 256);
  for (int64_t T : {1, 11, 40, 80}) {
    const auto hidden = testing::random_hidden(rng, T, H);
    const auto topk = testing::random_topk(rng, T, 16, 4);
    MoeTuning fused, unfused;
    fused.fused = true;
    unfused.fused = false;
    GpuMoe a(layer, T, true, fused), b(layer, T, true, unfused);
    ASSERT_TRUE(moe_config(a.plan, T).fused) << a.plan.describe(T);
    ASSERT_EQ(moe_config(a.plan, T).l1.block_n, T == 80 ? 32 : 16) << a.plan.describe(T);
    ASSERT_EQ(moe_config(b.plan, T).l1.block_n, T >= 40 ? 32 : 16) << b.plan.describe(T);
    const auto got = a.run(hidden, topk);
    ASSERT_EQ(got, b.run(hidden, topk)) << "T=" << T;
    for (int rep = 0; rep < 3; ++rep) ASSERT_EQ(a.run(hidden, topk), got) << "T=" << T << " repetition " << rep;
  }
}

// Early start changes only when L1's first items start, never the schedule or the arithmetic:
// bitwise equal to waiting for the dispatch (deterministic mode), fused and not, with a shared
// expert, an invalid id, every token on one expert, and the 32-token tile (one expert; fused
// and not).
TEST(GpuMoe, EarlyStartIsBitwiseTheWaitingPipeline) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  struct Shape {
    int64_t H, I, E;
    int k;
    int64_t shared_I, T;
    int only_expert;
  };
  for (const Shape& s : {Shape{512, 256, 16, 4, 256, 1, -1}, Shape{512, 256, 16, 4, 256, 7, -1},
                         Shape{256, 64, 16, 8, 512, 4, -1}, Shape{192, 64, 8, 2, 0, 16, 3},
                         Shape{128, 64, 1, 1, 0, 20, -1}}) {
    const MoeLayer layer = testing::random_layer(rng, s.H, s.I, s.E, s.k, s.shared_I);
    const auto hidden = testing::random_hidden(rng, s.T, s.H);
    auto topk = testing::random_topk(rng, s.T, s.E, s.k, s.only_expert);
    if (s.T > 1) topk.ids[1] = static_cast<int32_t>(s.E);  // invalid: skipped by both
    for (bool fused : {true, false}) {
      MoeTuning early, waiting;
      early.early_start = true;
      waiting.early_start = false;
      if (moe_config(MoePlan::create(MoeProblem::from_layer(layer, s.T), {}), s.T).can_fuse()) {
        early.fused = waiting.fused = fused;
      } else if (fused) {
        continue;  // past 24 tokens per expert: no fused kernel
      }
      GpuMoe a(layer, s.T, true, early), b(layer, s.T, true, waiting);
      ASSERT_TRUE(moe_config(a.plan, s.T).early_start) << a.plan.describe(s.T);
      const auto got = a.run(hidden, topk);
      ASSERT_EQ(got, b.run(hidden, topk)) << a.plan.describe(s.T);
      for (int rep = 0; rep < 3; ++rep) ASSERT_EQ(a.run(hidden, topk), got) << "repetition " << rep;
    }
  }
}

TEST(GpuMoe, RejectsTuningThatCannotRun) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const MoeLayer layer = testing::random_layer(rng, 256, 128, 8, 2);
  const MoeProblem p = MoeProblem::from_layer(layer, 512);
  MoeTuning t;
  t.fused = true;
  EXPECT_TRUE(moe_config(MoePlan::create(p, t), 8).fused);
  EXPECT_EQ(moe_config(MoePlan::create(p, t), 80).l1.block_n, 32);  // 20 per expert: the fused 32-token tile
  EXPECT_TRUE(moe_config(MoePlan::create(p, t), 80).fused);
  EXPECT_THROW(moe_config(MoePlan::create(p, t), 128), Error);  // 32 per expert: the 48-token tile, not fused
  EXPECT_THROW(moe_config(MoePlan::create(p, t), 512), Error);  // 128 tokens per expert: no fused kernel
  t.fused = false;
  EXPECT_FALSE(moe_config(MoePlan::create(p, t), 8).fused);
  MoeTuning ctas;
  ctas.fused = true;
  ctas.fused_ctas_per_sm = 3;
  EXPECT_EQ(moe_config(MoePlan::create(p, ctas), 8).fused_ctas_per_sm, 3);
  ctas.fused_ctas_per_sm = 0;
  EXPECT_THROW(moe_config(MoePlan::create(p, ctas), 8), Error);
  ctas.fused = false;  // two launches: no fused grid to size
  ctas.fused_ctas_per_sm = 2;
  EXPECT_THROW(moe_config(MoePlan::create(p, ctas), 8), Error);
  MoeTuning early;
  early.early_start = true;
  EXPECT_TRUE(moe_config(MoePlan::create(p, early), 16).early_start);  // 32 selections
  EXPECT_THROW(moe_config(MoePlan::create(p, early), 17), Error);      // 34: more than a warp
  early.early_start = false;
  EXPECT_FALSE(moe_config(MoePlan::create(p, early), 1).early_start);
}

// A small random layer on the GPU (H 128, I 64, 4 experts, top-2), for the tests of what run()
// accepts: its values never matter.
GpuMoe small_gpu_moe(int64_t max_tokens) {
  testing::Rng rng(testing::fresh_seed());
  return GpuMoe(testing::random_layer(rng, 128, 64, 4, 2), max_tokens, /*deterministic=*/false);
}

TEST(GpuMoe, ZeroTokensIsANoOp) {
  MEGAMOE_REQUIRE_GPU();
  GpuMoe gpu = small_gpu_moe(8);
  MoeRunArgs args{};
  args.tokens = 0;
  EXPECT_NO_THROW(run(gpu.plan, gpu.weights, args, nullptr));
}

TEST(GpuMoe, DeterministicIsBitwiseStable) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const MoeLayer layer = testing::random_layer(rng, 512, 256, 16, 4, 256);
  const auto hidden = testing::random_hidden(rng, 300, 512);
  const auto topk = testing::random_topk(rng, 300, 16, 4);
  GpuMoe gpu(layer, 300, true);
  const auto first = gpu.run(hidden, topk);
  for (int rep = 0; rep < 5; ++rep) {
    ASSERT_EQ(gpu.run(hidden, topk), first) << "repetition " << rep << " differs";
  }
}

TEST(GpuMoe, GraphReplayEqualsEager) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t T = 77, H = 256;
  const MoeLayer layer = testing::random_layer(rng, H, 128, 8, 2);
  const auto hidden = testing::random_hidden(rng, T, H);
  const auto topk = testing::random_topk(rng, T, 8, 2);
  GpuMoe gpu(layer, T, true);
  const auto eager = gpu.run(hidden, topk);
  const auto replays = gpu.run_graph_replays(hidden, topk, 3);
  for (size_t rep = 0; rep < replays.size(); ++rep) EXPECT_EQ(replays[rep], eager) << "replay " << rep;
}

// Runs a random layer (H = 128, I = 64 unless given; E experts, top-k) over T tokens with the
// selections at `bad` (flat [T, k] indices) given the out-of-range ids `bad_ids`: the run counts
// them, and the valid selections still match the reference with the invalid ones dropped.
void check_invalid_ids_skipped(int64_t E, int k, int64_t T, const std::vector<size_t>& bad,
                               const std::vector<int32_t>& bad_ids, bool deterministic = true,
                               const MoeTuning& tuning = {}, int64_t H = 128, int64_t I = 64) {
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const MoeLayer layer = testing::random_layer(rng, H, I, E, k);
  auto topk = testing::random_topk(rng, T, E, k);
  for (size_t j = 0; j < bad.size(); ++j) topk.ids[bad[j]] = bad_ids[j];
  const auto hidden = testing::random_hidden(rng, T, H);
  GpuMoe gpu(layer, T, deterministic, tuning);
  const auto got = gpu.run(hidden, topk);
  EXPECT_EQ(gpu.plan.invalid_id_count(gpu.workspace.get(), nullptr), static_cast<int64_t>(bad.size()));
  if (bad.size() == static_cast<size_t>(T * k)) {  // no valid id: exactly zero (a relative error is undefined)
    for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i] & 0x7fffu, 0u) << "output " << i << " " << gpu.plan.describe(T);
    return;
  }
  auto valid = topk;
  for (size_t i : bad) {
    valid.weights[i] = 0.0f;
    valid.ids[i] = 0;
  }
  const auto stats = testing::compare(got, testing::widen(reference::moe_forward(layer, hidden, T, valid)));
  EXPECT_EQ(stats.nonfinite, 0);
  EXPECT_LE(stats.rel_l2, kMaxRelL2);
}

TEST(GpuMoe, InvalidExpertIdsAreCountedAndSkipped) {
  MEGAMOE_REQUIRE_GPU();
  check_invalid_ids_skipped(/*E=*/4, /*k=*/2, /*T=*/5, {3, 6}, {4 /* == E */, -1});
}

// Every id invalid: no L2 work item at all, and still every output written (zero), in each
// combine: the folded one (two launches, atomic), the combine kernel after the fused launch, and
// the deterministic one.
TEST(GpuMoe, AllExpertIdsInvalidGivesZeros) {
  MEGAMOE_REQUIRE_GPU();
  const std::vector<size_t> all = {0, 1, 2, 3, 4, 5};
  const std::vector<int32_t> ids = {4, -1, 9, 1 << 30, -5, 4};
  MoeTuning fused, unfused;
  fused.fused = true;
  unfused.fused = false;
  for (bool deterministic : {false, true}) {
    for (const MoeTuning& t : {fused, unfused}) check_invalid_ids_skipped(/*E=*/4, /*k=*/2, /*T=*/3, all, ids, deterministic, t);
  }
}

// The absorbing tile's L1 zeroes the combine accumulator one slice per work item; with no item
// (every id invalid) its grid zeroes it whole (2I and H multiples of its 256-row blocks; the
// workspace is poisoned, so an accumulator left unzeroed reads NaN).
TEST(GpuMoe, AllExpertIdsInvalidGivesZerosOnTheAbsorbingTile) {
  MEGAMOE_REQUIRE_GPU();
  MoeTuning absorbing;
  absorbing.absorbing_tile = true;
  const std::vector<size_t> all = {0, 1, 2, 3, 4, 5};
  const std::vector<int32_t> ids = {4, -1, 9, 1 << 30, -5, 4};
  check_invalid_ids_skipped(/*E=*/4, /*k=*/2, /*T=*/3, all, ids, /*deterministic=*/false, absorbing, /*H=*/256,
                            /*I=*/128);
  // And with items: one invalid id among 40 selections.
  check_invalid_ids_skipped(/*E=*/4, /*k=*/2, /*T=*/20, {7}, {-3}, /*deterministic=*/false, absorbing, /*H=*/256,
                            /*I=*/128);
}

// The same through the multi-CTA dispatch: invalid ids in the first, a middle and the last
// CTA's tokens (T * k = 8400: 9 CTAs of 234 tokens, the last one of 228).
TEST(GpuMoe, InvalidExpertIdsAreCountedAndSkippedAtLargeT) {
  MEGAMOE_REQUIRE_GPU();
  // 2800 selections: the single-CTA dispatch, which stages the slots; 8400: the multi-CTA pair.
  for (int64_t T : {700, 2100}) {
    check_invalid_ids_skipped(/*E=*/8, /*k=*/4, T, {1, 4 * 500 + 2, static_cast<size_t>(4 * (T - 1) + 3)}, {8 /* == E */, -7, 1 << 30});
  }
}

TEST(GpuMoe, RejectsBadProblems) {
  MEGAMOE_REQUIRE_GPU();
  MoeProblem p;
  p.hidden_size = 96;  // not a multiple of 64
  p.intermediate_size = 64;
  p.num_experts = 4;
  p.top_k = 2;
  p.max_tokens = 8;
  EXPECT_THROW(MoePlan::create(p), Error);
  p.hidden_size = 128;
  p.top_k = 5;  // > E
  EXPECT_THROW(MoePlan::create(p), Error);
  p.top_k = 2;
  p.shared_intermediate_size = 96;  // not a multiple of I
  EXPECT_THROW(MoePlan::create(p), Error);
}

// Precision: w4a8 plans resolve to the w4a8/sm_90 row (its tests: test_gpu_w4a8_moe.cpp) and
// say so in describe; auto resolves to w4a16 at every T (visible in describe) and gives the w4a16
// plan's output bit for bit.
TEST(GpuMoe, PrecisionW4a8RunsItsRowAndAutoRunsW4a16) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const MoeLayer layer = testing::random_layer(rng, 256, 128, 8, 2);
  MoeProblem p = MoeProblem::from_layer(layer, 64);
  p.precision = Precision::kW4a8;
  const MoePlan w4a8 = MoePlan::create(p);
  EXPECT_EQ(w4a8.resolved_precision(64), Precision::kW4a8);
  EXPECT_NE(w4a8.describe(64).find("w4a8 L1{"), std::string::npos) << w4a8.describe(64);
  GpuMoe gpu(layer, 64, /*deterministic=*/true);
  const MoePlan exact = gpu.plan;
  EXPECT_EQ(exact.resolved_precision(64), Precision::kW4a16);
  EXPECT_NE(exact.describe(64).find("T=64 w4a16 L1{"), std::string::npos) << exact.describe(64);
  p.precision = Precision::kAuto;
  p.deterministic = true;
  const MoePlan automatic = MoePlan::create(p);
  for (const int64_t T : {1, 17, 64}) {
    EXPECT_EQ(automatic.resolved_precision(T), Precision::kW4a16) << T;
    EXPECT_NE(automatic.describe(T).find("w4a16 (auto)"), std::string::npos) << automatic.describe(T);
    const std::vector<uint16_t> hidden = testing::random_hidden(rng, T, 256);
    const reference::TopK topk = testing::random_topk(rng, T, 8, 2);
    gpu.plan = exact;
    const std::vector<uint16_t> want = gpu.run(hidden, topk);
    gpu.plan = automatic;  // the same weights and workspace: only the plan's precision differs
    EXPECT_EQ(gpu.run(hidden, topk), want) << "auto differs from w4a16 at T=" << T;
  }
}

TEST(GpuMoe, RejectsTooManyTokens) {
  MEGAMOE_REQUIRE_GPU();
  GpuMoe gpu = small_gpu_moe(4);
  MoeRunArgs args{};
  args.tokens = 5;
  EXPECT_THROW(run(gpu.plan, gpu.weights, args, nullptr), Error);
}

}  // namespace
}  // namespace megamoe
