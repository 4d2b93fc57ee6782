// The random values of synthetic checkpoints, a pure function of (seed, name), for the parts of
// the generator (internal to src/synth).
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace megamoe::synth_detail {

// synth_weight (megamoe/presets.h) into a caller-owned buffer of rows * cols values (the
// generator reuses one buffer per thread).
void synth_weight_into(uint64_t seed, const std::string& name, int64_t rows, int64_t cols,
                       std::span<float> out);

// The index-th approximately standard normal value of the scalar quantity `name` (biases, input
// amax): drawn from its own stream, like a weight element.
float synth_scalar(uint64_t seed, const std::string& name, uint64_t index);

}  // namespace megamoe::synth_detail
