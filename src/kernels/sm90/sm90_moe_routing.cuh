// Router logits -> top-k expert ids and weights (docs/design.md §2), one warp per token.
//
// The selection must be the CPU reference's (reference::route): the GPU result feeds the same
// experts and the tests compare ids exactly. So the scores are computed as the reference computes
// them, in double precision from the fp32 logits, every selection is an argmax with the order
// (score descending, expert index ascending), and each weight is rounded to fp32 once at the end.
// Double precision costs little here: a token has at most a few thousand scores, against the
// 3 x H x I multiply-adds of each expert it selects.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

namespace megamoe::kernels::sm90 {

struct RoutingParams {
  const float* logits;    // (T, E) fp32
  const float* bias;      // (E) fp32 e_score_correction_bias (noaux_tc), or nullptr
  int64_t tokens;         // T
  int32_t num_experts;    // E
  int32_t top_k;          // k, 1..E
  int32_t noaux_tc;       // 0: softmax top-k; 1: DeepSeek noaux_tc
  int32_t renormalize;    // divide the chosen weights by their sum
  int32_t n_group;        // noaux_tc groups (1 for softmax)
  int32_t topk_group;     // noaux_tc groups kept
  double scale;           // routed_scaling_factor
  int32_t warp_smem_bytes;  // per-warp slice of the dynamic shared memory (routing_warp_smem_bytes)
  int32_t* topk_ids;      // (T, k) out
  float* topk_weights;    // (T, k) out
};

// At most this many warps (tokens) per CTA; fewer when a warp's scratch is large (big E).
inline constexpr int kRoutingMaxWarpsPerBlock = 4;

// Per-warp scratch: score[E] and group_score[G] (double), chosen[k] (int32), then one flag byte
// per expert and per group. Rounded to 16 bytes so every warp's doubles stay aligned.
__host__ __device__ inline int32_t routing_warp_smem_bytes(int32_t experts, int32_t groups,
                                                           int32_t top_k) {
  const int64_t bytes = 8LL * (experts + groups) + 4LL * top_k + experts + groups;
  return static_cast<int32_t>((bytes + 15) / 16 * 16);
}

// s = sigmoid(l) in double, as the reference computes it (one definition: the weights recompute
// it for the chosen experts and must get the same bits as the selection saw).
__device__ __forceinline__ double routing_sigmoid(float logit) {
  return 1.0 / (1.0 + exp(-static_cast<double>(logit)));
}

// Is (s, i) ahead of (best_s, best_i) in the selection order? Index -1 means "none yet". A real
// entry is always ahead of none, so even NaN scores (non-finite logits) yield a real, untaken
// index; among finite scores this is the strict order (score desc, index asc).
__device__ __forceinline__ bool routing_ahead(double s, int32_t i, double best_s, int32_t best_i) {
  if (i < 0) return false;
  if (best_i < 0) return true;
  return s > best_s || (s == best_s && i < best_i);
}

// The first entry of score[0, n) in the selection order among those with flag == 0, over the
// whole warp; every lane returns lane 0's answer. Each lane scans its strided entries in
// ascending order, so a strict comparison keeps the lower index of equal scores.
__device__ __forceinline__ int32_t routing_warp_argmax(const double* score, const uint8_t* flag,
                                                       int32_t n, int lane) {
  double best_s = 0.0;
  int32_t best_i = -1;
  for (int32_t i = lane; i < n; i += 32) {
    if (flag[i] == 0 && routing_ahead(score[i], i, best_s, best_i)) {
      best_s = score[i];
      best_i = i;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const double other_s = __shfl_xor_sync(0xffffffffu, best_s, offset);
    const int32_t other_i = __shfl_xor_sync(0xffffffffu, best_i, offset);
    if (routing_ahead(other_s, other_i, best_s, best_i)) {
      best_s = other_s;
      best_i = other_i;
    }
  }
  return __shfl_sync(0xffffffffu, best_i, 0);
}

__device__ __forceinline__ double routing_warp_sum(double v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float routing_warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Launch with blockDim.x = 32 x warps (1..kRoutingMaxWarpsPerBlock) and warps x
// warp_smem_bytes of dynamic shared memory.
__global__ void __launch_bounds__(kRoutingMaxWarpsPerBlock * 32) moe_routing_kernel(RoutingParams p) {
  extern __shared__ __align__(16) uint8_t routing_smem[];
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + warp;
  if (t >= p.tokens) return;  // warp-uniform: the shuffles below always see a full warp

  const int32_t E = p.num_experts, G = p.n_group, k = p.top_k;
  uint8_t* base = routing_smem + static_cast<int64_t>(warp) * p.warp_smem_bytes;
  double* score = reinterpret_cast<double*>(base);        // selection score per expert
  double* group_score = score + E;                        // noaux_tc only
  int32_t* chosen = reinterpret_cast<int32_t*>(group_score + G);
  uint8_t* taken = reinterpret_cast<uint8_t*>(chosen + k);  // 1: chosen or not eligible
  uint8_t* group_kept = taken + E;
  const float* logits = p.logits + t * E;

  if (p.noaux_tc == 0) {
    // Softmax: p = exp(l - max) / sum, the max subtracted (exactly, in double) to keep exp in
    // range as the reference does; top-k by p.
    float mx = -INFINITY;
    for (int32_t e = lane; e < E; e += 32) mx = fmaxf(mx, logits[e]);
    mx = routing_warp_max(mx);
    double sum = 0.0;
    for (int32_t e = lane; e < E; e += 32) {
      score[e] = exp(static_cast<double>(logits[e]) - static_cast<double>(mx));
      sum += score[e];
      taken[e] = 0;
    }
    sum = routing_warp_sum(sum);
    for (int32_t e = lane; e < E; e += 32) score[e] /= sum;
  } else {
    // noaux_tc: choose by s + bias among the best topk_group groups (group score = sum of its
    // two best choice scores), weigh by the unbiased s.
    for (int32_t e = lane; e < E; e += 32) {
      score[e] = routing_sigmoid(logits[e]) + (p.bias ? static_cast<double>(p.bias[e]) : 0.0);
      taken[e] = 0;
    }
    __syncwarp();
    const int32_t group_size = E / G;
    for (int32_t g = lane; g < G; g += 32) {
      const double* m = score + static_cast<int64_t>(g) * group_size;
      double first = m[0], second = -INFINITY;
      for (int32_t i = 1; i < group_size; ++i) {
        if (m[i] > first) {
          second = first;
          first = m[i];
        } else if (m[i] > second) {
          second = m[i];
        }
      }
      group_score[g] = first + (group_size > 1 ? second : 0.0);
      group_kept[g] = 0;
    }
    __syncwarp();
    for (int32_t j = 0; j < p.topk_group; ++j) {
      const int32_t g = routing_warp_argmax(group_score, group_kept, G, lane);
      if (lane == 0) group_kept[g] = 1;
      __syncwarp();
    }
    for (int32_t e = lane; e < E; e += 32) {
      if (!group_kept[e / group_size]) taken[e] = 1;
    }
  }
  __syncwarp();

  for (int32_t j = 0; j < k; ++j) {
    const int32_t e = routing_warp_argmax(score, taken, E, lane);
    if (lane == 0) {
      chosen[j] = e;
      taken[e] = 1;
    }
    __syncwarp();
  }

  // Weights: the base scores (softmax p, or the unbiased sigmoid) of the chosen experts, summed
  // in top-k order by one lane as the reference does, renormalised, scaled, rounded once.
  auto base_score = [&](int32_t e) {
    return p.noaux_tc ? routing_sigmoid(logits[e]) : score[e];
  };
  double total = 0.0;
  if (lane == 0) {
    for (int32_t j = 0; j < k; ++j) total += base_score(chosen[j]);
  }
  total = __shfl_sync(0xffffffffu, total, 0);
  for (int32_t j = lane; j < k; j += 32) {
    const int32_t e = chosen[j];
    double w = base_score(e);
    // A zero sum happens only in noaux_tc when every chosen sigmoid underflowed; the weights
    // are then 0, as in the reference.
    if (p.renormalize && total > 0.0) w /= total;
    w *= p.scale;
    p.topk_ids[t * k + j] = e;
    p.topk_weights[t * k + j] = static_cast<float>(w);
  }
}

}  // namespace megamoe::kernels::sm90
