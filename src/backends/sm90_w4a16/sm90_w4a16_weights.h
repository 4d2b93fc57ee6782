// A layer's weights in the sm90 prepacked layout (sm90_w4a16_layout.h: the checkpoint's NVFP4
// bits reshuffled for the kernels, never decoded), owned on the device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "megamoe/moe.h"
#include "runtime/backend.h"

namespace megamoe::runtime {

struct Sm90PrepackedWeights final : BackendWeights {
  static constexpr const char* kLayout = "sm90-prepacked-nvfp4";
  // Virtual experts (routed, then the shared expert's slices) one after another, each *_stride
  // bytes (sm90_w4a16_prepack.h).
  uint8_t* w13_codes = nullptr;
  uint8_t* w13_scales = nullptr;
  uint8_t* w2_codes = nullptr;
  uint8_t* w2_scales = nullptr;
  float* s2 = nullptr;  // [3][E']: gate, up, down
  // What the W4A8 row reads beside the same bytes (docs/w4a8.md §3), derived with them: k depends
  // on a whole tensor's scales, so it is found once here, not per run. [3][E'] s2 * 2^k of gate,
  // up, down; [2][E'] the decode's scale constants of W13 (gate rows in each pair's low half, up
  // rows in its high half) and of W2 (sm90_w4a8_layout.h: scale_exponent_addend). One allocation.
  float* w4a8_s2 = nullptr;
  uint32_t* w4a8_addends = nullptr;
  int64_t w13_code_stride = 0, w13_scale_stride = 0, w2_code_stride = 0, w2_scale_stride = 0;
  size_t bytes = 0;      // device memory allocated here
  bool borrowed = false;  // the four code/scale buffers are the caller's (upload_into, view)

  Sm90PrepackedWeights() = default;
  Sm90PrepackedWeights(const Sm90PrepackedWeights&) = delete;
  Sm90PrepackedWeights& operator=(const Sm90PrepackedWeights&) = delete;
  ~Sm90PrepackedWeights() override;
  const char* layout() const override { return kLayout; }
  size_t device_bytes() const override { return bytes; }
  bool views_caller_memory() const override { return borrowed; }
};

// Prepacks on all host cores and copies on `stream`, into new device memory or into `into`;
// returns once the copies have landed.
std::unique_ptr<Sm90PrepackedWeights> upload_sm90_prepacked(const MoeLayer& layer, cudaStream_t stream,
                                                            const WeightStorage* into = nullptr);
// A view of storage upload_sm90_prepacked has written for a layer of `shape`.
std::unique_ptr<Sm90PrepackedWeights> view_sm90_prepacked(const MoeProblem& shape, const WeightStorage& at,
                                                          const GlobalScales& scales, cudaStream_t stream);
// The inverse of the prepack, host to host (MoeBackend::unprepack).
void unprepack_sm90(const MoeProblem& shape, const HostPrepacked& in, const StackedNvfp4Buffers& out);

}  // namespace megamoe::runtime
