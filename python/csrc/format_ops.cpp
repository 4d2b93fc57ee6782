// megamoe::quantize_nvfp4 and megamoe::dequantize_nvfp4: the NVFP4 codecs of docs/design.md §2 on 2-D
// weights [N, K] or stacked expert weights [E, N, K] (one global scale per expert).
//
// Quantization is the ModelOpt recipe of the host library (format::quantize_weight_modelopt),
// a load-time step: CUDA inputs are copied to the host and the results back. Dequantization
// runs where the tensors are: the host codec, or the device dequantizer; both give
// bf16(e2m1 * ue4m3 * weight_scale_2) with the same two roundings, so their results are equal.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <span>
#include <tuple>
#include <vector>

#include "megamoe/format.h"
#include "megamoe/gpu.h"
#include "torch_utils.h"

namespace megamoe::torch_ext {
namespace {

constexpr const char* kQuantize = "quantize_nvfp4";
constexpr const char* kDequantize = "dequantize_nvfp4";
constexpr int64_t kBlock = format::kNvfp4BlockSize;

// Leading dimensions [E] (3-D) or [] (2-D) of a weight-like tensor.
std::vector<int64_t> lead(const at::Tensor& t) {
  return t.dim() == 3 ? std::vector<int64_t>{t.size(0)} : std::vector<int64_t>{};
}
std::vector<int64_t> with(std::vector<int64_t> dims, int64_t rows, int64_t cols) {
  dims.push_back(rows);
  dims.push_back(cols);
  return dims;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cpu(const at::Tensor& weight) {
  return translate_errors(kQuantize, [&] {
    arg(kQuantize, "weight", weight).dtype({at::kFloat, at::kBFloat16, at::kHalf});
    TORCH_CHECK_VALUE(weight.dim() == 2 || weight.dim() == 3, "megamoe.", kQuantize,
                      ": weight has shape ", sizes_string(weight.sizes()),
                      "; expected [N, K] or stacked experts [E, N, K].");
    const int64_t N = weight.size(-2), K = weight.size(-1);
    TORCH_CHECK_VALUE(N >= 1 && K >= kBlock && K % kBlock == 0, "megamoe.", kQuantize,
                      ": weight has shape ", sizes_string(weight.sizes()), "; N must be >= 1 and K ",
                      "a positive multiple of the NVFP4 block size ", kBlock, ".");
    const at::Tensor w = weight.to(at::kFloat).contiguous();  // exact widening
    const int64_t experts = weight.dim() == 3 ? weight.size(0) : 1;
    const auto cpu = at::TensorOptions().device(at::kCPU);
    at::Tensor codes = at::empty(with(lead(weight), N, K / 2), cpu.dtype(at::kByte));
    at::Tensor scales = at::empty(with(lead(weight), N, K / kBlock), cpu.dtype(at::ScalarType::Float8_e4m3fn));
    at::Tensor global = at::empty(lead(weight), cpu.dtype(at::kFloat));
    const float* src = w.const_data_ptr<float>();
    auto* c = static_cast<uint8_t*>(codes.data_ptr());
    auto* s = static_cast<uint8_t*>(scales.data_ptr());
    float* g = global.data_ptr<float>();
    at::parallel_for(0, experts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) {
        g[e] = format::quantize_weight_modelopt(
            {src + e * N * K, static_cast<size_t>(N * K)}, N, K,
            {c + e * N * (K / 2), static_cast<size_t>(N * (K / 2))},
            {s + e * N * (K / kBlock), static_cast<size_t>(N * (K / kBlock))});
      }
    });
    return std::make_tuple(codes, scales, global);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cuda(const at::Tensor& weight) {
  auto [codes, scales, global] = quantize_cpu(weight.cpu());
  return {codes.to(weight.device()), scales.to(weight.device()), global.to(weight.device())};
}

// Checks the dequantize arguments; returns (E, N, K) with E = 1 for 2-D.
std::tuple<int64_t, int64_t, int64_t> check_dequantize(const at::Tensor& weight,
                                                        const at::Tensor& scale,
                                                        const at::Tensor& global) {
  arg(kDequantize, "weight", weight).dtype({at::kByte}).contiguous();
  TORCH_CHECK_VALUE(weight.dim() == 2 || weight.dim() == 3, "megamoe.", kDequantize,
                    ": weight has shape ", sizes_string(weight.sizes()),
                    "; expected packed codes [N, K/2] or stacked experts [E, N, K/2].");
  const int64_t experts = weight.dim() == 3 ? weight.size(0) : 1;
  const int64_t N = weight.size(-2), K = 2 * weight.size(-1);
  TORCH_CHECK_VALUE(K % kBlock == 0, "megamoe.", kDequantize, ": weight has shape ",
                    sizes_string(weight.sizes()), ", so K = ", K,
                    ", which is not a multiple of the NVFP4 block size ", kBlock, ".");
  arg(kDequantize, "weight_scale", scale).on(weight.device()).scale_dtype()
      .shape(with(lead(weight), N, K / kBlock), "ue4m3 block scales [.., N, K/16]").contiguous();
  arg(kDequantize, "weight_scale_2", global).dtype({at::kFloat});
  const bool ok = weight.dim() == 3 ? (global.dim() == 1 && global.size(0) == experts)
                                    : (global.numel() == 1 && global.dim() <= 1);
  TORCH_CHECK_VALUE(ok, "megamoe.", kDequantize, ": weight_scale_2 has shape ",
                    sizes_string(global.sizes()), "; expected ",
                    weight.dim() == 3 ? "[E], one global scale per expert" : "[] or [1]", ".");
  return {experts, N, K};
}

at::Tensor dequantize_cpu(const at::Tensor& weight, const at::Tensor& scale,
                          const at::Tensor& global) {
  return translate_errors(kDequantize, [&] {
    auto [experts, N, K] = check_dequantize(weight, scale, global);
    arg(kDequantize, "weight", weight).cpu();
    const at::Tensor g = global.cpu().contiguous();
    at::Tensor out = at::empty(with(lead(weight), N, K), weight.options().dtype(at::kFloat));
    const auto* codes = static_cast<const uint8_t*>(weight.const_data_ptr());
    const auto* scales = static_cast<const uint8_t*>(scale.const_data_ptr());
    float* o = out.data_ptr<float>();
    at::parallel_for(0, experts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) {
        const format::Nvfp4View view{N, K, codes + e * N * (K / 2), scales + e * N * (K / kBlock),
                                     g.const_data_ptr<float>()[e]};
        format::dequantize(view, {o + e * N * K, static_cast<size_t>(N * K)});
      }
    });
    return out.to(at::kBFloat16);  // round to nearest even, as the device's __float2bfloat16_rn
  });
}

at::Tensor dequantize_cuda(const at::Tensor& weight, const at::Tensor& scale,
                           const at::Tensor& global) {
  return translate_errors(kDequantize, [&] {
    auto [experts, N, K] = check_dequantize(weight, scale, global);
    arg(kDequantize, "weight", weight).cuda();
    const at::Tensor g = global.cpu().contiguous();  // a host synchronisation if on the device
    const c10::cuda::CUDAGuard guard(weight.device());
    at::Tensor out = at::empty(with(lead(weight), N, K), weight.options().dtype(at::kBFloat16));
    const auto* codes = static_cast<const uint8_t*>(weight.const_data_ptr());
    const auto* scales = static_cast<const uint8_t*>(scale.const_data_ptr());
    auto* o = static_cast<uint16_t*>(out.data_ptr());
    const cudaStream_t stream = current_stream(weight.device());
    for (int64_t e = 0; e < experts; ++e) {
      const float s2 = g.const_data_ptr<float>()[e];
      TORCH_CHECK_VALUE(std::isfinite(s2) && s2 > 0.0f, "megamoe.", kDequantize,
                        ": weight_scale_2[", e, "] is ", s2,
                        "; global scales must be finite and > 0.");
      gpu::dequantize_nvfp4(codes + e * N * (K / 2), scales + e * N * (K / kBlock), s2, N, K,
                            o + e * N * K, stream);
    }
    return out;
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(megamoe, CPU, m) {
  m.impl("quantize_nvfp4", &quantize_cpu);
  m.impl("dequantize_nvfp4", &dequantize_cpu);
}

TORCH_LIBRARY_IMPL(megamoe, CUDA, m) {
  m.impl("quantize_nvfp4", &quantize_cuda);
  m.impl("dequantize_nvfp4", &dequantize_cuda);
}

}  // namespace megamoe::torch_ext
