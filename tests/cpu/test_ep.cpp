// The host-side pieces of expert parallelism (include/megamoe/ep.h) that need no GPU: the expert
// split, the rank's local layer, the unique id's text form, the window layout and the transport
// factory's argument checks. The multi-GPU runs are in tests/cpu/test_tool.cpp
// (ToolSynth.RunExpertParallelMatchesReference, skipped below 2 GPUs).
#include <gtest/gtest.h>

#if MEGAMOE_HAS_EP

#include <cctype>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "ep/ep_transport.h"
#include "ep/ep_transport_nccl.h"
#include "ep/ep_window_layout.h"
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

TEST(ExpertParallel, WindowLayoutByHand) {
  // R = 2 sources of max_t = 3 rows, H = 64, k = 4: recv_x 768 B, recv_ids and recv_w 96 B each
  // (256 with alignment), recv_src 24 B (256), ret 1536 B.
  constexpr ep::EpWindowLayout l = ep::ep_window_layout(2, 3, 64, 4);
  EXPECT_EQ(l.recv_x, 0);
  EXPECT_EQ(l.recv_ids, 768);
  EXPECT_EQ(l.recv_w, 1024);
  EXPECT_EQ(l.recv_src, 1280);
  EXPECT_EQ(l.ret, 1536);
  EXPECT_EQ(l.bytes, 3072);
  // The signal words: sent and done slots for the largest world, and the receive count; the area
  // is rounded so that the data bytes after it stay 256-byte aligned.
  EXPECT_EQ(ep::kFlagWords, 17u);
  EXPECT_EQ(ep::kRecvCountWord, 16);
  EXPECT_EQ(ep::flag_area_bytes(ep::kFlagWords), 256u);
  EXPECT_EQ(ep::flag_area_bytes(0), 0u);
  EXPECT_EQ(ep::flag_area_bytes(1), 256u);
  EXPECT_EQ(ep::flag_area_bytes(32), 256u);
  EXPECT_EQ(ep::flag_area_bytes(33), 512u);
}

// For every shape: each buffer 256-byte aligned, as large as its rows need, after the previous one
// with less than 256 bytes of padding between, and the window just large enough.
TEST(ExpertParallel, WindowLayoutHoldsEveryBuffer) {
  for (int R = 1; R <= ep::kMaxRanks; ++R) {
    for (int64_t max_t : {1, 7, 512, 65536}) {
      for (int64_t H : {8, 2048, 7168}) {
        for (int k : {1, 6, 8}) {
          SCOPED_TRACE(testing::Message() << "R=" << R << " max_t=" << max_t << " H=" << H << " k=" << k);
          const ep::EpWindowLayout l = ep::ep_window_layout(R, max_t, H, k);
          const int64_t rows = R * max_t;
          const int64_t offsets[] = {l.recv_x, l.recv_ids, l.recv_w, l.recv_src, l.ret, l.bytes};
          const int64_t sizes[] = {rows * H * 2, rows * k * 4, rows * k * 4, rows * 4, rows * H * 4};
          EXPECT_EQ(offsets[0], 0);
          for (int i = 0; i < 5; ++i) {
            EXPECT_EQ(offsets[i] % 256, 0) << "buffer " << i;
            const int64_t end = offsets[i] + sizes[i];
            EXPECT_GE(offsets[i + 1], end) << "buffer " << i << " overlaps the next";
            EXPECT_LT(offsets[i + 1] - end, 256) << "buffer " << i;
          }
        }
      }
    }
  }
}

// The factory rejects a rank, world size or timeout out of range before it calls NCCL (no GPU
// is needed to get these errors).
TEST(ExpertParallel, TransportFactoryChecksItsArguments) {
  const EpUniqueId id;
  auto code_of = [&](int world, int rank, double timeout) {
    EpConfig config;
    config.world_size = world;
    config.rank = rank;
    config.timeout_seconds = timeout;
    try {
      ep::make_nccl_transport(config, id);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("expert parallelism"), std::string::npos) << e.what();
      return e.code();
    }
    ADD_FAILURE() << "world " << world << ", rank " << rank << ", timeout " << timeout << " was accepted";
    return ErrorCode::kInternal;
  };
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  EXPECT_EQ(code_of(0, 0, 60), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code_of(ep::kMaxRanks + 1, 0, 60), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code_of(4, -1, 60), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code_of(4, 4, 60), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code_of(2, 1, 0), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code_of(2, 1, -1), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code_of(2, 1, inf), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code_of(2, 1, nan), ErrorCode::kInvalidArgument);
  // make_transport, the layer's entry, checks the same.
  EpConfig bad;
  bad.world_size = 2;
  bad.rank = 2;
  EXPECT_THROW(ep::make_transport(bad, id), Error);
}

// EpGroup and EpLoopback refuse bad arguments before they touch a device or NCCL.
TEST(ExpertParallel, GroupAndLoopbackCheckTheirArguments) {
  const EpUniqueId id;
  auto group_code = [&](EpConfig config, int64_t H, int k) {
    try {
      EpGroup::create(config, id, H, k);
    } catch (const Error& e) {
      return std::make_pair(e.code(), std::string(e.what()));
    }
    return std::make_pair(ErrorCode::kInternal, std::string("accepted"));
  };
  EpConfig ok;
  ok.world_size = 2;
  ok.rank = 1;
  ok.max_tokens_per_rank = 64;
  EpConfig bad_t = ok;
  bad_t.max_tokens_per_rank = 0;
  EpConfig bad_rank = ok;
  bad_rank.rank = 2;
  EpConfig bad_timeout = ok;
  bad_timeout.timeout_seconds = 0;
  EXPECT_EQ(group_code(bad_t, 7168, 8).first, ErrorCode::kInvalidArgument);
  EXPECT_NE(group_code(bad_t, 7168, 8).second.find("max_tokens_per_rank = 0"), std::string::npos);
  EXPECT_EQ(group_code(bad_rank, 7168, 8).first, ErrorCode::kInvalidArgument);
  EXPECT_EQ(group_code(bad_timeout, 7168, 8).first, ErrorCode::kInvalidArgument);
  EXPECT_NE(group_code(ok, 7000, 8).second.find("hidden_size = 7000"), std::string::npos);
  EXPECT_NE(group_code(ok, 7168, 17).second.find("top_k = 17"), std::string::npos);
  EXPECT_NE(group_code(ok, 7168, 0).second.find("top_k = 0"), std::string::npos);
  for (int world : {0, ep::kMaxRanks + 1}) {
    try {
      EpLoopback::create(world);
      ADD_FAILURE() << "EpLoopback::create(" << world << ") was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("1..8"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace megamoe

#endif  // MEGAMOE_HAS_EP
