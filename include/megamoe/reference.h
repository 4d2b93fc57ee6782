// The exact CPU reference: the oracle every GPU result is compared with. Written for clarity,
// independent of the kernels (it decodes NVFP4 with format::, never with device code).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "megamoe/moe.h"

namespace megamoe::reference {

// Round-to-nearest-even from double straight to bf16: one rounding (rounding to fp32 first and
// then to bf16 would round twice). Subnormals, overflow to infinity, signed zeros, NaN included.
uint16_t f64_to_bf16(double v);

// Top-k routing result, row-major [tokens, k].
struct TopK {
  int64_t tokens = 0;
  int k = 0;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// logits [T, E] = hidden(bf16) · router_weightᵀ, accumulated in double, rounded to fp32.
// Each bf16·fp32 term is exact in double; one accumulator per logit, in index order.
// Throws kInvalidArgument when the layer has no router weight, or router_weight is not [E, H],
// or hidden is not tokens x H.
std::vector<float> router_logits(const MoeLayer& layer, std::span<const uint16_t> hidden_bf16,
                                 int64_t tokens);

// Routing per docs/design.md §2. Softmax: p = softmax(logits) in double; top-k by p (ties to the
// lower index); renormalise if asked; times routed_scaling_factor. noaux_tc: s = sigmoid(l);
// choice score s + bias; group score = sum of the group's top-2 choice scores; keep the best
// topk_group groups (ties to the lower group); top-k experts among them by choice score (ties
// to the lower index); weights = s of the chosen, divided by their sum when renormalize, times
// routed_scaling_factor. `bias` is empty or [E] (noaux_tc only; softmax takes none).
// Scores and weights are computed in double; each weight is rounded to fp32 once.
// Order: each row lists its k experts by selection score descending (softmax: p; noaux_tc: the
// biased choice score), equal scores by ascending expert index.
// noaux_tc with renormalize: where every chosen sigmoid underflowed to 0 (logits below about
// -745) the row's weights are 0 (as with HF's `sum + 1e-20` denominator).
// Throws kInvalidArgument unless: tokens >= 0, num_experts >= 1, logits hold tokens x E finite
// values, k in [1, E], routed_scaling_factor finite and > 0; for noaux_tc also n_group >= 1
// divides E, groups hold >= 2 experts when n_group > 1, topk_group in [1, n_group],
// k <= topk_group x E/n_group, and the bias is empty or E finite values.
TopK route(const RoutingConfig& cfg, std::span<const float> logits, int64_t tokens,
           int64_t num_experts, std::span<const float> bias = {});

// Options change speed and memory only: results are bitwise the same for every value.
struct ForwardOptions {
  int threads = 0;           // 0: std::thread::hardware_concurrency()
  int64_t chunk_tokens = 0;  // tokens per pass (each pass decodes its experts' weights once);
                             // 0: as many as keep the per-(token, slot) outputs near 64 MiB
};

// W4A16 forward (docs/design.md §2) from the NVFP4 tensors: per (token, expert) g = x·Wgᵀ·s2_gate,
// u = x·Wuᵀ·s2_up (double accumulation of exact products); optional clamp g <= L, |u| <= L;
// a = bf16(silu(g)·u); y = a·Wdᵀ·s2_down; out = bf16(Σ_k w_k·y_k + y_shared), summed in
// double in top-k order. Ids must be in [0, E) (throws kInvalidArgument otherwise); a repeated
// id in a row is allowed and counts twice.
// Exactly: W = e2m1·ue4m3 decoded exactly (fp32); every dot product is one double accumulator
// summed in index order (its terms x·W and a·W are exact in double), then times the global
// scale in double; silu(g)·u = g/(1 + exp(-g))·u in double, rounded to bf16 once (straight from
// double, never through fp32); the shared expert (weight 1) is added after the k slots; the
// final double sum is rounded once (to bf16 here, to fp32 in moe_forward_f32).
// Throws kInvalidArgument for an invalid layer (MoeLayer::validate), hidden not tokens x H,
// topk not [tokens, k >= 1] with finite weights, or an invalid ue4m3 block scale in an expert
// that is used (only those are read). tokens == 0 gives an empty result.
std::vector<uint16_t> moe_forward(const MoeLayer& layer, std::span<const uint16_t> hidden_bf16,
                                  int64_t tokens, const TopK& topk,
                                  const ForwardOptions& opt = {});

// Same, as fp32 before the final bf16 rounding (for error analysis).
std::vector<float> moe_forward_f32(const MoeLayer& layer, std::span<const uint16_t> hidden_bf16,
                                   int64_t tokens, const TopK& topk,
                                   const ForwardOptions& opt = {});

// ---- Tensor parallelism (megamoe/tp.h) -----------------------------------------------------
// A TP rank's partial output is moe_forward_f32 of tp_local_layer(layer, {R, r}) with the whole
// layer's tokens and top-k. tp_combine sums the R partials ([T, H] fp32 each, in rank order) in
// double, ranks 0..R-1, and rounds once (to bf16; to fp32 in tp_combine_f32); deterministic,
// non-finite partials propagate. Not bitwise the whole layer's result: an element a of
// tp_combine_f32 and b of moe_forward_f32 differ by at most 2^-24·(Σ_r |partial_r| + |a| + |b|)
// plus ~2^-53 per term of reassociation; after the bf16 rounding by at most one bf16 ulp unless
// the partials cancel to below 2^-15 of Σ_r |partial_r| (docs/design.md §7.1).
// Throws kInvalidArgument when there are no partials or their sizes differ.
std::vector<uint16_t> tp_combine(std::span<const std::vector<float>> partials);
std::vector<float> tp_combine_f32(std::span<const std::vector<float>> partials);

// ---- W4A8 emulation (docs/w4a8.md) ---------------------------------------------------------
// The exact CPU emulation of the W4A8 forward, the oracle of W4A8 kernels: hidden and the SwiGLU
// output quantized to e4m3 with a power-of-two scale per 128 elements along K; each weight
// e2m1·ue4m3 rounded to e4m3 after the exact rescale 2^-k of its (expert, projection), which is
// folded back into the global scale; exact per-128 partial sums (double), summed in K order;
// SwiGLU, clamp, routing weights, shared expert and combine as moe_forward. Options change speed
// only. Same contract as moe_forward, and also throws kInvalidArgument where H, the routed or the
// shared I is not a multiple of 128, hidden holds a non-finite value, or a SwiGLU output exceeds
// fp32's range.
std::vector<uint16_t> moe_forward_w4a8(const MoeLayer& layer,
                                       std::span<const uint16_t> hidden_bf16, int64_t tokens,
                                       const TopK& topk, const ForwardOptions& opt = {});
// Same, as fp32 before the final bf16 rounding.
std::vector<float> moe_forward_w4a8_f32(const MoeLayer& layer,
                                        std::span<const uint16_t> hidden_bf16, int64_t tokens,
                                        const TopK& topk, const ForwardOptions& opt = {});


// The emulation of one expert, stage by stage, for tests of a W4A8 kernel's intermediates
// (docs/w4a8.md §4, "Testing a kernel stage by stage"). expert: a routed expert in [0, E), or
// kW4a8SharedExpert. Each projection's output n, beside the sum of its terms' magnitudes (the
// scale of a fp8 MMA's accumulation error):
//   value[n]     = Σ_b Σ_{i in block b} in_i·Ŵ_{n,i} · s2·2^k   (as moe_forward_w4a8, bit for bit)
//   magnitude[n] = Σ_b Σ_{i in block b} |in_i·Ŵ_{n,i}| · s2·2^k
// `in` is the dequantized input of the projection: x̂ (H values) for gate and up, â (that expert's
// I values) for down, e.g. from w4a8_quantize_dequantize. Throws kInvalidArgument on a bad expert,
// a size mismatch, or an invalid block scale.
inline constexpr int kW4a8SharedExpert = -1;
enum class W4a8Projection { kGate, kUp, kDown };
struct W4a8ProjectionOutput {
  std::vector<double> value, magnitude;
};
W4a8ProjectionOutput w4a8_project(const MoeLayer& layer, int expert, W4a8Projection proj,
                                  std::span<const double> in);
// a = silu(g)·u of the gate and up outputs, after the layer's clamp, unquantized (§2, §5).
std::vector<double> w4a8_swiglu(const MoeLayer& layer, std::span<const double> gate,
                                std::span<const double> up);
// x̂ = e4m3(x·2^-e)·2^e per 128 consecutive values (§1): format::quantize_activation_w4a8 of one
// row, dequantized exactly.
std::vector<double> w4a8_quantize_dequantize(std::span<const double> x);

}  // namespace megamoe::reference
