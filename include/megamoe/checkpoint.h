// Checkpoints on disk: one file or a sharded directory, the HF config.json, and the loader of one
// MoE layer in ModelOpt NVFP4 or compressed-tensors NVFP4.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "megamoe/moe.h"
#include "megamoe/safetensors.h"
#include "megamoe/tp.h"

namespace megamoe {

// A tensor found in a checkpoint: its description, the file that holds it, its bytes.
struct TensorRef {
  const TensorInfo* info = nullptr;
  std::shared_ptr<const SafetensorsFile> file;
  std::span<const uint8_t> bytes;
};

class Checkpoint {
 public:
  // `path` is a .safetensors file, or a directory holding model.safetensors.index.json
  // (sharded; its weight_map names the shard of every tensor) or exactly one *.safetensors.
  static Checkpoint open(const std::string& path);

  const std::string& path() const { return path_; }
  std::optional<TensorRef> find(const std::string& name) const;
  // Throws megamoe::Error(kNotFound) naming the tensor and the checkpoint.
  TensorRef get(const std::string& name) const;
  std::vector<std::string> tensor_names() const;  // sorted
  const std::vector<std::shared_ptr<const SafetensorsFile>>& files() const { return files_; }

 private:
  std::string path_;
  std::vector<std::shared_ptr<const SafetensorsFile>> files_;
  std::vector<std::pair<std::string, size_t>> where_;  // sorted by name -> index in files_
};

enum class QuantFormat { kUnquantized, kModelOptNvfp4, kCompressedTensorsNvfp4 };
const char* quant_format_name(QuantFormat f);

// The fields of an HF config.json that matter to a MoE layer, with HF's names and meanings.
struct ModelConfig {
  std::string architecture;       // "DeepseekV3ForCausalLM" or "Qwen3MoeForCausalLM"
  std::string model_type;         // "deepseek_v3", "qwen3_moe"
  int64_t hidden_size = 0;
  int64_t moe_intermediate_size = 0;
  int64_t num_experts = 0;        // n_routed_experts (DeepSeek) / num_experts (Qwen3)
  int num_experts_per_tok = 0;
  int n_shared_experts = 0;       // DeepSeek; the shared expert's I is n_shared * moe_I
  int64_t num_hidden_layers = 0;
  int first_k_dense_replace = 0;  // DeepSeek: layers below are dense
  int moe_layer_freq = 1;         // DeepSeek
  int decoder_sparse_step = 1;    // Qwen3: layer L is MoE iff (L+1) % step == 0
  std::vector<int64_t> mlp_only_layers;  // Qwen3: dense layers
  bool norm_topk_prob = true;
  std::string scoring_func;       // "sigmoid" (DeepSeek-V3) / "softmax"
  std::string topk_method;        // "noaux_tc" / "greedy" ...
  int n_group = 1;
  int topk_group = 1;
  float routed_scaling_factor = 1.0f;
  std::string hidden_act = "silu";
  std::optional<float> swiglu_limit;  // DeepSeek-V4-style clamp, when present
  QuantFormat quant_format = QuantFormat::kUnquantized;  // from quantization_config / hf_quant_config.json

  bool is_moe_layer(int64_t layer) const;
  RoutingConfig routing() const;
};

// Reads `dir`/config.json (and `dir`/hf_quant_config.json when present). Errors name the file and
// the field (missing, wrong type, out of range, unsupported architecture).
ModelConfig load_model_config(const std::string& dir);

// Loads model.layers.{layer}.mlp: routed experts, optional shared_experts, gate.weight and
// gate.e_score_correction_bias. Detects ModelOpt (weight, weight_scale, weight_scale_2) or
// compressed-tensors (weight_packed, weight_scale, weight_global_scale = reciprocal) per tensor
// names. Tensor bytes stay in the mapped files (no copy). Every error names the file, the
// tensor and what is wrong: missing tensor, wrong dtype or shape, K not a multiple of 16,
// NaN/negative/infinite scales, non-MoE layer. The one exception is ModelOpt's export of an
// all-zero weight (format::is_modelopt_zero_weight: weight_scale_2 = 0, every block scale NaN,
// every code 0x77): it loads, with a warning on stderr naming the tensor, as zero codes, zero
// block scales and weight_scale_2 = 1 (the same zero weight, decodable).
MoeLayer load_moe_layer(const Checkpoint& ckpt, const ModelConfig& config, int64_t layer);

// load_moe_layer for one TP rank: the same checks on the rank's slice only (gate/up: its rows;
// down: its columns of every row), so a rank reads its share of the checkpoint, not the whole
// layer (page granularity: docs/design.md §7.1). Bytes outside the slice are not read, so a bad
// scale byte there is not reported; a tensor whose global scale is 0 is read whole and checked
// against ModelOpt's all-zero signature. For a valid checkpoint, returns what
// tp_local_layer(load_moe_layer(...), tp) returns. Throws what load_moe_layer throws, and
// tp_range's errors before anything is read.
MoeLayer load_moe_layer_tp(const Checkpoint& ckpt, const ModelConfig& config, int64_t layer,
                           const TpConfig& tp);

// Reads one NVFP4 linear `prefix`.{weight,weight_scale,weight_scale_2[,input_scale]} (or the
// compressed-tensors names) with the expected shape [out, in]; checked, and ModelOpt's all-zero
// weight mapped, as load_moe_layer says.
Nvfp4Linear load_nvfp4_linear(const Checkpoint& ckpt, const std::string& prefix,
                              int64_t out_features, int64_t in_features);

}  // namespace megamoe
