// The absorbing160 tile's L1 (gate/up) kernel (sm90_w4a16_tiles.h).
#include "backends/sm90_w4a16/sm90_w4a16_launch.cuh"

MEGAMOE_W4A16_GEMM_INSTANCE(kTileAbsorbing160, true)
