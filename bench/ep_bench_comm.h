// `megamoe bench --ep` (ep_bench.h): the benchmark's own NCCL communicator, the timing of a replay
// that every rank starts together, and the NVLink rate between neighbouring ranks. Internal to
// bench/, in builds with expert parallelism (NCCL).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <type_traits>
#include <vector>

#include "bench/bench_common.h"
#include "bench/l2_flush.h"
#include "megamoe/ep.h"
#include "megamoe/gpu.h"
#include "support/device_buffer.h"

namespace megamoe::bench {

// Throws megamoe::Error(kCuda) naming `what` and NCCL's message where `r` is not ncclSuccess.
void check_nccl(ncclResult_t r, const char* what);

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
    support::DeviceBuffer<uint8_t> send(sizeof(T));
    support::DeviceBuffer<uint8_t> recv(sizeof(T) * static_cast<size_t>(world_));
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

PeerRate measure_peer_rate(const BenchComm& comm, cudaStream_t stream);

}  // namespace megamoe::bench
