// The absorbing160 tile's L1 (gate/up) kernel (sm90_w4a16_tiles.h).
#include "runtime/sm90_w4a16_launch.cuh"

MEGAMOE_W4A16_GEMM_INSTANCE(kTileAbsorbing160, true)
