// Host launcher of the GPU router (kernels/sm90/sm90_moe_routing.cuh): checks the configuration
// exactly as reference::route does, then launches one warp per token. No allocation, no sync.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/sm90/sm90_moe_routing.cuh"
#include "megamoe/gpu.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"

namespace megamoe {

namespace k90 = kernels::sm90;

void route_topk(const RoutingConfig& cfg, const RouteArgs& args, cudaStream_t stream) {
  const int64_t E = args.num_experts;
  MEGAMOE_CHECK(args.tokens >= 0, kInvalidArgument, "route_topk: tokens is ", args.tokens,
                "; it must be >= 0.");
  MEGAMOE_CHECK(E >= 1 && E <= kRouteMaxExperts, kInvalidArgument, "route_topk: num_experts is ",
                E, "; the GPU router supports 1 to ", kRouteMaxExperts, ".");
  MEGAMOE_CHECK(cfg.top_k >= 1 && cfg.top_k <= E, kInvalidArgument, "route_topk: top_k is ",
                cfg.top_k, "; it must be in [1, num_experts = ", E, "].");
  MEGAMOE_CHECK(std::isfinite(cfg.routed_scaling_factor) && cfg.routed_scaling_factor > 0.0f,
                kInvalidArgument, "route_topk: routed_scaling_factor is ",
                cfg.routed_scaling_factor, "; it must be finite and > 0.");
  int n_group = 1, topk_group = 1;
  switch (cfg.kind) {
    case RoutingKind::kSoftmaxTopK:
      MEGAMOE_CHECK(args.bias == nullptr, kInvalidArgument,
                    "route_topk: a correction bias was given to softmax top-k routing, which "
                    "takes none (only noaux_tc uses e_score_correction_bias).");
      break;
    case RoutingKind::kNoauxTc: {
      n_group = cfg.n_group;
      topk_group = cfg.topk_group;
      MEGAMOE_CHECK(n_group >= 1 && E % n_group == 0, kInvalidArgument,
                    "route_topk: noaux_tc n_group is ", n_group,
                    "; it must be >= 1 and divide num_experts (", E, ").");
      const int64_t group_size = E / n_group;
      MEGAMOE_CHECK(n_group == 1 || group_size >= 2, kInvalidArgument, "route_topk: noaux_tc groups of ",
                    group_size, " expert (num_experts ", E, " / n_group ", n_group,
                    ") have no top-2 group score; with n_group > 1 each group must hold at "
                    "least 2 experts.");
      MEGAMOE_CHECK(topk_group >= 1 && topk_group <= n_group, kInvalidArgument,
                    "route_topk: noaux_tc topk_group is ", topk_group,
                    "; it must be in [1, n_group = ", n_group, "].");
      MEGAMOE_CHECK(cfg.top_k <= topk_group * group_size, kInvalidArgument,
                    "route_topk: noaux_tc top_k is ", cfg.top_k, " but the ", topk_group,
                    " kept groups hold only ", topk_group * group_size,
                    " experts; top_k must be <= topk_group x (num_experts / n_group).");
      break;
    }
    default:
      MEGAMOE_FAIL(kInvalidArgument, "route_topk: routing kind ", static_cast<int>(cfg.kind),
                   " is unknown; allowed: softmax top-k (0) and noaux_tc (1).");
  }
  if (args.tokens == 0) return;
  MEGAMOE_CHECK(args.logits && args.topk_ids && args.topk_weights, kInvalidArgument,
                "route_topk: logits, topk_ids and topk_weights must be device pointers, not null.");

  k90::RoutingParams p{};
  p.logits = args.logits;
  p.bias = args.bias;
  p.tokens = args.tokens;
  p.num_experts = static_cast<int32_t>(E);
  p.top_k = cfg.top_k;
  p.noaux_tc = cfg.kind == RoutingKind::kNoauxTc ? 1 : 0;
  p.renormalize = cfg.renormalize ? 1 : 0;
  p.n_group = n_group;
  p.topk_group = topk_group;
  p.scale = static_cast<double>(cfg.routed_scaling_factor);
  p.warp_smem_bytes = k90::routing_warp_smem_bytes(p.num_experts, n_group, cfg.top_k);
  p.topk_ids = args.topk_ids;
  p.topk_weights = args.topk_weights;

  // Up to 48 KB of dynamic shared memory needs no opt-in: 4 warps a CTA up to about E = 1300
  // (k <= 16); beyond that fewer warps, down to one warp with a larger opt-in slice.
  constexpr int kDefaultDynamicSmem = 48 * 1024;
  const int warps = std::clamp(kDefaultDynamicSmem / p.warp_smem_bytes, 1,
                               k90::kRoutingMaxWarpsPerBlock);
  const int smem = p.warp_smem_bytes * warps;
  if (smem > kDefaultDynamicSmem) {
    gpu::check_cuda(cudaFuncSetAttribute(k90::moe_routing_kernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                    "cudaFuncSetAttribute(routing kernel shared memory)");
  }
  const int64_t blocks = (args.tokens + warps - 1) / warps;
  MEGAMOE_CHECK(blocks <= std::numeric_limits<int32_t>::max(), kInvalidArgument,
                "route_topk: tokens = ", args.tokens, " is too large for one launch.");
  k90::moe_routing_kernel<<<static_cast<unsigned>(blocks), warps * 32, smem, stream>>>(p);
  gpu::check_cuda(cudaGetLastError(), "moe_routing_kernel launch");
}

}  // namespace megamoe
