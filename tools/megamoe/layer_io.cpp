// Reading the input of one MoE layer (`hidden`, optional `topk_ids` + `topk_weights`, or routing
// through the layer's router) and writing its output: shared by `reference` (CPU) and `run` (GPU).
#include <cmath>
#include <cstring>

#include "commands.h"
#include "megamoe/reference.h"
#include "megamoe/safetensors.h"
#include "megamoe/status.h"

namespace megamoe::tool {

namespace {

// Reads the caller's routing: topk_ids [T, k] (I32 or I64) and topk_weights [T, k] (F32).
reference::TopK read_topk(const SafetensorsFile& x, const TensorInfo& ids, const TensorInfo& w,
                          int64_t tokens, int64_t num_experts) {
  const std::string& path = x.path();
  MEGAMOE_CHECK(ids.dtype == DType::I32 || ids.dtype == DType::I64, kInvalidArgument,
                "tensor 'topk_ids' of '", path, "' has dtype ", dtype_name(ids.dtype),
                "; expected I32 or I64.");
  // k is checked as the int64 it is stored as before it becomes TopK's int: a width of 2^32 + 1
  // must not wrap around to 1.
  MEGAMOE_CHECK(ids.shape.size() == 2 && ids.shape[0] == tokens && ids.shape[1] >= 1 &&
                    ids.shape[1] <= num_experts,
                kInvalidArgument, "tensor 'topk_ids' of '", path, "' has shape ",
                shape_string(ids.shape), "; expected [", tokens, ", k] with 1 <= k <= ",
                num_experts, " (one row per token of 'hidden', at most one slot per expert of the "
                "layer).");
  MEGAMOE_CHECK(w.dtype == DType::F32, kInvalidArgument, "tensor 'topk_weights' of '", path,
                "' has dtype ", dtype_name(w.dtype), "; expected F32.");
  MEGAMOE_CHECK(w.shape == ids.shape, kInvalidArgument, "tensor 'topk_weights' of '", path,
                "' has shape ", shape_string(w.shape), "; expected the shape of 'topk_ids', ",
                shape_string(ids.shape), ".");
  reference::TopK topk;
  topk.tokens = tokens;
  topk.k = int(ids.shape[1]);
  const int64_t n = tokens * topk.k;
  topk.ids.resize(size_t(n));
  topk.weights.resize(size_t(n));
  const uint8_t* id_bytes = x.bytes(ids).data();
  const uint8_t* w_bytes = x.bytes(w).data();
  for (int64_t i = 0; i < n; ++i) {
    int64_t id;
    if (ids.dtype == DType::I32) {
      int32_t v;
      std::memcpy(&v, id_bytes + 4 * i, 4);
      id = v;
    } else {
      std::memcpy(&id, id_bytes + 8 * i, 8);
    }
    MEGAMOE_CHECK(id >= 0 && id < num_experts, kInvalidArgument, "tensor 'topk_ids' of '", path,
                  "' holds expert id ", id, " at [", i / topk.k, ", ", i % topk.k,
                  "]; expert ids must be in [0, ", num_experts, ").");
    topk.ids[size_t(i)] = int32_t(id);
    std::memcpy(&topk.weights[size_t(i)], w_bytes + 4 * i, 4);
    MEGAMOE_CHECK(std::isfinite(topk.weights[size_t(i)]), kInvalidArgument,
                  "tensor 'topk_weights' of '", path, "' holds ", topk.weights[size_t(i)], " at [",
                  i / topk.k, ", ", i % topk.k, "]; routing weights must be finite.");
  }
  return topk;
}

}  // namespace

LayerJob load_layer_job(const std::string& checkpoint, int64_t layer_index, const std::string& input) {
  LayerJob job;
  job.layer_index = layer_index;
  const ModelConfig config = load_model_config(checkpoint);
  const Checkpoint ckpt = Checkpoint::open(checkpoint);
  job.layer = load_moe_layer(ckpt, config, layer_index);
  job.input_files = checkpoint_input_files(ckpt);
  const MoeLayer& layer = job.layer;
  const int64_t H = layer.hidden_size;

  const auto x = SafetensorsFile::open(input);
  const TensorInfo* hidden = x->find("hidden");
  MEGAMOE_CHECK(hidden != nullptr, kNotFound, "input '", input,
                "' has no tensor 'hidden'; expected the layer input as BF16 [tokens, ", H, "].");
  MEGAMOE_CHECK(hidden->dtype == DType::BF16, kInvalidArgument, "tensor 'hidden' of '", input,
                "' has dtype ", dtype_name(hidden->dtype), "; expected BF16.");
  MEGAMOE_CHECK(hidden->shape.size() == 2 && hidden->shape[1] == H, kInvalidArgument,
                "tensor 'hidden' of '", input, "' has shape ", shape_string(hidden->shape),
                "; expected [tokens, ", H, "]: layer ", layer_index, " of '", checkpoint,
                "' has hidden_size ", H, ".");
  const int64_t tokens = hidden->shape[0];
  job.hidden.resize(size_t(tokens * H));
  // tokens == 0 is a valid, empty batch; memcpy must not see the null data() of empty vectors.
  if (!job.hidden.empty()) {
    std::memcpy(job.hidden.data(), x->bytes(*hidden).data(), job.hidden.size() * sizeof(uint16_t));
  }
  // Checked here, whatever the routing: a NaN or Inf token would otherwise come out as a NaN row
  // with given routing, or be blamed on a router logit.
  for (size_t i = 0; i < job.hidden.size(); ++i) {
    const float v = bf16_to_f32(job.hidden[i]);
    MEGAMOE_CHECK(std::isfinite(v), kInvalidArgument, "tensor 'hidden' of '", input, "' holds ", v,
                  " at [", int64_t(i) / H, ", ", int64_t(i) % H,
                  "]; the layer input must be finite.");
  }
  job.input_files.push_back(input);

  const TensorInfo* ids = x->find("topk_ids");
  const TensorInfo* weights = x->find("topk_weights");
  MEGAMOE_CHECK((ids == nullptr) == (weights == nullptr), kInvalidArgument, "input '", input,
                "' has '", ids ? "topk_ids" : "topk_weights", "' without '",
                ids ? "topk_weights" : "topk_ids",
                "'; give both to skip routing, or neither to route with the layer's router.");
  job.given_routing = ids != nullptr;
  if (ids) {
    job.topk = read_topk(*x, *ids, *weights, tokens, layer.num_experts);
  } else {
    MEGAMOE_CHECK(!layer.router_weight.empty(), kNotFound, "layer ", layer_index, " of '",
                  checkpoint, "' has no router weight 'model.layers.", layer_index,
                  ".mlp.gate.weight'; give 'topk_ids' and 'topk_weights' in the input instead.");
    const std::vector<float> logits = reference::router_logits(layer, job.hidden, tokens);
    job.topk = reference::route(layer.routing, logits, tokens, layer.num_experts,
                            layer.e_score_correction_bias);
  }
  return job;
}

void write_layer_output(const std::string& path, const LayerJob& job, const std::vector<uint16_t>& out) {
  const std::span<const uint8_t> out_bytes = byte_view(std::span<const uint16_t>(out));
  const std::span<const uint8_t> id_bytes = byte_view(std::span<const int32_t>(job.topk.ids));
  const std::span<const uint8_t> w_bytes = byte_view(std::span<const float>(job.topk.weights));
  const int64_t k = job.topk.k, tokens = job.topk.tokens, H = job.layer.hidden_size;
  write_safetensors(path, {{{"output", DType::BF16, {tokens, H}}, out_bytes},
                                  {{"topk_ids", DType::I32, {tokens, k}}, id_bytes},
                                  {{"topk_weights", DType::F32, {tokens, k}}, w_bytes}});
}

}  // namespace megamoe::tool
