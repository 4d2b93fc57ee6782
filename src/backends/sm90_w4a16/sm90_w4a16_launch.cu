// The launch whitelist of the sm90 W4A16 grouped GEMM: a configuration runs the kernels of its
// tile table entry (sm90_w4a16_tiles.h), compiled under instantiations/.
#include <utility>

#include "megamoe/status.h"
#include "backends/sm90_w4a16/sm90_w4a16_l1_split.h"
#include "backends/sm90_w4a16/sm90_w4a16_launch.h"

namespace megamoe::runtime {

namespace {

template <class F, int... I>
void for_each_tile(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}

}  // namespace

template <bool kIsL1>
void launch_w4a16_gemm(const GemmConfig& c, const kernels::sm90::W4a16GemmParams& params, const GemmGrid& grid) {
  const int tile = find_w4a16_tile(c);
  MEGAMOE_CHECK(tile >= 0, kInternal, "no kernel instantiated for GEMM config ", c.to_string());
  bool splits_allowed = c.k_splits == 1;
  if constexpr (kIsL1) {
    splits_allowed = splits_allowed || (l1_splits(kW4a16Tiles[tile]) && params.l1_partial != nullptr &&
                                        c.k_splits <= w4a16_split::kMaxL1KSplits);
  } else {
    splits_allowed = splits_allowed || params.y_slot == nullptr;
  }
  MEGAMOE_CHECK(c.k_splits >= 1 && splits_allowed, kInternal, "GEMM config ", c.to_string(),
                ": only the atomic L2 and L1 on the decode tiles (with a partial buffer, up to ",
                w4a16_split::kMaxL1KSplits, " slices) may split K");
  MEGAMOE_CHECK(c.k_splits == params.k_splits, kInternal, "GEMM config ", c.to_string(), " and its parameters' ",
                params.k_splits, " K slices differ");
  for_each_tile(
      [&](auto index) {
        if (index.value == tile) launch_w4a16_tile<decltype(index)::value, kIsL1>(params, grid);
      },
      std::make_integer_sequence<int, kW4a16TileCount>{});
}

template void launch_w4a16_gemm<true>(const GemmConfig&, const kernels::sm90::W4a16GemmParams&, const GemmGrid&);
template void launch_w4a16_gemm<false>(const GemmConfig&, const kernels::sm90::W4a16GemmParams&, const GemmGrid&);

void launch_w4a16_fused(const MoeConfig& c, const kernels::sm90::W4a16FusedParams& params, const GemmGrid& grid) {
  const int tile = find_w4a16_tile(c.l1);
  MEGAMOE_CHECK(c.can_fuse() && tile >= 0, kInternal, "no fused kernel instantiated for ", c.to_string());
  MEGAMOE_CHECK(c.l1.k_splits == params.l1.k_splits && c.l2.k_splits == params.l2.k_splits &&
                    (c.l1.k_splits == 1 || (params.l1.l1_partial != nullptr && c.l1.k_splits <= w4a16_split::kMaxL1KSplits)),
                kInternal, "fused config ", c.to_string(), ": its K slices (L1 ", params.l1.k_splits, ", L2 ",
                params.l2.k_splits, " in the parameters) cannot run");
  for_each_tile(
      [&](auto index) {
        if constexpr (kW4a16Tiles[decltype(index)::value].fusable) {
          if (index.value == tile) launch_w4a16_fused_tile<decltype(index)::value>(params, grid);
        }
      },
      std::make_integer_sequence<int, kW4a16TileCount>{});
}

void load_w4a16_kernels() {
  for_each_tile(
      [](auto index) {
        constexpr int kTile = decltype(index)::value;
        w4a16_tile_blocks_per_sm<kTile, true>();
        w4a16_tile_blocks_per_sm<kTile, false>();
        if constexpr (kW4a16Tiles[kTile].fusable) w4a16_fused_blocks_per_sm<kTile>();
      },
      std::make_integer_sequence<int, kW4a16TileCount>{});
}

void set_w4a16_timeline(const W4a16TimelineBuffer& buffer) {
#if MEGAMOE_TIMELINE
  for_each_tile(
      [&](auto index) {
        constexpr int kTile = decltype(index)::value;
        set_w4a16_tile_timeline<kTile, kTimelineLaunchL1>(buffer);
        set_w4a16_tile_timeline<kTile, kTimelineLaunchL2>(buffer);
        if constexpr (kW4a16Tiles[kTile].fusable) set_w4a16_tile_timeline<kTile, kTimelineLaunchFused>(buffer);
      },
      std::make_integer_sequence<int, kW4a16TileCount>{});
#else
  (void)buffer;
  MEGAMOE_FAIL(kUnsupported, kW4a16TimelineNotBuilt);
#endif
}

}  // namespace megamoe::runtime
