// The configuration heuristic: a pure function of the problem and the token count.
//
// The tile's N side is tokens. Few tokens per expert (decode) means the layer streams weights
// and the mainloop is bound by the decode's instructions: a narrow N (16, 32 or 48, the
// narrowest that holds an average expert's tokens, or 32 where it means fewer tiles, i.e. fewer
// weight decodes) keeps the accumulator and the B stage small so 6-8 stage pipelines and 4-6
// CTAs per SM run. Many tokens per expert (prefill): two
// consumer warpgroups share a 128-token B tile, halving the B traffic per decoded weight and
// giving the tensor cores long wgmma runs; from 256 tokens per expert its warpgroups overlap
// each k16 step's decode with the previous step's wgmma (kOverlappedPrefillTile); where an
// expert's remainder past its 128-token tiles is usually short, the absorbing tile
// (kAbsorbingTile) folds it into the last tile; from 256 tokens per expert it runs every prefill
// (its four warpgroups share one B tile). Within a tile, each work item runs at the narrowest
// token width that holds its slots (the kernel's choice, not this heuristic's). On the 16- and
// 32-token tiles both GEMMs run as one persistent launch where L1's items end in a partial wave
// (0.6-4.5 waves of the 16-token tile's CTA slots, up to 4.8 of the 32-token tile's): L2 items
// fill the wave's idle slots.
#include <algorithm>
#include <cmath>
#include <optional>
#include <sstream>

#include "kernels/sm90/sm90_moe_token_tiles.h"
#include "megamoe/runtime.h"

namespace megamoe {

std::string GemmConfig::to_string() const {
  std::ostringstream os;
  os << "BLOCK_M=" << 64 * warpgroups << " BLOCK_N=" << block_n << " stages=" << stages;
  if (last_tile_extra > 0) os << " step=" << tile_step();
  if (k_splits > 1) os << " k_splits=" << k_splits;
  if (overlapped) os << " overlapped";
  return os.str();
}

std::string MoeConfig::to_string() const {
  return "L1{" + l1.to_string() + "} L2{" + l2.to_string() + "}" + (fused ? " fused" : "") +
         (early_start ? " early-start" : "");
}

bool can_start_early(const MoeProblem& problem, int64_t tokens) {
  const int64_t chunks = problem.intermediate_size > 0 ? problem.shared_intermediate_size / problem.intermediate_size : 0;
  return tokens * problem.top_k <= kEarlyStartMaxSelections &&
         tokens * (problem.top_k + chunks) <= kEarlyStartMaxSlots;
}

bool can_absorb(const MoeProblem& problem) {
  const int64_t rows_per_block = 64 * kAbsorbingTile.warpgroups;
  return (2 * problem.intermediate_size) % rows_per_block == 0 && problem.hidden_size % rows_per_block == 0;
}

bool MoeConfig::can_fuse() const {
  auto same_tile = [](const GemmConfig& a, const GemmConfig& b) {
    return a.warpgroups == b.warpgroups && a.block_n == b.block_n && a.stages == b.stages && a.overlapped == b.overlapped;
  };
  return same_tile(l1, l2) && (same_tile(l1, kFusedTile) || same_tile(l1, kFusedTile32));
}

namespace {

// Token tiles of an expert of c slots, as the dispatch kernel counts them.
double token_tiles(int64_t c, int block_n, int step) {
  return static_cast<double>(kernels::sm90::expert_token_tiles(c, block_n, step));
}

// E[token_tiles(c)] for c ~ Binomial(tokens, p): an expert's expected tiles.
double expected_tiles(int64_t tokens, double p, int block_n, int step) {
  if (tokens <= 0 || p <= 0.0) return 0.0;
  if (p >= 1.0) return token_tiles(tokens, block_n, step);
  const double n = static_cast<double>(tokens);
  // The terms past mean + 12 sigma are negligible; run() calls this, so the sum stays short.
  const double mean = n * p;
  const int64_t last = std::min<int64_t>(tokens, static_cast<int64_t>(mean + 12.0 * std::sqrt(mean) + 64.0));
  double sum = 0.0;
  for (int64_t c = 1; c <= last; ++c) {
    const double x = static_cast<double>(c);
    const double log_pmf = std::lgamma(n + 1) - std::lgamma(x + 1) - std::lgamma(n - x + 1) + x * std::log(p) +
                           (n - x) * std::log1p(-p);
    sum += std::exp(log_pmf) * token_tiles(c, block_n, step);
  }
  return sum;
}

}  // namespace

MoeConfig choose_moe_config(const MoeProblem& problem, int64_t tokens, int num_sms, std::optional<bool> fused,
                            std::optional<bool> absorbing_tile) {
  // Average rows of B per routed expert.
  const double per_expert = problem.num_experts > 0
                                ? static_cast<double>(tokens) * problem.top_k / problem.num_experts
                                : 0.0;
  GemmConfig decode = kFusedTile;
  // 32-token tile at six stages: eight (6.25 KiB each) fit only 4 CTAs in shared memory, six
  // fit the 5 its registers allow (DeepSeek-V3 T=640: 2649 -> 2361 us; Qwen3 T=384: 181 -> 172).
  GemmConfig decode32 = kFusedTile32;
  // Six stages, not eight: eight stages of a 48-token tile (8.25 KiB each) fit only 3 CTAs in an
  // SM's shared memory, six fit 4 (DeepSeek-V3 T=1024 on H200: 3326 -> 2827 us).
  GemmConfig decode48{1, 48, 6};
  GemmConfig middle{1, 64, 6};
  const GemmConfig prefill = kPrefillTile;
  auto pick = [&](int64_t m_tiles) {
    // Measured on H200 (DeepSeek-V3 / Qwen3-30B-A3B, uniform routing; docs/perf): each token
    // tile should hold an average expert's tokens in one piece (the weights are then decoded
    // once) while staying as narrow as that allows (the decode regime is instruction-bound).
    if (per_expert <= 16) return decode;    // 1..16 tokens (unfused, often 32: see below)
    if (per_expert <= 24) return decode32;  // T=768: 3705 -> 3081 us vs the 64-token tile
    if (per_expert <= 40) return decode48;  // T=1024: 4283 -> 3213 us vs the 32-token tile
    // 64-token tile, two chunks per wgmma round trip: at 48 tokens per expert 15-25% faster than
    // the 128-token tile (DeepSeek-V3 T=1536: 5040 -> 3836..4300 us, Qwen3 T=768: 332 -> 262
    // us), at 64 tokens 6-14% slower (T=2048: 5234 -> 5974 us).
    if (per_expert <= 48 || m_tiles % 2 != 0) return middle;
    // The two-warpgroup 128-token tile needs an even number of 64-row tiles.
    return prefill;
  };
  MoeConfig cfg;
  cfg.l1 = pick(2 * problem.intermediate_size / 64);
  cfg.l2 = pick(problem.hidden_size / 64);
  // Expected token tiles of width block_n per 64-row block (each decodes its weights once) under
  // uniform routing: an expert's token count is binomial, and each shared slice holds every
  // token. Counting one tile per expert with tokens put Qwen3-30B T=256 (16 tokens per expert:
  // 45% of experts need two tiles) at 3.9 waves, fused, where it has 5.6 and runs 1.9% faster in
  // two launches (H100: 179.7 -> 176.3 us).
  const double E = static_cast<double>(problem.num_experts);
  const double chunks = static_cast<double>(problem.shared_intermediate_size / problem.intermediate_size);
  auto expected_tile_count = [&](int block_n, int step) {
    return E * expected_tiles(tokens, problem.top_k / E, block_n, step) + chunks * token_tiles(tokens, block_n, step);
  };
  // Both GEMMs run the 16-token tile up to 16 tokens per expert (pick): its expected tiles decide
  // the launch and whether two launches take the 32-token tile.
  const bool decode_tile = cfg.can_fuse() && cfg.l1.block_n == kFusedTile.block_n;
  const double decode_tiles = decode_tile ? expected_tile_count(decode.block_n, decode.block_n) : 0.0;
  // The 32-token tile's expected tiles, summed at most once (run() calls this heuristic): both the
  // switch to that tile and its fusion window below need them.
  std::optional<double> decode32_tiles;
  auto decode32_tile_count = [&] {
    if (!decode32_tiles) decode32_tiles = expected_tile_count(decode32.block_n, decode32.block_n);
    return *decode32_tiles;
  };
  // Decode: both GEMMs in one persistent launch, where L1 ends in a partial wave of items that
  // L2 items can fill (they start as soon as their expert's L1 items are done). Measured on
  // H200 against two launches (docs/perf/2026-11-21-h200-w4a16-v6.md), in waves of L1 items
  // over the 16-token tile's CTA slots: DeepSeek-V3 T=2 (1.4 waves) 158 -> 144 us, T=4 (2.6)
  // 236 -> 228, Qwen3-30B T=4 (0.9) 46.9 -> 45.4, T=16 (2.5) 93.0 -> 87.7, T=64 (3.9) 124.4 ->
  // 121.6; but Qwen3 T=2 (0.5 waves: no tail to fill) 31.6 -> 33.3, DeepSeek-V3 T=16 (8 waves)
  // 688 -> 696 and T=64 1447 -> 1474.
  if (fused) {
    // On the tile pick() chose (the 16-token tile keeps it: no switch below). MoePlan::config
    // rejects a fused launch it cannot run.
    cfg.fused = *fused && cfg.can_fuse();
  } else if (decode_tile && num_sms > 0) {
    const double l1_items = decode_tiles * static_cast<double>(2 * problem.intermediate_size / 64);
    const double waves = l1_items / (static_cast<double>(num_sms) * kFusedTileCtasPerSm);
    cfg.fused = waves >= 0.6 && waves <= 4.5;
  }
  // Two launches: the 32-token tile wherever it decodes at least 1% fewer weights than the
  // 16-token tile, i.e. fewer tiles: an expert past 16 tokens (from 12 per expert on, over 10% of
  // them), and the shared slices, which take every token (DeepSeek-V3 T=256: 16 tiles per slice
  // instead of 8). An item of <= 16 tokens still runs at width 16 in the 32-token tile. H100,
  // interleaved, two rounds each (us, 16 -> 32): DeepSeek-V3 T=128 2154/2154 -> 2135/2134, T=192
  // 2232/2233 -> 2204/2204, T=256 2287/2284 -> 2248/2245, T=320 2332/2331 -> 2283/2286, T=384
  // 2396/2387 -> 2323/2328, T=512 2786/2819 -> 2406/2407; Qwen3-30B T=256 173.9/174.3 ->
  // 164.6/164.6; Kimi-K2 T=128 (1.1% fewer tiles) 2925/2926 -> 2909/2910, T=256 3302/3302 ->
  // 3256/3258; DeepSeek-V4-Flash T=128 1191/1191 -> 1183/1183. Fused, the 16-token tile stays
  // ahead (Qwen3-30B T=192, 12 per expert: 152.4 fused vs 159.2).
  if (decode_tile && !cfg.fused && decode32_tile_count() <= 0.99 * decode_tiles) {
    cfg.l1 = decode32;
    cfg.l2 = decode32;
  }
  // The 32-token tile fused as well, up to 4.8 waves of its L1 items over its CTA slots (5 per
  // SM): a small layer's L1 ends in a partial wave whose idle slots L2 items fill. H100,
  // interleaved, two rounds (us, two launches -> fused): Qwen3-30B T=224 (4.65 waves) 162.4/162.3
  // -> 158.3/158.4, T=256 (4.7) 163.2/163.6 -> 161.2/161.8, T=320 (4.7) 169.8/170.2 ->
  // 167.0/167.1, T=384 (4.9) 174.6/175.9 -> 174.2/174.6. At many waves the launch between the
  // GEMMs is a small part of the layer and fused runs slower (DeepSeek-V3 T=256, 25 waves:
  // 2246.7/2243.4 -> 2256.0/2255.5; T=512 2410.2/2400.0 -> 2429.6/2428.4).
  if (!fused && !cfg.fused && num_sms > 0 && cfg.can_fuse() && cfg.l1.block_n == kFusedTile32.block_n) {
    const double l1_items = decode32_tile_count() * static_cast<double>(2 * problem.intermediate_size / 64);
    const double waves = l1_items / (static_cast<double>(num_sms) * kFusedTile32CtasPerSm);
    cfg.fused = waves >= 0.6 && waves <= 4.8;
  }
  // One token: L2 has only (k + shared) * H/64 tiles of I/64 chunks, fewer than two per CTA slot
  // (DeepSeek-V3: 1008 for 660 slots on an H200), so two K slices per tile give the CTAs twice
  // as many, shorter, items (H200, us, 1 vs 2 slices: DeepSeek-V3 T=1 97.5 / 94.6; Qwen3-30B T=1
  // 29.8 / 28.0). The slices add into the fp32 accumulator, so the fixed-order (deterministic)
  // combine keeps whole tiles.
  //
  // Up to early start's batch size (T * k <= 32), long L2 items split as well where each slice
  // keeps at least 16 chunks (I >= 2048): the layer ends in a tail of L2 items on fewer and fewer
  // CTAs, and halving the items halves it. H100, interleaved, two rounds (us, 1 -> 2 slices):
  // DeepSeek-V3 T=2 159.7/159.6 -> 158.0/159.5, T=3 207.5/207.7 -> 205.5/205.8, T=4
  // 270.8/271.0 -> 268.7/269.0. With short items a split adds more per-item cost than it saves
  // (Qwen3-30B, 6-chunk slices: T=2 32.7/32.6 -> 33.1/32.8, T=4 44.4/44.4 -> 45.1/45.0), and from
  // 8 or more items per CTA slot the claimed items balance the CTAs anyway (H200, us, 1 vs 2
  // slices: DeepSeek-V3 T=16 751 / 776, T=64 1574 / 1634).
  const bool long_l2_items = problem.intermediate_size / 64 / 2 >= 16;
  if ((tokens == 1 || (long_l2_items && can_start_early(problem, tokens))) && !problem.deterministic &&
      problem.intermediate_size % 128 == 0) {
    cfg.l2.k_splits = 2;
  }
  // A tiny batch's L1 CTAs start their first items while the dispatch kernel runs: its ~4.4 us
  // and the hand-off leave the critical path (sm90_w4a16_grouped_gemm.cuh).
  cfg.early_start = can_start_early(problem, tokens);
  // The absorbing tile in both GEMMs where a remainder of up to 32 tokens per expert is common:
  // the 128-token tile then runs it as an item of its own, which decodes every weight again. Both
  // GEMMs: at DeepSeek-V3 T=4096 (H200, us, two rounds) the 128-token tile ran 6587/6575, the
  // absorbing tile in L1 only 6267/6213, in L2 only 6521/6548, in both 6031/6025.
  // Long K (H >= 4096, I >= 2048): where it saves tiles (15% or more), or from 256 tokens per
  // expert, where most items are whole 128-token tiles: with its stages passed by mbarriers (v18)
  // its K loop runs long items at 92% of the tensor rate against the overlapped 128-token tile's
  // 80-87% (megamoe_mainloop_probe), and DeepSeek-V3 T=16384 (512 +- 23 per expert, 9% fewer
  // tiles) ran 20205/20325 -> 19259/19234 us (H100, two rounds). It ran 1% slower there before
  // v18, and at 64 tokens per expert its widths (128, 160) would double the wgmma columns.
  // Short K (Qwen3: L2's K = I = 768 or 1536): its one CTA per SM has no other CTA to cover an
  // item's fill and epilogue, which short items make frequent: where it saves a quarter of the
  // tiles (around 128-160 tokens per expert), or from 256 per expert. H100, two rounds (us,
  // 128-token tile -> absorbing): Qwen3-30B T=2048 / 2304 / 2560 (128 / 144 / 160 per expert:
  // 0.68 / 0.57 / 0.74 of the tiles) 404.8/402.9 -> 374.1/372.4, 477.0/477.1 -> 430.8/426.1,
  // 504.8/509.6 -> 494.7/493.0; Qwen3-235B 1330.3/1324.2 -> 1148.9/1146.3, 1535.3/1617.5 ->
  // 1261.0/1254.1, 1653.4/1655.4 -> 1550.4/1551.0 (docs/perf/2026-11-22-h100-w4a16-v21.md).
  // From 256 per expert since the staged L1 epilogue (v22): Qwen3-30B T=4096 / 8192 / 16384
  // 662.6/664.3 -> 641.6/639.7, 1270.9/1273.0 -> 1260.6/1267.7, 2619.6/2617.1 -> 2534.1/2520.7,
  // T=6144 956 -> 956; Qwen3-235B T=4096 / 8192 2216.9/2293.4 -> 2040.1/2114.7, 4374.6/4406.4 ->
  // 4208.7/4186.2, T=16384 8567/8439 -> 8599/8489. Below 256 where it saves fewer it still loses:
  // Qwen3-30B T=1024 / 1536 / 3072 (64 / 96 / 192 per expert) 246/295/536 -> 289/309/570,
  // Qwen3-235B T=1024 / 3072 786/1805 -> 908/1914 (docs/perf/2026-11-22-h100-w4a16-v22.md).
  if (!absorbing_tile && cfg.l1.block_n == prefill.block_n && cfg.l2.block_n == prefill.block_n &&
      can_absorb(problem)) {
    const double tiles = expected_tile_count(prefill.block_n, prefill.block_n);
    const double absorbed = expected_tile_count(kAbsorbingTile.block_n, kAbsorbingTile.tile_step());
    const bool long_k = problem.hidden_size >= 4096 && problem.intermediate_size >= 2048;
    if (absorbed <= (long_k ? 0.85 : 0.75) * tiles || per_expert >= 256) {
      cfg.l1 = kAbsorbingTile;
      cfg.l2 = kAbsorbingTile;
    }
  }
  // The 128-token tile's overlapped K loop from 256 tokens per expert: each warpgroup decodes a
  // k16 step while its previous step's wgmma runs, instead of decoding a chunk and then waiting
  // for its wgmmas. Its two token widths (64, 128) waste more of an expert's last tile than the
  // plain tile's four (32 .. 128), which costs most where an expert has one or two tiles. H100,
  // interleaved, two rounds (us, plain -> overlapped): DeepSeek-V3 routed T=16384 (512 per
  // expert) 21298/21406 -> 20165/20131, Qwen3-30B T=4096 (256) 715.5/715.1 -> 697.5/696.9,
  // T=16384 (1024) 2632/2687 -> 2676/2691; but Qwen3-30B T=1024 (64) 255.8/256.8 -> 270.9/269.8.
  if (cfg.l1.block_n == prefill.block_n && cfg.l1.last_tile_extra == 0 && cfg.l2.block_n == prefill.block_n &&
      per_expert >= 256) {
    cfg.l1 = kOverlappedPrefillTile;
    cfg.l2 = kOverlappedPrefillTile;
  }
  // MoeTuning::absorbing_tile = true: the absorbing tile in both GEMMs at any T (two launches,
  // no early start; L2 keeps the heuristic's K slices). false left it out above.
  if (absorbing_tile && *absorbing_tile && can_absorb(problem)) {
    const int l2_k_splits = cfg.l2.k_splits;
    cfg.l1 = kAbsorbingTile;
    cfg.l2 = kAbsorbingTile;
    cfg.l2.k_splits = l2_k_splits;
    cfg.fused = false;
    cfg.early_start = false;
  }
  return cfg;
}

}  // namespace megamoe
