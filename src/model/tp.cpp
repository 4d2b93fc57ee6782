// Tensor-parallel slices of a MoE layer (include/megamoe/tp.h): gate/up row slices as views, down's
// K slice copied (strided in the checkpoint's row-major layout).

#include "megamoe/tp.h"

#include <cstring>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "megamoe/format.h"
#include "megamoe/status.h"

namespace megamoe {
namespace {

// Rows [first, first + count) of a row-major [out, in] linear: contiguous, so a view that shares
// the owner of `w`'s bytes.
Nvfp4Linear row_slice(const Nvfp4Linear& w, int64_t first, int64_t count) {
  Nvfp4Linear s = w;
  s.out_features = count;
  s.weight = w.weight + first * (w.in_features / 2);
  s.weight_scale = w.weight_scale + first * (w.in_features / format::kNvfp4BlockSize);
  return s;
}

// Columns [first, first + count) of every row: first and count are whole NVFP4 blocks (tp_range
// guarantees multiples of 64), so each row's slice is whole code bytes and whole scale bytes.
Nvfp4Linear column_slice(const Nvfp4Linear& w, int64_t first, int64_t count) {
  const int64_t rows = w.out_features;
  const int64_t code_row = w.in_features / 2, scale_row = w.in_features / format::kNvfp4BlockSize;
  const int64_t code_first = first / 2, code_count = count / 2;
  const int64_t scale_first = first / format::kNvfp4BlockSize;
  const int64_t scale_count = count / format::kNvfp4BlockSize;
  std::vector<uint8_t> codes(static_cast<size_t>(rows * code_count));
  std::vector<uint8_t> scales(static_cast<size_t>(rows * scale_count));
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(codes.data() + r * code_count, w.weight + r * code_row + code_first,
                static_cast<size_t>(code_count));
    std::memcpy(scales.data() + r * scale_count, w.weight_scale + r * scale_row + scale_first,
                static_cast<size_t>(scale_count));
  }
  return make_owned_linear(rows, count, std::move(codes), std::move(scales), w.weight_scale_2,
                           w.input_scale);
}

ExpertWeights slice_expert(const ExpertWeights& x, const TpRange& r) {
  return {row_slice(x.gate, r.first, r.count), row_slice(x.up, r.first, r.count),
          column_slice(x.down, r.first, r.count)};
}

}  // namespace

TpRange tp_range(int64_t size, const TpConfig& tp, const char* what) {
  MEGAMOE_CHECK(tp.world_size >= 1 && tp.world_size <= kTpMaxRanks, kInvalidArgument,
                "tensor parallelism: world size ", tp.world_size, " is out of range 1..",
                kTpMaxRanks, " (the GPUs of one host)");
  MEGAMOE_CHECK(tp.rank >= 0 && tp.rank < tp.world_size, kInvalidArgument,
                "tensor parallelism: rank ", tp.rank, " is out of range 0..", tp.world_size - 1,
                " for world size ", tp.world_size);
  MEGAMOE_CHECK(size >= 1 && size % tp.world_size == 0, kInvalidArgument, "tensor parallelism: ",
                what, " = ", size, " does not split evenly over ", tp.world_size,
                " ranks; it must be a multiple of the world size");
  const int64_t count = size / tp.world_size;
  MEGAMOE_CHECK(count % kTpSliceMultiple == 0, kInvalidArgument, "tensor parallelism: ", what,
                " = ", size, " over ", tp.world_size, " ranks gives slices of ", count,
                ", which is not a multiple of ", kTpSliceMultiple,
                " (the sm90 kernels' intermediate_size rule, MoePlan); use fewer ranks");
  return {tp.rank * count, count};
}

MoeLayer tp_local_layer(const MoeLayer& layer, const TpConfig& tp) {
  layer.validate();
  const TpRange routed = tp_range(layer.intermediate_size, tp, "intermediate_size");
  std::optional<TpRange> shared;
  if (layer.shared_expert) {
    shared = tp_range(layer.shared_expert->intermediate_size(), tp,
                      "the shared expert's intermediate size");
  }
  MoeLayer local;
  local.hidden_size = layer.hidden_size;
  local.intermediate_size = routed.count;
  local.num_experts = layer.num_experts;
  local.experts.reserve(layer.experts.size());
  for (const ExpertWeights& x : layer.experts) local.experts.push_back(slice_expert(x, routed));
  if (shared) local.shared_expert = slice_expert(*layer.shared_expert, *shared);
  // Every rank sees every token and routes it the same way: the router is the whole layer's.
  local.router_weight = layer.router_weight;
  local.e_score_correction_bias = layer.e_score_correction_bias;
  local.routing = layer.routing;
  local.swiglu_limit = layer.swiglu_limit;
  return local;
}

}  // namespace megamoe
