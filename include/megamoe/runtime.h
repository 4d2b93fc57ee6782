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
  int k_splits = 1;    // K slices per output tile, added atomically (L2 atomic combine only)
  // Tokens an expert's last tile may hold beyond the others: tiles step by block_n - last_tile_extra
  // tokens, and a remainder of up to last_tile_extra tokens joins the last full tile.
  int last_tile_extra = 0;
  // Each warpgroup decodes a k16 step while its previous step's wgmma runs (the overlapped K loop,
  // sm90_w4a16_grouped_gemm.cuh), at two token widths: block_n and a narrower one.
  bool overlapped = false;
  int tile_step() const { return block_n - last_tile_extra; }
  std::string to_string() const;
};
// The prefill tile: two warpgroups (BLOCK_M = 128) on a 128-token tile, two CTAs per SM.
inline constexpr GemmConfig kPrefillTile{2, 128, 4};
// The same tile with the overlapped K loop, for experts of many tokens (token widths 64 and 128).
inline constexpr GemmConfig kOverlappedPrefillTile{2, 128, 4, 1, 0, true};
// The absorbing prefill tile: four warpgroups (BLOCK_M = 256), 128-token tiles of which an
// expert's last takes up to 32 tokens more (sm90_w4a16_grouped_gemm.cuh, gemm_item_overlapped).
inline constexpr GemmConfig kAbsorbingTile{4, 160, 6, 1, 32, true};
// The decode tiles the fused L1 + L2 launch is built for: the 16-token tile (the heuristic's
// fused choice, and the one a forced fused launch runs) and the 32-token tile (where it decodes
// fewer weights; see sm90_moe_heuristics.cpp).
inline constexpr GemmConfig kFusedTile{1, 16, 8};
inline constexpr GemmConfig kFusedTile32{1, 32, 6};
// CTAs per SM of those tiles' kernels (their launch bounds: <= 80 and <= 96 registers), which the
// heuristic's count of CTA slots assumes.
inline constexpr int kFusedTileCtasPerSm = 6;
inline constexpr int kFusedTile32CtasPerSm = 5;
// Early start (a tiny batch's L1 CTAs compute their first work item from the top-k ids and run it
// while the dispatch kernel still runs) holds up to this many routed selections (T * k: one per
// lane of a warp) and slots (T * (k + shared slices)).
inline constexpr int64_t kEarlyStartMaxSelections = 32;
inline constexpr int64_t kEarlyStartMaxSlots = 64;
struct MoeConfig {
  GemmConfig l1;       // x · W13ᵀ + SwiGLU
  GemmConfig l2;       // a · W2ᵀ + combine
  bool fused = false;  // L1 and L2 in one persistent launch (needs can_fuse)
  bool early_start = false;  // L1's first items start before the dispatch completes (tiny T)
  std::string to_string() const;
  // Whether both GEMMs run the same fused tile, kFusedTile or kFusedTile32 (K slices aside), so
  // that they may run fused.
  bool can_fuse() const;
};

// Whether a batch of `tokens` is small enough for early start (kEarlyStartMaxSelections,
// kEarlyStartMaxSlots).
bool can_start_early(const MoeProblem& problem, int64_t tokens);

// Whether both GEMMs can run the absorbing tile (kAbsorbingTile): 2I and H multiples of its
// 256-row blocks.
bool can_absorb(const MoeProblem& problem);

// The heuristic: a pure function of the problem, the token count and the device's SM count
// (printable). `fused`, where set, replaces its choice of launch (MoeTuning::fused) before the
// tiles that depend on it are chosen: two launches may take a wider decode tile than the fused
// launch's. `absorbing_tile` (MoeTuning::absorbing_tile): true runs both GEMMs on the absorbing
// tile where can_absorb (MoePlan::config rejects the rest); false leaves it out, for the tile
// the heuristic picks without it.
MoeConfig choose_moe_config(const MoeProblem& problem, int64_t tokens, int num_sms = 132,
                            std::optional<bool> fused = std::nullopt, std::optional<bool> absorbing_tile = std::nullopt);

// Overrides of the heuristic, for tuning and tests; unset fields keep the heuristic's choice.
// MoePlan::config() rejects an override the kernels cannot run, saying what is allowed.
struct MoeTuning {
  // The fused L1 + L2 launch. true runs it on the 16-token tile up to 16 tokens per expert, and on
  // the 32-token tile from 17 to 24 (the tile the heuristic picks there); past 24 there is no
  // fused kernel. Its CTAs wait on each other, so its grid (sized by the occupancy on every SM of
  // the device) must be resident at once: where the process gets only part of the SMs (an MPS
  // active-thread limit, a green context), set it to false.
  std::optional<bool> fused;
  // Early start (only where can_start_early); false waits for the dispatch before L1's first items.
  std::optional<bool> early_start;
  // The absorbing prefill tile (kAbsorbingTile) in both GEMMs. true needs 2I and H multiples of
  // 256 (its 256-row blocks) and runs two launches without early start; false never uses it.
  std::optional<bool> absorbing_tile;
};

// The stacked NVFP4 expert layout inference engines keep on the GPU (DESIGN.md §2): DEVICE
// pointers to row-major, contiguous tensors. Codes are packed e2m1 (element 2j in the low nibble),
// block scales ue4m3 bytes (one per 16 elements along K), global scales fp32 (multiply).
struct StackedNvfp4Weights {
  int64_t hidden_size = 0;        // H
  int64_t intermediate_size = 0;  // I of a routed expert
  int64_t num_experts = 0;        // E
  const uint8_t* w13 = nullptr;        // [E, 2I, H/2]: rows 0..I-1 gate, I..2I-1 up
  const uint8_t* w13_scale = nullptr;  // [E, 2I, H/16]
  const float* w13_scale_2 = nullptr;  // [E, 2]: (gate, up) of each expert
  const uint8_t* w2 = nullptr;         // [E, H, I/2]
  const uint8_t* w2_scale = nullptr;   // [E, H, I/16]
  const float* w2_scale_2 = nullptr;   // [E]
  // The optional shared expert (every token, weight 1): the same layout without the E axis, with
  // its own intermediate size Is (0: none; the other shared pointers are then ignored).
  int64_t shared_intermediate_size = 0;
  const uint8_t* shared_w13 = nullptr;        // [2Is, H/2]
  const uint8_t* shared_w13_scale = nullptr;  // [2Is, H/16]
  const float* shared_w13_scale_2 = nullptr;  // [2]: (gate, up)
  const uint8_t* shared_w2 = nullptr;         // [H, Is/2]
  const uint8_t* shared_w2_scale = nullptr;   // [H, Is/16]
  const float* shared_w2_scale_2 = nullptr;   // [1]
};

// Prepacked weights on the device (owned). Built once from a layer; the NVFP4 bits are the
// checkpoint's, reshuffled for the kernels, never decoded into memory.
class MoeDeviceWeights {
 public:
  // Prepacks on all host cores and copies on `stream`; returns once the copies have landed.
  static MoeDeviceWeights upload(const MoeLayer& layer, cudaStream_t stream = nullptr);
  // The same prepacked weights from the stacked device layout. A one-time load step, not for a
  // forward pass: it copies the tensors to the host (after the work already queued on `stream`),
  // checks every block scale (finite, non-negative ue4m3) and global scale (finite, > 0),
  // prepacks and uploads them as upload() does, and synchronises the device before returning.
  // Needs host memory for one copy of the layer's NVFP4 bytes. Throws megamoe::Error
  // (kInvalidArgument) naming the tensor and the first bad value, or (kCuda).
  static MoeDeviceWeights from_stacked(const StackedNvfp4Weights& weights,
                                       cudaStream_t stream = nullptr);
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
  static MoePlan create(const MoeProblem& problem, const MoeTuning& tuning = {});
  const MoeProblem& problem() const { return problem_; }
  const MoeTuning& tuning() const { return tuning_; }
  // The configuration run() uses for T tokens: the heuristic's, with the tuning overrides.
  // Throws megamoe::Error(kInvalidArgument) when an override cannot run at this T.
  MoeConfig config(int64_t tokens) const;
  size_t workspace_bytes() const;
  int num_sms() const { return num_sms_; }
  // The configuration run() will use for T tokens, as text.
  std::string describe(int64_t tokens) const;
  // Number of top-k ids outside [0, E) seen by the last run() that used `workspace`
  // (synchronises `stream`; call outside graph capture).
  int64_t invalid_id_count(const void* workspace, cudaStream_t stream) const;

 private:
  MoeProblem problem_;
  MoeTuning tuning_;
  int num_sms_ = 0;
};

// Runs the MoE layer. Checks arguments on the host (shapes, null pointers, alignment) without
// touching the device; launches only.
void run(const MoePlan& plan, const MoeDeviceWeights& weights, const MoeRunArgs& args,
         cudaStream_t stream);

// Router logits to top-k ids and weights on the device (DESIGN.md §2): the selection and the
// weights of reference::route, computed the same way in double precision (so ties go to the lower
// expert index and rows list experts by selection score descending, exactly as there). Weights
// may differ from the reference's in the last fp32 bit where the device's exp() differs from the
// host's by an ulp. Never allocates or synchronises: CUDA-graph capturable.
struct RouteArgs {
  const float* logits = nullptr;  // [T, E] fp32, device; expected finite (not checked: with a
                                  // non-finite logit the ids are still distinct and in [0, E),
                                  // the weights are unspecified)
  const float* bias = nullptr;    // [E] fp32, device: noaux_tc e_score_correction_bias, or null
  int64_t tokens = 0;             // T
  int64_t num_experts = 0;        // E, 1..kRouteMaxExperts
  int32_t* topk_ids = nullptr;    // [T, top_k] int32, device (written)
  float* topk_weights = nullptr;  // [T, top_k] fp32, device (written)
};
inline constexpr int64_t kRouteMaxExperts = 4096;
// Throws megamoe::Error(kInvalidArgument) for the configurations reference::route rejects (top_k,
// scaling factor, groups), null pointers or E outside 1..kRouteMaxExperts; launches on `stream`.
void route_topk(const RoutingConfig& cfg, const RouteArgs& args, cudaStream_t stream);

}  // namespace megamoe
