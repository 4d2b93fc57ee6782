// The host-side pieces of expert parallelism (include/megamoe/ep.h) that need no GPU: the expert
// split, the rank's local layer and the unique id's text form. The multi-GPU runs are in
// tests/cpu/test_tool.cpp (ToolSynth.RunExpertParallelMatchesReference, skipped below 2 GPUs).
#include <gtest/gtest.h>

#if MEGAMOE_HAS_EP

#include <cctype>
#include <string>
#include <vector>

#include "megamoe/ep.h"
#include "megamoe/moe.h"
#include "megamoe/status.h"

namespace megamoe {
namespace {

TEST(ExpertParallel, ExpertRangesSplitEvenly) {
  const EpExpertRange r0 = ep_expert_range(256, 8, 0), r7 = ep_expert_range(256, 8, 7);
  EXPECT_EQ(r0.first, 0);
  EXPECT_EQ(r0.count, 32);
  EXPECT_EQ(r7.first, 224);
  EXPECT_EQ(r7.count, 32);
  int64_t next = 0;
  for (int r = 0; r < 4; ++r) {
    const EpExpertRange e = ep_expert_range(384, 4, r);  // Kimi-K2 over 4 GPUs
    EXPECT_EQ(e.first, next);
    next = e.first + e.count;
  }
  EXPECT_EQ(next, 384);
  EXPECT_THROW(ep_expert_range(100, 8, 0), Error);  // not a multiple of the world size
  EXPECT_THROW(ep_expert_range(256, 9, 0), Error);  // more than the GPUs of a host
  EXPECT_THROW(ep_expert_range(256, 2, 2), Error);  // rank out of range
  EXPECT_THROW(ep_expert_range(256, 0, 0), Error);
}

// A layer of E experts whose weights are distinguishable by pointer.
MoeLayer tiny_layer(int64_t E, int top_k, bool shared) {
  MoeLayer layer;
  layer.hidden_size = 64;
  layer.intermediate_size = 64;
  layer.num_experts = E;
  layer.routing.top_k = top_k;
  auto linear = [](int64_t out, int64_t in) {
    return make_owned_linear(out, in, std::vector<uint8_t>(static_cast<size_t>(out * in / 2), 0x21),
                             std::vector<uint8_t>(static_cast<size_t>(out * in / 16), 0x38), 1.0f);
  };
  for (int64_t e = 0; e < E; ++e) layer.experts.push_back({linear(64, 64), linear(64, 64), linear(64, 64)});
  if (shared) layer.shared_expert = ExpertWeights{linear(128, 64), linear(128, 64), linear(64, 128)};
  layer.router_weight.assign(static_cast<size_t>(E * 64), 0.5f);
  return layer;
}

TEST(ExpertParallel, LocalLayerViewsTheRanksExperts) {
  const MoeLayer layer = tiny_layer(16, 4, true);
  const MoeLayer local = ep_local_layer(layer, ep_expert_range(16, 2, 1));
  ASSERT_EQ(local.num_experts, 8);
  ASSERT_EQ(local.experts.size(), 8u);
  for (int64_t e = 0; e < 8; ++e) {
    // The same bytes (views, not copies) as the global experts 8..15.
    EXPECT_EQ(local.experts[static_cast<size_t>(e)].gate.weight, layer.experts[static_cast<size_t>(8 + e)].gate.weight);
    EXPECT_EQ(local.experts[static_cast<size_t>(e)].down.weight_scale,
              layer.experts[static_cast<size_t>(8 + e)].down.weight_scale);
  }
  ASSERT_TRUE(local.shared_expert.has_value());
  EXPECT_EQ(local.shared_expert->up.weight, layer.shared_expert->up.weight);
  EXPECT_EQ(local.routing.top_k, 4);
  EXPECT_TRUE(local.router_weight.empty()) << "the router runs where the tokens are, over all E experts";
  EXPECT_NO_THROW(local.validate());
  // Fewer experts per rank than top_k: a rank's local layer could not take a token's k ids.
  EXPECT_THROW(ep_local_layer(tiny_layer(16, 8, false), ep_expert_range(16, 4, 0)), Error);
  EXPECT_THROW(ep_local_layer(layer, EpExpertRange{12, 8}), Error);  // past the layer's experts
}

TEST(ExpertParallel, UniqueIdRoundTripsThroughHex) {
  EpUniqueId id;
  for (size_t i = 0; i < id.bytes.size(); ++i) id.bytes[i] = static_cast<char>(i * 37 + 11);
  const std::string hex = id.to_hex();
  ASSERT_EQ(hex.size(), 256u);
  EXPECT_EQ(EpUniqueId::from_hex(hex).bytes, id.bytes);
  std::string upper = hex;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  EXPECT_EQ(EpUniqueId::from_hex(upper).bytes, id.bytes);
  EXPECT_THROW(EpUniqueId::from_hex(hex.substr(1)), Error);
  EXPECT_THROW(EpUniqueId::from_hex(std::string(255, '0') + "g"), Error);
}

}  // namespace
}  // namespace megamoe

#endif  // MEGAMOE_HAS_EP
