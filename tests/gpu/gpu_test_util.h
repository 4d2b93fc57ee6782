// Helpers for GPU tests: skip visibly where there is no GPU; device buffers (megamoe/gpu.h); a
// layer's plan, weights and workspace on the device, run on host inputs. The host-only helpers
// (seeds, random layers, errors) are tests/common/test_util.h.
#pragma once

#include <gtest/gtest.h>

#include <cuda_runtime.h>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "megamoe/gpu.h"
#include "megamoe/reference.h"
#include "megamoe/runtime.h"
#include "support/device_buffer.h"

#define MEGAMOE_REQUIRE_GPU()                                                       \
  do {                                                                              \
    if (::megamoe::gpu::device_count() == 0) {                                      \
      GTEST_SKIP() << "no CUDA device: GPU test skipped (run it on the GPU machine)"; \
    }                                                                               \
  } while (0)

namespace megamoe::testing {

using support::DeviceBuffer;

// Everything one GPU run needs but its inputs, owned.
struct GpuMoe {
  MoePlan plan;
  MoeDeviceWeights weights;
  DeviceBuffer<uint8_t> workspace;

  GpuMoe(const MoeLayer& layer, int64_t max_tokens, bool deterministic, const MoeTuning& tuning = {})
      : GpuMoe(make_plan(layer, max_tokens, deterministic, tuning), MoeDeviceWeights::upload(layer)) {}
  GpuMoe(MoePlan p, MoeDeviceWeights w)
      : plan(std::move(p)), weights(std::move(w)), workspace(plan.workspace_bytes()) {}

  static MoePlan make_plan(const MoeLayer& layer, int64_t max_tokens, bool deterministic,
                           const MoeTuning& tuning) {
    MoeProblem p = MoeProblem::from_layer(layer, max_tokens);
    p.deterministic = deterministic;
    return MoePlan::create(p, tuning);
  }

  // One run() on `stream`, synchronised. The output and the workspace are poisoned first (NaN,
  // int32 -1): an output run() leaves unwritten reads NaN, and run() must initialise whatever it
  // reads, the combine accumulator included, whatever an earlier run left there.
  std::vector<uint16_t> run(const std::vector<uint16_t>& hidden, const reference::TopK& topk,
                            cudaStream_t stream = nullptr) {
    return run_into<uint16_t>(hidden, topk, stream);
  }
  // run() captured once in a CUDA graph on its own stream, then replayed `replays` times, the
  // output and the workspace poisoned before each replay: each replay's output.
  std::vector<std::vector<uint16_t>> run_graph_replays(const std::vector<uint16_t>& hidden,
                                                       const reference::TopK& topk, int replays) {
    const int64_t T = topk.tokens;
    DeviceBuffer<uint16_t> d_hidden(hidden), d_out(static_cast<size_t>(T * plan.problem().hidden_size));
    DeviceBuffer<int32_t> d_ids(topk.ids);
    DeviceBuffer<float> d_weights(topk.weights);
    cudaStream_t stream;
    gpu::check_cuda(cudaStreamCreate(&stream), "cudaStreamCreate");
    MoeRunArgs args{d_hidden.get(), d_ids.get(), d_weights.get(), T, d_out.get(), workspace.get()};
    megamoe::run(plan, weights, args, stream);  // warm-up: kernel attributes set outside capture
    gpu::check_cuda(cudaStreamSynchronize(stream), "warm-up");
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    gpu::check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
    megamoe::run(plan, weights, args, stream);
    gpu::check_cuda(cudaStreamEndCapture(stream, &graph), "end capture");
    gpu::check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    std::vector<std::vector<uint16_t>> outs;
    for (int rep = 0; rep < replays; ++rep) {
      d_out.poison();
      workspace.poison();
      gpu::check_cuda(cudaGraphLaunch(exec, stream), "graph launch");
      gpu::check_cuda(cudaStreamSynchronize(stream), "graph replay");
      outs.push_back(d_out.download());
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
    return outs;
  }
  // The same with the fp32 output (MoeRunArgs::output_f32: the sums before the bf16 rounding).
  std::vector<float> run_f32(const std::vector<uint16_t>& hidden, const reference::TopK& topk,
                             cudaStream_t stream = nullptr) {
    return run_into<float>(hidden, topk, stream);
  }

 private:
  template <typename Out>
  std::vector<Out> run_into(const std::vector<uint16_t>& hidden, const reference::TopK& topk,
                            cudaStream_t stream) {
    const int64_t T = topk.tokens;
    DeviceBuffer<uint16_t> d_hidden(hidden);
    DeviceBuffer<int32_t> d_ids(topk.ids);
    DeviceBuffer<float> d_weights(topk.weights);
    DeviceBuffer<Out> d_out(static_cast<size_t>(T * plan.problem().hidden_size));
    d_out.poison();
    workspace.poison();
    MoeRunArgs args{};
    args.hidden = d_hidden.get();
    args.topk_ids = d_ids.get();
    args.topk_weights = d_weights.get();
    args.tokens = T;
    args.workspace = workspace.get();
    if constexpr (std::is_same_v<Out, uint16_t>) {
      args.output = d_out.get();
    } else {
      args.output_f32 = d_out.get();
    }
    megamoe::run(plan, weights, args, stream);
    gpu::check_cuda(cudaStreamSynchronize(stream), "run");
    return d_out.download();
  }
};

}  // namespace megamoe::testing
