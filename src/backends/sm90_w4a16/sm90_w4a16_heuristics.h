// The configuration heuristic of the (sm_90, w4a16) row: a pure function of the problem, the
// token count, the SMs the plan gets and the device's figures, built from named steps (printable
// with MoeConfig::to_string). MoeTuning overrides are applied outside it (tuned_moe_config).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "megamoe/runtime.h"
#include "backends/sm90_w4a16/sm90_w4a16_tiles.h"

namespace megamoe {

struct MoeConfig {
  GemmConfig l1;             // x · W13ᵀ + SwiGLU
  GemmConfig l2;             // a · W2ᵀ + combine
  bool fused = false;        // L1 and L2 in one persistent launch (needs can_fuse)
  bool early_start = false;  // L1's first items start before the dispatch completes (tiny T)
  // The fused launch's CTAs per SM where fewer than the tile's occupancy (0: the occupancy), so
  // that no SM holds more than its share of L1's first wave (heuristic::fused_ctas_per_sm).
  int fused_ctas_per_sm = 0;
  std::string to_string() const;
  // Whether both GEMMs run the same tile (K slices aside) and that tile has a fused kernel
  // (kFusedTile or kFusedTile32), so that they may run fused.
  bool can_fuse() const;
};

// Early start (a tiny batch's L1 CTAs compute their first work item from the top-k ids and run it
// while the dispatch kernel still runs) holds up to this many routed selections (T * k: one per
// lane of a warp) and slots (T * (k + shared slices)).
inline constexpr int64_t kEarlyStartMaxSelections = 32;
inline constexpr int64_t kEarlyStartMaxSlots = 64;

// Whether a batch of `tokens` is small enough for early start.
bool can_start_early(const MoeProblem& problem, int64_t tokens);

// Whether both GEMMs can run the absorbing tile (kAbsorbingTile): 2I and H multiples of its
// 256-row blocks.
bool can_absorb(const MoeProblem& problem);

// What the heuristic knows of the device: figures the runtime queries (never the product name).
// Where the token tiles change depends on the balance of DRAM rate to SM issue: a device that
// streams more bytes per SM clock runs out of SM issue at fewer tokens per expert.
struct DeviceFigures {
  int sms = 0;                  // the device's SMs
  double dram_bytes_per_s = 0;  // nominal: 2 x memory clock x bus width
  double sm_clock_hz = 0;       // the SMs' peak clock
  int64_t l2_bytes = 0;
  // The nominal DRAM rate over all SMs at their peak clock, bytes per SM per clock.
  double dram_bytes_per_sm_clock() const;
};

// The figures of the device the current device's kernels run on (cudaDeviceGetAttribute, once per
// device). Throws megamoe::Error(kCuda).
DeviceFigures current_device_figures();

// The expected token tiles of the two decode tiles at T under uniform routing, each summed at
// most once (run() evaluates the heuristic at every call).
class DecodeTileCounts {
 public:
  DecodeTileCounts(const MoeProblem& problem, int64_t tokens) : problem_(problem), tokens_(tokens) {}
  double tiles16();
  double tiles32();

 private:
  const MoeProblem& problem_;
  int64_t tokens_;
  std::optional<double> tiles16_, tiles32_;
};

// The heuristic's steps, in the order choose_moe_config takes them.
namespace heuristic {
// Both GEMMs' tiles by tokens per expert, from the cut-offs measured on the device's balance of
// DRAM rate to SM issue.
MoeConfig width_tiles(const MoeProblem& problem, int64_t tokens, const DeviceFigures& device);
// Whether the 16-token tile's GEMMs run as one launch (a partial last wave L2 items can fill).
bool fuse_decode16(const MoeProblem& problem, int num_sms, const MoeConfig& cfg, DecodeTileCounts& tiles);
// Two launches take the 32-token tile where it has fewer tiles than the 16-token one.
void widen_unfused_decode(MoeConfig& cfg, DecodeTileCounts& tiles);
// Whether the 32-token tile's GEMMs run as one launch.
bool fuse_decode32(const MoeProblem& problem, int num_sms, const MoeConfig& cfg, DecodeTileCounts& tiles);
// The fused launch's CTAs per SM (0: the tile's occupancy): L1's expected items per SM, rounded
// up, where that is from 4 to below the occupancy and the device's row asks for it.
int fused_ctas_per_sm(const MoeProblem& problem, int num_sms, const MoeConfig& cfg, DecodeTileCounts& tiles,
                      const DeviceFigures& device);
// L2's K slices (1 or 2).
int l2_k_splits(const MoeProblem& problem, int64_t tokens);
// L1's K slices on the decode tiles (1 or 2; sm90_w4a16_l1_split.h): 2 where L1 has fewer than two
// items per SM and the device's row asks for it; 1 in deterministic mode.
int l1_k_splits(const MoeProblem& problem, int64_t tokens, int num_sms, const MoeConfig& cfg, DecodeTileCounts& tiles,
                const DeviceFigures& device);
// Whether the absorbing tile pays in both GEMMs (prefill tiles, a common short remainder).
bool absorbing_pays(const MoeProblem& problem, int64_t tokens, const MoeConfig& cfg, const DeviceFigures& device);
// The overlapped 128-token tile from 256 tokens per expert.
void overlap_prefill(const MoeProblem& problem, int64_t tokens, MoeConfig& cfg, const DeviceFigures& device);
}  // namespace heuristic

// The heuristic: no overrides. num_sms: the SMs the plan's kernels get (up to device.sms).
MoeConfig choose_moe_config(const MoeProblem& problem, int64_t tokens, int num_sms, const DeviceFigures& device);

// The heuristic's steps with MoeTuning's overrides in place of the choices they fix: `fused`
// replaces the launch decision (before the decode tile that depends on it), `absorbing_tile` true
// runs both GEMMs on the absorbing tile where can_absorb, false leaves it out; `l1_tile` and
// `l2_tile` replace the tiles last (find_tile_by_name); `l1_k_splits` replaces L1's K slices where L1
// runs a tile that splits (l1_splits). Never throws: an override that cannot run
// is reported by moe_config.
MoeConfig tuned_moe_config(const MoeProblem& problem, int64_t tokens, int num_sms, const DeviceFigures& device,
                           const MoeTuning& tuning);

// The tile table's entry named `name` (W4a16TileEntry::name), or -1.
int find_tile_by_name(const std::string& name);

// The configuration run() uses for T tokens under `plan`: tuned_moe_config with the plan's tuning.
// Throws megamoe::Error(kInvalidArgument) when an override cannot run at this T.
MoeConfig moe_config(const MoePlan& plan, int64_t tokens);

}  // namespace megamoe
