// A layer's NVFP4 weights prepacked for the sm90 kernels (sm90_w4a16_prepack.h: the
// checkpoint's bits, reshuffled) and uploaded once.
#include <algorithm>
#include <exception>
#include <thread>
#include <vector>

#include "backends/sm90_w4a16/sm90_w4a16_weights.h"

#include "backends/sm90_w4a16/sm90_w4a16_prepack.h"
#include "megamoe/gpu.h"
#include "megamoe/runtime.h"
#include "runtime/sm90/sm90_moe_workspace.h"

namespace megamoe::runtime {

using gpu::check_cuda;

Sm90PrepackedWeights::~Sm90PrepackedWeights() {
  for (void* ptr : {static_cast<void*>(w13_codes), static_cast<void*>(w13_scales), static_cast<void*>(w2_codes),
                    static_cast<void*>(w2_scales), static_cast<void*>(s2)}) {
    if (ptr) cudaFree(ptr);
  }
}

std::unique_ptr<Sm90PrepackedWeights> upload_sm90_prepacked(const MoeLayer& layer, cudaStream_t stream) {
  const MoeProblem shape = MoeProblem::from_layer(layer, 0);
  const int64_t H = layer.hidden_size, I = layer.intermediate_size;
  const int64_t E = layer.num_experts, EV = virtual_experts(shape);

  auto out = std::make_unique<Sm90PrepackedWeights>();
  Sm90PrepackedWeights& w = *out;
  w.w13_code_stride = prepacked_code_bytes(2 * I, H);
  w.w13_scale_stride = prepacked_scale_bytes(2 * I, H);
  w.w2_code_stride = prepacked_code_bytes(H, I);
  w.w2_scale_stride = prepacked_scale_bytes(H, I);
  auto alloc = [&](uint8_t** ptr, int64_t bytes) {
    check_cuda(cudaMalloc(reinterpret_cast<void**>(ptr), static_cast<size_t>(bytes)), "cudaMalloc(weights)");
    w.bytes += static_cast<size_t>(bytes);
  };
  alloc(&w.w13_codes, EV * w.w13_code_stride);
  alloc(&w.w13_scales, EV * w.w13_scale_stride);
  alloc(&w.w2_codes, EV * w.w2_code_stride);
  alloc(&w.w2_scales, EV * w.w2_scale_stride);
  check_cuda(cudaMalloc(reinterpret_cast<void**>(&w.s2), static_cast<size_t>(3 * EV) * sizeof(float)),
             "cudaMalloc(global scales)");

  // Virtual expert v: a routed expert, or slice v - E of the shared expert.
  auto expert_of = [&](int64_t v) -> const ExpertWeights& {
    return v < E ? layer.experts[static_cast<size_t>(v)] : *layer.shared_expert;
  };
  std::vector<float> s2(static_cast<size_t>(3 * EV));
  for (int64_t v = 0; v < EV; ++v) {
    const ExpertWeights& ex = expert_of(v);
    s2[v] = ex.gate.weight_scale_2;
    s2[EV + v] = ex.up.weight_scale_2;
    s2[2 * EV + v] = ex.down.weight_scale_2;
  }
  check_cuda(cudaMemcpyAsync(w.s2, s2.data(), s2.size() * sizeof(float), cudaMemcpyHostToDevice, stream),
             "cudaMemcpyAsync(global scales)");

  // Prepack in batches of experts on all cores, upload each batch (bounded host memory).
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  const int64_t batch = std::min<int64_t>(EV, threads);
  const size_t per_expert = static_cast<size_t>(w.w13_code_stride + w.w13_scale_stride +
                                                w.w2_code_stride + w.w2_scale_stride);
  std::vector<uint8_t> host(static_cast<size_t>(batch) * per_expert);
  for (int64_t first = 0; first < EV; first += batch) {
    const int64_t n = std::min(batch, EV - first);
    std::vector<std::thread> pool;
    std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      pool.emplace_back([&, i] {
        try {
          const int64_t v = first + i;
          const ExpertWeights& ex = expert_of(v);
          const int64_t col0 = v < E ? 0 : (v - E) * I;
          uint8_t* base = host.data() + static_cast<size_t>(i) * per_expert;
          uint8_t* c13 = base;
          uint8_t* s13 = c13 + w.w13_code_stride;
          uint8_t* c2 = s13 + w.w13_scale_stride;
          uint8_t* sc2 = c2 + w.w2_code_stride;
          prepack_w13(ex.gate, ex.up, col0, I, {c13, static_cast<size_t>(w.w13_code_stride)},
                               {s13, static_cast<size_t>(w.w13_scale_stride)});
          prepack_w2(ex.down, col0, I, {c2, static_cast<size_t>(w.w2_code_stride)},
                              {sc2, static_cast<size_t>(w.w2_scale_stride)});
        } catch (...) {
          errors[static_cast<size_t>(i)] = std::current_exception();
        }
      });
    }
    for (auto& th : pool) th.join();
    for (auto& err : errors) {
      if (err) std::rethrow_exception(err);
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = first + i;
      const uint8_t* base = host.data() + static_cast<size_t>(i) * per_expert;
      auto copy = [&](uint8_t* dst, const uint8_t* src, int64_t bytes) {
        check_cuda(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream),
                   "cudaMemcpyAsync(prepacked weights)");
      };
      copy(w.w13_codes + v * w.w13_code_stride, base, w.w13_code_stride);
      copy(w.w13_scales + v * w.w13_scale_stride, base + w.w13_code_stride, w.w13_scale_stride);
      copy(w.w2_codes + v * w.w2_code_stride, base + w.w13_code_stride + w.w13_scale_stride,
           w.w2_code_stride);
      copy(w.w2_scales + v * w.w2_scale_stride,
           base + w.w13_code_stride + w.w13_scale_stride + w.w2_code_stride, w.w2_scale_stride);
    }
    // The host buffer is refilled by the next batch, and a pageable-memory copy may return before
    // its DMA lands: wait, so neither the next batch nor a kernel on another stream races it.
    check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize(weight upload)");
  }
  return out;
}

}  // namespace megamoe::runtime
