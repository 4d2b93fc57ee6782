// Tensor parallelism (TP) of a MoE layer: R ranks each hold a slice of EVERY expert's intermediate
// dimension I and see every token; rank r's layer computes a partial output, and the layer's
// output is the sum of the R partials (docs/design.md §7.1).
//
// Rank r of R holds, for every routed expert (intermediate size I) and for the shared expert (its
// own intermediate size Is, sliced the same way):
//   gate_proj, up_proj  rows    [r·I/R, (r+1)·I/R) of [I, H]  (codes [I/R, H/2], scales [I/R, H/16])
//   down_proj           columns [r·I/R, (r+1)·I/R) of [H, I]  (codes [H, I/(2R)], scales [H, I/(16R)])
// Global scales, input scales, the router and the routing configuration are unchanged: every rank
// routes every token the same way.
//
// Why the sum of the partials is the layer: each element of the SwiGLU output a_i = silu(g_i)·u_i
// depends only on row i of gate and of up (the optional clamp is element-wise too), so slicing I
// changes no a_i; the down projection y = a·W_downᵀ is a sum over I, split into R partial sums;
// routing weights and the shared expert's weight 1 distribute over that sum. Only the association
// of the fp32 sums changes (docs/design.md §2: fp32 sums, one bf16 rounding at the end): each rank
// keeps its partial in fp32 (MoeRunArgs::output_f32 on the GPU, reference::moe_forward_f32 on the
// CPU), the partials are summed, and the sum is rounded to bf16 once (reference::tp_combine).
//
// Built: the slicing, the loader of one rank's slice and the CPU reference of the combine. Not
// built yet (issue 37): the GPU all-reduce over a communicator and `megamoe run --tp`; an engine
// runs the sliced layer on one GPU with MoeRunArgs::output_f32 and all-reduces the fp32 partials
// itself.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "megamoe/moe.h"

namespace megamoe {

// The ranks of one host (as expert parallelism: EpConfig::world_size).
inline constexpr int kTpMaxRanks = 8;
// I/R (and Is/R) must be a multiple of this: the sm90 kernels' rule for intermediate_size
// (MoePlan: a positive multiple of 64). The NVFP4 format alone needs 16 (whole ue4m3 blocks,
// i.e. whole code and scale bytes of down's K slice); a slice only the CPU reference could run
// is refused, since a TP rank exists to run on a GPU.
inline constexpr int64_t kTpSliceMultiple = 64;

struct TpConfig {
  int world_size = 1;  // R, 1..kTpMaxRanks
  int rank = 0;        // this rank, 0..R-1
};

// The intermediate rows [first, first + count) one rank holds of a dimension of size `size`.
struct TpRange {
  int64_t first = 0;
  int64_t count = 0;
};

// Rank tp.rank's share of an intermediate dimension (I of the routed experts, or Is of the shared
// expert; `what` names it in errors). Throws megamoe::Error(kInvalidArgument) naming the values
// when the world size is outside 1..kTpMaxRanks, the rank outside 0..R-1, `size` is not a multiple
// of R, or size/R is not a multiple of kTpSliceMultiple.
TpRange tp_range(int64_t size, const TpConfig& tp, const char* what = "intermediate_size");

// Rank tp.rank's slice of every expert of `layer` (see the top of this file). intermediate_size
// becomes I/R; router, correction bias, routing and clamp are copied unchanged.
//
// Memory: gate and up are views into `layer`'s bytes (a row slice of a row-major tensor is
// contiguous; no copy, `owner` shared), so with a memory-mapped checkpoint only the slice's pages
// are ever read. down's K slice is strided (I/(2R) of every row's I/2 code bytes, I/(16R) of its
// I/16 scale bytes), and Nvfp4Linear, like every consumer of it (the reference, format::, the GPU
// prepack), addresses rows as contiguous [out, in/2]: the slice is copied into an owned buffer,
// H·I/(2R) + H·I/(16R) bytes per expert, the rank's own share of down and nothing more. (A row
// stride in Nvfp4Linear would avoid the copy, but every consumer that ignored it would read the
// wrong bytes silently; the copy is the cheapest representation that cannot be misread.) The GPU
// upload copies these bytes to the device anyway, so the host copy can be dropped after it.
//
// Throws megamoe::Error(kInvalidArgument): an invalid layer (MoeLayer::validate) or tp_range's
// errors for I or the shared expert's Is.
MoeLayer tp_local_layer(const MoeLayer& layer, const TpConfig& tp);

}  // namespace megamoe
