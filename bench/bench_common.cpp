// The helpers of bench_common.h.
#include "bench/bench_common.h"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <set>

#include "megamoe/dtype.h"
#include "megamoe/status.h"
#include "support/device_buffer.h"

namespace megamoe::bench {

using support::DeviceBuffer;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}


double measure_copy_tbps(cudaStream_t stream, int warm_ms) {
  const size_t bytes = size_t{2} << 30;
  DeviceBuffer<uint8_t> src(bytes), dst(bytes);
  check_cuda(cudaMemset(src.get(), 0x5A, bytes), "memset");
  const double us = event_median_us(
      [&] { check_cuda(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, stream), "D2D copy"); },
      10, 2, stream, nullptr, warm_ms);
  return 2.0 * bytes / (us * 1e-6) / 1e12;  // read + write
}

double measure_bf16_tflops(cudaStream_t stream, int warm_ms) {
  const int n = 8192;
  std::vector<uint16_t> h(size_t(n) * n);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  for (auto& v : h) v = f32_to_bf16(nd(rng));
  DeviceBuffer<uint16_t> A(h.size()), B(h.size()), C(h.size());
  A.upload(h);
  B.upload(h);
  cublasHandle_t handle;
  MEGAMOE_CHECK(cublasCreate(&handle) == CUBLAS_STATUS_SUCCESS, kCuda, "cublasCreate failed");
  cublasSetStream(handle, stream);
  const float one = 1, zero = 0;
  const double us = event_median_us(
      [&] {
        MEGAMOE_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, A.get(), CUDA_R_16BF, n, B.get(),
                                   CUDA_R_16BF, n, &zero, C.get(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS,
                      kCuda, "cublasGemmEx failed");
      },
      10, 2, stream, nullptr, warm_ms);
  cublasDestroy(handle);
  return 2.0 * double(n) * n * n / (us * 1e-6) / 1e12;
}

double measure_fp8_tflops(cudaStream_t stream, int warm_ms) {
  const int n = 8192;
  // Random finite e4m3 codes of moderate magnitude (no NaN 0x7F/0xFF): exponent fields 4..11.
  std::vector<uint8_t> h(size_t(n) * n);
  std::mt19937 rng(7);
  for (auto& v : h) v = static_cast<uint8_t>((rng() & 0x80) | (0x20 + (rng() & 0x3F)));
  DeviceBuffer<uint8_t> A(h.size()), B(h.size()), workspace(size_t{32} << 20);
  DeviceBuffer<uint16_t> D(h.size());
  A.upload(h);
  B.upload(h);
  auto ok = [](cublasStatus_t s, const char* what) {
    MEGAMOE_CHECK(s == CUBLAS_STATUS_SUCCESS, kCuda, "bench: ", what, " failed (cuBLAS status ", int(s), ")");
  };
  cublasLtHandle_t lt;
  ok(cublasLtCreate(&lt), "cublasLtCreate");
  cublasLtMatmulDesc_t op;
  ok(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;  // fp8 needs TN
  ok(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)), "set TRANSA");
  ok(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)), "set TRANSB");
  cublasLtMatrixLayout_t a, b, d;
  ok(cublasLtMatrixLayoutCreate(&a, CUDA_R_8F_E4M3, n, n, n), "layout A");
  ok(cublasLtMatrixLayoutCreate(&b, CUDA_R_8F_E4M3, n, n, n), "layout B");
  ok(cublasLtMatrixLayoutCreate(&d, CUDA_R_16BF, n, n, n), "layout D");
  cublasLtMatmulPreference_t pref;
  ok(cublasLtMatmulPreferenceCreate(&pref), "preference");
  const size_t ws_bytes = workspace.size();
  ok(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)),
     "preference workspace");
  cublasLtMatmulHeuristicResult_t algo{};
  int found = 0;
  ok(cublasLtMatmulAlgoGetHeuristic(lt, op, a, b, d, d, pref, 1, &algo, &found), "cublasLtMatmulAlgoGetHeuristic");
  MEGAMOE_CHECK(found > 0, kUnsupported, "bench: cuBLASLt has no fp8 e4m3 GEMM for this device");
  const float one = 1, zero = 0;
  const double us = event_median_us(
      [&] {
        ok(cublasLtMatmul(lt, op, &one, A.get(), a, B.get(), b, &zero, D.get(), d, D.get(), d, &algo.algo,
                          workspace.get(), ws_bytes, stream),
           "cublasLtMatmul (fp8)");
      },
      10, 2, stream, nullptr, warm_ms);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(a);
  cublasLtMatrixLayoutDestroy(b);
  cublasLtMatrixLayoutDestroy(d);
  cublasLtMatmulDescDestroy(op);
  cublasLtDestroy(lt);
  return 2.0 * double(n) * n * n / (us * 1e-6) / 1e12;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// FNV-1a over a point's inputs (hidden bits, expert ids, routing weight bits): recorded in the
// JSON so that two runs can be checked to have timed the same inputs.
uint64_t inputs_fingerprint(const std::vector<uint16_t>& x, const reference::TopK& topk) {
  uint64_t h = 0xCBF29CE484222325ull;
  auto mix = [&](const void* data, size_t bytes) {
    const auto* b = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < bytes; ++i) h = (h ^ b[i]) * 0x100000001B3ull;
  };
  mix(x.data(), x.size() * sizeof(x[0]));
  mix(topk.ids.data(), topk.ids.size() * sizeof(topk.ids[0]));
  mix(topk.weights.data(), topk.weights.size() * sizeof(topk.weights[0]));
  return h;
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// Uniform random distinct experts per token, weights positive and normalised.
reference::TopK uniform_topk(std::mt19937_64& rng, int64_t T, int64_t E, int k) {
  reference::TopK r;
  r.tokens = T;
  r.k = k;
  r.ids.resize(size_t(T * k));
  r.weights.resize(size_t(T * k));
  std::uniform_real_distribution<float> u(0.1f, 1.0f);
  for (int64_t t = 0; t < T; ++t) {
    std::set<int32_t> chosen;
    float sum = 0;
    for (int j = 0; j < k; ++j) {
      int32_t e;
      do e = int32_t(rng() % uint64_t(E)); while (!chosen.insert(e).second);
      r.ids[size_t(t * k + j)] = e;
      sum += (r.weights[size_t(t * k + j)] = u(rng));
    }
    for (int j = 0; j < k; ++j) r.weights[size_t(t * k + j)] /= sum;
  }
  return r;
}

std::vector<uint16_t> random_hidden(std::mt19937_64& rng, int64_t T, int64_t H) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> x(size_t(T * H));
  for (auto& v : x) v = f32_to_bf16(nd(rng));
  return x;
}


double rel_l2(const std::vector<uint16_t>& got, const std::vector<float>& ref, int64_t* nonfinite) {
  double num = 0, den = 0;
  *nonfinite = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = bf16_to_f32(got[i]);
    if (!std::isfinite(g)) { ++*nonfinite; continue; }
    num += (g - ref[i]) * (g - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// `count` token rows spread evenly over [0, T) (the first and the last among them): a timed point
// is checked where its first and its last tiles write.
std::vector<int64_t> spread_rows(int64_t T, int64_t count) {
  count = std::min(count, T);
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < count; ++i) rows.push_back(count == 1 ? 0 : i * (T - 1) / (count - 1));
  return rows;
}

// The rows `rows` of a layer's GPU output `got` ([T, H] bf16) against the CPU reference run on
// those tokens alone (tokens are independent), as a relative L2 error; *nonfinite counts the
// non-finite values among them.
double reference_rel_l2(const MoeLayer& layer, const std::vector<uint16_t>& x, const reference::TopK& topk,
                        const std::vector<uint16_t>& got, const std::vector<int64_t>& rows, int64_t* nonfinite,
                        bool w4a8) {
  const int64_t H = layer.hidden_size, k = topk.k, n = int64_t(rows.size());
  std::vector<uint16_t> xs(size_t(n * H)), gs(size_t(n * H));
  reference::TopK ts;
  ts.tokens = n;
  ts.k = topk.k;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = rows[size_t(j)];
    std::copy_n(x.begin() + r * H, H, xs.begin() + j * H);
    std::copy_n(got.begin() + r * H, H, gs.begin() + j * H);
    ts.ids.insert(ts.ids.end(), topk.ids.begin() + r * k, topk.ids.begin() + (r + 1) * k);
    ts.weights.insert(ts.weights.end(), topk.weights.begin() + r * k, topk.weights.begin() + (r + 1) * k);
  }
  // Both outputs are bf16: the error is what the GPU arithmetic adds beyond the final rounding.
  const auto ref_bf16 = w4a8 ? reference::moe_forward_w4a8(layer, xs, n, ts) : reference::moe_forward(layer, xs, n, ts);
  std::vector<float> ref(ref_bf16.size());
  for (size_t i = 0; i < ref.size(); ++i) ref[i] = bf16_to_f32(ref_bf16[i]);
  return rel_l2(gs, ref, nonfinite);
}

int64_t count_nonfinite(const std::vector<uint16_t>& v) {
  return std::count_if(v.begin(), v.end(), [](uint16_t b) { return !std::isfinite(bf16_to_f32(b)); });
}

std::string synthesize_bench_checkpoint(const std::string& preset_name, const std::string& work_dir,
                                        const SynthOptions& options) {
  const ModelPreset& preset = find_preset(preset_name);
  const std::string dir = work_dir.empty()
                              ? (std::filesystem::temp_directory_path() / ("megamoe-bench-" + preset.name)).string()
                              : work_dir;
  synth_checkpoint(preset, dir, options);
  return dir;
}

int64_t bench_layer_index(const ModelConfig& config, int64_t layer) {
  if (layer >= 0) return layer;
  int64_t first = 0;
  while (first < config.num_hidden_layers && !config.is_moe_layer(first)) ++first;
  return first;
}

}  // namespace megamoe::bench
