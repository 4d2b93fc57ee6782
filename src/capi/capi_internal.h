// What the C API's entry points (capi.cpp, capi_layer.cpp) share with the part that needs the GPU
// runtime: layer_cuda.cpp in a CUDA build, layer_no_cuda.cpp in a CPU-only one. The entry points
// check every argument on the host, in every build; the layer functions then do the device work.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "megamoe/megamoe.h"
#include "megamoe/moe.h"
#include "megamoe/precision.h"

namespace megamoe::capi {

// megamoe_layer_options, checked.
struct LayerOptions {
  int device = 0;
  int64_t max_tokens = 0;
  Precision precision = Precision::kW4a16;
  bool deterministic = false;
  bool external_workspace = false;
};

// megamoe_stacked_layer, checked: the shapes agree, every tensor is contiguous. Device pointers.
struct StackedLayer {
  int64_t hidden_size = 0, intermediate_size = 0, num_experts = 0, shared_intermediate_size = 0;
  const uint8_t *w13 = nullptr, *w13_scale = nullptr, *w2 = nullptr, *w2_scale = nullptr;
  const float *w13_scale_2 = nullptr, *w2_scale_2 = nullptr;
  const uint8_t *shared_w13 = nullptr, *shared_w13_scale = nullptr, *shared_w2 = nullptr,
                *shared_w2_scale = nullptr;
  const float *shared_w13_scale_2 = nullptr, *shared_w2_scale_2 = nullptr;
  int top_k = 0;
  std::optional<float> swiglu_limit;
  std::optional<RoutingConfig> routing;  // none: runs pass top-k ids
  const float* correction_bias = nullptr;
  bool in_place = false;  // prepack the caller's tensors in place (their memory is writable)
};

// megamoe_run_args, read (struct_size checked).
struct RunArgs {
  int64_t tokens = 0;
  const void* hidden = nullptr;
  const int32_t* topk_ids = nullptr;
  const float* topk_weights = nullptr;
  const float* router_logits = nullptr;
  void* output = nullptr;
  float* output_f32 = nullptr;
  void* workspace = nullptr;
  size_t workspace_size = 0;
};

// The device side. Each throws megamoe::Error; a CPU-only build's throw kUnsupported.
int device_count();
megamoe_layer* create_layer(const MoeLayer& layer, const LayerOptions& options);
megamoe_layer* create_layer_stacked(const StackedLayer& weights, const LayerOptions& options,
                                    megamoe_stream stream);
void destroy_layer(megamoe_layer* layer) noexcept;
void layer_info(const megamoe_layer& layer, megamoe_layer_info& info);  // every field
std::string describe_layer(const megamoe_layer& layer, int64_t tokens);
void run_layer(megamoe_layer& layer, const RunArgs& args, megamoe_stream stream);
int64_t invalid_id_count(const megamoe_layer& layer, const void* workspace, megamoe_stream stream);

// The message a CPU-only build's layer functions fail with.
inline constexpr const char* kNoCudaMessage =
    "unsupported: this libmegamoe was built without CUDA (MEGAMOE_CUDA=OFF), so it has no GPU "
    "runtime; checkpoints can be opened and checked, layers need a CUDA build";

}  // namespace megamoe::capi
