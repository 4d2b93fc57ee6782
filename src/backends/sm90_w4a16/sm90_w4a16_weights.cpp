// A layer's NVFP4 weights prepacked for the sm90 kernels (sm90_w4a16_prepack.h: the
// checkpoint's bits, reshuffled) and uploaded once.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include "backends/sm90_w4a16/sm90_w4a16_weights.h"

#include "backends/sm90_w4a16/sm90_w4a16_prepack.h"
#include "backends/sm90_w4a8/sm90_w4a8_layout.h"
#include "backends/sm90_w4a8/sm90_w4a8_rescale.h"
#include "megamoe/gpu.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "runtime/sm90/sm90_moe_workspace.h"

namespace megamoe::runtime {

using gpu::check_cuda;

Sm90PrepackedWeights::~Sm90PrepackedWeights() {
  if (!borrowed) {
    for (void* ptr : {static_cast<void*>(w13_codes), static_cast<void*>(w13_scales), static_cast<void*>(w2_codes),
                      static_cast<void*>(w2_scales)}) {
      if (ptr) cudaFree(ptr);
    }
  }
  if (s2) cudaFree(s2);
  if (w4a8_s2) cudaFree(w4a8_s2);
}

namespace {

// Strides for a layer of `shape`; the code/scale buffers are allocated, or the caller's `at`.
std::unique_ptr<Sm90PrepackedWeights> make_weights(const MoeProblem& shape, const WeightStorage* at) {
  const int64_t H = shape.hidden_size, I = shape.intermediate_size, EV = virtual_experts(shape);
  auto out = std::make_unique<Sm90PrepackedWeights>();
  Sm90PrepackedWeights& w = *out;
  w.w13_code_stride = prepacked_code_bytes(2 * I, H);
  w.w13_scale_stride = prepacked_scale_bytes(2 * I, H);
  w.w2_code_stride = prepacked_code_bytes(H, I);
  w.w2_scale_stride = prepacked_scale_bytes(H, I);
  if (at != nullptr) {
    w.borrowed = true;
    w.w13_codes = at->w13_codes;
    w.w13_scales = at->w13_scales;
    w.w2_codes = at->w2_codes;
    w.w2_scales = at->w2_scales;
  } else {
    auto alloc = [&](uint8_t** ptr, int64_t bytes) {
      check_cuda(cudaMalloc(reinterpret_cast<void**>(ptr), static_cast<size_t>(bytes)), "cudaMalloc(weights)");
      w.bytes += static_cast<size_t>(bytes);
    };
    alloc(&w.w13_codes, EV * w.w13_code_stride);
    alloc(&w.w13_scales, EV * w.w13_scale_stride);
    alloc(&w.w2_codes, EV * w.w2_code_stride);
    alloc(&w.w2_scales, EV * w.w2_scale_stride);
  }
  check_cuda(cudaMalloc(reinterpret_cast<void**>(&w.s2), static_cast<size_t>(3 * EV) * sizeof(float)),
             "cudaMalloc(global scales)");
  w.bytes += static_cast<size_t>(3 * EV) * sizeof(float);
  check_cuda(cudaMalloc(reinterpret_cast<void**>(&w.w4a8_s2), static_cast<size_t>(5 * EV) * 4),
             "cudaMalloc(W4A8 constants)");
  w.w4a8_addends = reinterpret_cast<uint32_t*>(w.w4a8_s2 + 3 * EV);
  w.bytes += static_cast<size_t>(5 * EV) * 4;
  return out;
}

// The kernels' [3][EV] global scales (gate, up, down); the shared expert's slices repeat its own.
void upload_scales(Sm90PrepackedWeights& w, const MoeProblem& shape, const GlobalScales& scales, cudaStream_t stream) {
  const int64_t E = shape.num_experts, EV = virtual_experts(shape);
  std::vector<float> s2(static_cast<size_t>(3 * EV));
  for (int64_t v = 0; v < EV; ++v) {
    const std::array<float, 3>& g = v < E ? scales.routed[static_cast<size_t>(v)] : scales.shared;
    for (int j = 0; j < 3; ++j) s2[static_cast<size_t>(j * EV + v)] = g[static_cast<size_t>(j)];
  }
  check_cuda(cudaMemcpyAsync(w.s2, s2.data(), s2.size() * sizeof(float), cudaMemcpyHostToDevice, stream),
             "cudaMemcpyAsync(global scales)");
  // A pageable-memory copy may return before its DMA reads `s2`.
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize(global scales)");
}

// The W4A8 constants from the global scales and each tensor's k.
void upload_w4a8_constants(Sm90PrepackedWeights& w, const MoeProblem& shape, const GlobalScales& scales,
                           const W4a8RescaleExponents& k, cudaStream_t stream) {
  namespace w4a8 = kernels::sm90::w4a8;
  const int64_t E = shape.num_experts, EV = virtual_experts(shape);
  std::vector<uint32_t> host(static_cast<size_t>(5 * EV));
  for (int64_t v = 0; v < EV; ++v) {
    const std::array<float, 3>& s2 = v < E ? scales.routed[static_cast<size_t>(v)] : scales.shared;
    const std::array<int, 3>& kv = v < E ? k.routed[static_cast<size_t>(v)] : k.shared;
    for (int j = 0; j < 3; ++j) {
      const float folded = std::ldexp(s2[static_cast<size_t>(j)], kv[static_cast<size_t>(j)]);  // exact
      std::memcpy(&host[static_cast<size_t>(j * EV + v)], &folded, 4);
    }
    host[static_cast<size_t>(3 * EV + v)] =
        (w4a8::scale_exponent_addend(kv[0]) & 0xFFFFu) | (w4a8::scale_exponent_addend(kv[1]) & 0xFFFF0000u);
    host[static_cast<size_t>(4 * EV + v)] = w4a8::scale_exponent_addend(kv[2]);
  }
  check_cuda(cudaMemcpyAsync(w.w4a8_s2, host.data(), host.size() * 4, cudaMemcpyHostToDevice, stream),
             "cudaMemcpyAsync(W4A8 constants)");
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize(W4A8 constants)");  // pageable source
}

}  // namespace

std::unique_ptr<Sm90PrepackedWeights> view_sm90_prepacked(const MoeProblem& shape, const WeightStorage& at,
                                                          const GlobalScales& scales, cudaStream_t stream) {
  auto out = make_weights(shape, &at);
  upload_scales(*out, shape, scales, stream);
  upload_w4a8_constants(*out, shape, scales, w4a8_rescale_exponents_prepacked(shape, at.w13_scales, at.w2_scales, stream),
                        stream);
  return out;
}

std::unique_ptr<Sm90PrepackedWeights> upload_sm90_prepacked(const MoeLayer& layer, cudaStream_t stream,
                                                            const WeightStorage* into) {
  const MoeProblem shape = MoeProblem::from_layer(layer, 0);
  const int64_t I = layer.intermediate_size;
  const int64_t E = layer.num_experts, EV = virtual_experts(shape);

  auto out = make_weights(shape, into);
  Sm90PrepackedWeights& w = *out;

  // Virtual expert v: a routed expert, or slice v - E of the shared expert.
  auto expert_of = [&](int64_t v) -> const ExpertWeights& {
    return v < E ? layer.experts[static_cast<size_t>(v)] : *layer.shared_expert;
  };
  auto triple = [](const ExpertWeights& ex) {
    return std::array<float, 3>{ex.gate.weight_scale_2, ex.up.weight_scale_2, ex.down.weight_scale_2};
  };
  GlobalScales scales;
  for (const ExpertWeights& ex : layer.experts) scales.routed.push_back(triple(ex));
  if (layer.shared_expert) scales.shared = triple(*layer.shared_expert);
  upload_scales(w, shape, scales, stream);

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
  // After the prepack, which has checked every scale byte.
  upload_w4a8_constants(w, shape, scales, w4a8_rescale_exponents(layer), stream);
  return out;
}

void unprepack_sm90(const MoeProblem& shape, const HostPrepacked& in, const StackedNvfp4Buffers& out) {
  const int64_t H = shape.hidden_size, I = shape.intermediate_size, Is = shape.shared_intermediate_size;
  const int64_t E = shape.num_experts, EV = virtual_experts(shape);
  const int64_t c13 = prepacked_code_bytes(2 * I, H), s13 = prepacked_scale_bytes(2 * I, H);
  const int64_t c2 = prepacked_code_bytes(H, I), sc2 = prepacked_scale_bytes(H, I);
  MEGAMOE_CHECK(static_cast<int64_t>(in.w13_codes.size()) == EV * c13 &&
                    static_cast<int64_t>(in.w13_scales.size()) == EV * s13 &&
                    static_cast<int64_t>(in.w2_codes.size()) == EV * c2 &&
                    static_cast<int64_t>(in.w2_scales.size()) == EV * sc2,
                kInternal, "unprepack_sm90: the prepacked buffers do not match the layer's shape");
  auto rows = [](int64_t n, int64_t k, uint8_t* codes, uint8_t* scales, int64_t row0) {
    return Nvfp4Rows{n, k, codes + row0 * (k / 2), scales + row0 * (k / 16)};
  };
  auto one = [&](int64_t v) {
    auto span = [](std::span<const uint8_t> all, int64_t stride, int64_t i) { return all.subspan(i * stride, stride); };
    if (v < E) {
      unprepack_w13(span(in.w13_codes, c13, v), span(in.w13_scales, s13, v), 0, I,
                    rows(I, H, out.w13, out.w13_scale, 2 * v * I), rows(I, H, out.w13, out.w13_scale, 2 * v * I + I));
      unprepack_w2(span(in.w2_codes, c2, v), span(in.w2_scales, sc2, v), 0, I, rows(H, I, out.w2, out.w2_scale, v * H));
    } else {
      const int64_t col0 = (v - E) * I;
      unprepack_w13(span(in.w13_codes, c13, v), span(in.w13_scales, s13, v), col0, I,
                    rows(Is, H, out.shared_w13, out.shared_w13_scale, 0),
                    rows(Is, H, out.shared_w13, out.shared_w13_scale, Is));
      unprepack_w2(span(in.w2_codes, c2, v), span(in.w2_scales, sc2, v), col0, I,
                   rows(H, Is, out.shared_w2, out.shared_w2_scale, 0));
    }
  };
  // Virtual experts write disjoint bytes of `out` (whole rows, or whole 16-column blocks of a shared row
  // whose slices are multiples of 64 columns): one thread per expert at a time is race-free.
  const int threads = static_cast<int>(std::min<int64_t>(EV, std::max(1u, std::thread::hardware_concurrency())));
  std::vector<std::exception_ptr> errors(static_cast<size_t>(threads));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      try {
        for (int64_t v = t; v < EV; v += threads) one(v);
      } catch (...) {
        errors[static_cast<size_t>(t)] = std::current_exception();
      }
    });
  }
  for (auto& th : pool) th.join();
  for (auto& err : errors) {
    if (err) std::rethrow_exception(err);
  }
}

}  // namespace megamoe::runtime
