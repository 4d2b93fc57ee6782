// The backend table: one row per (architecture, precision) this build has kernels for. The
// arch-neutral runtime (MoePlan, MoeDeviceWeights, run) reaches device code only through a row;
// a new precision or architecture is a new row (docs/design.md §8), never a branch in the runtime.
#pragma once

#include <cuda_runtime.h>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "megamoe/moe.h"
#include "megamoe/precision.h"
#include "megamoe/runtime.h"
#include "runtime/token_gate.h"

namespace megamoe::runtime {

// A compute capability as major * 10 + minor (90: sm_90a, Hopper).
using Arch = int;
std::string arch_name(Arch arch);  // "sm_90"

// The current CUDA device's architecture and SM count (throws megamoe::Error(kCuda)).
struct DeviceInfo {
  int device = 0;
  Arch arch = 0;
  int num_sms = 0;
  std::string name;
};
DeviceInfo current_device();

// A layer's weights on the device in one row's layout (owned and freed with the object, or the
// caller's memory, viewed: MoeDeviceWeights::prepack_in_place). Rows of an
// architecture that read the same layout share one upload: a layer is held once per GPU whatever
// precision runs it.
class BackendWeights {
 public:
  virtual ~BackendWeights() = default;
  virtual const char* layout() const = 0;
  virtual size_t device_bytes() const = 0;          // allocated by this object
  virtual bool views_caller_memory() const = 0;     // the layer's bytes are the caller's
};

// A layer's prepacked bytes in the caller's device memory: per kind, the virtual experts (routed,
// then the shared expert's slices) one after another, as many bytes as the checkpoint's of that
// kind (MoeDeviceWeights::prepack_in_place).
struct WeightStorage {
  uint8_t* w13_codes = nullptr;
  uint8_t* w13_scales = nullptr;
  uint8_t* w2_codes = nullptr;
  uint8_t* w2_scales = nullptr;
};

// The same bytes on the host, read-only (unprepack).
struct HostPrepacked {
  std::span<const uint8_t> w13_codes, w13_scales, w2_codes, w2_scales;
};

// A layer's global scales: each routed expert's (gate, up, down), then the shared expert's.
struct GlobalScales {
  std::vector<std::array<float, 3>> routed;
  std::array<float, 3> shared{};
};

// A run whose tokens arrive on the device while it is queued (token_gate.h): args.tokens is their
// bound; `hint` is the count the host expects, for which the kernels' configuration and grids are
// chosen (any count up to the bound runs correctly, some slower).
struct GatedTokens {
  TokenGate gate;
  int64_t hint = 0;
};

// run() on gated tokens: the plan must be deterministic (no accumulator of the bound's rows to
// zero per run). Early start, where the plan's configuration for `hint` has it, runs in the fused
// launch when the rows that arrive make a tiny batch and gate.published is set. Internal: the
// expert-parallel layer's local experts.
void run_gated(const MoePlan& plan, const MoeDeviceWeights& weights, const MoeRunArgs& args,
               const GatedTokens& gated, cudaStream_t stream);

class MoeBackend {
 public:
  virtual ~MoeBackend() = default;
  virtual Arch arch() const = 0;
  virtual Precision precision() const = 0;  // never kAuto
  std::string name() const;                 // "w4a16/sm_90"

  // Whether kAuto should run this row at T tokens. Rows are asked in the table's order; the
  // exact row of an architecture comes last and always accepts.
  virtual bool auto_accepts(const MoeProblem& problem, int64_t tokens) const = 0;
  // Whether auto_accepts may hold for some T of `problem`. kAuto leaves out a row that never
  // takes any, so that its plans hold neither that row's workspace nor its kernels.
  virtual bool auto_may_accept(const MoeProblem& problem) const = 0;

  // Throws megamoe::Error(kUnsupported / kInvalidArgument) naming what the row's kernels cannot
  // run (the arch-neutral checks, validate_problem_common, have passed).
  virtual void validate(const MoeProblem& problem) const = 0;
  virtual size_t workspace_bytes(const MoeProblem& problem) const = 0;
  // The configuration run() uses at T tokens (the row's heuristic with the plan's MoeTuning), as
  // text. Throws megamoe::Error(kInvalidArgument) where an override cannot run at this T.
  virtual std::string describe_config(const MoePlan& plan, int64_t tokens) const = 0;

  // The layout this row's kernels read, and the upload (prepack) that makes it.
  virtual const char* weight_layout() const = 0;
  virtual std::unique_ptr<BackendWeights> upload(const MoeLayer& layer, cudaStream_t stream) const = 0;
  // upload() into the caller's storage instead of new memory; the result views it.
  virtual std::unique_ptr<BackendWeights> upload_into(const MoeLayer& layer, const WeightStorage& into,
                                                      cudaStream_t stream) const = 0;
  // Weights viewing storage upload_into has already written for a layer of `shape`.
  virtual std::unique_ptr<BackendWeights> view(const MoeProblem& shape, const WeightStorage& at,
                                               const GlobalScales& scales, cudaStream_t stream) const = 0;
  // upload_into's inverse on the host: the codes and block scales of `in` written to `out` (host
  // pointers) in the checkpoint layout; global scales are not touched.
  virtual void unprepack(const MoeProblem& shape, const HostPrepacked& in, const StackedNvfp4Buffers& out) const = 0;

  // Launches only: arguments are checked (check_run_args), T > 0, weights in weight_layout().
  // With `gated`, the tokens arrive on the device (run_gated).
  virtual void run(const MoePlan& plan, const BackendWeights& weights, const MoeRunArgs& args, cudaStream_t stream,
                   const GatedTokens* gated) const = 0;
  virtual int64_t invalid_id_count(const MoePlan& plan, const void* workspace, cudaStream_t stream) const = 0;
  // Loads every kernel run() may launch (once per process; MoePlan::create calls it). Under CUDA's
  // lazy loading a kernel is otherwise loaded at its first launch, which waits for the kernels
  // running on the device: a deadlock where a peer on the same GPU spin-waits for this launch's
  // stream (EpLoopback), and a stall inside a graph capture.
  virtual void load_kernels() const = 0;
};

// Every row of this build, in the order kAuto asks them.
std::span<const MoeBackend* const> backend_table();
// The row for (arch, precision), or null where this build has none.
const MoeBackend* find_backend(Arch arch, Precision precision);
// The rows of this build as "w4a16/sm_90, ..." (for messages).
std::string built_backends();
// The row that uploads weights for `arch` (every row of an arch reads its layout); throws
// megamoe::Error(kUnsupported) naming the built rows where there is none.
const MoeBackend& weights_backend(Arch arch);
// The exact row whose weight_layout() is `layout`, else another that reads it (every row reading a
// layout can unprepack it); throws
// megamoe::Error(kInvalidArgument) naming the built layouts where there is none.
const MoeBackend& layout_backend(const std::string& layout);

// The rows a plan for `problem` (validate_problem_common passed) on `arch` may use, each row's
// validation passed (MoePlan::create; no device needed). Throws megamoe::Error(kUnsupported)
// naming `device` (default: the arch) and the built rows where none serves the request.
std::vector<const MoeBackend*> resolve_backends(const MoeProblem& problem, Arch arch,
                                                const std::string& device = {});

// Problem checks that hold for every row (top_k, max_tokens, swiglu_limit, precision).
void validate_problem_common(const MoeProblem& problem);

// The plan's rows (MoePlan keeps them private to users).
struct PlanAccess {
  static const MoeBackend& backend(const MoePlan& plan, int64_t tokens);
};

}  // namespace megamoe::runtime
