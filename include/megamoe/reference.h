// The exact CPU reference: the oracle every GPU result is compared with. Written for clarity,
// independent of the kernels (it decodes NVFP4 with format::, never with device code).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "megamoe/moe.h"

namespace megamoe::reference {

// Top-k routing result, row-major [tokens, k].
struct TopK {
  int64_t tokens = 0;
  int k = 0;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// logits [T, E] = hidden(bf16) · router_weightᵀ, accumulated in double, rounded to fp32.
std::vector<float> router_logits(const MoeLayer& layer, std::span<const uint16_t> hidden_bf16,
                                 int64_t tokens);

// Routing per DESIGN.md §2. Softmax: p = softmax(logits) in double; top-k by p (ties to the
// lower index); renormalise if asked; times routed_scaling_factor. noaux_tc: s = sigmoid(l);
// choice score s + bias; group score = sum of the group's top-2 choice scores; keep the best
// topk_group groups (ties to the lower group); top-k experts among them by choice score (ties
// to the lower index); weights = s of the chosen, divided by their sum when renormalize, times
// routed_scaling_factor. `bias` is empty or [E].
TopK route(const RoutingConfig& cfg, std::span<const float> logits, int64_t tokens,
           int64_t num_experts, std::span<const float> bias = {});

struct ForwardOptions {
  int threads = 0;  // 0: std::thread::hardware_concurrency()
};

// W4A16 forward (DESIGN.md §2) from the NVFP4 tensors: per (token, expert) g = x·Wgᵀ·s2_gate,
// u = x·Wuᵀ·s2_up (double accumulation of exact products); optional clamp g <= L, |u| <= L;
// a = bf16(silu(g)·u); y = a·Wdᵀ·s2_down; out = bf16(Σ_k w_k·y_k + y_shared), summed in
// double in top-k order. Ids must be in [0, E) (throws kInvalidArgument otherwise); a repeated
// id in a row is allowed and counts twice.
std::vector<uint16_t> moe_forward(const MoeLayer& layer, std::span<const uint16_t> hidden_bf16,
                                  int64_t tokens, const TopK& topk,
                                  const ForwardOptions& opt = {});

// Same, as fp32 before the final bf16 rounding (for error analysis).
std::vector<float> moe_forward_f32(const MoeLayer& layer, std::span<const uint16_t> hidden_bf16,
                                   int64_t tokens, const TopK& topk,
                                   const ForwardOptions& opt = {});

}  // namespace megamoe::reference
