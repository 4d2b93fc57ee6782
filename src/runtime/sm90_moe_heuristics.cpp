// The configuration heuristic: a pure function of the problem and the token count.
//
// The tile's N side is tokens. Few tokens per expert (decode) means the layer streams weights:
// a narrow N (16, or 32 up to 32 tokens per expert) keeps the accumulator and the B stage small
// so deep pipelines (8 stages) and several CTAs per SM keep enough weight bytes in flight. Many
// tokens per expert (prefill) means MMA-bound: two consumer warpgroups share a 128-token B tile,
// halving the B traffic per decoded weight and giving the tensor cores long wgmma runs.
#include <sstream>

#include "megamoe/runtime.h"

namespace megamoe {

std::string GemmConfig::to_string() const {
  std::ostringstream os;
  os << "BLOCK_M=" << 64 * warpgroups << " BLOCK_N=" << block_n << " stages=" << stages;
  if (k_splits > 1) os << " k_splits=" << k_splits;
  return os.str();
}

std::string MoeConfig::to_string() const {
  return "L1{" + l1.to_string() + "} L2{" + l2.to_string() + "}";
}

MoeConfig choose_moe_config(const MoeProblem& problem, int64_t tokens) {
  // Average rows of B per routed expert.
  const double per_expert = problem.num_experts > 0
                                ? static_cast<double>(tokens) * problem.top_k / problem.num_experts
                                : 0.0;
  GemmConfig decode{1, 16, 8};
  GemmConfig decode32{1, 32, 8};
  GemmConfig middle{1, 64, 6};
  GemmConfig prefill{2, 128, 4};
  auto pick = [&](int64_t m_tiles) {
    if (per_expert <= 16) return decode;
    // Measured on H200 (commit 97c5d2f + this tile): 24 tokens per expert, DeepSeek-V3 T=768
    // 3705 -> 3081 us and Qwen3-30B-A3B T=384 246 -> 184 us against the 64-token tile; equal at
    // 32 per expert (T=1024), where ragged experts spill into a second 32-token tile.
    if (per_expert <= 32) return decode32;
    // From 64 tokens per expert the two-warpgroup 128-token tile is 16-21% faster than the
    // 64-token one (measured at da380c4); that tile needs an even number of 64-row tiles.
    if (m_tiles % 2 != 0) return middle;
    return prefill;
  };
  MoeConfig cfg;
  cfg.l1 = pick(2 * problem.intermediate_size / 64);
  cfg.l2 = pick(problem.hidden_size / 64);
  // Decode: L2 has E_active * H/64 tiles of only I/64 chunks each, which leaves a ragged last
  // wave over the persistent CTAs; two K slices per tile even it out. The slices add into the
  // fp32 accumulator, so the fixed-order (deterministic) combine keeps whole tiles. Each slice
  // keeps at least 16 chunks: shorter work items pay their pipeline fill and schedule lookup
  // for too little streaming (Qwen3-30B-A3B, I = 768: 6-chunk slices ran L2 at 1.2 TB/s).
  if (per_expert <= 16 && !problem.deterministic && problem.intermediate_size % 128 == 0 &&
      problem.intermediate_size / 64 >= 2 * 16) {
    cfg.l2.k_splits = 2;
  }
  return cfg;
}

}  // namespace megamoe
