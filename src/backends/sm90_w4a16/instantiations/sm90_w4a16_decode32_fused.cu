// The decode32 tile's fused L1 + L2 kernel (sm90_w4a16_tiles.h).
#include "backends/sm90_w4a16/sm90_w4a16_launch.cuh"

MEGAMOE_W4A16_FUSED_INSTANCE(kTileDecode32)
