// The two baselines of `megamoe bench --ep` (ep_bench.h): (a) the unfused path users have today, on
// every rank, and (b) this library's single-GPU layer over every rank's tokens, on rank 0.
// Internal to bench/, in builds with expert parallelism (NCCL).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bench/ep_bench_comm.h"
#include "bench/ep_bench_model.h"
#include "megamoe/moe.h"
#include "megamoe/runtime.h"
#include "support/device_buffer.h"

namespace megamoe::bench {

// Baseline (a) of one rank: the unfused path. Sized once for max_t tokens per rank; per point the
// host lays out which rows go where (the routing is known on the host here; a real engine would
// first exchange the counts, a small all-to-all and a host synchronisation this baseline does not
// pay, so it is, if anything, faster than the real path).
class UnfusedBaseline {
 public:
  UnfusedBaseline(const MoeLayer& local_layer, const EpShape& shape, int rank, int64_t max_t, bool deterministic,
                  cudaStream_t stream);

  // Lays out a point: this rank's rows to each destination (by destination, then token), the rows
  // every source sends here (by source), and where each of this rank's tokens' partial sums come
  // back. `counts` is ep_row_counts of every rank's routing; `ids` this rank's [T, k].
  void prepare(const std::vector<std::vector<int64_t>>& counts, const std::vector<int32_t>& ids, int64_t tokens);

  // The whole unfused layer on this rank's tokens (NCCL calls: every rank must call it together).
  void run(const BenchComm& comm, const uint16_t* x, const int32_t* ids, const float* w, cudaStream_t stream) const;

  // The compute part alone: this library's single-GPU layer on the received rows (the rank's
  // experts, fp32 weighted partial sums) and the shared expert on the rank's own tokens. Reads
  // the receive buffers as the last run() left them.
  void compute(cudaStream_t stream) const;

  // The shared expert reads the rank's own tokens: set before run()/compute() are enqueued.
  void set_tokens(const uint16_t* x) { shared_x_ = x; }

  uint16_t* output() const { return out_.get(); }
  int64_t received_rows() const { return recv_rows_; }

 private:
  size_t rows_h() const { return static_cast<size_t>(max_rows_ * shape_.hidden); }
  size_t rows_k() const { return static_cast<size_t>(max_rows_ * shape_.top_k); }

  EpShape shape_;
  int rank_ = 0;
  int64_t max_rows_ = 0, max_t_ = 0;
  std::optional<MoePlan> routed_plan_, shared_plan_;
  std::optional<MoeDeviceWeights> routed_weights_, shared_weights_;
  std::optional<support::DeviceBuffer<uint8_t>> routed_ws_, shared_ws_;
  std::optional<support::DeviceBuffer<int32_t>> shared_ids_;
  std::optional<support::DeviceBuffer<float>> shared_w_, shared_out_;
  support::DeviceBuffer<uint16_t> send_x_, recv_x_;
  support::DeviceBuffer<int32_t> send_ids_, recv_ids_;
  support::DeviceBuffer<float> send_w_, recv_w_, partial_, ret_;
  support::DeviceBuffer<uint16_t> out_;
  support::DeviceBuffer<int32_t> row_token_, row_dest_, slots_;
  std::vector<std::vector<int64_t>> counts_;
  std::vector<int64_t> send_off_, recv_off_;
  int64_t send_rows_ = 0, recv_rows_ = 0, tokens_ = 0;
  const uint16_t* shared_x_ = nullptr;
};

// Baseline (b): the single-GPU layer (every expert) on rank 0, over all R * T_r tokens.
struct SingleGpuBaseline {
  std::optional<MoePlan> plan;
  std::optional<MoeDeviceWeights> weights;
  std::optional<support::DeviceBuffer<uint8_t>> workspace;
  std::string skipped;  // why it does not run (empty: it does)
  double bytes_needed = 0;
};

// Sets up baseline (b) in `single`: the whole layer planned for `single_max_t` tokens and uploaded,
// where it fits beside what is on the GPU; where not, `single.skipped` says why.
void prepare_single_gpu_baseline(SingleGpuBaseline& single, const MoeLayer& layer, const EpShape& shape,
                                 int64_t single_max_t, bool deterministic, cudaStream_t stream);

}  // namespace megamoe::bench
