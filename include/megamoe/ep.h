// Expert parallelism (EP) over the GPUs of one host: R processes, one per GPU; rank r owns routed
// experts [r·E/R, (r+1)·E/R) and a copy of the shared expert. Each rank calls the layer on its own
// tokens with top-k ids in the global expert space and gets its tokens' outputs: the single-GPU
// layer's numerics (fp32 sums, one bf16 rounding at the end; docs/design.md §7), its fp32 sums
// associated differently (per rank, then over ranks).
//
// Transport: NCCL's symmetric memory (ncclMemAlloc + ncclCommWindowRegister) and its LSA peer
// pointers, i.e. plain loads and stores over NVLink; no NVLink multicast (the library sets
// NCCL_NVLS_ENABLE=0 before it creates a communicator, and never asks for multimem).
//
// Per run, all device-initiated (no host synchronisation, no memset, CUDA-graph capturable;
// docs/design.md §7):
//   send      each token crosses NVLink once per rank that owns any of its experts, packed with its
//             ids and weights for that rank; then one {epoch, rows} word per destination;
//   local     the shared expert on the rank's own tokens; the rank's experts on the rows that
//             arrived (its dispatch waits on the device for every source's word, bounded: a peer
//             that never arrives fails the run within EpConfig::timeout_seconds);
//   return    each received row's fp32 partial sum goes straight to its source's slot; one done
//             word per source;
//   combine   waits for every done word; Σ over ranks in rank order (+ shared expert), one bf16
//             rounding: bitwise the same whatever order the rows arrived in.
// With world size 1 there is no exchange: the layer is the single-GPU layer on the rank's tokens.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "megamoe/moe.h"
#include "megamoe/precision.h"
#include "megamoe/runtime.h"

namespace megamoe {

// The 128 bytes that name an NCCL communicator: made once (EpUniqueId::create on one process) and
// handed to every rank (as hex on a command line, or through the engine's own process group).
struct EpUniqueId {
  std::array<char, 128> bytes{};
  static EpUniqueId create();
  std::string to_hex() const;
  // Throws megamoe::Error(kInvalidArgument) unless `hex` is 256 hex digits.
  static EpUniqueId from_hex(const std::string& hex);
};

struct EpConfig {
  int world_size = 1;                // R, 1..8 (the GPUs of one host)
  int rank = 0;                      // this process's rank, 0..R-1; it runs on CUDA device `device`
  int device = 0;
  int64_t max_tokens_per_rank = 0;   // the largest T any rank passes to run()
  double timeout_seconds = 60.0;     // a wait for the peers that lasts longer fails the run (check())
  // The GEMMs' arithmetic on every rank: MoeProblem::precision of the rank's plans, validated the
  // same way (a precision no GPU kernel serves makes create() throw kUnsupported).
  Precision precision = Precision::kW4a16;
  // Whether the local experts may start early (MoeTuning::early_start: the heuristic decides
  // where; with a rank's tiny batch of received rows the GEMM starts before the dispatch ends).
  // false never does, e.g. to measure what it gains.
  bool early_start = true;
};

// The routed experts rank `rank` owns: [first, first + count). Throws megamoe::Error
// (kInvalidArgument) when num_experts is not a multiple of world_size.
struct EpExpertRange {
  int64_t first = 0;
  int64_t count = 0;
};
EpExpertRange ep_expert_range(int64_t num_experts, int world_size, int rank);

// The part of a layer one rank holds: its routed experts (renumbered from 0) and the shared
// expert, sharing the NVFP4 bytes with `layer` (views, no copy; with a memory-mapped checkpoint
// only the rank's experts are ever read). num_experts becomes the range's count.
MoeLayer ep_local_layer(const MoeLayer& layer, const EpExpertRange& range);

// R virtual ranks of the expert-parallel layer on one GPU, for tests and debugging where fewer
// GPUs are at hand. Each rank gets its own share of the SMs (a CUDA green context: its kernels
// never run on another rank's SMs, so its fused kernel's grid is resident and its spin-waits
// cannot starve a peer) and a stream on them; the ranks' windows are plain device buffers of the
// GPU. The layers run the same device code as over NCCL, so the outputs equal those of R GPUs
// for the same routing; the timings are of SM partitions of one GPU, not of R GPUs.
// One thread drives every rank: create each rank's groups and layers (create() does not wait for
// the other ranks, but it synchronises the device: make them all before the first run), then call
// each rank's run() on stream(rank). Shared by copies; the streams, contexts and windows live
// until the last copy and the last layer made with it are destroyed.
class EpLoopback {
 public:
  // Splits `device`'s SMs into world_size equal groups (whole multiples of the split's
  // granularity, 8 SMs on sm_90; the remainder idles). Throws megamoe::Error: kInvalidArgument (a
  // world size outside 1..8 or a device that does not exist), kUnsupported (a driver without
  // green contexts, or too few SMs for world_size groups), kCuda.
  static EpLoopback create(int world_size, int device = 0);
  int world_size() const;
  int device() const;
  int sms_per_rank() const;
  // Rank r's stream: its work runs on rank r's SMs only. Throws kInvalidArgument for a bad rank.
  cudaStream_t stream(int rank) const;

  struct Impl;

 private:
  friend struct EpLoopbackAccess;
  std::shared_ptr<Impl> impl_;
};

// One rank's endpoint of expert parallelism, shared by every layer of a model: its communicator
// (or loopback rank), one window (the receive and return buffers and the signal words) sized for
// the largest layer (hidden_size, top_k) and config.max_tokens_per_rank, and the scratch the
// layers' local experts use (sized by the largest layer made on it). A layer keeps only its
// weights and plans. The layers of a group run one at a time, in stream order, in the same order
// on every rank (two runs of one group on two streams at once share its window and epoch: a run
// that then receives more rows than the window holds fails loudly, anything else is undefined).
// Creating one is collective (every rank, the same arguments; ranks that ask for different
// windows fail). Shared by copies and by the layers made on it; freed with the last (after every
// rank's work has ended).
class EpGroup {
 public:
  // Throws megamoe::Error: kInvalidArgument (the config's ranges, hidden_size not a positive
  // multiple of 64, top_k outside 1..16, a loopback of another size or device), kUnsupported
  // (NCCL without symmetric memory between these GPUs), kCuda.
  static EpGroup create(const EpConfig& config, const EpUniqueId& id, int64_t hidden_size, int top_k);
  // Rank config.rank of `loopback`'s virtual ranks: the local plans size their grids by
  // loopback.sms_per_rank(), and run() must be given loopback.stream(config.rank).
  static EpGroup create(const EpConfig& config, const EpLoopback& loopback, int64_t hidden_size, int top_k);
  const EpConfig& config() const;
  // The window and the scratch of its layers.
  size_t device_bytes() const;

  struct Impl;

 private:
  friend class MoeEpLayer;
  std::shared_ptr<Impl> impl_;
};

// A rank's weights already on the device, for a layer that holds them once: `routed` its experts
// (E/R of them, renumbered from 0, no shared expert), `shared` the shared expert as a one-expert
// layer of its own intermediate size, or none. E.g. MoeDeviceWeights::prepack_in_place of the
// rank's slice of an engine's tensors.
struct EpLocalWeights {
  MoeDeviceWeights routed;
  std::optional<MoeDeviceWeights> shared;
};

// What a layer over EpLocalWeights is, beyond the weights' shapes.
struct EpLayerOptions {
  int64_t num_experts = 0;  // the global E
  int top_k = 0;
  std::optional<float> swiglu_limit;
  bool deterministic = false;
};

// One rank of an expert-parallel MoE layer: its communicator, its symmetric buffers, its experts'
// prepacked weights and every workspace, all made at create() (collective: every rank calls it,
// with the same id and problem). Not copyable; destroy it on every rank.
class MoeEpLayer {
 public:
  // `local_layer`: this rank's experts and the shared expert (ep_local_layer); `num_experts`: the
  // global E. Throws megamoe::Error naming what is wrong: a rank or size out of range, E not a
  // multiple of R, E/R below top_k, an unsupported shape or precision (MoePlan's rules), NCCL
  // without symmetric memory between these GPUs (kUnsupported), or a CUDA/NCCL failure (kCuda).
  static MoeEpLayer create(const MoeLayer& local_layer, int64_t num_experts, const EpGroup& group,
                           bool deterministic = false);
  // The same on a group of its own (EpGroup::create with this layer's H and top_k).
  static MoeEpLayer create(const MoeLayer& local_layer, int64_t num_experts, const EpConfig& config,
                           const EpUniqueId& id, bool deterministic = false);
  // On a group of its own over `loopback` (EpGroup::create). With world size 1 the layer is the
  // single-GPU layer.
  static MoeEpLayer create(const MoeLayer& local_layer, int64_t num_experts, const EpConfig& config,
                           const EpLoopback& loopback, bool deterministic = false);
  // Over weights the rank already holds (moved in; if they view the caller's memory, keep it
  // alive while the layer is): nothing is uploaded. Not at world size 1 with a shared expert (the
  // single-GPU layer's weights hold both: use run() there). Throws megamoe::Error as above, or
  // (kInvalidArgument) where the weights do not fit the rank's range or each other.
  static MoeEpLayer create(EpLocalWeights weights, const EpLayerOptions& options, const EpGroup& group);
  MoeEpLayer(MoeEpLayer&&) noexcept;
  MoeEpLayer& operator=(MoeEpLayer&&) noexcept;
  ~MoeEpLayer();

  const EpConfig& config() const;
  EpExpertRange experts() const;
  // Device bytes of this layer's own state: its experts' and the shared expert's weights (the
  // window and scratch it shares are group().device_bytes()).
  size_t device_bytes() const;
  EpGroup group() const;

  // Runs the layer on this rank's tokens. `args.topk_ids` are global expert ids (ids outside
  // [0, E) are counted and skipped); `args.workspace` is ignored (the layer owns its workspaces);
  // args.tokens may be 0 and may differ between ranks, up to max_tokens_per_rank. Every rank must
  // call run() the same number of times. Launches only: no allocation, no host synchronisation.
  void run(const MoeRunArgs& args, cudaStream_t stream);
  // The same, recording `stages` on `stream` between the stages, for benchmarks (eager runs, not
  // graph capture): start→sent the send; sent→computed the shared expert and the rank's experts,
  // including the wait for the peers' rows; computed→done the return (which runs in the
  // combine's kernel), the wait for the peers' partial sums and the combine.
  struct StageEvents {
    cudaEvent_t start, sent, computed, done;
  };
  void run(const MoeRunArgs& args, cudaStream_t stream, const StageEvents& stages);

  // %globaltimer stamps (ns on this GPU's clock; clocks of different GPUs are not aligned) of the
  // last run's stages on this rank, taken on the device, so graph replays record them too:
  //   send_begin/send_end            the send kernel's first CTA starts / its last CTA has
  //                                  published the rows (just after its release stores, so a
  //                                  destination's gate may open a little before it)
  //   gate_begin/gate_open           the local dispatch starts waiting for every source's rows /
  //                                  has them (the local experts run from here)
  //   return_begin/return_end        the combine kernel's first CTA has claimed the return (the
  //                                  local experts are done: their combine wrote every partial
  //                                  sum into its source's buffer) / has told every source (just
  //                                  after its release stores, so the partial sums may arrive
  //                                  first); they may precede combine_begin (CTA 0's)
  //   combine_begin/partials_arrived the combine starts / has every destination's partial sums
  //   combine_end                    the combine's last CTA ends the run
  // Synchronises `stream`. At world size 1 (no exchange) every stamp is 0.
  struct StageStamps {
    uint64_t send_begin, send_end, gate_begin, gate_open, return_begin, return_end, combine_begin,
        partials_arrived, combine_end;
  };
  StageStamps stage_stamps(cudaStream_t stream) const;

  // Synchronises `stream` and throws megamoe::Error(kCuda) if a wait of any earlier run failed (a
  // peer never arrived, or gave up: the outputs since are undefined; the message names the rank
  // that gave up first and where), or with the CUDA error. A replayed graph's failure surfaces
  // here too.
  void check(cudaStream_t stream) const;
  // Top-k ids outside [0, E) seen by the last run of any layer of this layer's group
  // (synchronises `stream`).
  int64_t invalid_id_count(cudaStream_t stream) const;

 private:
  struct Impl;
  MoeEpLayer();
  std::unique_ptr<Impl> impl_;
  void run_stages(const MoeRunArgs& args, cudaStream_t stream, const StageEvents* stages);
  struct Shape;
  static MoeEpLayer make(const EpGroup& group, const Shape& shape, bool deterministic);
};

}  // namespace megamoe
