// The W4A16 kernels' timeline (sm90_w4a16_timeline.h, builds configured with
// -DMEGAMOE_TIMELINE=ON): a recorded run records every work item the dispatch schedules once, in
// order (start <= wait <= end, inside its CTA's span), and still matches the CPU reference.
// Skipped, with the reason, in builds without the timeline.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <ostream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "gpu_test_util.h"
#include "backends/sm90_w4a16/sm90_w4a16_heuristics.h"
#include "backends/sm90_w4a16/sm90_w4a16_timeline.h"
#include "kernels/sm90/sm90_moe_token_tiles.h"
#include "megamoe/reference.h"
#include "megamoe/runtime.h"
#include "tests/common/test_util.h"

namespace megamoe {
namespace {

using runtime::W4a16TimelineEvent;
using testing::GpuMoe;

struct TimelineCase {
  const char* name;
  int64_t H, I, E;
  int k;
  int64_t T;
  int64_t shared_I;
  MoeTuning tuning;
};
void PrintTo(const TimelineCase& c, std::ostream* os) { *os << c.name; }

// A GEMM's work items as the dispatch schedules them (sm90_moe_dispatch.cuh), and their slots
// summed over the items: per virtual expert of c slots, its token tiles times its blocks of
// weight rows times its K slices.
struct Schedule {
  int64_t items = 0, slots = 0;
};
Schedule schedule(const std::vector<int64_t>& expert_slots, const GemmConfig& c, int64_t rows) {
  const int64_t blocks = rows / (64 * c.warpgroups) * c.k_splits;
  Schedule s;
  for (int64_t n : expert_slots) {
    s.items += kernels::sm90::expert_token_tiles<int64_t>(n, c.block_n, c.tile_step()) * blocks;
    s.slots += n * blocks;
  }
  return s;
}

class GpuTimeline : public ::testing::TestWithParam<TimelineCase> {};

TEST_P(GpuTimeline, RecordsEveryScheduledItemOnce) {
  MEGAMOE_REQUIRE_GPU();
  if (!runtime::w4a16_timeline_built()) {
    GTEST_SKIP() << "this build records no kernel timeline (configure a build directory with "
                    "-DMEGAMOE_TIMELINE=ON to test it)";
  }
  const TimelineCase& c = GetParam();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const MoeLayer layer = testing::random_layer(rng, c.H, c.I, c.E, c.k, c.shared_I);
  const auto hidden = testing::random_hidden(rng, c.T, c.H);
  const auto topk = testing::random_topk(rng, c.T, c.E, c.k);
  GpuMoe gpu(layer, c.T, /*deterministic=*/false, c.tuning);
  const MoeConfig cfg = moe_config(gpu.plan, c.T);
  SCOPED_TRACE(gpu.plan.describe(c.T));
  if (c.tuning.fused) ASSERT_EQ(cfg.fused, *c.tuning.fused);
  if (c.tuning.early_start) ASSERT_EQ(cfg.early_start, *c.tuning.early_start);
  if (c.tuning.absorbing_tile.value_or(false)) ASSERT_EQ(cfg.l1.warpgroups, 4);

  runtime::W4a16TimelineRecorder recorder;
  recorder.start();
  const auto got = gpu.run(hidden, topk);
  const std::vector<W4a16TimelineEvent> events = recorder.stop();

  const auto stats = testing::compare(got, testing::widen(reference::moe_forward(layer, hidden, c.T, topk)));
  EXPECT_EQ(stats.nonfinite, 0) << "non-finite or unwritten outputs";
  EXPECT_LE(stats.rel_l2, testing::kMaxRelL2);

  // The slots of each virtual expert: the routed ones, then the shared expert's slices (every token).
  std::vector<int64_t> expert_slots(static_cast<size_t>(c.E), 0);
  for (int32_t id : topk.ids) ++expert_slots[static_cast<size_t>(id)];
  for (int64_t s = 0; s < c.shared_I / c.I; ++s) expert_slots.push_back(c.T);
  const Schedule l1 = schedule(expert_slots, cfg.l1, 2 * c.I), l2 = schedule(expert_slots, cfg.l2, c.H);

  // The CTA records, by (launch, CTA): one each.
  std::map<std::pair<int, int>, W4a16TimelineEvent> ctas;
  for (const W4a16TimelineEvent& e : events) {
    if (e.kind != runtime::kTimelineCta) continue;
    EXPECT_TRUE(ctas.emplace(std::make_pair(int{e.launch}, e.block), e).second) << "CTA " << e.block << " twice";
    EXPECT_LE(e.start_ns, e.end_ns) << "CTA " << e.block;
    EXPECT_EQ(e.expert, 0) << "CTA " << e.block << ": items not recorded";
  }
  std::set<int> launches;
  for (const auto& [key, cta] : ctas) launches.insert(key.first);
  if (cfg.fused) {
    EXPECT_EQ(launches, (std::set<int>{runtime::kTimelineLaunchFused}));
  } else {
    EXPECT_EQ(launches, (std::set<int>{runtime::kTimelineLaunchL1, runtime::kTimelineLaunchL2}));
  }

  std::set<int> l1_items, l2_items;
  int64_t l1_slots = 0, l2_slots = 0;
  std::map<std::pair<int, int>, int> items_per_cta;
  for (const W4a16TimelineEvent& e : events) {
    if (e.kind == runtime::kTimelineCta) continue;
    const bool is_l1 = e.kind == runtime::kTimelineL1Item;
    ASSERT_TRUE(is_l1 || e.kind == runtime::kTimelineL2Item) << "kind " << e.kind;
    SCOPED_TRACE(::testing::Message() << (is_l1 ? "L1" : "L2") << " item " << e.item << " of CTA " << e.block);
    const GemmConfig& g = is_l1 ? cfg.l1 : cfg.l2;
    EXPECT_TRUE((is_l1 ? l1_items : l2_items).insert(e.item).second) << "recorded twice";
    (is_l1 ? l1_slots : l2_slots) += e.slots;
    EXPECT_LE(e.start_ns, e.wait_ns);
    EXPECT_LE(e.wait_ns, e.end_ns);
    if (!(cfg.fused && !is_l1)) EXPECT_EQ(e.wait_ns, e.start_ns) << "only fused L2 items wait";
    EXPECT_GT(e.cycles, 0u);
    EXPECT_EQ(e.launch, cfg.fused ? runtime::kTimelineLaunchFused
                                  : is_l1 ? runtime::kTimelineLaunchL1 : runtime::kTimelineLaunchL2);
    EXPECT_EQ(e.rows, 64 * g.warpgroups);
    EXPECT_GE(e.slots, 1);
    EXPECT_LE(e.slots, g.block_n);
    EXPECT_GE(e.expert, 0);
    EXPECT_LT(e.expert, static_cast<int64_t>(expert_slots.size()));
    const int64_t k_chunks = (is_l1 ? c.H : c.I) / 64, per_split = (k_chunks + g.k_splits - 1) / g.k_splits;
    EXPECT_EQ(e.k_chunks, std::min(per_split, k_chunks - e.k_split * per_split));
    const auto cta = ctas.find({e.launch, e.block});
    ASSERT_NE(cta, ctas.end()) << "no record of its CTA";
    EXPECT_EQ(e.smid, cta->second.smid);
    EXPECT_GE(e.start_ns, cta->second.start_ns);
    EXPECT_LE(e.end_ns, cta->second.end_ns);
    ++items_per_cta[{e.launch, e.block}];
  }
  for (const auto& [key, cta] : ctas) {
    EXPECT_EQ(cta.item, items_per_cta[key]) << "CTA " << key.second << " of launch " << key.first;
  }
  EXPECT_EQ(static_cast<int64_t>(l1_items.size()), l1.items);
  EXPECT_EQ(static_cast<int64_t>(l2_items.size()), l2.items);
  if (!l1_items.empty()) EXPECT_EQ(*l1_items.rbegin(), l1.items - 1);
  if (!l2_items.empty()) EXPECT_EQ(*l2_items.rbegin(), l2.items - 1);
  EXPECT_EQ(l1_slots, l1.slots);
  EXPECT_EQ(l2_slots, l2.slots);
}

MoeTuning tuning(std::optional<bool> fused, std::optional<bool> early_start, std::optional<bool> absorbing = {}) {
  MoeTuning t;
  t.fused = fused;
  t.early_start = early_start;
  t.absorbing_tile = absorbing;
  return t;
}

INSTANTIATE_TEST_SUITE_P(
    Launches, GpuTimeline,
    ::testing::Values(
        // The fused launch, L1 started early and waiting for the dispatch; the two launches.
        TimelineCase{"fused_early_start", 512, 256, 16, 4, 1, 256, tuning(true, true)},
        TimelineCase{"fused_waiting", 512, 256, 16, 4, 11, 256, tuning(true, false)},
        TimelineCase{"two_launches", 512, 256, 16, 4, 40, 256, tuning(false, false)},
        // The absorbing tile's item loop (no CTA barrier between items); the prefill tiles'.
        TimelineCase{"absorbing_tile", 512, 256, 8, 2, 700, 0, tuning(false, false, true)},
        TimelineCase{"prefill", 512, 256, 8, 2, 1000, 0, tuning(std::nullopt, std::nullopt, false)}),
    [](const ::testing::TestParamInfo<TimelineCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace megamoe
