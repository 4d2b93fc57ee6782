// Helpers for GPU tests: skip visibly where there is no GPU; device buffers (megamoe/gpu.h).
#pragma once

#include <gtest/gtest.h>

#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "megamoe/gpu.h"
#include "support/device_buffer.h"

#define MEGAMOE_REQUIRE_GPU()                                                       \
  do {                                                                              \
    if (::megamoe::gpu::device_count() == 0) {                                      \
      GTEST_SKIP() << "no CUDA device: GPU test skipped (run it on the GPU machine)"; \
    }                                                                               \
  } while (0)

namespace megamoe::testing {

using support::DeviceBuffer;

}  // namespace megamoe::testing
