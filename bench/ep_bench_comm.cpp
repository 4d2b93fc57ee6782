// The communicator, timing and NVLink rate of `megamoe bench --ep` (ep_bench_comm.h).
#if MEGAMOE_HAS_EP

#include "bench/ep_bench_comm.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <vector>

#include "megamoe/gpu.h"
#include "megamoe/status.h"
#include "support/device_buffer.h"

namespace megamoe::bench {

using support::DeviceBuffer;

void check_nccl(ncclResult_t r, const char* what) {
  MEGAMOE_CHECK(r == ncclSuccess, kCuda, "bench --ep: NCCL ", what, " failed: ", ncclGetErrorString(r), " (", r, ")");
}

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

}  // namespace megamoe::bench

#endif  // MEGAMOE_HAS_EP
