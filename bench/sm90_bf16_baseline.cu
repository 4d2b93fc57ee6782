#include "bench/sm90_bf16_baseline.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <numeric>

#include "megamoe/gpu.h"
#include "megamoe/status.h"

namespace megamoe::bench {
namespace {

using gpu::check_cuda;

void check_cublas(cublasStatus_t s, const char* what) {
  MEGAMOE_CHECK(s == CUBLAS_STATUS_SUCCESS, kCuda, what, " failed: cuBLAS status ", int(s));
}

// xs[slot] = hidden[slot_token[slot]], 16 bytes per thread.
__global__ void gather_rows(const __nv_bfloat16* __restrict__ hidden, const int32_t* __restrict__ slot_token,
                            int64_t slots, int64_t H, __nv_bfloat16* __restrict__ xs) {
  const int64_t vec = H / 8;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < slots * vec; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t s = i / vec, c = i % vec;
    reinterpret_cast<uint4*>(xs + s * H)[c] = reinterpret_cast<const uint4*>(hidden + int64_t(slot_token[s]) * H)[c];
  }
}

// a[s, j] = bf16(silu(clamp(g)) * clamp(u)) from h13[s] = [g (I) | u (I)].
__global__ void swiglu(const __nv_bfloat16* __restrict__ h13, int64_t slots, int64_t I, float limit,
                       __nv_bfloat16* __restrict__ a) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < slots * I; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t s = i / I, j = i % I;
    float g = __bfloat162float(h13[s * 2 * I + j]);
    float u = __bfloat162float(h13[s * 2 * I + I + j]);
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    a[i] = __float2bfloat16_rn(g / (1.0f + __expf(-g)) * u);
  }
}

// out[t, h] = bf16(sum_j w[t, j] * y[token_slot[t, j], h]) in fp32, j in order.
__global__ void combine(const __nv_bfloat16* __restrict__ y, const int32_t* __restrict__ token_slot,
                        const float* __restrict__ weight, int64_t T, int spt, int64_t H,
                        __nv_bfloat16* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < T * H; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / H, h = i % H;
    float acc = 0.0f;
    for (int j = 0; j < spt; ++j) {
      const int32_t s = token_slot[t * spt + j];
      acc += weight[t * spt + j] * __bfloat162float(y[int64_t(s) * H + h]);
    }
    out[i] = __float2bfloat16_rn(acc);
  }
}

template <class T>
T* device_alloc(size_t count) {
  void* p = nullptr;
  check_cuda(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)), "cudaMalloc(baseline)");
  return static_cast<T*>(p);
}

}  // namespace

struct Bf16BaselineMoe::Impl {
  int64_t H, I, E, shared_I;
  float limit;
  cublasHandle_t handle = nullptr;
  std::vector<uint16_t*> w13, w2;
  // routing
  int64_t T = 0, slots = 0;
  int spt = 0;
  std::vector<int64_t> count, offset;  // per expert (incl. shared)
  int32_t* slot_token = nullptr;
  int32_t* token_slot = nullptr;
  float* weight = nullptr;
  __nv_bfloat16 *xs = nullptr, *h13 = nullptr, *act = nullptr, *y = nullptr;
  int64_t max_I() const { return std::max(I, shared_I); }
  void free_routing() {
    for (void* p : {(void*)slot_token, (void*)token_slot, (void*)weight, (void*)xs, (void*)h13, (void*)act, (void*)y}) {
      if (p) cudaFree(p);
    }
    slot_token = token_slot = nullptr;
    weight = nullptr;
    xs = h13 = act = y = nullptr;
  }
};

Bf16BaselineMoe::Bf16BaselineMoe(int64_t hidden, int64_t inter, int64_t experts, int64_t shared_inter,
                                 std::optional<float> swiglu_limit)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.H = hidden;
  m.I = inter;
  m.E = experts;
  m.shared_I = shared_inter;
  m.limit = swiglu_limit ? *swiglu_limit : INFINITY;
  check_cublas(cublasCreate(&m.handle), "cublasCreate");
  const int64_t ev = experts + (shared_inter > 0 ? 1 : 0);
  for (int64_t e = 0; e < ev; ++e) {
    const int64_t i = expert_intermediate(e);
    m.w13.push_back(device_alloc<uint16_t>(size_t(2 * i * hidden)));
    m.w2.push_back(device_alloc<uint16_t>(size_t(hidden * i)));
  }
}

Bf16BaselineMoe::~Bf16BaselineMoe() {
  impl_->free_routing();
  for (auto* p : impl_->w13) cudaFree(p);
  for (auto* p : impl_->w2) cudaFree(p);
  if (impl_->handle) cublasDestroy(impl_->handle);
}

uint16_t* Bf16BaselineMoe::w13(int64_t e) const { return impl_->w13[size_t(e)]; }
uint16_t* Bf16BaselineMoe::w2(int64_t e) const { return impl_->w2[size_t(e)]; }
int64_t Bf16BaselineMoe::expert_intermediate(int64_t e) const {
  return e < impl_->E ? impl_->I : impl_->shared_I;
}

void Bf16BaselineMoe::set_routing(const reference::TopK& topk) {
  Impl& m = *impl_;
  m.free_routing();
  const bool shared = m.shared_I > 0;
  const int64_t ev = m.E + (shared ? 1 : 0);
  m.T = topk.tokens;
  m.spt = topk.k + (shared ? 1 : 0);
  m.slots = m.T * m.spt;
  m.count.assign(size_t(ev), 0);
  for (int32_t id : topk.ids) {
    MEGAMOE_CHECK(id >= 0 && id < m.E, kInvalidArgument, "baseline: expert id ", id, " out of range");
    ++m.count[size_t(id)];
  }
  if (shared) m.count[size_t(m.E)] = m.T;
  m.offset.assign(size_t(ev) + 1, 0);
  std::partial_sum(m.count.begin(), m.count.end(), m.offset.begin() + 1);
  std::vector<int64_t> cursor(m.offset.begin(), m.offset.end() - 1);
  std::vector<int32_t> slot_token(size_t(m.slots)), token_slot(size_t(m.slots));
  std::vector<float> weight(size_t(m.slots));
  for (int64_t t = 0; t < m.T; ++t) {
    for (int j = 0; j < m.spt; ++j) {
      const bool is_shared = j == topk.k;
      const int64_t e = is_shared ? m.E : topk.ids[size_t(t * topk.k + j)];
      const int64_t s = cursor[size_t(e)]++;
      slot_token[size_t(s)] = int32_t(t);
      token_slot[size_t(t * m.spt + j)] = int32_t(s);
      weight[size_t(t * m.spt + j)] = is_shared ? 1.0f : topk.weights[size_t(t * topk.k + j)];
    }
  }
  m.slot_token = device_alloc<int32_t>(size_t(m.slots));
  m.token_slot = device_alloc<int32_t>(size_t(m.slots));
  m.weight = device_alloc<float>(size_t(m.slots));
  check_cuda(cudaMemcpy(m.slot_token, slot_token.data(), slot_token.size() * 4, cudaMemcpyHostToDevice), "H2D");
  check_cuda(cudaMemcpy(m.token_slot, token_slot.data(), token_slot.size() * 4, cudaMemcpyHostToDevice), "H2D");
  check_cuda(cudaMemcpy(m.weight, weight.data(), weight.size() * 4, cudaMemcpyHostToDevice), "H2D");
  m.xs = device_alloc<__nv_bfloat16>(size_t(m.slots * m.H));
  m.h13 = device_alloc<__nv_bfloat16>(size_t(m.slots * 2 * m.max_I()));
  m.act = device_alloc<__nv_bfloat16>(size_t(m.slots * m.max_I()));
  m.y = device_alloc<__nv_bfloat16>(size_t(m.slots * m.H));
}

void Bf16BaselineMoe::run(const uint16_t* hidden, uint16_t* out, cudaStream_t stream) {
  Impl& m = *impl_;
  if (m.T == 0) return;
  check_cublas(cublasSetStream(m.handle, stream), "cublasSetStream");
  const int grid = 132 * 8;
  gather_rows<<<grid, 256, 0, stream>>>(reinterpret_cast<const __nv_bfloat16*>(hidden), m.slot_token, m.slots, m.H, m.xs);
  const float one = 1.0f, zero = 0.0f;
  // Row-major C[n, m] = X[n, k] · W[m, k]ᵀ is column-major Cᵀ = op(W) · Xᵀ with op = T.
  for (size_t e = 0; e < m.count.size(); ++e) {
    const int64_t n = m.count[e];
    if (n == 0) continue;
    const int64_t I = expert_intermediate(int64_t(e));
    const int64_t s0 = m.offset[e];
    check_cublas(cublasGemmEx(m.handle, CUBLAS_OP_T, CUBLAS_OP_N, int(2 * I), int(n), int(m.H), &one,
                              m.w13[e], CUDA_R_16BF, int(m.H), m.xs + s0 * m.H, CUDA_R_16BF, int(m.H), &zero,
                              m.h13 + s0 * 2 * m.max_I(), CUDA_R_16BF, int(2 * I), CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx(W13)");
    // SwiGLU per expert (its own I; rows of h13 are 2*max_I apart, packed as 2*I here).
    swiglu<<<grid, 256, 0, stream>>>(m.h13 + s0 * 2 * m.max_I(), n, I, m.limit, m.act + s0 * m.max_I());
    check_cublas(cublasGemmEx(m.handle, CUBLAS_OP_T, CUBLAS_OP_N, int(m.H), int(n), int(I), &one, m.w2[e],
                              CUDA_R_16BF, int(I), m.act + s0 * m.max_I(), CUDA_R_16BF, int(I), &zero,
                              m.y + s0 * m.H, CUDA_R_16BF, int(m.H), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx(W2)");
  }
  combine<<<grid, 256, 0, stream>>>(m.y, m.token_slot, m.weight, m.T, m.spt, m.H,
                                    reinterpret_cast<__nv_bfloat16*>(out));
  check_cuda(cudaGetLastError(), "baseline kernels");
}

}  // namespace megamoe::bench
