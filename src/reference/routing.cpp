// Reference routing (docs/design.md §2): router logits, softmax top-k and DeepSeek noaux_tc.
//
// Written for clarity, not speed: every score is computed in double from the fp32 logits, every
// selection is a full sort with an explicit (score descending, index ascending) order, and the
// weights are rounded to fp32 once at the end.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "megamoe/dtype.h"
#include "megamoe/reference.h"
#include "megamoe/status.h"

namespace megamoe::reference {
namespace {

// Indices [0, n) ordered by score descending, ties to the lower index. Scores are finite here
// (callers reject non-finite logits and biases), so the comparison is a strict weak order.
std::vector<int64_t> order_by_score(std::span<const double> score) {
  std::vector<int64_t> idx(score.size());
  std::iota(idx.begin(), idx.end(), int64_t{0});
  std::sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) {
    if (score[a] != score[b]) return score[a] > score[b];
    return a < b;
  });
  return idx;
}

void check_logits(std::span<const float> logits, int64_t tokens, int64_t num_experts) {
  MEGAMOE_CHECK(tokens >= 0, kInvalidArgument, "route: tokens is ", tokens,
                "; it must be >= 0.");
  MEGAMOE_CHECK(num_experts >= 1, kInvalidArgument, "route: num_experts is ", num_experts,
                "; it must be >= 1.");
  MEGAMOE_CHECK(static_cast<int64_t>(logits.size()) / num_experts == tokens &&
                    static_cast<int64_t>(logits.size()) % num_experts == 0,
                kInvalidArgument, "route: logits hold ", logits.size(),
                " values; expected tokens (", tokens, ") x num_experts (", num_experts, ").");
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < num_experts; ++e) {
      const float l = logits[t * num_experts + e];
      MEGAMOE_CHECK(std::isfinite(l), kInvalidArgument, "route: the logit of token ", t,
                    ", expert ", e, " is ", l, "; logits must be finite.");
    }
  }
}

// Writes row t of the result: the chosen experts in the given order, weights = base scores
// (divided by their sum when renormalising) times the scaling factor, rounded to fp32 once.
void emit_row(TopK& out, int64_t t, std::span<const int64_t> chosen,
              std::span<const double> base_score, const RoutingConfig& cfg) {
  double sum = 0.0;
  for (int64_t e : chosen) sum += base_score[e];
  for (size_t j = 0; j < chosen.size(); ++j) {
    const int64_t e = chosen[j];
    double w = base_score[e];
    // A zero sum only happens in noaux_tc when every chosen sigmoid underflowed to 0 (logits
    // below about -745); the weights are then 0, as with HF's `sum + 1e-20` denominator.
    if (cfg.renormalize && sum > 0.0) w /= sum;
    w *= static_cast<double>(cfg.routed_scaling_factor);
    out.ids[t * out.k + j] = static_cast<int32_t>(e);
    out.weights[t * out.k + j] = static_cast<float>(w);
  }
}

void route_softmax(const RoutingConfig& cfg, std::span<const float> logits, int64_t E,
                   TopK& out) {
  std::vector<double> p(E);
  for (int64_t t = 0; t < out.tokens; ++t) {
    const float* l = logits.data() + t * E;
    // Subtracting the max keeps exp() in range; it cancels in the quotient.
    const double mx = *std::max_element(l, l + E);
    double denom = 0.0;
    for (int64_t e = 0; e < E; ++e) {
      p[e] = std::exp(static_cast<double>(l[e]) - mx);
      denom += p[e];
    }
    for (int64_t e = 0; e < E; ++e) p[e] /= denom;
    const std::vector<int64_t> order = order_by_score(p);
    emit_row(out, t, std::span(order).first(cfg.top_k), p, cfg);
  }
}

void route_noaux_tc(const RoutingConfig& cfg, std::span<const float> logits, int64_t E,
                    std::span<const float> bias, TopK& out) {
  const int64_t group_size = E / cfg.n_group;
  std::vector<double> s(E), choice(E), group_score(cfg.n_group);
  std::vector<int64_t> candidates;
  std::vector<double> candidate_choice;
  for (int64_t t = 0; t < out.tokens; ++t) {
    const float* l = logits.data() + t * E;
    for (int64_t e = 0; e < E; ++e) {
      s[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(l[e])));
      choice[e] = s[e] + (bias.empty() ? 0.0 : static_cast<double>(bias[e]));
    }
    // Group score: the sum of the group's two best choice scores (the whole group when it has
    // a single expert, which only happens with n_group == 1, where the score is unused).
    for (int g = 0; g < cfg.n_group; ++g) {
      const std::span<const double> members(choice.data() + g * group_size, group_size);
      const std::vector<int64_t> best = order_by_score(members);
      group_score[g] = members[best[0]] + (group_size > 1 ? members[best[1]] : 0.0);
    }
    const std::vector<int64_t> group_order = order_by_score(group_score);
    std::vector<bool> kept(cfg.n_group, false);
    for (int j = 0; j < cfg.topk_group; ++j) kept[group_order[j]] = true;

    // Experts of the kept groups only, then the top k of those by choice score.
    candidates.clear();
    candidate_choice.clear();
    for (int64_t e = 0; e < E; ++e) {
      if (kept[e / group_size]) {
        candidates.push_back(e);
        candidate_choice.push_back(choice[e]);
      }
    }
    // Candidates are in ascending expert order, so ties on the candidate index are ties on the
    // expert index.
    const std::vector<int64_t> order = order_by_score(candidate_choice);
    std::vector<int64_t> chosen(cfg.top_k);
    for (int j = 0; j < cfg.top_k; ++j) chosen[j] = candidates[order[j]];
    emit_row(out, t, chosen, s, cfg);
  }
}

}  // namespace

std::vector<float> router_logits(const MoeLayer& layer, std::span<const uint16_t> hidden_bf16,
                                 int64_t tokens) {
  const int64_t H = layer.hidden_size;
  const int64_t E = layer.num_experts;
  MEGAMOE_CHECK(H >= 1 && E >= 1, kInvalidArgument, "router_logits: the layer has hidden_size ",
                H, " and num_experts ", E, "; both must be >= 1.");
  MEGAMOE_CHECK(tokens >= 0, kInvalidArgument, "router_logits: tokens is ", tokens,
                "; it must be >= 0.");
  MEGAMOE_CHECK(!layer.router_weight.empty(), kInvalidArgument,
                "router_logits: the layer has no router weight (gate.weight); give top-k ids and "
                "weights instead.");
  MEGAMOE_CHECK(static_cast<int64_t>(layer.router_weight.size()) / H == E &&
                    static_cast<int64_t>(layer.router_weight.size()) % H == 0,
                kInvalidArgument, "router_logits: router_weight holds ",
                layer.router_weight.size(), " values; expected num_experts (", E,
                ") x hidden_size (", H, ").");
  MEGAMOE_CHECK(static_cast<int64_t>(hidden_bf16.size()) / H == tokens &&
                    static_cast<int64_t>(hidden_bf16.size()) % H == 0,
                kInvalidArgument, "router_logits: hidden holds ", hidden_bf16.size(),
                " values; expected tokens (", tokens, ") x hidden_size (", H, ").");

  std::vector<float> logits(tokens * E);
  for (int64_t t = 0; t < tokens; ++t) {
    const uint16_t* x = hidden_bf16.data() + t * H;
    for (int64_t e = 0; e < E; ++e) {
      const float* w = layer.router_weight.data() + e * H;
      // bf16 x fp32 products have at most 8 + 24 significant bits: exact in double.
      double acc = 0.0;
      for (int64_t h = 0; h < H; ++h) {
        acc += static_cast<double>(bf16_to_f32(x[h])) * static_cast<double>(w[h]);
      }
      logits[t * E + e] = static_cast<float>(acc);
    }
  }
  return logits;
}

TopK route(const RoutingConfig& cfg, std::span<const float> logits, int64_t tokens,
           int64_t num_experts, std::span<const float> bias) {
  const int64_t E = num_experts;
  check_logits(logits, tokens, E);
  MEGAMOE_CHECK(cfg.top_k >= 1 && cfg.top_k <= E, kInvalidArgument, "route: top_k is ",
                cfg.top_k, "; it must be in [1, num_experts = ", E, "].");
  MEGAMOE_CHECK(std::isfinite(cfg.routed_scaling_factor) && cfg.routed_scaling_factor > 0.0f,
                kInvalidArgument, "route: routed_scaling_factor is ", cfg.routed_scaling_factor,
                "; it must be finite and > 0.");

  TopK out;
  out.tokens = tokens;
  out.k = cfg.top_k;
  out.ids.resize(tokens * cfg.top_k);
  out.weights.resize(tokens * cfg.top_k);

  switch (cfg.kind) {
    case RoutingKind::kSoftmaxTopK:
      MEGAMOE_CHECK(bias.empty(), kInvalidArgument, "route: a correction bias of ", bias.size(),
                    " values was given to softmax top-k routing, which takes none (only "
                    "noaux_tc uses e_score_correction_bias).");
      route_softmax(cfg, logits, E, out);
      return out;
    case RoutingKind::kNoauxTc: {
      MEGAMOE_CHECK(cfg.n_group >= 1 && E % cfg.n_group == 0, kInvalidArgument,
                    "route: noaux_tc n_group is ", cfg.n_group, "; it must be >= 1 and divide "
                    "num_experts (", E, ").");
      const int64_t group_size = E / cfg.n_group;
      MEGAMOE_CHECK(cfg.n_group == 1 || group_size >= 2, kInvalidArgument,
                    "route: noaux_tc groups of ", group_size, " expert (num_experts ", E,
                    " / n_group ", cfg.n_group, ") have no top-2 group score; with n_group > 1 "
                    "each group must hold at least 2 experts.");
      MEGAMOE_CHECK(cfg.topk_group >= 1 && cfg.topk_group <= cfg.n_group, kInvalidArgument,
                    "route: noaux_tc topk_group is ", cfg.topk_group,
                    "; it must be in [1, n_group = ", cfg.n_group, "].");
      MEGAMOE_CHECK(cfg.top_k <= cfg.topk_group * group_size, kInvalidArgument,
                    "route: noaux_tc top_k is ", cfg.top_k, " but the ", cfg.topk_group,
                    " kept groups hold only ", cfg.topk_group * group_size,
                    " experts; top_k must be <= topk_group x (num_experts / n_group).");
      MEGAMOE_CHECK(bias.empty() || static_cast<int64_t>(bias.size()) == E, kInvalidArgument,
                    "route: the correction bias holds ", bias.size(),
                    " values; it must be empty or hold num_experts (", E, ") values.");
      for (size_t e = 0; e < bias.size(); ++e) {
        MEGAMOE_CHECK(std::isfinite(bias[e]), kInvalidArgument, "route: the correction bias of "
                      "expert ", e, " is ", bias[e], "; it must be finite.");
      }
      route_noaux_tc(cfg, logits, E, bias, out);
      return out;
    }
  }
  MEGAMOE_FAIL(kInvalidArgument, "route: routing kind ", static_cast<int>(cfg.kind),
               " is unknown; allowed: softmax top-k (0) and noaux_tc (1).");
}

}  // namespace megamoe::reference
