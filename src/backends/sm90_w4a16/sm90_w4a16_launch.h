// Host launchers of the sm90 W4A16 grouped-GEMM kernels: the whitelist of instantiations is the
// tile table (sm90_w4a16_tiles.h); each entry's kernels are compiled in translation units of
// their own (instantiations/), so that a build compiles them in parallel.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

#include "backends/sm90_w4a16/sm90_w4a16_params.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_heuristics.h"
#include "backends/sm90_w4a16/sm90_w4a16_tiles.h"
#include "backends/sm90_w4a16/sm90_w4a16_timeline.h"

namespace megamoe::runtime {

// How large a persistent grid to launch, and where.
struct GemmGrid {
  int num_sms = 0;
  int64_t max_work = 0;  // upper bound of the work items (the grid never exceeds it)
  cudaStream_t stream = nullptr;
  int ctas_per_sm = 0;  // fewer CTAs per SM than the kernel's occupancy (0: the occupancy)
};

// One GEMM (L1 when kIsL1, else L2) on the tile of `c`. Throws megamoe::Error(kInternal) where no
// kernel is instantiated for it (the heuristic only picks table entries).
template <bool kIsL1>
void launch_w4a16_gemm(const GemmConfig& c, const kernels::sm90::W4a16GemmParams& params, const GemmGrid& grid);

// The fused L1 + L2 launch on a fusable tile (MoeConfig::can_fuse).
void launch_w4a16_fused(const MoeConfig& c, const kernels::sm90::W4a16FusedParams& params, const GemmGrid& grid);

// Loads every instantiated kernel and sets its attributes (MoeBackend::load_kernels).
void load_w4a16_kernels();

// The kernels of table entry kTile (defined in sm90_w4a16_launch.cuh, instantiated under
// instantiations/); *_blocks_per_sm loads one and sets its attributes (once), returning its
// occupancy.
template <int kTile, bool kIsL1>
void launch_w4a16_tile(const kernels::sm90::W4a16GemmParams& params, const GemmGrid& grid);
template <int kTile>
void launch_w4a16_fused_tile(const kernels::sm90::W4a16FusedParams& params, const GemmGrid& grid);
template <int kTile, bool kIsL1>
int w4a16_tile_blocks_per_sm();
template <int kTile>
int w4a16_fused_blocks_per_sm();
// -DMEGAMOE_TIMELINE=ON builds: sets the timeline variable of the translation unit of entry kTile's
// kernel kLaunch (sm90_w4a16_timeline.cuh; each unit has its own). set_w4a16_timeline sets them all.
template <int kTile, W4a16TimelineLaunch kLaunch>
void set_w4a16_tile_timeline(const W4a16TimelineBuffer& buffer);

}  // namespace megamoe::runtime
