// MoeDeviceWeights::from_stacked (the engine layout already on the device) against upload() of
// the same layer: the same prepacked weights, so deterministic runs are bitwise identical. Also
// every rejection: bad block scales, bad global scales, null pointers, bad shapes. Then the layer
// held once: prepack_in_place and view_prepacked run bitwise as from_stacked, unprepack_stacked
// gives the checkpoint bytes back, and a rejected layer is left untouched.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "megamoe/reference.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "tests/common/error_matchers.h"
#include "tests/common/test_util.h"

namespace megamoe {
namespace {

using testing::DeviceBuffer;
using testing::GpuMoe;

// A layer's tensors in the stacked layout, on the host: w13 = [gate rows; up rows] per expert.
struct HostStacked {
  std::vector<uint8_t> w13, w13_scale, w2, w2_scale;
  std::vector<float> w13_scale_2, w2_scale_2;
  std::vector<uint8_t> s_w13, s_w13_scale, s_w2, s_w2_scale;
  std::vector<float> s_w13_scale_2, s_w2_scale_2;
};

void append(std::vector<uint8_t>& dst, const uint8_t* src, int64_t bytes) {
  dst.insert(dst.end(), src, src + bytes);
}

void append_expert(const ExpertWeights& x, int64_t H, std::vector<uint8_t>& w13,
                   std::vector<uint8_t>& w13_scale, std::vector<uint8_t>& w2,
                   std::vector<uint8_t>& w2_scale) {
  const int64_t I = x.intermediate_size();
  append(w13, x.gate.weight, I * H / 2);
  append(w13, x.up.weight, I * H / 2);
  append(w13_scale, x.gate.weight_scale, I * H / 16);
  append(w13_scale, x.up.weight_scale, I * H / 16);
  append(w2, x.down.weight, H * I / 2);
  append(w2_scale, x.down.weight_scale, H * I / 16);
}

HostStacked stack(const MoeLayer& layer) {
  HostStacked s;
  const int64_t H = layer.hidden_size;
  for (const ExpertWeights& x : layer.experts) {
    append_expert(x, H, s.w13, s.w13_scale, s.w2, s.w2_scale);
    s.w13_scale_2.push_back(x.gate.weight_scale_2);
    s.w13_scale_2.push_back(x.up.weight_scale_2);
    s.w2_scale_2.push_back(x.down.weight_scale_2);
  }
  if (layer.shared_expert) {
    const ExpertWeights& x = *layer.shared_expert;
    append_expert(x, H, s.s_w13, s.s_w13_scale, s.s_w2, s.s_w2_scale);
    s.s_w13_scale_2 = {x.gate.weight_scale_2, x.up.weight_scale_2};
    s.s_w2_scale_2 = {x.down.weight_scale_2};
  }
  return s;
}

// DeviceBuffer uploads what it is given: one dummy element stands for an absent shared expert.
template <typename T>
std::vector<T> nonempty(const std::vector<T>& v) {
  return v.empty() ? std::vector<T>(1) : v;
}

// The host tensors uploaded, and the StackedNvfp4Weights view of them.
struct DeviceStacked {
  explicit DeviceStacked(const MoeLayer& layer, const HostStacked& h)
      : w13(h.w13), w13_scale(h.w13_scale), w2(h.w2), w2_scale(h.w2_scale),
        w13_scale_2(h.w13_scale_2), w2_scale_2(h.w2_scale_2), s_w13(nonempty(h.s_w13)),
        s_w13_scale(nonempty(h.s_w13_scale)), s_w2(nonempty(h.s_w2)),
        s_w2_scale(nonempty(h.s_w2_scale)), s_w13_scale_2(nonempty(h.s_w13_scale_2)),
        s_w2_scale_2(nonempty(h.s_w2_scale_2)) {
    view.hidden_size = layer.hidden_size;
    view.intermediate_size = layer.intermediate_size;
    view.num_experts = layer.num_experts;
    view.w13 = w13.get();
    view.w13_scale = w13_scale.get();
    view.w13_scale_2 = w13_scale_2.get();
    view.w2 = w2.get();
    view.w2_scale = w2_scale.get();
    view.w2_scale_2 = w2_scale_2.get();
    if (layer.shared_expert) {
      view.shared_intermediate_size = layer.shared_expert->intermediate_size();
      view.shared_w13 = s_w13.get();
      view.shared_w13_scale = s_w13_scale.get();
      view.shared_w13_scale_2 = s_w13_scale_2.get();
      view.shared_w2 = s_w2.get();
      view.shared_w2_scale = s_w2_scale.get();
      view.shared_w2_scale_2 = s_w2_scale_2.get();
    }
  }
  DeviceBuffer<uint8_t> w13, w13_scale, w2, w2_scale;
  DeviceBuffer<float> w13_scale_2, w2_scale_2;
  DeviceBuffer<uint8_t> s_w13, s_w13_scale, s_w2, s_w2_scale;
  DeviceBuffer<float> s_w13_scale_2, s_w2_scale_2;
  StackedNvfp4Weights view;
};

void check_same_as_upload(int64_t H, int64_t I, int64_t E, int k, int64_t shared_I, int64_t T) {
  SCOPED_TRACE(::testing::Message() << "H=" << H << " I=" << I << " E=" << E << " k=" << k
                                    << " shared_I=" << shared_I << " T=" << T);
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const MoeLayer layer = testing::random_layer(rng, H, I, E, k, shared_I);
  const HostStacked host = stack(layer);
  const DeviceStacked dev(layer, host);
  MoeProblem problem = MoeProblem::from_layer(layer, T);
  problem.deterministic = true;
  const MoePlan plan = MoePlan::create(problem);
  GpuMoe from_stacked(plan, MoeDeviceWeights::from_stacked(dev.view));
  GpuMoe uploaded(plan, MoeDeviceWeights::upload(layer));
  EXPECT_EQ(from_stacked.weights.device_bytes(), uploaded.weights.device_bytes());

  const auto hidden = testing::random_hidden(rng, T, H);
  const auto topk = testing::random_topk(rng, T, E, k);
  const auto got = from_stacked.run(hidden, topk);
  const auto want = uploaded.run(hidden, topk);
  ASSERT_EQ(got.size(), want.size());
  int64_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) differ += got[i] != want[i];
  EXPECT_EQ(differ, 0) << "outputs that differ from the upload() path (of " << got.size() << ")";
  const auto stats = testing::compare(got, reference::moe_forward_f32(layer, hidden, T, topk));
  EXPECT_EQ(stats.nonfinite, 0);
  EXPECT_LE(stats.rel_l2, testing::kMaxRelL2);
}

TEST(GpuStackedWeights, SameAsUploadWithoutSharedExpert) {
  MEGAMOE_REQUIRE_GPU();
  check_same_as_upload(256, 128, 8, 2, 0, 37);
}

TEST(GpuStackedWeights, SameAsUploadWithSharedExpert) {
  MEGAMOE_REQUIRE_GPU();
  check_same_as_upload(512, 128, 6, 3, 256, 70);
}

TEST(GpuStackedWeights, SameAsUploadWithMoreExpertsThanCores) {
  MEGAMOE_REQUIRE_GPU();
  check_same_as_upload(128, 64, 64, 4, 64, 200);  // prepack batches of experts
}

// from_stacked on a copy of `host` with one value changed by `mutate`; expects kInvalidArgument
// with `expected` in the message.
template <typename Mutate>
void expect_rejected(const MoeLayer& layer, const HostStacked& host, Mutate mutate,
                     const std::string& expected) {
  HostStacked bad = host;
  mutate(bad);
  const DeviceStacked dev(layer, bad);
  try {
    MoeDeviceWeights::from_stacked(dev.view);
    ADD_FAILURE() << "no error; expected one mentioning '" << expected << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
  }
}

TEST(GpuStackedWeights, RejectsBadScalesNamingTheElement) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t H = 128, I = 64, E = 4, Is = 64;
  const MoeLayer layer = testing::random_layer(rng, H, I, E, 2, Is);
  const HostStacked host = stack(layer);
  // w13_scale [E, 2I, H/16]: element [1, 5, 2].
  expect_rejected(layer, host, [&](HostStacked& s) { s.w13_scale[(1 * 2 * I + 5) * (H / 16) + 2] = 0x7F; },
                  "w13_scale[1, 5, 2] is the block scale 0x7F, which is NaN");
  // w2_scale [E, H, I/16]: element [3, 100, 1], negative.
  expect_rejected(layer, host, [&](HostStacked& s) { s.w2_scale[(3 * H + 100) * (I / 16) + 1] = 0xB8; },
                  "w2_scale[3, 100, 1] is the block scale 0xB8, which is negative");
  expect_rejected(layer, host, [&](HostStacked& s) { s.s_w13_scale[7] = 0xFF; },
                  "shared_w13_scale[0, 7]");
  expect_rejected(layer, host, [&](HostStacked& s) { s.s_w2_scale[H * (Is / 16) - 1] = 0x80 | 0x11; },
                  "shared_w2_scale[127, 3]");
  expect_rejected(layer, host, [&](HostStacked& s) { s.w13_scale_2[2 * 2 + 1] = 0.0f; },
                  "w13_scale_2[2, 1] (up of expert 2) is 0");
  expect_rejected(layer, host, [&](HostStacked& s) { s.w2_scale_2[0] = INFINITY; },
                  "w2_scale_2[0] (down of expert 0) is inf");
  expect_rejected(layer, host, [&](HostStacked& s) { s.s_w2_scale_2[0] = -1.0f; },
                  "shared_w2_scale_2 (shared down) is -1");
  expect_rejected(layer, host, [&](HostStacked& s) { s.s_w13_scale_2[0] = NAN; },
                  "shared_w13_scale_2[0] (shared gate)");
}

// ModelOpt's all-zero weight (global scale 0, NaN block scales, codes 0x77) in the stacked
// tensors: from_stacked takes it as zeros, so the run is bitwise the run of the same layer whose
// linears are zero (uploaded), and close to the reference of that layer.
TEST(GpuStackedWeights, ModelOptZeroWeightRunsAsZeros) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t H = 256, I = 128, E = 8, Is = 128, T = 64;
  const int k = 2;
  MoeLayer layer = testing::random_layer(rng, H, I, E, k, Is);
  HostStacked host = stack(layer);
  // Expert 1's gate and up (a fused group, as a GPU export writes it: NaN 0x7F) and the shared
  // expert's down (as a CPU export writes it: NaN 0xFF).
  std::fill(host.w13.begin() + 1 * 2 * I * (H / 2), host.w13.begin() + 2 * 2 * I * (H / 2), 0x77);
  std::fill(host.w13_scale.begin() + 1 * 2 * I * (H / 16),
            host.w13_scale.begin() + 2 * 2 * I * (H / 16), 0x7F);
  host.w13_scale_2[2] = host.w13_scale_2[3] = 0.0f;
  std::fill(host.s_w2.begin(), host.s_w2.end(), 0x77);
  std::fill(host.s_w2_scale.begin(), host.s_w2_scale.end(), 0xFF);
  host.s_w2_scale_2[0] = 0.0f;
  auto zero = [](const Nvfp4Linear& l) {
    const int64_t n = l.out_features, kk = l.in_features;
    return make_owned_linear(n, kk, std::vector<uint8_t>(n * kk / 2, 0),
                             std::vector<uint8_t>(n * kk / 16, 0), 1.0f);
  };
  layer.experts[1].gate = zero(layer.experts[1].gate);
  layer.experts[1].up = zero(layer.experts[1].up);
  layer.shared_expert->down = zero(layer.shared_expert->down);

  const DeviceStacked dev(layer, host);
  MoeProblem problem = MoeProblem::from_layer(layer, T);
  problem.deterministic = true;
  const MoePlan plan = MoePlan::create(problem);
  GpuMoe from_stacked(plan, MoeDeviceWeights::from_stacked(dev.view));
  GpuMoe uploaded(plan, MoeDeviceWeights::upload(layer));
  const auto hidden = testing::random_hidden(rng, T, H);
  reference::TopK topk = testing::random_topk(rng, T, E, k);
  for (int64_t t = 0; t < T; t += 2) {  // half the tokens use expert 1 (ids stay distinct)
    if (topk.ids[t * k + 1] == 1) topk.ids[t * k + 1] = topk.ids[t * k];
    topk.ids[t * k] = 1;
  }
  const auto got = from_stacked.run(hidden, topk);
  const auto want = uploaded.run(hidden, topk);
  int64_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) differ += got[i] != want[i];
  EXPECT_EQ(differ, 0) << "outputs that differ from the zero layer's (of " << got.size() << ")";
  const auto stats = testing::compare(got, reference::moe_forward_f32(layer, hidden, T, topk));
  EXPECT_EQ(stats.nonfinite, 0);
  EXPECT_LE(stats.rel_l2, testing::kMaxRelL2);

  // One byte short of the signature: the NaN scales are refused again.
  expect_rejected(layer, host, [&](HostStacked& s) { s.w13[1 * 2 * I * (H / 2) + 3] = 0x76; },
                  "w13_scale[1, 0, 0] is the block scale 0x7F, which is NaN");
}

TEST(GpuStackedWeights, RejectsNullPointersAndBadShapes) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const MoeLayer layer = testing::random_layer(rng, 128, 64, 2, 1, 64);
  const HostStacked host = stack(layer);
  const DeviceStacked dev(layer, host);
  auto expect_error = [](StackedNvfp4Weights w, const std::string& expected) {
    try {
      MoeDeviceWeights::from_stacked(w);
      ADD_FAILURE() << "no error; expected one mentioning '" << expected << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  StackedNvfp4Weights w = dev.view;
  w.w2 = nullptr;
  expect_error(w, "w2 is a null pointer");
  w = dev.view;
  w.shared_w2_scale_2 = nullptr;
  expect_error(w, "shared_w2_scale_2 is a null pointer");
  w = dev.view;
  w.hidden_size = 120;  // not a multiple of 16
  expect_error(w, "hidden_size 120");
  w = dev.view;
  w.num_experts = 0;
  expect_error(w, "num_experts 0");
  w = dev.view;
  w.shared_intermediate_size = 40;
  expect_error(w, "shared_intermediate_size 40");
  w = dev.view;
  w.hidden_size = 32;  // a multiple of 16 but not of 64: the kernels' limit, from upload()
  w.intermediate_size = 32;
  w.shared_intermediate_size = 0;
  try {
    MoeDeviceWeights::from_stacked(w);
    ADD_FAILURE() << "no error for H = 32";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 64"), std::string::npos) << e.what();
  }
}

// The stacked tensors with the routed and the shared expert's of each kind in one allocation, as
// prepack_in_place needs them (a torch module's buffers are views of such storages).
struct JointStacked {
  JointStacked(const MoeLayer& layer, const HostStacked& h)
      : w13(concat(h.w13, h.s_w13)), w13_scale(concat(h.w13_scale, h.s_w13_scale)), w2(concat(h.w2, h.s_w2)),
        w2_scale(concat(h.w2_scale, h.s_w2_scale)), w13_scale_2(h.w13_scale_2), w2_scale_2(h.w2_scale_2),
        s_w13_scale_2(nonempty(h.s_w13_scale_2)), s_w2_scale_2(nonempty(h.s_w2_scale_2)) {
    b.hidden_size = layer.hidden_size;
    b.intermediate_size = layer.intermediate_size;
    b.num_experts = layer.num_experts;
    b.w13 = w13.get();
    b.w13_scale = w13_scale.get();
    b.w13_scale_2 = w13_scale_2.get();
    b.w2 = w2.get();
    b.w2_scale = w2_scale.get();
    b.w2_scale_2 = w2_scale_2.get();
    if (layer.shared_expert) {
      b.shared_intermediate_size = layer.shared_expert->intermediate_size();
      b.shared_w13 = w13.get() + h.w13.size();
      b.shared_w13_scale = w13_scale.get() + h.w13_scale.size();
      b.shared_w13_scale_2 = s_w13_scale_2.get();
      b.shared_w2 = w2.get() + h.w2.size();
      b.shared_w2_scale = w2_scale.get() + h.w2_scale.size();
      b.shared_w2_scale_2 = s_w2_scale_2.get();
    }
  }
  static std::vector<uint8_t> concat(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
    std::vector<uint8_t> out = a;
    out.insert(out.end(), b.begin(), b.end());
    return out;
  }
  // The routed then the shared bytes of each kind, and the global scales, as on the device now.
  HostStacked download() const {
    HostStacked h;
    const int64_t H = b.hidden_size, I = b.intermediate_size, E = b.num_experts;
    const auto split = [](const std::vector<uint8_t>& all, int64_t routed, std::vector<uint8_t>& r,
                          std::vector<uint8_t>& sh) {
      r.assign(all.begin(), all.begin() + routed);
      sh.assign(all.begin() + routed, all.end());
    };
    split(w13.download(), E * 2 * I * H / 2, h.w13, h.s_w13);
    split(w13_scale.download(), E * 2 * I * H / 16, h.w13_scale, h.s_w13_scale);
    split(w2.download(), E * H * I / 2, h.w2, h.s_w2);
    split(w2_scale.download(), E * H * I / 16, h.w2_scale, h.s_w2_scale);
    h.w13_scale_2 = w13_scale_2.download();
    h.w2_scale_2 = w2_scale_2.download();
    if (b.shared_intermediate_size > 0) {
      h.s_w13_scale_2 = s_w13_scale_2.download();
      h.s_w2_scale_2 = s_w2_scale_2.download();
    }
    return h;
  }
  DeviceBuffer<uint8_t> w13, w13_scale, w2, w2_scale;
  DeviceBuffer<float> w13_scale_2, w2_scale_2, s_w13_scale_2, s_w2_scale_2;
  StackedNvfp4Buffers b;
};

// The bytes a prepack round trip gives back: the codes of every zero-scale block cleared.
std::vector<uint8_t> canonical_codes(std::vector<uint8_t> codes, const std::vector<uint8_t>& scales) {
  for (size_t blk = 0; blk < scales.size(); ++blk) {
    if (scales[blk] == 0) std::fill(codes.begin() + 8 * blk, codes.begin() + 8 * blk + 8, 0);
  }
  return codes;
}

void expect_same_bytes(const HostStacked& got, const HostStacked& want) {
  EXPECT_TRUE(got.w13 == canonical_codes(want.w13, want.w13_scale)) << "w13";
  EXPECT_TRUE(got.w13_scale == want.w13_scale) << "w13_scale";
  EXPECT_TRUE(got.w2 == canonical_codes(want.w2, want.w2_scale)) << "w2";
  EXPECT_TRUE(got.w2_scale == want.w2_scale) << "w2_scale";
  EXPECT_TRUE(got.w13_scale_2 == want.w13_scale_2) << "w13_scale_2";
  EXPECT_TRUE(got.w2_scale_2 == want.w2_scale_2) << "w2_scale_2";
  EXPECT_TRUE(got.s_w13 == canonical_codes(want.s_w13, want.s_w13_scale)) << "shared_w13";
  EXPECT_TRUE(got.s_w13_scale == want.s_w13_scale) << "shared_w13_scale";
  EXPECT_TRUE(got.s_w2 == canonical_codes(want.s_w2, want.s_w2_scale)) << "shared_w2";
  EXPECT_TRUE(got.s_w2_scale == want.s_w2_scale) << "shared_w2_scale";
  EXPECT_TRUE(got.s_w13_scale_2 == want.s_w13_scale_2) << "shared_w13_scale_2";
  EXPECT_TRUE(got.s_w2_scale_2 == want.s_w2_scale_2) << "shared_w2_scale_2";
}

int64_t count_differ(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  EXPECT_EQ(a.size(), b.size());
  int64_t differ = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) differ += a[i] != b[i];
  return differ;
}

void check_in_place(int64_t H, int64_t I, int64_t E, int k, int64_t shared_I, int64_t T) {
  SCOPED_TRACE(::testing::Message() << "H=" << H << " I=" << I << " E=" << E << " k=" << k
                                    << " shared_I=" << shared_I << " T=" << T);
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const MoeLayer layer = testing::random_layer(rng, H, I, E, k, shared_I, std::nullopt, {testing::ScaleCodes::kEveryCode});
  const HostStacked host = stack(layer);
  JointStacked joint(layer, host);
  MoeProblem problem = MoeProblem::from_layer(layer, T);
  problem.deterministic = true;
  const MoePlan plan = MoePlan::create(problem);
  GpuMoe copied(plan, MoeDeviceWeights::from_stacked(joint.b.as_const()));

  GpuMoe in_place(plan, MoeDeviceWeights::prepack_in_place(joint.b));
  EXPECT_TRUE(in_place.weights.views_caller_memory());
  EXPECT_FALSE(copied.weights.views_caller_memory());
  EXPECT_EQ(std::string(in_place.weights.layout()), prepacked_layout());
  const int64_t virtual_experts = E + shared_I / I;
  // [3][E'] global scales, and the W4A8 row's [3][E'] rescaled scales and [2][E'] decode constants.
  EXPECT_EQ(in_place.weights.device_bytes(), static_cast<size_t>(8 * virtual_experts) * 4)
      << "a layer prepacked in place allocates its global scales and W4A8 constants only";
  EXPECT_FALSE(joint.download().w13 == host.w13) << "the caller's w13 holds the prepacked layout";

  const auto hidden = testing::random_hidden(rng, T, H);
  const auto topk = testing::random_topk(rng, T, E, k);
  const auto want = copied.run(hidden, topk);
  EXPECT_EQ(count_differ(in_place.run(hidden, topk), want), 0) << "prepack_in_place vs from_stacked";
  GpuMoe viewed(plan, MoeDeviceWeights::view_prepacked(joint.b.as_const()));
  EXPECT_TRUE(viewed.weights.views_caller_memory());
  EXPECT_EQ(count_differ(viewed.run(hidden, topk), want), 0) << "view_prepacked vs from_stacked";

  // Out of place to fresh host memory, then in place: the checkpoint bytes both times.
  HostStacked out = host;
  for (auto* v : {&out.w13, &out.w13_scale, &out.w2, &out.w2_scale, &out.s_w13, &out.s_w13_scale, &out.s_w2,
                  &out.s_w2_scale}) {
    std::fill(v->begin(), v->end(), 0xA5);  // poison: every byte must be written
  }
  for (auto* v : {&out.w13_scale_2, &out.w2_scale_2, &out.s_w13_scale_2, &out.s_w2_scale_2}) {
    std::fill(v->begin(), v->end(), NAN);
  }
  StackedNvfp4Buffers host_out = joint.b;
  host_out.w13 = out.w13.data();
  host_out.w13_scale = out.w13_scale.data();
  host_out.w13_scale_2 = out.w13_scale_2.data();
  host_out.w2 = out.w2.data();
  host_out.w2_scale = out.w2_scale.data();
  host_out.w2_scale_2 = out.w2_scale_2.data();
  if (shared_I > 0) {
    host_out.shared_w13 = out.s_w13.data();
    host_out.shared_w13_scale = out.s_w13_scale.data();
    host_out.shared_w13_scale_2 = out.s_w13_scale_2.data();
    host_out.shared_w2 = out.s_w2.data();
    host_out.shared_w2_scale = out.s_w2_scale.data();
    host_out.shared_w2_scale_2 = out.s_w2_scale_2.data();
  }
  unprepack_stacked(in_place.weights.layout(), joint.b.as_const(), host_out);
  {
    SCOPED_TRACE("unprepacked to host memory");
    expect_same_bytes(out, host);
  }
  unprepack_stacked(in_place.weights.layout(), joint.b.as_const(), joint.b);
  {
    SCOPED_TRACE("unprepacked in place");
    expect_same_bytes(joint.download(), host);
  }
}

TEST(GpuStackedWeights, InPlaceRunsAsFromStackedAndUnprepacksWithoutSharedExpert) {
  MEGAMOE_REQUIRE_GPU();
  check_in_place(256, 128, 8, 2, 0, 37);
}

TEST(GpuStackedWeights, InPlaceRunsAsFromStackedAndUnprepacksWithSharedExpert) {
  MEGAMOE_REQUIRE_GPU();
  check_in_place(512, 128, 6, 3, 256, 70);
  check_in_place(128, 64, 64, 4, 64, 200);  // prepack batches of experts
}

// ModelOpt's all-zero weight prepacked in place: its global scale becomes 1 in the caller's tensor
// too, so the run, a view and the unprepacked bytes all say the same zero weight.
TEST(GpuStackedWeights, InPlaceRewritesModelOptZeroWeightAsZeros) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t H = 256, I = 128, E = 4, T = 16;
  const MoeLayer layer = testing::random_layer(rng, H, I, E, 2, 0);
  HostStacked host = stack(layer);
  std::fill(host.w2.begin() + 2 * H * (I / 2), host.w2.begin() + 3 * H * (I / 2), 0x77);
  std::fill(host.w2_scale.begin() + 2 * H * (I / 16), host.w2_scale.begin() + 3 * H * (I / 16), 0x7F);
  host.w2_scale_2[2] = 0.0f;
  JointStacked joint(layer, host);
  MoeProblem problem = MoeProblem::from_layer(layer, T);
  problem.deterministic = true;
  const MoePlan plan = MoePlan::create(problem);
  GpuMoe copied(plan, MoeDeviceWeights::from_stacked(joint.b.as_const()));
  GpuMoe in_place(plan, MoeDeviceWeights::prepack_in_place(joint.b));
  EXPECT_EQ(joint.download().w2_scale_2[2], 1.0f);
  const auto hidden = testing::random_hidden(rng, T, H);
  const auto topk = testing::random_topk(rng, T, E, 2);
  EXPECT_EQ(count_differ(in_place.run(hidden, topk), copied.run(hidden, topk)), 0);
  unprepack_stacked(in_place.weights.layout(), joint.b.as_const(), joint.b);
  const HostStacked back = joint.download();
  for (int64_t i = 2 * H * (I / 16); i < 3 * H * (I / 16); ++i) ASSERT_EQ(back.w2_scale[i], 0) << i;
  for (int64_t i = 2 * H * (I / 2); i < 3 * H * (I / 2); ++i) ASSERT_EQ(back.w2[i], 0) << i;
}

TEST(GpuStackedWeights, InPlaceRejectsMemoryItCannotUseAndLeavesBadLayersUntouched) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t H = 128, I = 64, E = 4, Is = 64;
  const MoeLayer layer = testing::random_layer(rng, H, I, E, 2, Is);
  const HostStacked host = stack(layer);
  JointStacked joint(layer, host);

  StackedNvfp4Buffers b = joint.b;
  const DeviceStacked apart(layer, host);  // the shared expert's tensors in their own allocations
  b.shared_w2 = const_cast<uint8_t*>(apart.view.shared_w2);
  EXPECT_MEGAMOE_ERROR(MoeDeviceWeights::prepack_in_place(b), kInvalidArgument, "shared_w2 must start where w2 ends");
  EXPECT_MEGAMOE_ERROR(MoeDeviceWeights::view_prepacked(b.as_const()), kInvalidArgument, "shared_w2 must start where w2 ends");
  b = joint.b;
  b.w2_scale += 8;
  b.shared_w2_scale += 8;
  EXPECT_MEGAMOE_ERROR(MoeDeviceWeights::prepack_in_place(b), kInvalidArgument, "w2_scale is not 16-byte aligned");
  std::vector<uint8_t> host_codes = joint.w13.download();
  b = joint.b;
  b.w13 = host_codes.data();
  b.shared_w13 = host_codes.data() + host.w13.size();
  EXPECT_MEGAMOE_ERROR(MoeDeviceWeights::prepack_in_place(b), kInvalidArgument, "w13 is not device memory");
  b = joint.b;
  b.w13_scale_2 = nullptr;
  EXPECT_MEGAMOE_ERROR(MoeDeviceWeights::prepack_in_place(b), kInvalidArgument, "w13_scale_2 is a null pointer");

  // A bad block scale is found before anything is written.
  HostStacked bad = host;
  bad.w2_scale[5] = 0x7F;
  JointStacked bad_joint(layer, bad);
  EXPECT_MEGAMOE_ERROR(MoeDeviceWeights::prepack_in_place(bad_joint.b), kInvalidArgument, "w2_scale[0, 1, 1] is the block scale 0x7F");
  const HostStacked after = bad_joint.download();
  EXPECT_TRUE(after.w13 == bad.w13 && after.w2 == bad.w2 && after.s_w13 == bad.s_w13 && after.s_w2 == bad.s_w2 &&
              after.w2_scale == bad.w2_scale)
      << "a rejected layer must be left as it was";

  EXPECT_MEGAMOE_ERROR(unprepack_stacked("no-such-layout", joint.b.as_const(), joint.b), kInvalidArgument, "weight layout \"no-such-layout\" is not one of this build's (" + prepacked_layout());
  StackedNvfp4Buffers wrong = joint.b;
  wrong.num_experts = E - 1;
  EXPECT_MEGAMOE_ERROR(unprepack_stacked(prepacked_layout(), joint.b.as_const(), wrong), kInvalidArgument, "out has hidden_size");
}

}  // namespace
}  // namespace megamoe
