// The configuration heuristic (sm90_w4a16_heuristics.h): a pure function of the problem, the
// token count, the plan's SMs and the device's figures. The tile's N side is tokens.
// - Few tokens per expert (decode): the layer streams weights and the mainloop is bound by the
//   decode's instructions, so the tile is the narrowest that holds an average expert's tokens in
//   one piece (each weight is then decoded once): small accumulators and B stages leave room for
//   deep pipelines and 4-6 CTAs per SM.
// - Many tokens per expert (prefill): two or four warpgroups share one B tile (less B traffic per
//   decoded weight, long wgmma runs); from many tokens per expert the K loop overlaps each k16
//   step's decode with the previous step's wgmma, and where an expert's remainder past its
//   128-token tiles is short the absorbing tile folds it into the last tile.
// - Where these prefill tiles start depends on the device's DRAM bytes per SM clock (one row of
//   kBalanceRows per measured balance): the more bytes the SMs must decode per clock, the fewer
//   tokens per expert the tiles that spend fewer SM instructions per weight need to pay.
// - On the 16- and 32-token tiles both GEMMs run as one persistent launch where L1's items end in
//   a partial wave that L2 items can fill.
// Within a tile, each work item runs at the narrowest token width that holds its slots (the
// kernel's choice). Every threshold below was measured; docs/perf/README.md indexes the records.
#include <algorithm>
#include <cmath>
#include <optional>
#include <sstream>

#include "backends/sm90_w4a16/sm90_w4a16_heuristics.h"

#include "backends/sm90_w4a16/sm90_w4a16_l1_split.h"
#include "kernels/sm90/sm90_moe_token_tiles.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "backends/sm90_w4a16/sm90_w4a16_tiles.h"

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
         (fused_ctas_per_sm > 0 ? " ctas/SM=" + std::to_string(fused_ctas_per_sm) : "") +
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

double DeviceFigures::dram_bytes_per_sm_clock() const {
  return sms > 0 && sm_clock_hz > 0 ? dram_bytes_per_s / (sms * sm_clock_hz) : 0.0;
}

int find_tile_by_name(const std::string& name) {
  for (int i = 0; i < kW4a16TileCount; ++i) {
    if (name == kW4a16Tiles[i].name) return i;
  }
  return -1;
}

bool MoeConfig::can_fuse() const {
  const int tile = find_w4a16_tile(l1);
  return l1.same_tile(l2) && tile >= 0 && kW4a16Tiles[tile].fusable;
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

namespace {

// Average rows of B per routed expert.
double tokens_per_expert(const MoeProblem& problem, int64_t tokens) {
  return problem.num_experts > 0 ? static_cast<double>(tokens) * problem.top_k / problem.num_experts : 0.0;
}

// Expected token tiles of width block_n per 64-row block (each decodes its weights once) under
// uniform routing: an expert's token count is binomial, and each shared slice holds every token.
// (One tile per expert with tokens undercounts where many experts need two, and put layers in
// the fused window that ran faster in two launches.)
double expected_tile_count(const MoeProblem& problem, int64_t tokens, int block_n, int step) {
  const double E = static_cast<double>(problem.num_experts);
  const double chunks = static_cast<double>(problem.shared_intermediate_size / problem.intermediate_size);
  return E * expected_tiles(tokens, problem.top_k / E, block_n, step) + chunks * token_tiles(tokens, block_n, step);
}

// Waves of L1 items over the CTA slots of a fused tile.
double l1_waves(const MoeProblem& problem, int num_sms, double tiles, int ctas_per_sm) {
  const double l1_items = tiles * static_cast<double>(2 * problem.intermediate_size / 64);
  return l1_items / (static_cast<double>(num_sms) * ctas_per_sm);
}

}  // namespace

double DecodeTileCounts::tiles16() {
  if (!tiles16_) tiles16_ = expected_tile_count(problem_, tokens_, kFusedTile.block_n, kFusedTile.block_n);
  return *tiles16_;
}

double DecodeTileCounts::tiles32() {
  if (!tiles32_) tiles32_ = expected_tile_count(problem_, tokens_, kFusedTile32.block_n, kFusedTile32.block_n);
  return *tiles32_;
}

namespace {

// Tokens per expert up to which a GEMM takes each tile; past the last, the two-warpgroup
// 128-token tile.
struct WidthCutoffs {
  double decode16, decode32, decode48, middle64;
};

// A threshold for long-K layers (H >= 4096, I >= 2048: DeepSeek-V3's, Kimi-K2's) and for the others
// (Qwen3's).
struct PerK {
  double long_k, short_k;
};

// The prefill choices measured on one balance of DRAM rate to SM issue (nominal DRAM bytes per SM
// clock): the steps width_tiles, absorbing_pays and overlap_prefill read their thresholds here.
struct BalanceRow {
  double min_bytes_per_sm_clock;  // the row applies from this balance up
  WidthCutoffs l1, l2;
  PerK absorbing_from;  // tokens per expert from which the absorbing tile runs (absorbing_pays)
  PerK overlap_from;    // tokens per expert from which the 128-token tile overlaps its K loop
  bool balance_fused_l1;  // fused_ctas_per_sm caps the fused launch's grid
  bool split_l1;          // l1_k_splits splits a sparse L1 in K
};

// One row per measured balance, ascending; a device takes the last row at or below its balance.
// - H100 SXM (3.35 TB/s over 132 SMs at 1980 MHz: 12.8 B per SM clock), where every choice
//   through docs/perf v29 was measured.
// - H200 (4.9 TB/s nominal, 132 SMs, 1980 MHz: 18.8; its measured 4.2 TB/s copy gives 16.1), from
//   docs/perf/2026-11-29-h200-w4a16-v36.md: there the SMs, not DRAM, bound the middle batches, and
//   the tiles that spend fewer SM instructions per weight pay from fewer tokens per expert: the
//   two-warpgroup 128-token tile from 40 (not 48), the absorbing tile from 96 at long K (not
//   256), the overlapped K loop from 96 at short K (not 256); and the fused launch's grid capped at
//   L1's share per SM (docs/perf/2026-11-29-h200-w4a16-v39.md; not measured on the H100); L1
//   split in K where it has fewer than two items per SM (docs/perf/2026-11-29-h200-w4a16-v41.md,
//   from v34's timeline; not yet measured, not on the H100).
// The boundary, 15, lies between the two devices' balances.
inline constexpr BalanceRow kBalanceRows[] = {
    {0.0, {16, 24, 40, 48}, {16, 24, 40, 48}, {256, 256}, {256, 256}, false, false},
    {15.0, {16, 24, 40, 40}, {16, 24, 40, 40}, {96, 256}, {256, 96}, true, true},
};

const BalanceRow& balance_row(const DeviceFigures& device) {
  const double balance = device.dram_bytes_per_sm_clock();
  const BalanceRow* row = &kBalanceRows[0];
  for (const BalanceRow& r : kBalanceRows) {
    if (balance >= r.min_bytes_per_sm_clock) row = &r;
  }
  return *row;
}

bool long_k(const MoeProblem& problem) { return problem.hidden_size >= 4096 && problem.intermediate_size >= 2048; }

double per_k(const PerK& t, const MoeProblem& problem) { return long_k(problem) ? t.long_k : t.short_k; }

}  // namespace

namespace heuristic {

// Each token tile holds an average expert's tokens in one piece (the weights are then decoded
// once) and is as narrow as that allows: the decode regime is instruction-bound, and a wider tile
// than needed pays wgmma columns and registers (fewer CTAs) for nothing. The 64-token tile (two
// chunks per wgmma round trip) beats the 128-token tile up to 48 tokens per expert, not at 64
// (H200 records v2-v7) on the H100; on the H200 only up to 40 (v36). The cut-offs are the
// device's row of kBalanceRows.
MoeConfig width_tiles(const MoeProblem& problem, int64_t tokens, const DeviceFigures& device) {
  const double per_expert = tokens_per_expert(problem, tokens);
  const BalanceRow& row = balance_row(device);
  auto pick = [&](const WidthCutoffs& c, int64_t m_tiles) {
    if (per_expert <= c.decode16) return kFusedTile;  // two launches often take the 32-token tile: below
    if (per_expert <= c.decode32) return kFusedTile32;
    if (per_expert <= c.decode48) return kDecode48Tile;
    // The two-warpgroup 128-token tile needs an even number of 64-row tiles.
    if (per_expert <= c.middle64 || m_tiles % 2 != 0) return kMiddleTile;
    return kPrefillTile;
  };
  MoeConfig cfg;
  cfg.l1 = pick(row.l1, 2 * problem.intermediate_size / 64);
  cfg.l2 = pick(row.l2, problem.hidden_size / 64);
  return cfg;
}

// Both GEMMs in one persistent launch where L1 ends in a partial wave of items that L2 items can
// fill (they start as soon as their expert's L1 items are done). Below ~0.6 waves there is no tail
// to fill; past ~4.5 waves the launch gap between the GEMMs is a small part of the layer and the
// fused kernel's hand-off costs more (docs/perf/2026-11-21-h200-w4a16-v6.md).
bool fuse_decode16(const MoeProblem& problem, int num_sms, const MoeConfig& cfg, DecodeTileCounts& tiles) {
  if (!cfg.can_fuse() || cfg.l1.block_n != kFusedTile.block_n || num_sms <= 0) return false;
  const double waves = l1_waves(problem, num_sms, tiles.tiles16(), kFusedTileCtasPerSm);
  return waves >= 0.6 && waves <= 4.5;
}

// The 32-token tile wherever it decodes at least 1% fewer weights than the 16-token tile, i.e.
// has fewer tiles: experts past 16 tokens, and the shared slices, which take every token. An item
// of <= 16 tokens still runs at width 16 in the 32-token tile. Fused, the 16-token tile stays.
void widen_unfused_decode(MoeConfig& cfg, DecodeTileCounts& tiles) {
  if (cfg.fused || !cfg.can_fuse() || cfg.l1.block_n != kFusedTile.block_n) return;
  if (tiles.tiles32() <= 0.99 * tiles.tiles16()) {
    cfg.l1 = kFusedTile32;
    cfg.l2 = kFusedTile32;
  }
}

// Up to 4.8 waves of the 32-token tile's L1 items: a small layer's L1 ends in a partial wave whose
// idle slots L2 items fill; at many waves the launch between the GEMMs is a small part of the
// layer and the fused kernel runs slower.
bool fuse_decode32(const MoeProblem& problem, int num_sms, const MoeConfig& cfg, DecodeTileCounts& tiles) {
  if (!cfg.can_fuse() || cfg.l1.block_n != kFusedTile32.block_n || num_sms <= 0) return false;
  const double waves = l1_waves(problem, num_sms, tiles.tiles32(), kFusedTile32CtasPerSm);
  return waves >= 0.6 && waves <= 4.8;
}

// The block scheduler hands a grid's CTAs to the GPCs in turn, so a GPC with fewer SMs fills its
// SMs first: with the full occupancy (six CTAs per SM on the 16-token tile), L1's first wave, the
// lowest CTA indices, put six L1 items on each SM of the smallest GPC and three or four on the
// others, and since every expert's L2 waits for all its L1 tiles, the layer waited for those
// SMs (DeepSeek-V3 routed T = 1 on the H200: L1 ended at 41 us on SMs with four items, 62 us on
// the seven with six; docs/perf/2026-11-29-h200-w4a16-v34.md). A grid of L1's items per SM,
// rounded up, below the occupancy is spread evenly (v34's grids of that kind held at most that
// many CTAs on any SM); the L2 items follow on the CTAs L1 frees (DeepSeek-V3
// routed T = 1: 78.4 -> 71.5 us at four, 73.1 at five; docs/perf/2026-11-29-h200-w4a16-v39.md).
// Only from four: with fewer L1 items per SM the CTAs past them start L2 items at once
// (prefetching their weights, starting as their experts' L1 ends), which pays more than the
// balance (Qwen3-30B-A3B forced fused, T = 1 at two per SM: 24.0 capped against 22.6 us; T = 2 at
// three: 27.5 against 27.0-27.3).
int fused_ctas_per_sm(const MoeProblem& problem, int num_sms, const MoeConfig& cfg, DecodeTileCounts& tiles,
                      const DeviceFigures& device) {
  constexpr int kMinShare = 4;
  if (!cfg.fused || num_sms <= 0 || !balance_row(device).balance_fused_l1) return 0;
  const bool tile16 = cfg.l1.block_n == kFusedTile.block_n;
  const int occupancy = tile16 ? kFusedTileCtasPerSm : kFusedTile32CtasPerSm;
  // L1 split in K: each slice is an item.
  const double items = (tile16 ? tiles.tiles16() : tiles.tiles32()) * static_cast<double>(2 * problem.intermediate_size / 64) *
                       cfg.l1.k_splits;
  const int share = static_cast<int>(std::ceil(items / num_sms - 1e-9));
  return share >= kMinShare && share < occupancy ? share : 0;
}

// Two K slices for L2 (adding into the fp32 accumulator, so not with the fixed-order combine):
// - one token: L2 has only (k + shared) * H/64 tiles, fewer than two per CTA slot, so slices give
//   the CTAs twice as many, shorter, items;
// - up to early start's batch size, where each slice keeps at least 16 chunks (I >= 2048): the
//   layer ends in a tail of L2 items on fewer and fewer CTAs, and halving the items halves it.
//   Short items gain less than the per-item cost, and from ~8 items per CTA slot the claimed
//   items balance the CTAs anyway.
int l2_k_splits(const MoeProblem& problem, int64_t tokens) {
  const bool long_l2_items = problem.intermediate_size / 64 / 2 >= 16;
  const bool small = tokens == 1 || (long_l2_items && can_start_early(problem, tokens));
  return small && !problem.deterministic && problem.intermediate_size % 128 == 0 ? 2 : 1;
}

// L1 split in two K slices, the tile's last-arriving slice running the SwiGLU
// (sm90_w4a16_l1_split.h), where L1's expected items are fewer than four per SM and each slice
// keeps at least 3584 of K. Below four items per SM the fused decode grid runs fewer CTAs than the
// occupancy allows (v39's cap), and the split's twice as many half items fill it; a slice of 28 or
// more 128-wide K blocks amortizes the split's partial stores and last-arriver epilogue. Measured
// on the H200 (docs/perf/2026-11-29-h200-w4a16-v41.md, --l1-k-splits 1 vs 2, two rounds):
// DeepSeek-V3 routed T = 1 (3.9 items per SM, K = 7168) 71.4 -> 67.5 us; slower by 3% at T = 2
// and 4 (7.8 and 15 per SM); Qwen3-235B-A22B T = 1 (2.9 per SM, K = 4096) and Qwen3-30B-A3B
// T = 1 (1.5 per SM, K = 2048) slower by 1.5% and 4%. Only the decode tiles split (l1_splits),
// within the workspace's slots, with K in an even number of chunks; the H100's row keeps L1 whole.
// Not in deterministic mode (as l2_k_splits): the split groups a tile's fp32 sum differently from
// the unsplit item, and chosen per T it would make a token's bits depend on the batch's size (a
// batch beyond max_tokens, run in chunks, would differ from the same batch run whole);
// MoeTuning::l1_k_splits still splits a deterministic layer.
int l1_k_splits(const MoeProblem& problem, int64_t tokens, int num_sms, const MoeConfig& cfg, DecodeTileCounts& tiles,
                const DeviceFigures& device) {
  constexpr int kSplits = 2;
  constexpr double kMaxItemsPerSm = 4.0;
  constexpr int64_t kMinSliceK = 3584;
  const int tile = find_w4a16_tile(cfg.l1);
  const int64_t slots =
      tokens * (problem.top_k + problem.shared_intermediate_size / std::max<int64_t>(problem.intermediate_size, 1));
  if (problem.deterministic || !balance_row(device).split_l1 || num_sms <= 0 || tile < 0 ||
      !l1_splits(kW4a16Tiles[tile]) || problem.hidden_size / kSplits < kMinSliceK ||
      !w4a16_split::can_split(problem.hidden_size, slots, kSplits)) {
    return 1;
  }
  const bool tile16 = cfg.l1.block_n == kFusedTile.block_n;
  const double items = (tile16 ? tiles.tiles16() : tiles.tiles32()) * static_cast<double>(2 * problem.intermediate_size / 64);
  return items < kMaxItemsPerSm * num_sms ? kSplits : 1;
}

// The absorbing tile in both GEMMs where a remainder of up to 32 tokens per expert is common: the
// 128-token tile would run it as an item of its own, decoding every weight again; in both GEMMs,
// since each gains (docs/perf/2026-11-21-h100-w4a16-v18.md).
// - Long K (H >= 4096, I >= 2048): where it saves 15% of the tiles, or from the row's
//   absorbing_from tokens per expert, where most items are whole tiles and its
//   mbarrier-passed K loop reaches a higher share of the tensor rate than the 128-token tiles (H100:
//   from 256; H200: from 96, 2-3% faster than both 128-token tiles at 96 per expert and 3-5%
//   slower at 64, v36).
// - Short K (Qwen3's L2): its one CTA per SM has no other CTA to cover an item's fill and
//   epilogue, which short items make frequent: only where it saves a quarter of the tiles, or from
//   the row's 256 tokens per expert (docs/perf/2026-11-22-h100-w4a16-v21.md, -v22.md; on the H200 too: the
//   overlapped 128-token tile beats it by 2% at 96 and 7% at 192 per expert, v36).
bool absorbing_pays(const MoeProblem& problem, int64_t tokens, const MoeConfig& cfg, const DeviceFigures& device) {
  if (cfg.l1.block_n != kPrefillTile.block_n || cfg.l2.block_n != kPrefillTile.block_n || !can_absorb(problem)) {
    return false;
  }
  const double tiles = expected_tile_count(problem, tokens, kPrefillTile.block_n, kPrefillTile.block_n);
  const double absorbed = expected_tile_count(problem, tokens, kAbsorbingTile.block_n, kAbsorbingTile.tile_step());
  return absorbed <= (long_k(problem) ? 0.85 : 0.75) * tiles ||
         tokens_per_expert(problem, tokens) >= per_k(balance_row(device).absorbing_from, problem);
}

// From the row's overlap cut-off each warpgroup decodes a k16 step while its previous step's wgmma
// runs. Its two token widths (64, 128) waste more of an expert's last tile than the plain tile's
// four (32 .. 128), which costs most where an expert has one or two tiles: on the H100 it pays
// from 256 tokens per expert; on the H200 at short K from 96 (Qwen3-30B-A3B: 2.6% faster at 96
// and 2.8% at 192 per expert, 5-6% slower at 48 and 64, v36).
void overlap_prefill(const MoeProblem& problem, int64_t tokens, MoeConfig& cfg, const DeviceFigures& device) {
  if (cfg.l1.block_n == kPrefillTile.block_n && cfg.l1.last_tile_extra == 0 &&
      cfg.l2.block_n == kPrefillTile.block_n &&
      tokens_per_expert(problem, tokens) >= per_k(balance_row(device).overlap_from, problem)) {
    cfg.l1 = kOverlappedPrefillTile;
    cfg.l2 = kOverlappedPrefillTile;
  }
}

}  // namespace heuristic

MoeConfig choose_moe_config(const MoeProblem& problem, int64_t tokens, int num_sms, const DeviceFigures& device) {
  MoeConfig cfg = heuristic::width_tiles(problem, tokens, device);
  DecodeTileCounts tiles(problem, tokens);
  cfg.fused = heuristic::fuse_decode16(problem, num_sms, cfg, tiles);
  heuristic::widen_unfused_decode(cfg, tiles);
  if (!cfg.fused) cfg.fused = heuristic::fuse_decode32(problem, num_sms, cfg, tiles);
  cfg.l2.k_splits = heuristic::l2_k_splits(problem, tokens);
  cfg.l1.k_splits = heuristic::l1_k_splits(problem, tokens, num_sms, cfg, tiles, device);
  cfg.fused_ctas_per_sm = heuristic::fused_ctas_per_sm(problem, num_sms, cfg, tiles, device);
  // A tiny batch's L1 CTAs start their first items while the dispatch kernel runs: the dispatch
  // (one CTA) and the hand-off leave the critical path (sm90_w4a16_scheduler.cuh, early start).
  cfg.early_start = can_start_early(problem, tokens);
  if (heuristic::absorbing_pays(problem, tokens, cfg, device)) {
    cfg.l1 = kAbsorbingTile;
    cfg.l2 = kAbsorbingTile;
  }
  heuristic::overlap_prefill(problem, tokens, cfg, device);
  return cfg;
}

}  // namespace megamoe
