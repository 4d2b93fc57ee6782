// Loads NVFP4 linears and one MoE layer (model.layers.{L}.mlp) from a ModelOpt or
// compressed-tensors checkpoint. The packed codes and block scales are not copied: Nvfp4Linear
// points into the mapped files and its owner keeps them mapped. Everything the kernels and the
// reference will trust is checked here: names, dtypes, shapes, every block scale byte (for a
// tensor-parallel rank, load_moe_layer_tp: every byte of its slice) and every global scale.

#include <array>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "megamoe/checkpoint.h"
#include "megamoe/format.h"
#include "megamoe/status.h"
#include "megamoe/tp.h"

namespace megamoe {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; F32 scalars are read with memcpy");

std::string describe(const TensorRef& t) {
  return detail::concat("tensor '", t.info->name, "' in '", t.file->path(), "'");
}

TensorRef require(const Checkpoint& ckpt, const std::string& name, const char* role) {
  auto ref = ckpt.find(name);
  MEGAMOE_CHECK(ref.has_value(), kNotFound, "checkpoint '", ckpt.path(), "' has no tensor '", name,
                "' (", role, ").");
  return *ref;
}

void expect_dtype(const TensorRef& t, std::initializer_list<DType> allowed, const char* role) {
  std::string names;
  for (DType d : allowed) {
    if (d == t.info->dtype) return;
    names += (names.empty() ? "" : " or ") + std::string(dtype_name(d));
  }
  MEGAMOE_FAIL(kInvalidCheckpoint, describe(t), " (", role, ") has dtype ",
               dtype_name(t.info->dtype), "; expected ", names, ".");
}

void expect_shape(const TensorRef& t, const std::vector<int64_t>& shape, const char* role) {
  MEGAMOE_CHECK(t.info->shape == shape, kInvalidCheckpoint, describe(t), " (", role,
                ") has shape ", shape_string(t.info->shape), "; expected ", shape_string(shape),
                ".");
}

// A per-tensor fp32 scalar, stored with shape [] or [1] (both occur in ModelOpt exports).
float read_f32_scalar(const TensorRef& t, const char* role) {
  expect_dtype(t, {DType::F32}, role);
  const auto& shape = t.info->shape;
  MEGAMOE_CHECK(shape.empty() || shape == std::vector<int64_t>{1}, kInvalidCheckpoint,
                describe(t), " (", role, ") has shape ", shape_string(shape),
                "; expected a scalar, shape [] or [1].");
  float v;
  std::memcpy(&v, t.bytes.data(), sizeof(v));
  return v;
}

void expect_positive_finite(float v, const TensorRef& t, const char* role) {
  MEGAMOE_CHECK(std::isfinite(v) && v > 0.0f, kInvalidCheckpoint, describe(t), " (", role,
                ") is ", v, "; it must be finite and > 0.");
}

// The block scales a load checks: rows [row_first, row_first + row_count) and, in each of them,
// blocks [block_first, block_first + block_count); a count of -1 means to the end. The default is
// the whole tensor.
struct ScaleRegion {
  int64_t row_first = 0, row_count = -1;
  int64_t block_first = 0, block_count = -1;
};

// Every block scale byte must be a valid ue4m3 (non-negative, not NaN): a bad one would poison a
// whole 16-element block in the kernels without any error. The table makes the scan of the
// ~700 MB of scales of a DeepSeek-V3 layer a byte lookup per scale. `region` limits the scan to
// the part one tensor-parallel rank reads (load_moe_layer_tp); positions in errors are the whole
// tensor's.
void check_block_scales(const TensorRef& t, int64_t blocks_per_row, const ScaleRegion& region) {
  static const std::array<bool, 256> valid = [] {
    std::array<bool, 256> v{};
    for (int b = 0; b < 256; ++b) v[b] = format::ue4m3_is_valid(static_cast<uint8_t>(b));
    return v;
  }();
  const int64_t rows = static_cast<int64_t>(t.bytes.size()) / blocks_per_row;
  const int64_t row_end = region.row_count < 0 ? rows : region.row_first + region.row_count;
  const int64_t block_end =
      region.block_count < 0 ? blocks_per_row : region.block_first + region.block_count;
  for (int64_t row = region.row_first; row < row_end; ++row) {
    const uint8_t* p = t.bytes.data() + row * blocks_per_row;
    for (int64_t block = region.block_first; block < block_end; ++block) {
      const uint8_t b = p[block];
      if (valid[b]) continue;
      const bool nan = (b & 0x7F) == 0x7F;
      char hex[8];
      std::snprintf(hex, sizeof(hex), "0x%02X", b);
      MEGAMOE_FAIL(kInvalidCheckpoint, describe(t), " has block scale ", hex, " at row ", row,
                   ", block ", block, " (elements ", block * format::kNvfp4BlockSize, " to ",
                   (block + 1) * format::kNvfp4BlockSize - 1, "), which is ",
                   nan ? std::string("NaN")
                       : detail::concat("negative (", format::e4m3_to_f32(b), ")"),
                   "; ue4m3 block scales must be finite and non-negative (NaN scales are valid "
                   "only in ModelOpt's all-zero weight: weight_scale_2 = 0, every block scale "
                   "NaN (0x7F or 0xFF), every code 0x77).");
    }
  }
}

// Keeps every distinct mapped file behind a linear alive (its tensors may sit in different shards).
std::shared_ptr<const void> make_owner(const TensorRef& weight, const TensorRef& scale) {
  if (weight.file == scale.file) return weight.file;
  return std::make_shared<const std::array<std::shared_ptr<const SafetensorsFile>, 2>>(
      std::array{weight.file, scale.file});
}

// A router parameter widened exactly to fp32; every value must be finite.
std::vector<float> load_router_tensor(const TensorRef& t, std::initializer_list<DType> dtypes,
                                      const std::vector<int64_t>& shape, const char* role) {
  expect_dtype(t, dtypes, role);
  expect_shape(t, shape, role);
  const int64_t cols = shape.back();
  std::vector<float> out(static_cast<size_t>(t.info->numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = load_as_f32(t.info->dtype, t.bytes.data(), static_cast<int64_t>(i));
    if (std::isfinite(out[i])) continue;
    const int64_t at = static_cast<int64_t>(i);
    const std::string index = shape.size() == 1 ? std::to_string(at)
                                                : detail::concat(at / cols, ", ", at % cols);
    MEGAMOE_FAIL(kInvalidCheckpoint, describe(t), " (", role, ") holds ", out[i], " at index [",
                 index, "]; router parameters must be finite.");
  }
  return out;
}

std::string why_not_moe(const ModelConfig& c) {
  if (c.architecture == "Qwen3MoeForCausalLM") {
    std::string dense;
    for (int64_t l : c.mlp_only_layers) dense += (dense.empty() ? "" : ", ") + std::to_string(l);
    return detail::concat("num_hidden_layers ", c.num_hidden_layers, ", decoder_sparse_step ",
                          c.decoder_sparse_step, ", mlp_only_layers [", dense, "]");
  }
  return detail::concat("num_hidden_layers ", c.num_hidden_layers, ", first_k_dense_replace ",
                        c.first_k_dense_replace, ", moe_layer_freq ", c.moe_layer_freq);
}

}  // namespace

namespace {

// load_nvfp4_linear, checking the block scales of `region` only.
Nvfp4Linear load_linear(const Checkpoint& ckpt, const std::string& prefix, int64_t out_features,
                        int64_t in_features, const ScaleRegion& region) {
  MEGAMOE_CHECK(out_features >= 1 && in_features >= 1, kInvalidArgument, "NVFP4 linear '", prefix,
                "': out_features ", out_features, " and in_features ", in_features,
                " must both be >= 1.");
  MEGAMOE_CHECK(in_features % format::kNvfp4BlockSize == 0, kInvalidArgument, "NVFP4 linear '",
                prefix, "' in checkpoint '", ckpt.path(), "': in_features (K) ", in_features,
                " is not a multiple of the NVFP4 block size ", format::kNvfp4BlockSize, ".");
  const bool modelopt = ckpt.find(prefix + ".weight").has_value();
  const bool compressed = ckpt.find(prefix + ".weight_packed").has_value();
  MEGAMOE_CHECK(!(modelopt && compressed), kInvalidCheckpoint, "checkpoint '", ckpt.path(),
                "' has both '", prefix, ".weight' (ModelOpt) and '", prefix,
                ".weight_packed' (compressed-tensors); expected one NVFP4 layout.");
  MEGAMOE_CHECK(modelopt || compressed, kNotFound, "checkpoint '", ckpt.path(),
                "' has no NVFP4 weight for '", prefix, "': neither '", prefix,
                ".weight' (ModelOpt) nor '", prefix, ".weight_packed' (compressed-tensors).");

  const TensorRef weight = require(ckpt, prefix + (modelopt ? ".weight" : ".weight_packed"),
                                   "packed e2m1 codes");
  expect_dtype(weight, {DType::U8}, "packed e2m1 codes");
  expect_shape(weight, {out_features, in_features / 2}, "packed e2m1 codes, [out, in/2]");

  const TensorRef scale = require(ckpt, prefix + ".weight_scale", "ue4m3 block scales");
  expect_dtype(scale, {DType::F8_E4M3}, "ue4m3 block scales");
  const int64_t blocks = in_features / format::kNvfp4BlockSize;
  expect_shape(scale, {out_features, blocks}, "ue4m3 block scales, [out, in/16]");

  if (modelopt) {
    // ModelOpt's export of an all-zero weight (format::is_modelopt_zero_weight) is the one place
    // where NaN scales (and a zero global scale) are valid. Its bytes cannot be decoded (NaN
    // times 0), so the layer gets zero codes and zero block scales instead: the same all-zero
    // weight in a form the reference and the kernels take as it is.
    const TensorRef s2 = require(ckpt, prefix + ".weight_scale_2", "fp32 global scale");
    const float global = read_f32_scalar(s2, "fp32 global scale");
    if (format::is_modelopt_zero_weight(
            {out_features, in_features, weight.bytes.data(), scale.bytes.data(), global})) {
      std::fprintf(stderr,
                   "megamoe: warning: '%s' in checkpoint '%s' is ModelOpt's all-zero weight "
                   "(weight_scale_2 = 0, every block scale NaN, every code 0x77); it is loaded "
                   "as zeros.\n",
                   prefix.c_str(), ckpt.path().c_str());
      float input_scale = 0.0f;
      if (const auto in = ckpt.find(prefix + ".input_scale")) {
        input_scale = read_f32_scalar(*in, "static input scale");
        expect_positive_finite(input_scale, *in, "static input scale");
      }
      const int64_t codes = out_features * (in_features / 2);
      return make_owned_linear(out_features, in_features,
                               std::vector<uint8_t>(static_cast<size_t>(codes), 0),
                               std::vector<uint8_t>(static_cast<size_t>(out_features * blocks), 0),
                               1.0f, input_scale);
    }
  }
  check_block_scales(scale, blocks, region);

  Nvfp4Linear lin;
  lin.out_features = out_features;
  lin.in_features = in_features;
  lin.weight = weight.bytes.data();
  lin.weight_scale = scale.bytes.data();
  lin.owner = make_owner(weight, scale);

  if (modelopt) {
    const TensorRef s2 = require(ckpt, prefix + ".weight_scale_2", "fp32 global scale");
    lin.weight_scale_2 = read_f32_scalar(s2, "fp32 global scale");
    MEGAMOE_CHECK(std::isfinite(lin.weight_scale_2) && lin.weight_scale_2 > 0.0f,
                  kInvalidCheckpoint, describe(s2), " (fp32 global scale) is ",
                  lin.weight_scale_2, "; it must be finite and > 0 (0 only in ModelOpt's "
                  "all-zero weight: every block scale NaN, every code 0x77).");
    if (const auto in = ckpt.find(prefix + ".input_scale")) {
      lin.input_scale = read_f32_scalar(*in, "static input scale");
      expect_positive_finite(lin.input_scale, *in, "static input scale");
    }
  } else {
    // compressed-tensors stores the reciprocal of ModelOpt's scales (2688/amax, not amax/2688).
    const TensorRef g = require(ckpt, prefix + ".weight_global_scale",
                                "fp32 reciprocal global scale");
    const float global = read_f32_scalar(g, "fp32 reciprocal global scale");
    expect_positive_finite(global, g, "fp32 reciprocal global scale");
    lin.weight_scale_2 = 1.0f / global;
    expect_positive_finite(lin.weight_scale_2, g, "reciprocal of the global scale");
    if (const auto in = ckpt.find(prefix + ".input_global_scale")) {
      const float input_global = read_f32_scalar(*in, "fp32 reciprocal input scale");
      expect_positive_finite(input_global, *in, "fp32 reciprocal input scale");
      lin.input_scale = 1.0f / input_global;
      expect_positive_finite(lin.input_scale, *in, "reciprocal of the input scale");
    }
  }
  // The largest weight is 6 x 448 x weight_scale_2. No finite fp32 amax gives a ModelOpt scale
  // (amax/2688) above FLT_MAX/2688, so one above it is corruption, and it would dequantize
  // finite codes to Inf. Below it, a large scale is accepted: the weights are finite, and an
  // output beyond the bf16 range is what the layer computes (README, "Accepted inputs").
  const float max_global_scale = std::numeric_limits<float>::max() / 2688.0f;
  MEGAMOE_CHECK(lin.weight_scale_2 <= max_global_scale, kInvalidCheckpoint, "NVFP4 linear '",
                prefix, "' in checkpoint '", ckpt.path(), "' has global scale ",
                lin.weight_scale_2, " (as weight_scale_2); at most ", max_global_scale,
                " (FLT_MAX/2688) is allowed, or its largest weight 6 x 448 x scale is not a "
                "finite fp32.");
  return lin;
}

}  // namespace

Nvfp4Linear load_nvfp4_linear(const Checkpoint& ckpt, const std::string& prefix,
                              int64_t out_features, int64_t in_features) {
  return load_linear(ckpt, prefix, out_features, in_features, ScaleRegion{});
}

namespace {

// load_moe_layer, or with `tp` load_moe_layer_tp: the whole layer's linears are mapped (views, no
// copy) but only the rank's slice of each is checked, then tp_local_layer slices them.
MoeLayer load_layer(const Checkpoint& ckpt, const ModelConfig& config, int64_t layer,
                    const std::optional<TpConfig>& tp) {
  MEGAMOE_CHECK(config.is_moe_layer(layer), kInvalidArgument, "layer ", layer, " of the ",
                config.architecture, " model in '", ckpt.path(), "' is not a MoE layer (",
                why_not_moe(config), ").");
  const int64_t H = config.hidden_size;
  const int64_t I = config.moe_intermediate_size;
  const int64_t E = config.num_experts;
  for (const auto& [name, value] : {std::pair{"hidden_size", H}, std::pair{"moe_intermediate_size", I}}) {
    MEGAMOE_CHECK(value >= 1 && value % format::kNvfp4BlockSize == 0, kInvalidCheckpoint,
                  "the config of '", ckpt.path(), "' has ", name, " ", value,
                  ", which is not a positive multiple of the NVFP4 block size ",
                  format::kNvfp4BlockSize, " (K of the expert GEMMs).");
  }

  const std::string mlp = "model.layers." + std::to_string(layer) + ".mlp";
  MoeLayer out;
  out.hidden_size = H;
  out.intermediate_size = I;
  out.num_experts = E;
  out.routing = config.routing();
  out.swiglu_limit = config.swiglu_limit;

  // The config's expert count is checked against the checkpoint before anything is sized by it:
  // a count of 2^31 - 1 would otherwise ask for hundreds of GB before the first missing tensor.
  const std::string last = mlp + ".experts." + std::to_string(E - 1) + ".down_proj";
  const bool last_modelopt = ckpt.find(last + ".weight").has_value();
  const bool last_compressed = ckpt.find(last + ".weight_packed").has_value();
  MEGAMOE_CHECK(last_modelopt || last_compressed, kInvalidCheckpoint, "the config of '",
                ckpt.path(), "' declares ", E, " routed experts, but checkpoint '", ckpt.path(),
                "' has no tensor '", last, ".weight' (or '.weight_packed') for expert ", E - 1,
                " of layer ", layer, "; the config's expert count must match the checkpoint.");
  // The config's quantization method (when it names one) must agree with the tensors' names:
  // the names decide how the global scale is read (ModelOpt multiplies, compressed-tensors
  // stores the reciprocal), so a disagreement means a mislabelled or half-converted checkpoint.
  if (config.quant_format != QuantFormat::kUnquantized) {
    const QuantFormat by_names =
        last_modelopt ? QuantFormat::kModelOptNvfp4 : QuantFormat::kCompressedTensorsNvfp4;
    MEGAMOE_CHECK(by_names == config.quant_format, kInvalidCheckpoint, "the config of '",
                  ckpt.path(), "' declares ", quant_format_name(config.quant_format),
                  " quantization, but the tensors of layer ", layer, " use ",
                  quant_format_name(by_names), " names ('", last,
                  last_modelopt ? ".weight'" : ".weight_packed'",
                  "); the config and the tensor names must agree.");
  }
  // The block scales one expert's load checks: all of them, or a TP rank's slice (gate and up:
  // its rows of [I, H]; down: its columns of [H, I], i.e. its blocks of every row).
  struct ExpertRegions {
    ScaleRegion rows, columns;
  };
  const auto regions = [&](int64_t inter, const char* what) {
    if (!tp) return ExpertRegions{};
    const TpRange r = tp_range(inter, *tp, what);
    return ExpertRegions{ScaleRegion{r.first, r.count, 0, -1},
                         ScaleRegion{0, -1, r.first / format::kNvfp4BlockSize,
                                     r.count / format::kNvfp4BlockSize}};
  };
  const ExpertRegions routed = regions(I, "moe_intermediate_size");
  if (tp && config.n_shared_experts > 0) {
    // Refused before any tensor data is read (the shared expert's I is n_shared x I, checked below).
    regions(int64_t(config.n_shared_experts) * I, "the shared expert's intermediate size");
  }
  out.experts.reserve(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    const std::string p = mlp + ".experts." + std::to_string(e);
    out.experts.push_back({load_linear(ckpt, p + ".gate_proj", I, H, routed.rows),
                           load_linear(ckpt, p + ".up_proj", I, H, routed.rows),
                           load_linear(ckpt, p + ".down_proj", H, I, routed.columns)});
  }

  if (config.n_shared_experts > 0) {
    const std::string p = mlp + ".shared_experts";
    const int64_t expected = int64_t(config.n_shared_experts) * I;
    // The shared expert's width comes from the checkpoint, and must agree with the config.
    int64_t shared_i = expected;
    for (const char* w : {".gate_proj.weight", ".gate_proj.weight_packed"}) {
      if (const auto t = ckpt.find(p + w); t && t->info->shape.size() == 2) {
        shared_i = t->info->shape[0];
        MEGAMOE_CHECK(shared_i == expected, kInvalidCheckpoint, describe(*t), " has ", shared_i,
                      " rows, but the config's n_shared_experts (", config.n_shared_experts,
                      ") x moe_intermediate_size (", I, ") = ", expected, ".");
      }
    }
    const ExpertRegions shared = regions(shared_i, "the shared expert's intermediate size");
    out.shared_expert = ExpertWeights{load_linear(ckpt, p + ".gate_proj", shared_i, H, shared.rows),
                                      load_linear(ckpt, p + ".up_proj", shared_i, H, shared.rows),
                                      load_linear(ckpt, p + ".down_proj", H, shared_i, shared.columns)};
  }

  // The router is optional (callers may route themselves), but when present it must be right.
  if (const auto gate = ckpt.find(mlp + ".gate.weight")) {
    out.router_weight = load_router_tensor(*gate, {DType::BF16, DType::F16, DType::F32}, {E, H},
                                           "router weight, [experts, hidden]");
  }
  if (out.routing.kind == RoutingKind::kNoauxTc) {
    const TensorRef bias = require(ckpt, mlp + ".gate.e_score_correction_bias",
                                   "noaux_tc routing needs the router's correction bias");
    out.e_score_correction_bias = load_router_tensor(bias, {DType::F32, DType::BF16}, {E},
                                                     "router correction bias, [experts]");
  }
  if (tp) return tp_local_layer(out, *tp);  // validates the layer first
  out.validate();
  return out;
}

}  // namespace

MoeLayer load_moe_layer(const Checkpoint& ckpt, const ModelConfig& config, int64_t layer) {
  return load_layer(ckpt, config, layer, std::nullopt);
}

MoeLayer load_moe_layer_tp(const Checkpoint& ckpt, const ModelConfig& config, int64_t layer,
                           const TpConfig& tp) {
  return load_layer(ckpt, config, layer, tp);
}

}  // namespace megamoe
