// One rank of `megamoe bench --ep N` (ep_bench.h).
#include "bench/ep_bench.h"

#if MEGAMOE_HAS_EP

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_common.h"
#include "bench/ep_baseline.h"
#include "bench/l2_flush.h"
#include "megamoe/checkpoint.h"
#include "megamoe/dtype.h"
#include "megamoe/ep.h"
#include "megamoe/format.h"
#include "megamoe/gpu.h"
#include "megamoe/reference.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "support/device_buffer.h"

namespace megamoe::bench {
namespace {

using support::DeviceBuffer;
static_assert(kEpMaxRelL2 == kMaxRelL2, "the EP benchmark checks with the single-GPU benchmark's bound");

void check_nccl(ncclResult_t r, const char* what) {
  MEGAMOE_CHECK(r == ncclSuccess, kCuda, "bench --ep: NCCL ", what, " failed: ", ncclGetErrorString(r), " (", r, ")");
}

// The benchmark's own communicator (not the EP layer's, which the layer keeps to itself): the
// barrier before each timed replay, the all-to-alls of baseline (a), and the gathers to rank 0.
// A blocking communicator: a rank that dies is noticed by the launcher, which ends the others.
class BenchComm {
 public:
  BenchComm(const EpUniqueId& id, int world, int rank) : world_(world), rank_(rank) {
    setenv("NCCL_NVLS_ENABLE", "0", 1);  // never NVLink multicast (the launcher sets it too)
    ncclUniqueId uid;
    static_assert(sizeof(uid) == sizeof(id.bytes), "ncclUniqueId is 128 bytes");
    std::memcpy(&uid, id.bytes.data(), sizeof(uid));
    check_nccl(ncclCommInitRank(&comm_, world, uid, rank), "ncclCommInitRank(benchmark communicator)");
    gpu::check_cuda(cudaMalloc(&scratch_, 256), "cudaMalloc");
    gpu::check_cuda(cudaMemset(scratch_, 0, 256), "cudaMemset");
  }
  ~BenchComm() {
    if (scratch_) cudaFree(scratch_);
    if (!comm_) return;
    // Unwinding from a failure, a collective may still wait for a peer: abort does not wait.
    if (std::uncaught_exceptions() > 0) {
      ncclCommAbort(comm_);
    } else {
      ncclCommDestroy(comm_);
    }
  }
  BenchComm(const BenchComm&) = delete;
  BenchComm& operator=(const BenchComm&) = delete;
  ncclComm_t get() const { return comm_; }
  int world() const { return world_; }
  int rank() const { return rank_; }

  // Enqueues a one-element all-reduce: the work after it on `stream` starts once every rank has
  // reached it (within the collective's exit skew, a few µs).
  void barrier(cudaStream_t stream) const {
    check_nccl(ncclAllReduce(scratch_, scratch_, 1, ncclFloat, ncclSum, comm_, stream), "ncclAllReduce(barrier)");
  }
  // Every rank's `mine`, in rank order (synchronises `stream`).
  template <class T>
  std::vector<T> all_gather(const T& mine, cudaStream_t stream) const {
    static_assert(std::is_trivially_copyable_v<T>, "gathered as bytes");
    DeviceBuffer<uint8_t> send(sizeof(T)), recv(sizeof(T) * static_cast<size_t>(world_));
    gpu::check_cuda(cudaMemcpy(send.get(), &mine, sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
    check_nccl(ncclAllGather(send.get(), recv.get(), sizeof(T), ncclUint8, comm_, stream), "ncclAllGather");
    gpu::check_cuda(cudaStreamSynchronize(stream), "all_gather");
    std::vector<T> out(static_cast<size_t>(world_));
    gpu::check_cuda(cudaMemcpy(out.data(), recv.get(), sizeof(T) * out.size(), cudaMemcpyDeviceToHost), "cudaMemcpy");
    return out;
  }
  // A barrier the host waits for.
  void host_barrier(cudaStream_t stream) const {
    barrier(stream);
    gpu::check_cuda(cudaStreamSynchronize(stream), "barrier");
  }

 private:
  ncclComm_t comm_ = nullptr;
  int world_ = 0, rank_ = 0;
  float* scratch_ = nullptr;
};

// Median µs of `fn` over `iters` runs after `warmup` untimed ones: before each run the L2 is
// flushed, then (with `comm`) every rank meets at a barrier, so that all ranks start the same
// run together and each rank's time is its run of the layer, peers' waits included.
template <class Fn>
double timed_median_us(Fn&& fn, int iters, int warmup, cudaStream_t stream, const L2Flush& flush, const BenchComm* comm) {
  cudaEvent_t a, b;
  gpu::check_cuda(cudaEventCreate(&a), "cudaEventCreate");
  gpu::check_cuda(cudaEventCreate(&b), "cudaEventCreate");
  std::vector<double> us;
  for (int r = 0; r < warmup + iters; ++r) {
    flush.run(stream, r);
    if (comm) comm->barrier(stream);
    gpu::check_cuda(cudaEventRecord(a, stream), "cudaEventRecord");
    fn();
    gpu::check_cuda(cudaEventRecord(b, stream), "cudaEventRecord");
    gpu::check_cuda(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0;
    gpu::check_cuda(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    if (r >= warmup) us.push_back(1000.0 * ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(us);
}

// The NVLink copy rate from this rank's GPU to the next rank's, every rank at once (a ring: each
// GPU sends one stream and receives one, as in an all-to-all), GB/s in one direction, median of 10
// copies of 1 GiB after 2 untimed ones.
//
// With the copy engines (cudaMemcpyPeerAsync; "copy engine") where every rank can: the
// destination is allocated by this process on the peer's GPU (a context of this process there), so
// no memory handle crosses processes. Where some rank cannot (no peer access, or a peer GPU in an
// exclusive compute mode, where a second process's context is refused), every rank measures NCCL
// send/recv instead ("nccl"), which moves the bytes through NCCL's own buffers and may read lower.
// The ranks agree on the method first: the two use different collectives.
struct PeerRate {
  double gbps = 0;
  const char* method = "none";  // one rank: no peer
};

PeerRate measure_peer_rate(const BenchComm& comm, cudaStream_t stream) {
  const int R = comm.world(), rank = comm.rank(), next = (rank + 1) % R, prev = (rank + R - 1) % R;
  if (R == 1) return {};
  int can = 0, mode = -1;
  gpu::check_cuda(cudaDeviceCanAccessPeer(&can, rank, next), "cudaDeviceCanAccessPeer");
  gpu::check_cuda(cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, next), "cudaDeviceGetAttribute");
  const int copy_engine_ok = can == 1 && mode == cudaComputeModeDefault;
  bool all_ok = true;
  for (int ok : comm.all_gather(copy_engine_ok, stream)) all_ok = all_ok && ok == 1;

  const size_t bytes = size_t{1} << 30;
  DeviceBuffer<uint8_t> src(bytes);
  src.poison(0x5A);
  gpu::check_cuda(cudaDeviceSynchronize(), "cudaMemset");
  void* dst = nullptr;  // on the next GPU (copy engines) or on this one (NCCL receives here)
  if (all_ok) {
    const cudaError_t enabled = cudaDeviceEnablePeerAccess(next, 0);
    if (enabled == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();  // not an error here; clear it
    } else {
      gpu::check_cuda(enabled, "cudaDeviceEnablePeerAccess");
    }
    gpu::check_cuda(cudaSetDevice(next), "cudaSetDevice(peer)");
    gpu::check_cuda(cudaMalloc(&dst, bytes), "cudaMalloc(on the peer GPU)");
    gpu::check_cuda(cudaSetDevice(rank), "cudaSetDevice");
  } else {
    gpu::check_cuda(cudaMalloc(&dst, bytes), "cudaMalloc");
  }
  cudaEvent_t a, b;
  gpu::check_cuda(cudaEventCreate(&a), "cudaEventCreate");
  gpu::check_cuda(cudaEventCreate(&b), "cudaEventCreate");
  std::vector<double> times;
  for (int r = 0; r < 12; ++r) {
    comm.barrier(stream);
    gpu::check_cuda(cudaEventRecord(a, stream), "cudaEventRecord");
    if (all_ok) {
      gpu::check_cuda(cudaMemcpyPeerAsync(dst, next, src.get(), rank, bytes, stream), "cudaMemcpyPeerAsync");
    } else {
      check_nccl(ncclGroupStart(), "ncclGroupStart");
      check_nccl(ncclSend(src.get(), bytes, ncclUint8, next, comm.get(), stream), "ncclSend");
      check_nccl(ncclRecv(dst, bytes, ncclUint8, prev, comm.get(), stream), "ncclRecv");
      check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    }
    gpu::check_cuda(cudaEventRecord(b, stream), "cudaEventRecord");
    gpu::check_cuda(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0;
    gpu::check_cuda(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    if (r >= 2) times.push_back(1000.0 * ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  if (all_ok) {
    gpu::check_cuda(cudaSetDevice(next), "cudaSetDevice(peer)");
    gpu::check_cuda(cudaFree(dst), "cudaFree(on the peer GPU)");
    gpu::check_cuda(cudaSetDevice(rank), "cudaSetDevice");
    gpu::check_cuda(cudaDeviceDisablePeerAccess(next), "cudaDeviceDisablePeerAccess");
  } else {
    gpu::check_cuda(cudaFree(dst), "cudaFree");
  }
  return {static_cast<double>(bytes) / (median(times) * 1e-6) / 1e9, all_ok ? "copy engine" : "nccl"};
}

// Parts of a point that draw random inputs, each from its own generator seeded by (seed, part,
// T_r, rank) alone: every rank can draw every rank's routing (the floors and baseline (a)'s
// message sizes need them all) without drawing their tokens.
enum class EpInputPart : uint64_t { kRouting = 11, kHidden = 12 };
std::mt19937_64 ep_input_rng(uint64_t seed, EpInputPart part, int64_t tokens_per_rank, int rank) {
  return std::mt19937_64(
      splitmix64(splitmix64(splitmix64(splitmix64(seed ^ 0xE9B3) ^ static_cast<uint64_t>(part)) ^
                            static_cast<uint64_t>(tokens_per_rank)) ^
                 static_cast<uint64_t>(rank)));
}

// The shared expert as a one-expert layer, every token's weight 1 (as MoeEpLayer runs it).
MoeLayer shared_expert_layer(const MoeLayer& layer) {
  MoeLayer shared;
  shared.hidden_size = layer.hidden_size;
  shared.intermediate_size = layer.shared_expert->intermediate_size();
  shared.num_experts = 1;
  shared.experts = {*layer.shared_expert};
  shared.routing.top_k = 1;
  shared.swiglu_limit = layer.swiglu_limit;
  return shared;
}

// Information every rank reports once (gathered as bytes).
struct EpRankInfo {
  char device[96] = {};
  EpRates rates;
  int64_t ep_device_bytes = 0;  // MoeEpLayer::device_bytes
  int64_t free_bytes = 0;       // cudaMemGetInfo after setup
};

// Baseline (a) of one rank: the unfused path. Sized once for max_t tokens per rank; per point the
// host lays out which rows go where (the routing is known on the host here; a real engine would
// first exchange the counts, a small all-to-all and a host synchronisation this baseline does not
// pay, so it is, if anything, faster than the real path).
class UnfusedBaseline {
 public:
  UnfusedBaseline(const MoeLayer& local_layer, const EpShape& shape, int rank, int64_t max_t, bool deterministic,
                  cudaStream_t stream)
      : shape_(shape), rank_(rank), max_rows_(shape.world * max_t), max_t_(max_t),
        send_x_(rows_h()), recv_x_(rows_h()), send_ids_(rows_k()), recv_ids_(rows_k()), send_w_(rows_k()),
        recv_w_(rows_k()), partial_(rows_h()), ret_(rows_h()), out_(static_cast<size_t>(max_t * shape.hidden)),
        row_token_(static_cast<size_t>(max_rows_)), row_dest_(static_cast<size_t>(max_rows_)),
        slots_(static_cast<size_t>(max_t * shape.world)) {
    MoeLayer routed = local_layer;
    routed.shared_expert.reset();
    MoeProblem rp;
    rp.hidden_size = shape.hidden;
    rp.intermediate_size = shape.intermediate;
    rp.num_experts = shape.num_experts / shape.world;
    rp.top_k = shape.top_k;
    rp.max_tokens = max_rows_;
    rp.swiglu_limit = local_layer.swiglu_limit;
    rp.deterministic = deterministic;
    routed_plan_.emplace(MoePlan::create(rp));
    routed_weights_.emplace(MoeDeviceWeights::upload(routed, stream));
    routed_ws_.emplace(routed_plan_->workspace_bytes());
    if (local_layer.shared_expert) {
      const MoeLayer shared = shared_expert_layer(local_layer);
      MoeProblem sp = MoeProblem::from_layer(shared, max_t);
      sp.deterministic = deterministic;
      shared_plan_.emplace(MoePlan::create(sp));
      shared_weights_.emplace(MoeDeviceWeights::upload(shared, stream));
      shared_ws_.emplace(shared_plan_->workspace_bytes());
      shared_ids_.emplace(std::vector<int32_t>(static_cast<size_t>(max_t), 0));
      shared_w_.emplace(std::vector<float>(static_cast<size_t>(max_t), 1.0f));
      shared_out_.emplace(static_cast<size_t>(max_t * shape.hidden));
    }
  }

  // Lays out a point: this rank's rows to each destination (by destination, then token), the rows
  // every source sends here (by source), and where each of this rank's tokens' partial sums come
  // back. `counts` is ep_row_counts of every rank's routing; `ids` this rank's [T, k].
  void prepare(const std::vector<std::vector<int64_t>>& counts, const std::vector<int32_t>& ids, int64_t tokens) {
    const int R = shape_.world;
    const int64_t per_rank = shape_.num_experts / R;
    tokens_ = tokens;
    counts_ = counts;
    std::vector<int32_t> row_token, row_dest, slots(static_cast<size_t>(tokens * R), -1);
    send_off_.assign(static_cast<size_t>(R) + 1, 0);
    for (int d = 0; d < R; ++d) {
      for (int64_t t = 0; t < tokens; ++t) {
        bool to_d = false;
        for (int j = 0; j < shape_.top_k; ++j) {
          const int32_t id = ids[static_cast<size_t>(t * shape_.top_k + j)];
          to_d = to_d || (id >= d * per_rank && id < (d + 1) * per_rank);
        }
        if (!to_d) continue;
        slots[static_cast<size_t>(t * R + d)] = static_cast<int32_t>(row_token.size());
        row_token.push_back(static_cast<int32_t>(t));
        row_dest.push_back(d);
      }
      send_off_[static_cast<size_t>(d) + 1] = static_cast<int64_t>(row_token.size());
      MEGAMOE_CHECK(send_off_[static_cast<size_t>(d) + 1] - send_off_[static_cast<size_t>(d)] ==
                        counts[static_cast<size_t>(rank_)][static_cast<size_t>(d)],
                    kInternal, "bench --ep: baseline (a)'s rows to rank ", d, " disagree with ep_row_counts");
    }
    recv_off_.assign(static_cast<size_t>(R) + 1, 0);
    for (int s = 0; s < R; ++s) {
      recv_off_[static_cast<size_t>(s) + 1] =
          recv_off_[static_cast<size_t>(s)] + counts[static_cast<size_t>(s)][static_cast<size_t>(rank_)];
    }
    send_rows_ = send_off_.back();
    recv_rows_ = recv_off_.back();
    row_token.resize(static_cast<size_t>(max_rows_), 0);
    row_dest.resize(static_cast<size_t>(max_rows_), 0);
    slots.resize(static_cast<size_t>(max_t_ * R), -1);
    row_token_.upload(row_token);
    row_dest_.upload(row_dest);
    slots_.upload(slots);
  }

  // The whole unfused layer on this rank's tokens (NCCL calls: every rank must call it together).
  void run(const BenchComm& comm, const uint16_t* x, const int32_t* ids, const float* w, cudaStream_t stream) const {
    const int R = shape_.world, k = shape_.top_k;
    const int64_t H = shape_.hidden;
    EpPackArgs pack;
    pack.hidden = x;
    pack.topk_ids = ids;
    pack.topk_weights = w;
    pack.row_token = row_token_.get();
    pack.row_dest = row_dest_.get();
    pack.rows = send_rows_;
    pack.hidden_size = H;
    pack.top_k = k;
    pack.experts_per_rank = shape_.num_experts / R;
    pack.send_hidden = send_x_.get();
    pack.send_ids = send_ids_.get();
    pack.send_weights = send_w_.get();
    ep_pack_rows(pack, stream);
    // Dispatch: rows, local ids and weights to every rank that owns any of a row's experts.
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    for (int d = 0; d < R; ++d) {
      const int64_t off = send_off_[static_cast<size_t>(d)], n = send_off_[static_cast<size_t>(d) + 1] - off;
      if (n == 0) continue;
      check_nccl(ncclSend(send_x_.get() + off * H, static_cast<size_t>(n * H * 2), ncclUint8, d, comm.get(), stream), "ncclSend");
      check_nccl(ncclSend(send_ids_.get() + off * k, static_cast<size_t>(n * k * 4), ncclUint8, d, comm.get(), stream), "ncclSend");
      check_nccl(ncclSend(send_w_.get() + off * k, static_cast<size_t>(n * k * 4), ncclUint8, d, comm.get(), stream), "ncclSend");
    }
    for (int s = 0; s < R; ++s) {
      const int64_t off = recv_off_[static_cast<size_t>(s)], n = recv_off_[static_cast<size_t>(s) + 1] - off;
      if (n == 0) continue;
      check_nccl(ncclRecv(recv_x_.get() + off * H, static_cast<size_t>(n * H * 2), ncclUint8, s, comm.get(), stream), "ncclRecv");
      check_nccl(ncclRecv(recv_ids_.get() + off * k, static_cast<size_t>(n * k * 4), ncclUint8, s, comm.get(), stream), "ncclRecv");
      check_nccl(ncclRecv(recv_w_.get() + off * k, static_cast<size_t>(n * k * 4), ncclUint8, s, comm.get(), stream), "ncclRecv");
    }
    check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    compute(stream);
    // Return: each received row's fp32 partial sum to its source.
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    for (int s = 0; s < R; ++s) {
      const int64_t off = recv_off_[static_cast<size_t>(s)], n = recv_off_[static_cast<size_t>(s) + 1] - off;
      if (n == 0) continue;
      check_nccl(ncclSend(partial_.get() + off * H, static_cast<size_t>(n * H * 4), ncclUint8, s, comm.get(), stream), "ncclSend");
    }
    for (int d = 0; d < R; ++d) {
      const int64_t off = send_off_[static_cast<size_t>(d)], n = send_off_[static_cast<size_t>(d) + 1] - off;
      if (n == 0) continue;
      check_nccl(ncclRecv(ret_.get() + off * H, static_cast<size_t>(n * H * 4), ncclUint8, d, comm.get(), stream), "ncclRecv");
    }
    check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    EpCombineArgs combine;
    combine.partial = ret_.get();
    combine.slots = slots_.get();
    combine.world = R;
    combine.shared = shared_plan_ ? shared_out_->get() : nullptr;
    combine.tokens = tokens_;
    combine.hidden_size = H;
    combine.out = out_.get();
    ep_combine_rows(combine, stream);
  }

  // The compute part alone: this library's single-GPU layer on the received rows (the rank's
  // experts, fp32 weighted partial sums) and the shared expert on the rank's own tokens. Reads
  // the receive buffers as the last run() left them.
  void compute(cudaStream_t stream) const {
    if (recv_rows_ > 0) {
      MoeRunArgs local{};
      local.hidden = recv_x_.get();
      local.topk_ids = recv_ids_.get();
      local.topk_weights = recv_w_.get();
      local.tokens = recv_rows_;
      local.output_f32 = partial_.get();
      local.workspace = routed_ws_->get();
      megamoe::run(*routed_plan_, *routed_weights_, local, stream);
    }
    if (shared_plan_ && tokens_ > 0) {
      MoeRunArgs shared{};
      shared.hidden = shared_x_;
      shared.topk_ids = shared_ids_->get();
      shared.topk_weights = shared_w_->get();
      shared.tokens = tokens_;
      shared.output_f32 = shared_out_->get();
      shared.workspace = shared_ws_->get();
      megamoe::run(*shared_plan_, *shared_weights_, shared, stream);
    }
  }
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
  std::optional<DeviceBuffer<uint8_t>> routed_ws_, shared_ws_;
  std::optional<DeviceBuffer<int32_t>> shared_ids_;
  std::optional<DeviceBuffer<float>> shared_w_, shared_out_;
  DeviceBuffer<uint16_t> send_x_, recv_x_;
  DeviceBuffer<int32_t> send_ids_, recv_ids_;
  DeviceBuffer<float> send_w_, recv_w_, partial_, ret_;
  DeviceBuffer<uint16_t> out_;
  DeviceBuffer<int32_t> row_token_, row_dest_, slots_;
  std::vector<std::vector<int64_t>> counts_;
  std::vector<int64_t> send_off_, recv_off_;
  int64_t send_rows_ = 0, recv_rows_ = 0, tokens_ = 0;
  const uint16_t* shared_x_ = nullptr;
};

// Baseline (b): the single-GPU layer (every expert) on rank 0, over all R * T_r tokens.
struct SingleGpuBaseline {
  std::optional<MoePlan> plan;
  std::optional<MoeDeviceWeights> weights;
  std::optional<DeviceBuffer<uint8_t>> workspace;
  std::string skipped;  // why it does not run (empty: it does)
  double bytes_needed = 0;
};

std::vector<float> bf16_to_f32_vector(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_f32(v[i]);
  return out;
}

}  // namespace

void run_ep_bench_rank(const EpRankSetup& setup, int rank) {
  const EpBenchOptions& opt = setup.options;
  validate_ep_bench_options(opt);
  const int R = opt.world_size;
  MEGAMOE_CHECK(rank >= 0 && rank < R, kInvalidArgument, "bench --ep: rank ", rank, " of ", R);
  MEGAMOE_CHECK(gpu::device_count() >= R, kUnsupported, "bench --ep ", R, ": rank ", rank, " sees only ",
                gpu::device_count(), " CUDA devices");
  const int64_t max_t = ep_max_tokens_per_rank(opt);
  gpu::check_cuda(cudaSetDevice(rank), "cudaSetDevice");
  cudaStream_t stream;
  gpu::check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const auto t_start = std::chrono::steady_clock::now();
  auto log = [&](const std::string& what) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    std::fprintf(stderr, "bench --ep %d: rank %d: %s [%.0fs]\n", R, rank, what.c_str(), s);
  };

  // ---- the benchmark's communicator, then this GPU's rates (every rank at once)
  const BenchComm comm(EpUniqueId::from_hex(setup.bench_comm_id), R, rank);
  EpRankInfo info;
  cudaDeviceProp prop{};
  gpu::check_cuda(cudaGetDeviceProperties(&prop, rank), "cudaGetDeviceProperties");
  std::snprintf(info.device, sizeof info.device, "%s", prop.name);
  comm.host_barrier(stream);
  info.rates.copy_tbps = measure_copy_tbps(stream, 0);
  comm.host_barrier(stream);
  info.rates.mma_tflops = measure_bf16_tflops(stream, 0);
  const PeerRate peer = measure_peer_rate(comm, stream);
  info.rates.peer_gbps = peer.gbps;
  log("copy " + std::to_string(info.rates.copy_tbps) + " TB/s, bf16 " + std::to_string(info.rates.mma_tflops) +
      " TFLOP/s, peer " + std::to_string(info.rates.peer_gbps) + " GB/s (" + peer.method + ")");

  // ---- the layer: only this rank's experts are read (views of the mapped checkpoint); the CPU
  // reference reads the few experts the checked tokens chose
  const Checkpoint ckpt = Checkpoint::open(setup.checkpoint_dir);
  const ModelConfig config = load_model_config(setup.checkpoint_dir);
  int64_t layer_index = opt.layer;
  if (layer_index < 0) {
    for (layer_index = 0; layer_index < config.num_hidden_layers && !config.is_moe_layer(layer_index); ++layer_index) {
    }
  }
  const MoeLayer layer = load_moe_layer(ckpt, config, layer_index);
  EpShape shape;
  shape.hidden = layer.hidden_size;
  shape.intermediate = layer.intermediate_size;
  shape.shared_intermediate = layer.shared_expert ? layer.shared_expert->intermediate_size() : 0;
  shape.num_experts = layer.num_experts;
  shape.top_k = layer.routing.top_k;
  shape.world = R;
  const int64_t H = shape.hidden, E = shape.num_experts;
  const int k = shape.top_k;
  const EpExpertRange range = ep_expert_range(E, R, rank);
  const MoeLayer local = ep_local_layer(layer, range);
  EpConfig cfg;
  cfg.world_size = R;
  cfg.rank = rank;
  cfg.device = rank;
  cfg.max_tokens_per_rank = max_t;
  cfg.timeout_seconds = opt.ep_timeout;
  MoeEpLayer ep = MoeEpLayer::create(local, E, cfg, EpUniqueId::from_hex(setup.layer_comm_id), opt.deterministic);
  info.ep_device_bytes = static_cast<int64_t>(ep.device_bytes());
  log("EP layer: experts [" + std::to_string(range.first) + ", " + std::to_string(range.first + range.count) + ")" +
      (layer.shared_expert ? " + shared" : "") + ", " + std::to_string(ep.device_bytes() / 1e9) + " GB on GPU " +
      std::to_string(rank));
  std::unique_ptr<UnfusedBaseline> unfused;
  if (opt.baselines) unfused = std::make_unique<UnfusedBaseline>(local, shape, rank, max_t, opt.deterministic, stream);

  // Baseline (b) on rank 0: the whole layer on one GPU, where it fits beside what is there.
  SingleGpuBaseline single;
  const int64_t single_max_t = R * max_t;
  if (opt.baselines && rank == 0) {
    single.bytes_needed = format::kNvfp4BytesPerWeight * 3.0 * static_cast<double>(H) *
                              (static_cast<double>(E) * shape.intermediate + shape.shared_intermediate) +
                          static_cast<double>(single_max_t) * (4.0 * H + 8.0 * k);
    size_t free_bytes = 0, total = 0;
    gpu::check_cuda(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo");
    std::optional<MoePlan> plan;
    if (single_max_t > 65536) {
      single.skipped = "R * max tokens per rank = " + std::to_string(single_max_t) + " is above one plan's 65536";
    } else {
      MoeProblem problem = MoeProblem::from_layer(layer, single_max_t);
      problem.deterministic = opt.deterministic;
      try {
        plan.emplace(MoePlan::create(problem));
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kInvalidArgument && e.code() != ErrorCode::kUnsupported) throw;
        single.skipped = std::string("the single-GPU plan for all tokens is refused: ") + e.what();
      }
    }
    if (plan) {
      single.bytes_needed += static_cast<double>(plan->workspace_bytes());
      // 2 GiB stay free for the flush buffers, the inputs and the CUDA graphs.
      if (single.bytes_needed + 2.0 * (1u << 30) > static_cast<double>(free_bytes)) {
        char why[256];
        std::snprintf(why, sizeof why, "does not fit: the whole layer on one GPU needs %.2f GB, %.2f GB free on GPU 0",
                      single.bytes_needed / 1e9, free_bytes / 1e9);
        single.skipped = why;
      } else {
        single.weights.emplace(MoeDeviceWeights::upload(layer, stream));
        single.workspace.emplace(plan->workspace_bytes());
        single.plan.emplace(*plan);
      }
    }
    log(single.skipped.empty() ? "single-GPU baseline (b) ready" : "single-GPU baseline (b): " + single.skipped);
  }
  {
    size_t free_bytes = 0, total = 0;
    gpu::check_cuda(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo");
    info.free_bytes = static_cast<int64_t>(free_bytes);
  }
  const std::vector<EpRankInfo> infos = comm.all_gather(info, stream);
  const L2Flush flush(opt.flush == "dirty" ? L2FlushMode::kDirty : L2FlushMode::kClean, size_t(prop.l2CacheSize));

  // ---- the report header (rank 0)
  nlohmann::json report;
  const std::vector<EpWeightEstimate> estimates = ep_weight_estimate_table();
  if (rank == 0) {
    std::printf("\nexpert parallelism over %d GPUs (%s); layer %s: H=%lld I=%lld E=%lld top-%d%s, %lld experts per rank; "
                "max %lld tokens per rank; %s; %s L2 flush; median of %d graph replays, the slowest rank's\n",
                R, prop.name, setup.layer_label.c_str(), (long long)H, (long long)shape.intermediate, (long long)E, k,
                shape.shared_intermediate ? " +shared" : "", (long long)range.count, (long long)max_t,
                opt.deterministic ? "deterministic" : "atomic combine", to_string(flush.mode()), opt.iters);
    report["mode"] = "ep";
    report["device"] = prop.name;
    report["ep"] = {{"world_size", R}, {"max_tokens_per_rank", max_t}, {"deterministic", opt.deterministic},
                    {"iters", opt.iters}, {"nccl_version", NCCL_VERSION_CODE}, {"peer_rate_method", peer.method}};
    report["l2_flush"] = to_string(flush.mode());
    report["layer"] = {{"H", H}, {"I", shape.intermediate}, {"E", E}, {"top_k", k},
                       {"shared_I", shape.shared_intermediate}, {"preset", setup.layer_label}};
    report["ranks"] = nlohmann::json::array();
    for (int r = 0; r < R; ++r) {
      const EpRankInfo& in = infos[static_cast<size_t>(r)];
      std::printf("  rank %d: %s, copy %.2f TB/s, bf16 %.0f TFLOP/s, NVLink to rank %d %.0f GB/s (%s); EP layer "
                  "%.2f GB on the GPU (MoeEpLayer::device_bytes), %.1f GB free after setup\n",
                  r, in.device, in.rates.copy_tbps, in.rates.mma_tflops, (r + 1) % R, in.rates.peer_gbps, peer.method,
                  in.ep_device_bytes / 1e9, in.free_bytes / 1e9);
      report["ranks"].push_back({{"rank", r}, {"device", in.device}, {"copy_tbps", in.rates.copy_tbps},
                                 {"bf16_tflops", in.rates.mma_tflops}, {"peer_gbps", in.rates.peer_gbps},
                                 {"ep_device_bytes", in.ep_device_bytes}, {"free_bytes", in.free_bytes}});
    }
    if (opt.baselines) {
      std::printf("  baseline (a): NCCL send/recv all-to-all of the rows, this library's single-GPU layer on the "
                  "received rows (fp32 partial sums), all-to-all back, weighted sum; (b): the single-GPU layer on "
                  "all R*T_r tokens on GPU 0%s%s\n",
                  single.skipped.empty() ? "" : ": ", single.skipped.c_str());
    }
    std::printf("%s", format_weight_estimates(estimates).c_str());
    report["weight_estimates"] = nlohmann::json::array();
    for (const EpWeightEstimate& e : estimates) report["weight_estimates"].push_back(to_json(e));
    report["points"] = nlohmann::json::array();
    std::printf("\n%s\n", ep_table_header().c_str());
    std::fflush(stdout);
  }
  auto write_json = [&] {
    if (rank != 0 || opt.json.empty()) return;
    std::ofstream f(opt.json);
    MEGAMOE_CHECK(f.good(), kIo, "bench --ep: cannot write '", opt.json, "'");
    f << report.dump(2) << "\n";
  };
  write_json();

  bool all_pass = true;
  for (const int64_t T : opt.tokens_per_rank) {
    // ---- inputs: every rank's routing (all ranks draw the same), this rank's tokens
    std::vector<reference::TopK> routing;
    std::vector<std::vector<int32_t>> all_ids;
    for (int s = 0; s < R; ++s) {
      std::mt19937_64 rng = ep_input_rng(opt.seed, EpInputPart::kRouting, T, s);
      routing.push_back(uniform_topk(rng, T, E, k));
      all_ids.push_back(routing.back().ids);
    }
    const reference::TopK& topk = routing[static_cast<size_t>(rank)];
    std::mt19937_64 hidden_rng = ep_input_rng(opt.seed, EpInputPart::kHidden, T, rank);
    const std::vector<uint16_t> x = random_hidden(hidden_rng, T, H);
    EpPointResult point;
    point.tokens_per_rank = T;
    point.baselines = opt.baselines;
    point.traffic = ep_traffic(shape, all_ids);
    for (int r = 0; r < R; ++r) {
      point.floors.push_back(ep_rank_floor(shape, point.traffic[static_cast<size_t>(r)], infos[static_cast<size_t>(r)].rates));
    }
    EpRankPoint mine;
    mine.tokens = T;
    mine.inputs_fnv1a = inputs_fingerprint(x, topk);
    const DeviceBuffer<uint16_t> dx(x);
    const DeviceBuffer<int32_t> dids(topk.ids);
    const DeviceBuffer<float> dw(topk.weights);
    DeviceBuffer<uint16_t> dout(static_cast<size_t>(T * H));
    MoeRunArgs args{};
    args.hidden = dx.get();
    args.topk_ids = dids.get();
    args.topk_weights = dw.get();
    args.tokens = T;
    args.output = dout.get();

    // ---- the EP layer: one eager run, then its captured graph; the graph's output is checked
    comm.host_barrier(stream);  // no rank waits long at the layer's own (bounded) barriers
    ep.run(args, stream);
    ep.check(stream);
    const Graph ep_graph(stream, [&] { ep.run(args, stream); });
    // Poisoned on the stream (a plain cudaMemset runs on the legacy stream, which a non-blocking
    // stream does not wait for).
    gpu::check_cuda(cudaMemsetAsync(dout.get(), 0xFF, dout.size() * 2, stream), "poison");
    comm.host_barrier(stream);
    ep_graph.launch(stream);
    ep.check(stream);
    mine.invalid_ids = ep.invalid_id_count(stream);
    const std::vector<uint16_t> got = dout.download();
    mine.check_nonfinite = count_nonfinite(got);
    const std::vector<int64_t> rows = spread_rows(T, opt.check_tokens);
    int64_t rows_nonfinite = 0;
    mine.check_rows = static_cast<int64_t>(rows.size());
    mine.check_rel_l2 = reference_rel_l2(layer, x, topk, got, rows, &rows_nonfinite);
    mine.us = timed_median_us([&] { ep_graph.launch(stream); }, opt.iters, 2, stream, flush, &comm);
    ep.check(stream);

    // ---- baseline (a): checked against the EP layer's output, then timed whole and compute-only
    if (unfused) {
      unfused->prepare(ep_row_counts(shape, all_ids), topk.ids, T);
      unfused->set_tokens(dx.get());
      comm.host_barrier(stream);
      unfused->run(comm, dx.get(), dids.get(), dw.get(), stream);  // eager: NCCL connects its peers here
      gpu::check_cuda(cudaStreamSynchronize(stream), "baseline (a)");
      // NCCL calls in a capture: relaxed mode (NCCL may call CUDA APIs the strict modes forbid).
      const Graph a_graph(stream, [&] { unfused->run(comm, dx.get(), dids.get(), dw.get(), stream); },
                          cudaStreamCaptureModeRelaxed);
      const Graph compute_graph(stream, [&] { unfused->compute(stream); });
      gpu::check_cuda(cudaMemsetAsync(unfused->output(), 0xFF, static_cast<size_t>(T * H) * 2, stream), "poison");
      comm.barrier(stream);
      a_graph.launch(stream);
      gpu::check_cuda(cudaStreamSynchronize(stream), "baseline (a) replay");
      std::vector<uint16_t> a_out(static_cast<size_t>(T * H));
      gpu::check_cuda(cudaMemcpy(a_out.data(), unfused->output(), a_out.size() * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
      mine.a_rel_l2_vs_ep = rel_l2(a_out, bf16_to_f32_vector(got), &mine.a_nonfinite);
      mine.a_us = timed_median_us([&] { a_graph.launch(stream); }, opt.iters, 2, stream, flush, &comm);
      mine.a_compute_us = timed_median_us([&] { compute_graph.launch(stream); }, opt.iters, 2, stream, flush, &comm);
    }

    // ---- baseline (b), rank 0 alone (the others wait at the gather below)
    if (rank == 0 && opt.baselines) {
      point.single.bytes_needed = single.bytes_needed;
      point.single.skipped = single.skipped;
      if (single.plan) {
        // Every rank's tokens in rank order, as drawn above.
        std::vector<uint16_t> x_all;
        reference::TopK topk_all;
        topk_all.k = k;
        for (int s = 0; s < R; ++s) {
          std::mt19937_64 rng = ep_input_rng(opt.seed, EpInputPart::kHidden, T, s);
          const std::vector<uint16_t> xs = random_hidden(rng, T, H);
          x_all.insert(x_all.end(), xs.begin(), xs.end());
          topk_all.ids.insert(topk_all.ids.end(), routing[static_cast<size_t>(s)].ids.begin(),
                              routing[static_cast<size_t>(s)].ids.end());
          topk_all.weights.insert(topk_all.weights.end(), routing[static_cast<size_t>(s)].weights.begin(),
                                  routing[static_cast<size_t>(s)].weights.end());
        }
        const int64_t T_all = R * T;
        topk_all.tokens = T_all;
        const DeviceBuffer<uint16_t> bx(x_all);
        const DeviceBuffer<int32_t> bids(topk_all.ids);
        const DeviceBuffer<float> bw(topk_all.weights);
        DeviceBuffer<uint16_t> bout(x_all.size());
        const MoeRunArgs b_args{bx.get(), bids.get(), bw.get(), T_all, bout.get(), single.workspace->get()};
        megamoe::run(*single.plan, *single.weights, b_args, stream);
        gpu::check_cuda(cudaStreamSynchronize(stream), "baseline (b)");
        const Graph b_graph(stream, [&] { megamoe::run(*single.plan, *single.weights, b_args, stream); });
        gpu::check_cuda(cudaMemsetAsync(bout.get(), 0xFF, bout.size() * 2, stream), "poison");
        b_graph.launch(stream);
        gpu::check_cuda(cudaStreamSynchronize(stream), "baseline (b) replay");
        const std::vector<uint16_t> b_got = bout.download();
        int64_t b_rows_nonfinite = 0;
        point.single.check_nonfinite = count_nonfinite(b_got);
        point.single.check_rel_l2 =
            reference_rel_l2(layer, x_all, topk_all, b_got, spread_rows(T_all, opt.check_tokens), &b_rows_nonfinite);
        point.single.us = timed_median_us([&] { b_graph.launch(stream); }, opt.iters, 2, stream, flush, nullptr);
        point.single.ran = true;
      }
    }

    // ---- every rank's figures to rank 0
    point.ranks = comm.all_gather(mine, stream);
    const bool pass = ep_point_pass(point);
    all_pass = all_pass && pass;
    if (rank == 0) {
      std::printf("%s\n", ep_table_row(point).c_str());
      if (!pass) {
        for (int r = 0; r < R; ++r) {
          const EpRankPoint& m = point.ranks[static_cast<size_t>(r)];
          std::printf("        rank %d: EP output rel L2 %.3g on %lld checked tokens, %lld non-finite, %lld invalid "
                      "ids; baseline (a) vs EP rel L2 %.3g, %lld non-finite (allowed %.0e)\n",
                      r, m.check_rel_l2, (long long)m.check_rows, (long long)m.check_nonfinite,
                      (long long)m.invalid_ids, m.a_rel_l2_vs_ep, (long long)m.a_nonfinite, kMaxRelL2);
        }
        if (point.single.ran) {
          std::printf("        single GPU (b): rel L2 %.3g, %lld non-finite\n", point.single.check_rel_l2,
                      (long long)point.single.check_nonfinite);
        }
      }
      std::fflush(stdout);
      report["points"].push_back(to_json(point));
      report["check_pass"] = all_pass;
      write_json();
    }
    log("T/rank " + std::to_string(T) + " done");
  }

  if (rank == 0) {
    std::ofstream status(setup.status_file);
    status << (all_pass ? "pass" : "fail") << "\n";
    MEGAMOE_CHECK(status.good(), kIo, "bench --ep: cannot write '", setup.status_file, "'");
  }
  // Every rank leaves together: the layer's and NCCL's teardown are collective.
  comm.host_barrier(stream);
  cudaStreamDestroy(stream);
}

}  // namespace megamoe::bench

#else  // no expert parallelism in this build

#include "megamoe/status.h"

namespace megamoe::bench {
void run_ep_bench_rank(const EpRankSetup&, int) {
  MEGAMOE_FAIL(kUnsupported, "megamoe bench --ep: this build has no expert parallelism (configured with "
               "-DMEGAMOE_EP=OFF)");
}
}  // namespace megamoe::bench

#endif
