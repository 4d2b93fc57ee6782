// MoeTuning's overrides of the (sm_90, w4a16) heuristic: tuned_moe_config runs the heuristic's
// steps with the overridden choices fixed, moe_config rejects an override that cannot run. Also
// the device figures the heuristic reads (current_device_figures).
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <string>

#include "backends/sm90_w4a16/sm90_w4a16_heuristics.h"
#include "backends/sm90_w4a16/sm90_w4a16_l1_split.h"
#include "megamoe/gpu.h"
#include "megamoe/status.h"

namespace megamoe {

namespace {

DeviceFigures query_device_figures(int device) {
  auto attribute = [device](cudaDeviceAttr attr, const char* what) {
    int value = 0;
    gpu::check_cuda(cudaDeviceGetAttribute(&value, attr, device), what);
    return value;
  };
  DeviceFigures f;
  f.sms = attribute(cudaDevAttrMultiProcessorCount, "cudaDeviceGetAttribute(multiProcessorCount)");
  // kHz; DDR: two transfers per clock over a bus of that many bits.
  const double memory_clock_hz = 1e3 * attribute(cudaDevAttrMemoryClockRate, "cudaDeviceGetAttribute(memoryClockRate)");
  const double bus_bytes = attribute(cudaDevAttrGlobalMemoryBusWidth, "cudaDeviceGetAttribute(globalMemoryBusWidth)") / 8.0;
  f.dram_bytes_per_s = 2.0 * memory_clock_hz * bus_bytes;
  f.sm_clock_hz = 1e3 * attribute(cudaDevAttrClockRate, "cudaDeviceGetAttribute(clockRate)");
  f.l2_bytes = attribute(cudaDevAttrL2CacheSize, "cudaDeviceGetAttribute(l2CacheSize)");
  return f;
}

// The table's tile names, for the error messages.
std::string tile_names() {
  std::string names;
  for (const W4a16TileEntry& e : kW4a16Tiles) names += (names.empty() ? "" : ", ") + std::string(e.name);
  return names;
}

// Whether a named tile's row blocks divide a GEMM's rows.
bool tile_fits(int tile, int64_t rows) { return tile >= 0 && rows % (64 * kW4a16Tiles[tile].config.warpgroups) == 0; }

}  // namespace

DeviceFigures current_device_figures() {
  int device = 0;
  gpu::check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  // run() asks at every call: each device is queried once.
  constexpr int kCachedDevices = 64;
  static std::once_flag once[kCachedDevices];
  static DeviceFigures cached[kCachedDevices];
  if (device < 0 || device >= kCachedDevices) return query_device_figures(device);
  std::call_once(once[device], [device] { cached[device] = query_device_figures(device); });
  return cached[device];
}

MoeConfig tuned_moe_config(const MoeProblem& problem, int64_t tokens, int num_sms, const DeviceFigures& device,
                           const MoeTuning& tuning) {
  MoeConfig cfg = heuristic::width_tiles(problem, tokens, device);
  DecodeTileCounts tiles(problem, tokens);
  if (tuning.fused) {
    // On the tile width_tiles chose; a fused launch keeps the 16-token tile.
    cfg.fused = *tuning.fused && cfg.can_fuse();
    heuristic::widen_unfused_decode(cfg, tiles);
  } else {
    cfg.fused = heuristic::fuse_decode16(problem, num_sms, cfg, tiles);
    heuristic::widen_unfused_decode(cfg, tiles);
    if (!cfg.fused) cfg.fused = heuristic::fuse_decode32(problem, num_sms, cfg, tiles);
  }
  cfg.l2.k_splits = heuristic::l2_k_splits(problem, tokens);
  cfg.l1.k_splits = heuristic::l1_k_splits(problem, tokens, num_sms, cfg, tiles, device);
  cfg.early_start = can_start_early(problem, tokens);
  if (!tuning.absorbing_tile && heuristic::absorbing_pays(problem, tokens, cfg, device)) {
    cfg.l1 = kAbsorbingTile;
    cfg.l2 = kAbsorbingTile;
  }
  heuristic::overlap_prefill(problem, tokens, cfg, device);
  // The absorbing tile at any T: two launches, no early start; L2 keeps its K slices.
  if (tuning.absorbing_tile && *tuning.absorbing_tile && can_absorb(problem)) {
    const int l2_k_splits = cfg.l2.k_splits;
    cfg.l1 = kAbsorbingTile;
    cfg.l2 = kAbsorbingTile;
    cfg.l2.k_splits = l2_k_splits;
    cfg.fused = false;
    cfg.early_start = false;
  }
  // Named tiles, where they fit the GEMM's rows: two launches unless `fused` asks for one and both
  // GEMMs took one fusable tile; no early start; L2 keeps its K slices.
  if (tuning.l1_tile || tuning.l2_tile) {
    auto named = [](const std::optional<std::string>& name, const GemmConfig& chosen, int64_t rows) {
      const int tile = name ? find_tile_by_name(*name) : -1;
      return tile_fits(tile, rows) ? kW4a16Tiles[tile].config : chosen;
    };
    const int l2_k_splits = cfg.l2.k_splits;
    cfg.l1 = named(tuning.l1_tile, cfg.l1, 2 * problem.intermediate_size);
    cfg.l2 = named(tuning.l2_tile, cfg.l2, problem.hidden_size);
    cfg.l2.k_splits = l2_k_splits;
    cfg.fused = tuning.fused.value_or(false) && cfg.can_fuse();
    cfg.early_start = false;
  }
  if (tuning.early_start) cfg.early_start = *tuning.early_start;
  // L1's K slices where its tile splits (the named tiles and the absorbing tile above start whole).
  if (tuning.l1_k_splits) {
    const int tile = find_w4a16_tile(cfg.l1);
    cfg.l1.k_splits = tile >= 0 && l1_splits(kW4a16Tiles[tile]) ? *tuning.l1_k_splits : 1;
  }
  cfg.fused_ctas_per_sm = heuristic::fused_ctas_per_sm(problem, num_sms, cfg, tiles, device);
  // The override, at most the fused tile's occupancy (the launch's cap), so that the configuration
  // names the grid that runs.
  if (tuning.fused_ctas_per_sm && cfg.fused) {
    const int occupancy = kW4a16Tiles[find_w4a16_tile(cfg.l1)].ctas_per_sm;
    cfg.fused_ctas_per_sm = std::min(*tuning.fused_ctas_per_sm, occupancy);
  }
  return cfg;
}

MoeConfig moe_config(const MoePlan& plan, int64_t tokens) {
  const MoeProblem& p = plan.problem();
  const MoeTuning& tuning = plan.tuning();
  if (tuning.absorbing_tile && *tuning.absorbing_tile) {
    MEGAMOE_CHECK(can_absorb(p), kInvalidArgument, "MoeTuning.absorbing_tile: its 256-row blocks need 2I and H multiples of 256; "
                  "this layer has I=", p.intermediate_size, ", H=", p.hidden_size);
    MEGAMOE_CHECK(!tuning.fused || !*tuning.fused, kInvalidArgument,
                  "MoeTuning.absorbing_tile runs two launches: it cannot be set with MoeTuning.fused = true");
    MEGAMOE_CHECK(!tuning.early_start || !*tuning.early_start, kInvalidArgument,
                  "MoeTuning.absorbing_tile has no early start: it cannot be set with MoeTuning.early_start = true");
  }
  const bool named_tiles = tuning.l1_tile || tuning.l2_tile;
  if (named_tiles) {
    MEGAMOE_CHECK(!tuning.absorbing_tile, kInvalidArgument,
                  "MoeTuning.l1_tile / l2_tile name the tiles themselves: they cannot be set with MoeTuning.absorbing_tile");
    MEGAMOE_CHECK(!tuning.early_start || !*tuning.early_start, kInvalidArgument,
                  "MoeTuning.l1_tile / l2_tile run without early start: they cannot be set with MoeTuning.early_start = true");
    const struct {
      const char* field;
      const std::optional<std::string>& name;
      const char* rows_name;
      int64_t rows;
    } gemms[] = {{"l1_tile", tuning.l1_tile, "2I", 2 * p.intermediate_size}, {"l2_tile", tuning.l2_tile, "H", p.hidden_size}};
    for (const auto& g : gemms) {
      if (!g.name) continue;
      const int tile = find_tile_by_name(*g.name);
      MEGAMOE_CHECK(tile >= 0, kInvalidArgument, "MoeTuning.", g.field, " = '", *g.name, "' names no tile; the tiles are ",
                    tile_names());
      MEGAMOE_CHECK(tile_fits(tile, g.rows), kInvalidArgument, "MoeTuning.", g.field, " = '", *g.name, "': its ",
                    64 * kW4a16Tiles[tile].config.warpgroups, "-row blocks do not divide the GEMM's ", g.rows_name, " = ",
                    g.rows, " rows");
    }
  }
  const MoeConfig cfg = tuned_moe_config(p, tokens, plan.num_sms(), current_device_figures(), tuning);
  if (tuning.l1_k_splits && *tuning.l1_k_splits != 1) {
    const int k = *tuning.l1_k_splits;
    const int64_t slots = tokens * (p.top_k + p.shared_intermediate_size / p.intermediate_size);
    const int tile = find_w4a16_tile(cfg.l1);
    MEGAMOE_CHECK(k >= 1 && k <= w4a16_split::kMaxL1KSplits, kInvalidArgument, "MoeTuning.l1_k_splits = ", k,
                  " is outside 1..", w4a16_split::kMaxL1KSplits);
    MEGAMOE_CHECK(tile >= 0 && l1_splits(kW4a16Tiles[tile]), kInvalidArgument, "MoeTuning.l1_k_splits = ", k,
                  ": L1 splits K on the ", kW4a16Tiles[kTileDecode16].name, " and ", kW4a16Tiles[kTileDecode32].name,
                  " tiles; at T=", tokens, " L1 runs ", cfg.l1.to_string());
    MEGAMOE_CHECK(w4a16_split::can_split(p.hidden_size, slots, k), kInvalidArgument, "MoeTuning.l1_k_splits = ", k,
                  ": needs at most ", w4a16_split::kL1SplitMaxSlots, " slots (T=", tokens, " has ", slots,
                  ") and H / 64 = ", p.hidden_size / 64, " a multiple of it");
  }
  MEGAMOE_CHECK(!tuning.fused_ctas_per_sm || *tuning.fused_ctas_per_sm >= 1, kInvalidArgument,
                "MoeTuning.fused_ctas_per_sm = ", tuning.fused_ctas_per_sm.value_or(0), " must be at least 1");
  MEGAMOE_CHECK(!named_tiles || !tuning.fused || !*tuning.fused || cfg.fused, kInvalidArgument,
                "MoeTuning.fused = true with named tiles needs both GEMMs on one fusable tile (",
                kW4a16Tiles[kTileDecode16].name, " or ", kW4a16Tiles[kTileDecode32].name, "); they are ", cfg.to_string());
  MEGAMOE_CHECK(!tuning.fused || !*tuning.fused || cfg.fused, kInvalidArgument,
                "MoeTuning.fused: the fused launch is built for the 16- and 32-token decode tiles (",
                kFusedTile.to_string(), ", ", kFusedTile32.to_string(), ") in both GEMMs, up to 24 tokens per expert; at T=",
                tokens, " the heuristic picks ", cfg.to_string());
  MEGAMOE_CHECK(!tuning.fused_ctas_per_sm || cfg.fused, kInvalidArgument,
                "MoeTuning.fused_ctas_per_sm sizes the fused launch's grid; at T=", tokens, " the layer runs ",
                cfg.to_string(), " (two launches): leave it unset there, or set fused = true");
  MEGAMOE_CHECK(!tuning.early_start || !*tuning.early_start || can_start_early(p, tokens), kInvalidArgument,
                "MoeTuning.early_start: early start holds up to ", kEarlyStartMaxSelections,
                " routed selections (T * top_k) and ", kEarlyStartMaxSlots,
                " slots (T * (top_k + shared slices)); T=", tokens, " has more");
  return cfg;
}

}  // namespace megamoe
