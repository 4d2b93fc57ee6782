// The configuration heuristic (src/runtime/sm90_moe_heuristics.cpp) is a pure function of the
// problem and the token count: these pin the measured tile choices, so a change to them is
// deliberate (and re-measured, docs/perf).
#include <gtest/gtest.h>

#include "megamoe/runtime.h"

namespace megamoe {
namespace {

MoeProblem deepseek_v3() {
  MoeProblem p;
  p.hidden_size = 7168;
  p.intermediate_size = 2048;
  p.num_experts = 256;
  p.top_k = 8;
  p.shared_intermediate_size = 2048;
  p.max_tokens = 16384;
  return p;
}

MoeProblem qwen3_30b() {
  MoeProblem p;
  p.hidden_size = 2048;
  p.intermediate_size = 768;
  p.num_experts = 128;
  p.top_k = 8;
  p.max_tokens = 16384;
  return p;
}

TEST(Heuristics, TokenTileFollowsTokensPerExpert) {
  const MoeProblem p = deepseek_v3();  // 32 tokens of T per expert
  EXPECT_EQ(choose_moe_config(p, 1).l1.block_n, 16);
  EXPECT_EQ(choose_moe_config(p, 512).l1.block_n, 16);
  EXPECT_EQ(choose_moe_config(p, 768).l1.block_n, 32);
  EXPECT_EQ(choose_moe_config(p, 1024).l1.block_n, 48);
  EXPECT_EQ(choose_moe_config(p, 1536).l1.block_n, 64);
  const GemmConfig prefill = choose_moe_config(p, 4096).l1;
  EXPECT_EQ(prefill.block_n, 128);
  EXPECT_EQ(prefill.warpgroups, 2);
}

TEST(Heuristics, L2SplitsKOnlyAtDecodeWithLongSlices) {
  const MoeProblem dsv3 = deepseek_v3();  // I/64 = 32 chunks: two slices of 16
  EXPECT_EQ(choose_moe_config(dsv3, 1).l2.k_splits, 2);
  EXPECT_EQ(choose_moe_config(dsv3, 768).l2.k_splits, 1);
  MoeProblem deterministic = dsv3;
  deterministic.deterministic = true;  // the fixed-order combine keeps whole tiles
  EXPECT_EQ(choose_moe_config(deterministic, 1).l2.k_splits, 1);
  EXPECT_EQ(choose_moe_config(qwen3_30b(), 1).l2.k_splits, 1);  // I/64 = 12 chunks
}

TEST(Heuristics, OddTileCountsAvoidTheTwoWarpgroupTile) {
  MoeProblem p = deepseek_v3();
  p.hidden_size = 192;  // L2 has 3 row tiles of 64
  const MoeConfig c = choose_moe_config(p, 16384);
  EXPECT_EQ(c.l2.warpgroups, 1);
  EXPECT_EQ(c.l1.warpgroups, 2);
}

}  // namespace
}  // namespace megamoe
