// The W4A8 weight rescale exponent k of every (expert, projection) of a layer (docs/w4a8.md §3,
// format::w4a8_weight_rescale_exponent): the kernels convert each weight to e4m3 as
// e2m1 * s * 2^-k and fold 2^k into the projection's global scale. k depends on the tensor's
// largest block scale only, so it is derived once, where the weights are prepacked or viewed:
// from the checkpoint-layout scales on the host (what the prepack reads) or from the prepacked
// scales on the device (what every sm90 row reads, whichever way they were made).
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <vector>

#include "megamoe/moe.h"
#include "megamoe/runtime.h"

namespace megamoe::runtime {

// Each tensor's k in GlobalScales' order: (gate, up, down) of every routed expert, then the
// shared expert's (all 0 where there is none).
struct W4a8RescaleExponents {
  std::vector<std::array<int, 3>> routed;
  std::array<int, 3> shared{};
};

// From the layer's block scales on the host (checkpoint layout). Throws megamoe::Error
// (kInvalidArgument) naming the expert, the projection and the first block scale that is not a
// valid ue4m3 byte.
W4a8RescaleExponents w4a8_rescale_exponents(const MoeLayer& layer);

// From a layer's prepacked block scales on the device (sm90_w4a16_layout.h, "Scale encoding"),
// the virtual experts one after another per kind, as MoeDeviceWeights holds them for a layer of
// `shape`. The encoding keeps the order of the scales, so the largest byte of a tensor is its
// largest scale; the shared expert's k covers all its slices. One reduction over the scale bytes
// on `stream` (16-byte aligned device pointers), then a synchronisation of `stream`. Throws
// megamoe::Error (kInvalidArgument) naming the tensor and a byte that no ue4m3 scale encodes to
// (not prepacked weights), or (kCuda).
W4a8RescaleExponents w4a8_rescale_exponents_prepacked(const MoeProblem& shape, const uint8_t* w13_scales,
                                                      const uint8_t* w2_scales, cudaStream_t stream);

}  // namespace megamoe::runtime
