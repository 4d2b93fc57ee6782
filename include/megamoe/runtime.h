// The GPU MoE operator: build a plan once, upload the weights once, then run() any number of
// times. run() never allocates, never synchronises the host and is CUDA-graph capturable; every
// buffer it touches is sized by the plan for `max_tokens`.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "megamoe/moe.h"
#include "megamoe/precision.h"

namespace megamoe {

namespace runtime {
class MoeBackend;
struct PlanAccess;
struct DeviceWeightsAccess;
}  // namespace runtime

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
  // The GEMMs' arithmetic (precision.h). MoePlan::create picks the kernels for it on the current
  // device and rejects a precision this build has none for; kAuto is resolved per T
  // (MoePlan::resolved_precision).
  Precision precision = Precision::kW4a16;

  static MoeProblem from_layer(const MoeLayer& layer, int64_t max_tokens);
};

// Overrides of the heuristic, for tuning and tests; unset fields keep the heuristic's choice.
// run() and MoePlan::describe reject an override the kernels cannot run at a given T, saying
// what is allowed.
struct MoeTuning {
  // The fused L1 + L2 launch. true runs it on the 16-token tile up to 16 tokens per expert, and on
  // the 32-token tile from 17 to 24 (the tile the heuristic picks there); past 24 there is no
  // fused kernel. Its CTAs wait on each other, so its grid (sized by the occupancy on every SM of
  // the device, or of num_sms below) must be resident at once: where the process gets only part of
  // the SMs and does not say so in num_sms (an MPS active-thread limit), set it to false.
  std::optional<bool> fused;
  // Early start (up to 32 routed selections T * top_k and 64 slots T * (top_k + shared slices));
  // false waits for the dispatch before L1's first items.
  std::optional<bool> early_start;
  // The absorbing prefill tile (four warpgroups, 128-token tiles whose last takes up to 32 more)
  // in both GEMMs. true needs 2I and H multiples of
  // 256 (its 256-row blocks) and runs two launches without early start; false never uses it.
  std::optional<bool> absorbing_tile;
  // The SMs this plan's kernels get, where that is fewer than the device's: a green context's
  // partition (EpLoopback gives each virtual rank one). Sizes every grid and the heuristic's
  // choices; 1..the device's SM count.
  std::optional<int> num_sms;
  // One GEMM's tile, named as in the backend's tile table (sm_90 w4a16: decode16, decode32,
  // decode48, middle64, prefill128, overlapped128, absorbing160; sm_90 w4a8: fp8_narrow32,
  // fp8_single128, fp8_tall128, fp8_wide256, fp8_absorb160), in place of the heuristic's: for measuring the
  // heuristic's choices. What follows is w4a16's; w4a8 takes only the names. With either set the layer runs two launches (fused only
  // where `fused` is true and both GEMMs take one fusable tile) without early start; neither may be
  // set with absorbing_tile. run() and MoePlan::describe reject an unknown name (listing the
  // table) and a tile whose row blocks do not divide the GEMM's rows (2I for L1, H for L2).
  std::optional<std::string> l1_tile;
  std::optional<std::string> l2_tile;
  // sm_90 w4a16: L1's K slices (1 keeps L1 whole; up to 4), the tile's last-arriving slice adding the
  // slices' fp32 sums in a fixed order and running the SwiGLU. Needs L1 on decode16 or decode32, at
  // most 64 slots (T * (top_k + shared slices)) and H / 64 a multiple of it; a gated run keeps L1
  // whole. Unset: the heuristic's choice.
  std::optional<int> l1_k_splits;
  // sm_90 w4a16: CTAs per SM of the fused launch's grid, in place of the heuristic's (the
  // kernel's occupancy, or L1's items per SM where that is fewer); the tile's occupancy caps it
  // (MoePlan::describe names the grid that runs).
  // Only where the layer runs the fused launch at T. Unset: the heuristic's choice.
  std::optional<int> fused_ctas_per_sm;
};

// The stacked NVFP4 expert layout inference engines keep on the GPU (docs/design.md §2): DEVICE
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

// The same tensors, writable: what MoeDeviceWeights::prepack_in_place rewrites and
// unprepack_stacked writes (device or host pointers there). For prepack_in_place the routed and the
// shared expert's tensors of each kind are one allocation: shared_w13 starts where w13 ends, and
// likewise shared_w13_scale, shared_w2 and shared_w2_scale (the kernels address all virtual
// experts from one base).
struct StackedNvfp4Buffers {
  int64_t hidden_size = 0, intermediate_size = 0, num_experts = 0, shared_intermediate_size = 0;
  uint8_t* w13 = nullptr;
  uint8_t* w13_scale = nullptr;
  float* w13_scale_2 = nullptr;
  uint8_t* w2 = nullptr;
  uint8_t* w2_scale = nullptr;
  float* w2_scale_2 = nullptr;
  uint8_t* shared_w13 = nullptr;
  uint8_t* shared_w13_scale = nullptr;
  float* shared_w13_scale_2 = nullptr;
  uint8_t* shared_w2 = nullptr;
  uint8_t* shared_w2_scale = nullptr;
  float* shared_w2_scale_2 = nullptr;

  StackedNvfp4Weights as_const() const;
};

// Prepacked weights on the device, in the layout of the current architecture's exact backend row
// (layout()). Built once from a layer; the NVFP4 bits are the checkpoint's, reshuffled for the
// kernels, never decoded into memory. Owned (upload, from_stacked), or written over and viewing
// the caller's tensors (prepack_in_place, view_prepacked): then the layer is held once on the GPU.
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
  // from_stacked without a second copy: the prepacked bytes overwrite the caller's w13, w13_scale,
  // w2 and w2_scale (and the shared expert's), and ModelOpt's all-zero weights are rewritten as
  // zero codes and scales with global scale 1 in place too (every weight keeps its value). The
  // result views that memory: keep it alive and unchanged while the weights are used;
  // unprepack_stacked restores the checkpoint layout. Checks as from_stacked, before the first
  // write; after a CUDA error during the writes the tensors' content is unspecified. Device
  // pointers, 16-byte aligned; with a shared expert, one allocation per kind (StackedNvfp4Buffers).
  static MoeDeviceWeights prepack_in_place(const StackedNvfp4Buffers& buffers,
                                           cudaStream_t stream = nullptr);
  // Weights viewing tensors that prepack_in_place has already rewritten on a device of the same
  // layout (another plan over the same layer, or tensors moved since): copies only the global
  // scales (checked: finite, > 0), checks nothing of the codes and block scales. Synchronises the
  // device.
  static MoeDeviceWeights view_prepacked(const StackedNvfp4Weights& prepacked,
                                         cudaStream_t stream = nullptr);
  MoeDeviceWeights(MoeDeviceWeights&&) noexcept;
  MoeDeviceWeights& operator=(MoeDeviceWeights&&) noexcept;
  ~MoeDeviceWeights();
  // Device memory this object allocated (the global scales alone where it views the caller's).
  size_t device_bytes() const;
  const char* layout() const;  // "sm90-prepacked-nvfp4"
  bool views_caller_memory() const;

 private:
  struct Impl;
  friend struct runtime::DeviceWeightsAccess;  // the runtime's view of the device tensors
  MoeDeviceWeights();
  std::unique_ptr<Impl> impl_;
};

// The prepacked layout MoeDeviceWeights uses on the current device ("sm90-prepacked-nvfp4");
// throws megamoe::Error(kUnsupported) where this build has no kernels for it.
std::string prepacked_layout();

// prepack_in_place's inverse: reads a layer in `layout` (as prepack_in_place wrote it) and writes
// it to `out` in the checkpoint layout, global scales included. Pointers may be device or host
// memory; `out` may be `prepacked`'s own memory (restores it in place). A one-time step: copies
// the layer through the host and synchronises the device. Throws megamoe::Error(kInvalidArgument)
// naming an unknown layout (and the built ones) or a bad shape.
void unprepack_stacked(const std::string& layout, const StackedNvfp4Weights& prepacked,
                       const StackedNvfp4Buffers& out, cudaStream_t stream = nullptr);

struct MoeRunArgs {
  const uint16_t* hidden = nullptr;      // [T, H] bf16, device
  const int32_t* topk_ids = nullptr;     // [T, top_k] int32, device; ids outside [0, E) are
                                         // counted (see MoePlan::invalid_id_count) and skipped
  const float* topk_weights = nullptr;   // [T, top_k] fp32, device
  int64_t tokens = 0;                    // T <= max_tokens
  uint16_t* output = nullptr;            // [T, H] bf16, device
  void* workspace = nullptr;             // MoePlan::workspace_bytes(), 256-byte aligned
  float* output_f32 = nullptr;           // instead of output (null then): [T, H] fp32, the sum before its
                                         // bf16 rounding (for callers that add partial layers)
};

class MoePlan {
 public:
  // Validates the problem and chooses the kernels for it on the current device. Throws
  // megamoe::Error(kUnsupported / kInvalidArgument) saying what is allowed: kUnsupported where
  // this build has no kernels for the device or the precision (the message lists what it has).
  static MoePlan create(const MoeProblem& problem, const MoeTuning& tuning = {});
  const MoeProblem& problem() const { return problem_; }
  const MoeTuning& tuning() const { return tuning_; }
  size_t workspace_bytes() const;
  int num_sms() const { return num_sms_; }
  // The configuration run() will use for T tokens, as text: the precision ("w4a16 (auto)" where
  // kAuto chose it), the kernels' configuration, the combine. Throws
  // megamoe::Error(kInvalidArgument) when a MoeTuning override cannot run at this T.
  std::string describe(int64_t tokens) const;
  // The precision run() uses for T tokens: the problem's, or what kAuto resolves to at this T.
  Precision resolved_precision(int64_t tokens) const;
  // Number of top-k ids outside [0, E) seen by the last run() that used `workspace`
  // (synchronises `stream`; call outside graph capture).
  int64_t invalid_id_count(const void* workspace, cudaStream_t stream) const;

 private:
  friend struct runtime::PlanAccess;
  MoeProblem problem_;
  MoeTuning tuning_;
  int num_sms_ = 0;
  // The backend rows run() may use, chosen at create(): one, or kAuto's in the order it asks them.
  std::vector<const runtime::MoeBackend*> backends_;
};

// Runs the MoE layer. Checks arguments on the host (shapes, null pointers, alignment) without
// touching the device; launches only.
void run(const MoePlan& plan, const MoeDeviceWeights& weights, const MoeRunArgs& args,
         cudaStream_t stream);

// Router logits to top-k ids and weights on the device (docs/design.md §2): the selection and the
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
