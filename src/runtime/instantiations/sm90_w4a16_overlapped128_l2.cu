// The overlapped128 tile's L2 (down) kernel (sm90_w4a16_tiles.h).
#include "runtime/sm90_w4a16_launch.cuh"

MEGAMOE_W4A16_GEMM_INSTANCE(kTileOverlapped128, false)
