// megamoe::load_moe_layer: one MoE layer of a ModelOpt or compressed-tensors NVFP4 checkpoint,
// through the library's loader (every name, dtype, shape and scale checked there), stacked into
// the engine layout as CPU tensors. Only whole byte rows are copied: the codes and block scales
// are the checkpoint's bits, and the global scales its values (compressed-tensors stores the
// reciprocal, which the loader inverts once in fp32).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "megamoe/checkpoint.h"
#include "torch_utils.h"

namespace megamoe::torch_ext {
namespace {

constexpr const char* kLoad = "load_moe_layer";
constexpr int64_t kBlock = format::kNvfp4BlockSize;

// Tensors are appended with their names; the JSON lists the names in the same order.
struct Output {
  std::vector<std::string> names;
  std::vector<at::Tensor> tensors;
  void add(std::string name, at::Tensor t) {
    names.push_back(std::move(name));
    tensors.push_back(std::move(t));
  }
};

at::Tensor empty_cpu(std::vector<int64_t> shape, at::ScalarType dtype) {
  return at::empty(shape, at::TensorOptions().dtype(dtype).device(at::kCPU));
}

uint8_t* bytes(at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

// Copies the rows of `parts` (all with the same in_features) one after the other into
// codes/scales at row offset 0 of matrix `index`.
void copy_rows(std::initializer_list<const Nvfp4Linear*> parts, int64_t index, at::Tensor& codes,
               at::Tensor& scales) {
  const int64_t code_row = codes.size(-1), scale_row = scales.size(-1);
  const int64_t rows_per_matrix = codes.size(-2);
  uint8_t* c = bytes(codes) + index * rows_per_matrix * code_row;
  uint8_t* s = bytes(scales) + index * rows_per_matrix * scale_row;
  for (const Nvfp4Linear* l : parts) {
    std::memcpy(c, l->weight, static_cast<size_t>(l->out_features * code_row));
    std::memcpy(s, l->weight_scale, static_cast<size_t>(l->out_features * scale_row));
    c += l->out_features * code_row;
    s += l->out_features * scale_row;
  }
}

at::Tensor floats(const std::vector<float>& v, std::vector<int64_t> shape) {
  at::Tensor t = empty_cpu(std::move(shape), at::kFloat);
  std::copy(v.begin(), v.end(), t.data_ptr<float>());
  return t;
}

std::tuple<std::string, std::vector<at::Tensor>> load_moe_layer_op(const std::string& path,
                                                                   int64_t layer) {
  return translate_errors(kLoad, [&] {
    const ModelConfig config = load_model_config(path);
    const Checkpoint ckpt = Checkpoint::open(path);
    const MoeLayer L = load_moe_layer(ckpt, config, layer);
    const int64_t H = L.hidden_size, I = L.intermediate_size, E = L.num_experts;
    constexpr auto kF8 = at::ScalarType::Float8_e4m3fn;

    at::Tensor w13 = empty_cpu({E, 2 * I, H / 2}, at::kByte);
    at::Tensor w13_scale = empty_cpu({E, 2 * I, H / kBlock}, kF8);
    at::Tensor w2 = empty_cpu({E, H, I / 2}, at::kByte);
    at::Tensor w2_scale = empty_cpu({E, H, I / kBlock}, kF8);
    std::vector<float> s13(static_cast<size_t>(2 * E)), s2(static_cast<size_t>(E));
    // Reading the mapped files is most of the time: spread the experts over the cores.
    at::parallel_for(0, E, 1, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) {
        const ExpertWeights& x = L.experts[static_cast<size_t>(e)];
        copy_rows({&x.gate, &x.up}, e, w13, w13_scale);
        copy_rows({&x.down}, e, w2, w2_scale);
        s13[static_cast<size_t>(2 * e)] = x.gate.weight_scale_2;
        s13[static_cast<size_t>(2 * e + 1)] = x.up.weight_scale_2;
        s2[static_cast<size_t>(e)] = x.down.weight_scale_2;
      }
    });
    Output out;
    out.add("w13", w13);
    out.add("w13_scale", w13_scale);
    out.add("w13_scale_2", floats(s13, {E, 2}));
    out.add("w2", w2);
    out.add("w2_scale", w2_scale);
    out.add("w2_scale_2", floats(s2, {E}));

    int64_t shared_i = 0;
    if (L.shared_expert) {
      const ExpertWeights& x = *L.shared_expert;
      shared_i = x.intermediate_size();
      at::Tensor sw13 = empty_cpu({2 * shared_i, H / 2}, at::kByte);
      at::Tensor sw13_scale = empty_cpu({2 * shared_i, H / kBlock}, kF8);
      at::Tensor sw2 = empty_cpu({H, shared_i / 2}, at::kByte);
      at::Tensor sw2_scale = empty_cpu({H, shared_i / kBlock}, kF8);
      copy_rows({&x.gate, &x.up}, 0, sw13, sw13_scale);
      copy_rows({&x.down}, 0, sw2, sw2_scale);
      out.add("shared_w13", sw13);
      out.add("shared_w13_scale", sw13_scale);
      out.add("shared_w13_scale_2", floats({x.gate.weight_scale_2, x.up.weight_scale_2}, {2}));
      out.add("shared_w2", sw2);
      out.add("shared_w2_scale", sw2_scale);
      out.add("shared_w2_scale_2", floats({x.down.weight_scale_2}, {1}));
    }
    if (!L.router_weight.empty()) out.add("router_weight", floats(L.router_weight, {E, H}));
    if (!L.e_score_correction_bias.empty()) {
      out.add("e_score_correction_bias", floats(L.e_score_correction_bias, {E}));
    }

    const RoutingConfig& r = L.routing;
    nlohmann::json meta = {
        {"architecture", config.architecture},
        {"model_type", config.model_type},
        {"quant_format", quant_format_name(config.quant_format)},
        {"layer", layer},
        {"hidden_size", H},
        {"intermediate_size", I},
        {"num_experts", E},
        {"shared_intermediate_size", shared_i},
        {"routing",
         {{"method", r.kind == RoutingKind::kNoauxTc ? "noaux_tc" : "softmax"},
          {"top_k", r.top_k},
          {"renormalize", r.renormalize},
          {"n_group", r.n_group},
          {"topk_group", r.topk_group},
          {"routed_scaling_factor", r.routed_scaling_factor}}},
        {"swiglu_limit", L.swiglu_limit ? nlohmann::json(*L.swiglu_limit) : nlohmann::json(nullptr)},
        {"tensors", out.names}};
    return std::make_tuple(meta.dump(), std::move(out.tensors));
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(megamoe, CompositeImplicitAutograd, m) {
  m.impl("load_moe_layer", &load_moe_layer_op);
}

}  // namespace megamoe::torch_ext
