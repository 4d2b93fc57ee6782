// The C API on the GPU against the C++ path `megamoe run` takes (tools/megamoe/run.cpp:
// load_moe_layer, MoePlan::create, MoeDeviceWeights::upload, run, the CPU router), bit for bit, on
// DeepSeek-V3's layer as `megamoe synth` writes it (256 experts, the shared expert, noaux_tc), at
// T = 1, 17 and 1000, deterministic combine:
//   - from the checkpoint, with the top-k ids and weights of the CPU router (what `megamoe run`
//     computes when its input has none);
//   - from the checkpoint, with router logits routed on the device (against route_topk + run);
//   - from stacked device tensors (the engine layout), with a workspace of the caller's;
//   - the first, captured in a CUDA graph and replayed.
// Everything C++ here comes from libmegamoe.so as well: the test links nothing else of the library.
#include <gtest/gtest.h>

#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "megamoe/checkpoint.h"
#include "megamoe/dtype.h"
#include "megamoe/gpu.h"
#include "megamoe/megamoe.h"
#include "megamoe/presets.h"
#include "megamoe/reference.h"
#include "megamoe/runtime.h"
#include "support/device_buffer.h"

namespace megamoe {
namespace {

using support::DeviceBuffer;

constexpr int64_t kMaxTokens = 1000;
const int64_t kTokens[] = {1, 17, 1000};

#define ASSERT_C_OK(call) ASSERT_EQ((call), MEGAMOE_OK) << #call << ": " << megamoe_last_error()

// The layer's stacked tensors on the device (w13 = gate rows then up rows per expert). `joint`:
// each of the shared expert's code and scale tensors follows the routed one in one allocation, as
// in_place needs them.
struct DeviceStacked {
  explicit DeviceStacked(const MoeLayer& layer, bool joint = false) {
    const int64_t H = layer.hidden_size;
    std::vector<uint8_t> w13, w13_scale, w2, w2_scale, s_w13, s_w13_scale, s_w2, s_w2_scale;
    std::vector<float> w13_scale_2, w2_scale_2, s_w13_scale_2, s_w2_scale_2;
    auto append = [](std::vector<uint8_t>& dst, const uint8_t* src, int64_t n) { dst.insert(dst.end(), src, src + n); };
    auto stack = [&](const ExpertWeights& x, std::vector<uint8_t>& c13, std::vector<uint8_t>& s13,
                     std::vector<uint8_t>& c2, std::vector<uint8_t>& s2) {
      const int64_t I = x.intermediate_size();
      append(c13, x.gate.weight, I * H / 2);
      append(c13, x.up.weight, I * H / 2);
      append(s13, x.gate.weight_scale, I * H / 16);
      append(s13, x.up.weight_scale, I * H / 16);
      append(c2, x.down.weight, H * I / 2);
      append(s2, x.down.weight_scale, H * I / 16);
    };
    for (const ExpertWeights& x : layer.experts) {
      stack(x, w13, w13_scale, w2, w2_scale);
      w13_scale_2.insert(w13_scale_2.end(), {x.gate.weight_scale_2, x.up.weight_scale_2});
      w2_scale_2.push_back(x.down.weight_scale_2);
    }
    const ExpertWeights& s = *layer.shared_expert;
    stack(s, s_w13, s_w13_scale, s_w2, s_w2_scale);
    s_w13_scale_2 = {s.gate.weight_scale_2, s.up.weight_scale_2};
    s_w2_scale_2 = {s.down.weight_scale_2};
    bytes.reserve(8);
    if (joint) {
      std::vector<uint8_t>* routed[] = {&w13, &w13_scale, &w2, &w2_scale};
      std::vector<uint8_t>* shared[] = {&s_w13, &s_w13_scale, &s_w2, &s_w2_scale};
      for (int i = 0; i < 4; ++i) {
        std::vector<uint8_t> both = *routed[i];
        both.insert(both.end(), shared[i]->begin(), shared[i]->end());
        bytes.push_back(std::make_unique<DeviceBuffer<uint8_t>>(both));
        ptr[i] = bytes.back()->get();
        ptr[4 + i] = ptr[i] + routed[i]->size();
      }
    } else {
      int i = 0;
      for (auto* v : {&w13, &w13_scale, &w2, &w2_scale, &s_w13, &s_w13_scale, &s_w2, &s_w2_scale}) {
        bytes.push_back(std::make_unique<DeviceBuffer<uint8_t>>(*v));
        ptr[i++] = bytes.back()->get();
      }
    }
    for (auto* v : {&w13_scale_2, &w2_scale_2, &s_w13_scale_2, &s_w2_scale_2}) {
      floats.push_back(std::make_unique<DeviceBuffer<float>>(*v));
    }
    floats.push_back(std::make_unique<DeviceBuffer<float>>(layer.e_score_correction_bias));
  }
  std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> bytes;
  uint8_t* ptr[8] = {};  // w13, w13_scale, w2, w2_scale, then the shared expert's
  std::vector<std::unique_ptr<DeviceBuffer<float>>> floats;   // w13_scale_2, w2_scale_2, shared's, bias
};

megamoe_tensor tensor(const void* data, megamoe_dtype dtype, std::vector<int64_t> shape) {
  megamoe_tensor t{};
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int32_t>(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) t.shape[d] = shape[d];
  return t;
}

// One T's inputs, on the host and the device, routed the way `megamoe run` routes.
struct Inputs {
  Inputs(const MoeLayer& layer, int64_t T) : tokens(T) {
    std::mt19937_64 rng(0xC0FFEE + T);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    hidden.resize(static_cast<size_t>(T * layer.hidden_size));
    for (uint16_t& h : hidden) h = f32_to_bf16(normal(rng));
    logits = reference::router_logits(layer, hidden, T);
    topk = reference::route(layer.routing, logits, T, layer.num_experts, layer.e_score_correction_bias);
    d_hidden = std::make_unique<DeviceBuffer<uint16_t>>(hidden);
    d_logits = std::make_unique<DeviceBuffer<float>>(logits);
    d_ids = std::make_unique<DeviceBuffer<int32_t>>(topk.ids);
    d_weights = std::make_unique<DeviceBuffer<float>>(topk.weights);
  }
  int64_t tokens;
  std::vector<uint16_t> hidden;
  std::vector<float> logits;
  reference::TopK topk;
  std::unique_ptr<DeviceBuffer<uint16_t>> d_hidden;
  std::unique_ptr<DeviceBuffer<float>> d_logits;
  std::unique_ptr<DeviceBuffer<int32_t>> d_ids;
  std::unique_ptr<DeviceBuffer<float>> d_weights;
};

size_t mismatches(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

// The synthesized checkpoint and the C++ path, made once for every test.
struct Shared {
  std::filesystem::path dir;
  std::unique_ptr<MoeLayer> layer;
  std::unique_ptr<MoePlan> plan;
  std::unique_ptr<MoeDeviceWeights> weights;
  std::unique_ptr<DeviceBuffer<uint8_t>> workspace;
  std::unique_ptr<DeviceBuffer<float>> bias;
  cudaStream_t stream = nullptr;

  ~Shared() {
    if (stream) cudaStreamDestroy(stream);
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }

  // The C++ path: route_topk on the device first when `logits`, then run().
  std::vector<uint16_t> cxx_run(const Inputs& in, bool logits) {
    const int64_t T = in.tokens, k = layer->routing.top_k;
    DeviceBuffer<uint16_t> out(static_cast<size_t>(T * layer->hidden_size));
    out.poison();
    DeviceBuffer<int32_t> ids(static_cast<size_t>(T * k));
    DeviceBuffer<float> w(static_cast<size_t>(T * k));
    MoeRunArgs args;
    args.hidden = in.d_hidden->get();
    args.topk_ids = in.d_ids->get();
    args.topk_weights = in.d_weights->get();
    if (logits) {
      RouteArgs route;
      route.logits = in.d_logits->get();
      route.bias = bias->get();
      route.tokens = T;
      route.num_experts = layer->num_experts;
      route.topk_ids = ids.get();
      route.topk_weights = w.get();
      route_topk(layer->routing, route, stream);
      args.topk_ids = ids.get();
      args.topk_weights = w.get();
    }
    args.tokens = T;
    args.output = out.get();
    args.workspace = workspace->get();
    run(*plan, *weights, args, stream);
    gpu::check_cuda(cudaStreamSynchronize(stream), "C++ path");
    return out.download();
  }
};

class CapiGpu : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (gpu::device_count() == 0) return;
    auto s = std::make_unique<Shared>();
    s->dir = std::filesystem::temp_directory_path() / ("megamoe-capi-gpu-" + std::to_string(getpid()));
    const ModelPreset& preset = find_preset("deepseek-v3");
    synth_checkpoint(preset, s->dir.string());
    const Checkpoint ckpt = Checkpoint::open(s->dir.string());
    s->layer = std::make_unique<MoeLayer>(load_moe_layer(ckpt, load_model_config(s->dir.string()), preset.layer));
    MoeProblem problem = MoeProblem::from_layer(*s->layer, kMaxTokens);
    problem.deterministic = true;
    s->plan = std::make_unique<MoePlan>(MoePlan::create(problem));
    s->weights = std::make_unique<MoeDeviceWeights>(MoeDeviceWeights::upload(*s->layer));
    s->workspace = std::make_unique<DeviceBuffer<uint8_t>>(s->plan->workspace_bytes());
    s->bias = std::make_unique<DeviceBuffer<float>>(s->layer->e_score_correction_bias);
    gpu::check_cuda(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking), "cudaStreamCreate");
    shared_ = std::move(s);
  }
  static void TearDownTestSuite() { shared_.reset(); }

  void SetUp() override {
    if (gpu::device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU test skipped (run it on the GPU machine)";
    ASSERT_NE(shared_, nullptr);
  }

  static megamoe_layer_options options() {
    megamoe_layer_options o;
    megamoe_layer_options_init(&o);
    o.max_tokens = kMaxTokens;
    o.deterministic = 1;
    return o;
  }

  // A C API run on the shared stream; `workspace` null uses the layer's own.
  static std::vector<uint16_t> c_run(megamoe_layer* layer, const Inputs& in, bool logits, void* workspace = nullptr,
                                     size_t workspace_size = 0) {
    DeviceBuffer<uint16_t> out(static_cast<size_t>(in.tokens * shared_->layer->hidden_size));
    out.poison();
    megamoe_run_args a;
    megamoe_run_args_init(&a);
    a.tokens = in.tokens;
    a.hidden = in.d_hidden->get();
    if (logits) {
      a.router_logits = in.d_logits->get();
    } else {
      a.topk_ids = in.d_ids->get();
      a.topk_weights = in.d_weights->get();
    }
    a.output = out.get();
    a.workspace = workspace;
    a.workspace_size = workspace_size;
    const megamoe_status status = megamoe_layer_run(layer, &a, shared_->stream);
    EXPECT_EQ(status, MEGAMOE_OK) << megamoe_last_error();
    gpu::check_cuda(cudaStreamSynchronize(shared_->stream), "C API run");
    return out.download();
  }

  static std::unique_ptr<Shared> shared_;
};

std::unique_ptr<Shared> CapiGpu::shared_;

TEST_F(CapiGpu, CheckpointLayerEqualsTheCxxPathBitwise) {
  const megamoe_layer_options o = options();
  megamoe_layer* layer = nullptr;
  ASSERT_C_OK(megamoe_layer_create_from_path(shared_->dir.c_str(), find_preset("deepseek-v3").layer, &o, &layer));
  megamoe_layer_info info{};
  info.struct_size = sizeof info;
  ASSERT_C_OK(megamoe_layer_get_info(layer, &info));
  EXPECT_EQ(info.hidden_size, 7168);
  EXPECT_EQ(info.num_experts, 256);
  EXPECT_EQ(info.shared_intermediate_size, 2048);
  EXPECT_EQ(info.routing_kind, MEGAMOE_ROUTING_NOAUX_TC);
  EXPECT_EQ(info.weight_bytes, shared_->weights->device_bytes());
  for (const int64_t T : kTokens) {
    SCOPED_TRACE(::testing::Message() << "T=" << T);
    const Inputs in(*shared_->layer, T);
    const std::vector<uint16_t> expected = shared_->cxx_run(in, /*logits=*/false);
    EXPECT_EQ(mismatches(c_run(layer, in, /*logits=*/false), expected), 0u) << "top-k given";
    EXPECT_EQ(mismatches(c_run(layer, in, /*logits=*/true), shared_->cxx_run(in, /*logits=*/true)), 0u)
        << "router logits";
    int64_t invalid = -1;
    ASSERT_C_OK(megamoe_layer_invalid_id_count(layer, nullptr, shared_->stream, &invalid));
    EXPECT_EQ(invalid, 0);
    char text[512];
    ASSERT_C_OK(megamoe_layer_describe(layer, T, text, sizeof text, nullptr));
    EXPECT_EQ(std::string(text), shared_->plan->describe(T));
  }
  ASSERT_C_OK(megamoe_layer_destroy(layer));
}

// The stacked layer's descriptor over `dev`, routed as the synthesized layer.
megamoe_stacked_layer stacked_of(const MoeLayer& L, const DeviceStacked& dev) {
  const int64_t E = L.num_experts, H = L.hidden_size, I = L.intermediate_size;
  const int64_t Is = L.shared_expert->intermediate_size();
  megamoe_stacked_layer s;
  megamoe_stacked_layer_init(&s);
  s.w13 = tensor(dev.ptr[0], MEGAMOE_DTYPE_U8, {E, 2 * I, H / 2});
  s.w13_scale = tensor(dev.ptr[1], MEGAMOE_DTYPE_F8_E4M3, {E, 2 * I, H / 16});
  s.w2 = tensor(dev.ptr[2], MEGAMOE_DTYPE_U8, {E, H, I / 2});
  s.w2_scale = tensor(dev.ptr[3], MEGAMOE_DTYPE_F8_E4M3, {E, H, I / 16});
  s.shared_w13 = tensor(dev.ptr[4], MEGAMOE_DTYPE_U8, {2 * Is, H / 2});
  s.shared_w13_scale = tensor(dev.ptr[5], MEGAMOE_DTYPE_U8, {2 * Is, H / 16});
  s.shared_w2 = tensor(dev.ptr[6], MEGAMOE_DTYPE_U8, {H, Is / 2});
  s.shared_w2_scale = tensor(dev.ptr[7], MEGAMOE_DTYPE_U8, {H, Is / 16});
  s.w13_scale_2 = tensor(dev.floats[0]->get(), MEGAMOE_DTYPE_F32, {E, 2});
  s.w2_scale_2 = tensor(dev.floats[1]->get(), MEGAMOE_DTYPE_F32, {E});
  s.shared_w13_scale_2 = tensor(dev.floats[2]->get(), MEGAMOE_DTYPE_F32, {2});
  s.shared_w2_scale_2 = tensor(dev.floats[3]->get(), MEGAMOE_DTYPE_F32, {1});
  s.top_k = L.routing.top_k;
  s.routing.kind = MEGAMOE_ROUTING_NOAUX_TC;
  s.routing.renormalize = L.routing.renormalize ? 1 : 0;
  s.routing.n_group = L.routing.n_group;
  s.routing.topk_group = L.routing.topk_group;
  s.routing.routed_scaling_factor = L.routing.routed_scaling_factor;
  s.routing.correction_bias = tensor(dev.floats[4]->get(), MEGAMOE_DTYPE_F32, {E});
  return s;
}

TEST_F(CapiGpu, StackedLayerWithAnExternalWorkspaceEqualsTheCxxPathBitwise) {
  const MoeLayer& L = *shared_->layer;
  const DeviceStacked dev(L);
  const megamoe_stacked_layer s = stacked_of(L, dev);
  megamoe_layer_options o = options();
  o.external_workspace = 1;
  megamoe_layer* layer = nullptr;
  ASSERT_C_OK(megamoe_layer_create_stacked(&s, &o, shared_->stream, &layer));
  size_t bytes = 0;
  ASSERT_C_OK(megamoe_layer_workspace_size(layer, &bytes));
  DeviceBuffer<uint8_t> workspace(bytes);
  for (const int64_t T : kTokens) {
    SCOPED_TRACE(::testing::Message() << "T=" << T);
    const Inputs in(L, T);
    EXPECT_EQ(mismatches(c_run(layer, in, false, workspace.get(), bytes), shared_->cxx_run(in, false)), 0u)
        << "top-k given";
    EXPECT_EQ(mismatches(c_run(layer, in, true, workspace.get(), bytes), shared_->cxx_run(in, true)), 0u)
        << "router logits";
  }
  ASSERT_C_OK(megamoe_layer_destroy(layer));
}

// in_place: the layer reads the caller's tensors, rewritten, and runs as the C++ path does. The
// shared expert in its own allocations is refused, naming the rule.
TEST_F(CapiGpu, StackedLayerInPlaceEqualsTheCxxPathBitwise) {
  const MoeLayer& L = *shared_->layer;
  const megamoe_layer_options o = options();
  megamoe_layer* layer = nullptr;
  {
    const DeviceStacked apart(L);
    megamoe_stacked_layer s = stacked_of(L, apart);
    s.in_place = 1;
    EXPECT_EQ(megamoe_layer_create_stacked(&s, &o, shared_->stream, &layer), MEGAMOE_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(megamoe_last_error()).find("shared_w13 must start where w13 ends"), std::string::npos)
        << megamoe_last_error();
  }
  const DeviceStacked dev(L, /*joint=*/true);
  megamoe_stacked_layer s = stacked_of(L, dev);
  s.in_place = 1;
  const std::vector<uint8_t> before = dev.bytes[0]->download();
  ASSERT_C_OK(megamoe_layer_create_stacked(&s, &o, shared_->stream, &layer));
  EXPECT_NE(dev.bytes[0]->download(), before) << "w13 was not rewritten in place";
  for (const int64_t T : kTokens) {
    SCOPED_TRACE(::testing::Message() << "T=" << T);
    const Inputs in(L, T);
    EXPECT_EQ(mismatches(c_run(layer, in, true, nullptr, 0), shared_->cxx_run(in, true)), 0u);
  }
  ASSERT_C_OK(megamoe_layer_destroy(layer));
}

TEST_F(CapiGpu, RunIsGraphCapturable) {
  const megamoe_layer_options o = options();
  megamoe_layer* layer = nullptr;
  ASSERT_C_OK(megamoe_layer_create_from_path(shared_->dir.c_str(), find_preset("deepseek-v3").layer, &o, &layer));
  const Inputs in(*shared_->layer, 17);
  DeviceBuffer<uint16_t> out(static_cast<size_t>(17 * shared_->layer->hidden_size));
  out.poison();
  megamoe_run_args a;
  megamoe_run_args_init(&a);
  a.tokens = 17;
  a.hidden = in.d_hidden->get();
  a.router_logits = in.d_logits->get();
  a.output = out.get();
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  gpu::check_cuda(cudaStreamBeginCapture(shared_->stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  const megamoe_status status = megamoe_layer_run(layer, &a, shared_->stream);
  gpu::check_cuda(cudaStreamEndCapture(shared_->stream, &graph), "end capture");
  ASSERT_EQ(status, MEGAMOE_OK) << megamoe_last_error();
  gpu::check_cuda(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  for (int replay = 0; replay < 2; ++replay) {
    gpu::check_cuda(cudaGraphLaunch(exec, shared_->stream), "cudaGraphLaunch");
    gpu::check_cuda(cudaStreamSynchronize(shared_->stream), "replay");
    EXPECT_EQ(mismatches(out.download(), shared_->cxx_run(in, true)), 0u) << "replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  ASSERT_C_OK(megamoe_layer_destroy(layer));
}

}  // namespace
}  // namespace megamoe
