// The GPU MoE operator (Hopper, W4A16): build a plan once, upload the weights once, then run()
// any number of times. run() never allocates, never synchronises the host and is CUDA-graph
// capturable; every buffer it touches is sized by the plan for `max_tokens`.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "megamoe/moe.h"

namespace megamoe {

// The shape of the problem (what the plan validates and sizes the workspace for).
struct MoeProblem {
  int64_t hidden_size = 0;               // H: a multiple of 64
  int64_t intermediate_size = 0;         // I of a routed expert: a multiple of 64
  int64_t num_experts = 0;               // E routed experts, 1..1024
  int top_k = 0;                         // 1..min(E, 16)
  int64_t shared_intermediate_size = 0;  // 0: no shared expert; else a multiple of I
  int64_t max_tokens = 0;                // largest T any run() may pass
  std::optional<float> swiglu_limit;     // clamp gate <= L, |up| <= L before SwiGLU
  bool deterministic = false;            // fixed-order combine: bitwise identical runs

  static MoeProblem from_layer(const MoeLayer& layer, int64_t max_tokens);
};

// One grouped-GEMM configuration (whitelisted: see sm90_moe_heuristics.cpp).
struct GemmConfig {
  int warpgroups = 1;  // consumer warpgroups per CTA: BLOCK_M = 64 * warpgroups
  int block_n = 16;    // tokens per tile (wgmma N)
  int stages = 4;      // cp.async pipeline depth
  std::string to_string() const;
};
struct MoeConfig {
  GemmConfig l1;  // x · W13ᵀ + SwiGLU
  GemmConfig l2;  // a · W2ᵀ + combine
  std::string to_string() const;
};

// The heuristic: a pure function of the problem and the token count (printable).
MoeConfig choose_moe_config(const MoeProblem& problem, int64_t tokens);

// Prepacked weights on the device (owned). Built once from a layer; the NVFP4 bits are the
// checkpoint's, reshuffled for the kernels, never decoded into memory.
class MoeDeviceWeights {
 public:
  static MoeDeviceWeights upload(const MoeLayer& layer, cudaStream_t stream = nullptr);
  MoeDeviceWeights(MoeDeviceWeights&&) noexcept;
  MoeDeviceWeights& operator=(MoeDeviceWeights&&) noexcept;
  ~MoeDeviceWeights();
  size_t device_bytes() const;
  struct Impl;
  const Impl& impl() const { return *impl_; }

 private:
  MoeDeviceWeights();
  std::unique_ptr<Impl> impl_;
};

struct MoeRunArgs {
  const uint16_t* hidden = nullptr;      // [T, H] bf16, device
  const int32_t* topk_ids = nullptr;     // [T, top_k] int32, device; ids outside [0, E) are
                                         // counted (see MoePlan::invalid_id_count) and skipped
  const float* topk_weights = nullptr;   // [T, top_k] fp32, device
  int64_t tokens = 0;                    // T <= max_tokens
  uint16_t* output = nullptr;            // [T, H] bf16, device
  void* workspace = nullptr;             // MoePlan::workspace_bytes(), 256-byte aligned
};

class MoePlan {
 public:
  // Validates the problem against what the sm90 kernels support and the current device.
  // Throws megamoe::Error(kUnsupported / kInvalidArgument) saying what is allowed.
  static MoePlan create(const MoeProblem& problem);
  const MoeProblem& problem() const { return problem_; }
  size_t workspace_bytes() const;
  int num_sms() const { return num_sms_; }
  // The configuration run() will use for T tokens, as text.
  std::string describe(int64_t tokens) const;
  // Number of top-k ids outside [0, E) seen by the last run() that used `workspace`
  // (synchronises `stream`; call outside graph capture).
  int64_t invalid_id_count(const void* workspace, cudaStream_t stream) const;

 private:
  MoeProblem problem_;
  int num_sms_ = 0;
};

// Runs the MoE layer. Checks arguments on the host (shapes, null pointers, alignment) without
// touching the device; launches only.
void run(const MoePlan& plan, const MoeDeviceWeights& weights, const MoeRunArgs& args,
         cudaStream_t stream);

}  // namespace megamoe
