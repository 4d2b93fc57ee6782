// The expert-parallel exchange kernels (include/megamoe/ep.h): dispatch of tokens to the ranks
// that own their experts, a bounded barrier, the return of weighted fp32 partial sums, and the
// final combine. Peers' windows are reached through the plain device pointers a transport hands
// out (EpPeerWindows, src/ep/ep_transport.h): loads and stores, whatever the transport. What
// each window holds is EpWindowLayout and the barriers' signal words (src/ep/ep_window_layout.h).
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

#include "ep/ep_transport.h"
#include "ep/ep_window_layout.h"
#include "kernels/common/ptx_atomics.cuh"

namespace megamoe::kernels::sm90 {

struct EpExchangeParams {
  ep::EpPeerWindows peers;  // every rank's window and signal words, this rank, the world size
  ep::EpWindowLayout layout;
  int64_t max_t;            // rows per source in the receive buffers
  int64_t hidden;           // H, a multiple of 8
  int32_t top_k;
  int64_t experts_per_rank;  // E / R
  int64_t num_experts;       // E
  // This rank's run.
  const __nv_bfloat16* x;   // [T, H]
  const int32_t* topk_ids;  // [T, k] global ids
  const float* topk_w;      // [T, k]
  int64_t tokens;           // T of this rank
  int32_t* invalid_ids;     // counter of ids outside [0, E), zeroed before each dispatch
  // Local results.
  const float* local_out;   // [R * max_t, H] fp32: this rank's experts on what it received
  const float* shared_out;  // [max_t, H] fp32: the shared expert on this rank's tokens, or null
  __nv_bfloat16* out;       // [T, H] bf16
  // Barrier state.
  uint64_t* epochs;         // [kBarriers] this rank's barrier epochs (device memory)
  int32_t* error;           // host-mapped: nonzero once a barrier failed (EpFailure)
  int32_t* failed;          // device memory: the same word, which the exchange kernels read cheaply
  uint64_t timeout_ns;
};

// A failed rank's error word: what failed (kind), and for a peer's failure which peer and where.
struct EpFailure {
  static constexpr int32_t kDispatchTimeout = 1;  // this rank waited too long at the dispatch barrier
  static constexpr int32_t kReturnTimeout = 2;    // ... at the return barrier
  static constexpr int32_t kPeerGaveUp = 3;       // a peer poisoned its signal words
  __host__ __device__ static constexpr int32_t peer(int32_t peer_rank, int32_t peer_stage) {
    return kPeerGaveUp | peer_rank << 8 | peer_stage << 16;
  }
  __host__ __device__ static constexpr int32_t kind(int32_t word) { return word & 0xff; }
  __host__ __device__ static constexpr int32_t peer_rank(int32_t word) { return word >> 8 & 0xff; }
  __host__ __device__ static constexpr int32_t peer_stage(int32_t word) { return word >> 16 & 0xff; }
};

namespace ep_detail {

// Once a barrier failed, no kernel of this rank writes into a peer's window again.
__device__ __forceinline__ bool failed(const EpExchangeParams& p) {
  return *reinterpret_cast<const volatile int32_t*>(p.failed) != 0;
}

__device__ __forceinline__ int owner_of(int64_t id, const EpExchangeParams& p) {
  return id >= 0 && id < p.num_experts ? static_cast<int>(id / p.experts_per_rank) : -1;
}

}  // namespace ep_detail

// One warp per (token row t < max_t, destination d): rows of tokens that hold an expert of d are
// copied to d's recv_x (once, however many of d's experts they chose), their ids mapped to d's
// local ids; every other row's ids become -1 there, so d's local layer skips it (the receive
// buffers persist between runs).
__global__ void __launch_bounds__(256) ep_dispatch_kernel(EpExchangeParams p) {
  if (ep_detail::failed(p)) return;
  const int lane = threadIdx.x % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int64_t rows = p.max_t * p.peers.world;
  for (int64_t item = warp; item < rows; item += warps) {
    const int d = static_cast<int>(item % p.peers.world);
    const int64_t t = item / p.peers.world;
    char* const base = p.peers.base[d];
    const int64_t row = static_cast<int64_t>(p.peers.rank) * p.max_t + t;  // this rank's block at d
    int32_t* ids = reinterpret_cast<int32_t*>(base + p.layout.recv_ids) + row * p.top_k;
    float* w = reinterpret_cast<float*>(base + p.layout.recv_w) + row * p.top_k;
    int32_t local = -1;
    float weight = 0.0f;
    if (t < p.tokens && lane < p.top_k) {
      const int32_t id = p.topk_ids[t * p.top_k + lane];
      const int owner = ep_detail::owner_of(id, p);
      if (owner < 0 && d == 0) atomicAdd(p.invalid_ids, 1);
      if (owner == d) {
        local = static_cast<int32_t>(id - d * p.experts_per_rank);
        weight = p.topk_w[t * p.top_k + lane];
      }
    }
    if (lane < p.top_k) {
      ids[lane] = local;
      w[lane] = weight;
    }
    if (__any_sync(0xffffffffu, local >= 0)) {
      const uint4* src = reinterpret_cast<const uint4*>(p.x + t * p.hidden);
      uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<__nv_bfloat16*>(base + p.layout.recv_x) + row * p.hidden);
      for (int64_t i = lane; i < p.hidden / 8; i += 32) dst[i] = src[i];
    }
  }
  // The stores to the peers precede the barrier kernel's release (next on the stream).
  __threadfence_system();
}

// A flag value no epoch reaches: a rank that gave up tells its peers so, and which rank gave up
// where (bits 8..15 the rank, bits 0..7 the stage: 1 + barrier).
inline constexpr uint64_t kEpPoisonFlag = uint64_t{1} << 63;

// Barrier `which` (0: after dispatch, 1: after return) over all ranks, one thread: publish this
// rank's next epoch in every peer's flag slot, then wait for every peer's, up to timeout_ns.
// Epochs live in device memory and advance once per run, so graph replays stay in step as long
// as every rank replays the same graph. On timeout the rank records the failure and poisons its
// slots of both barriers in every peer, so that every peer fails at once wherever it waits,
// instead of running on with data it may overwrite or waiting a second full timeout; a rank that
// sees a poison records it and passes it on the same way. A rank that has failed stops taking
// part (no kernel of it writes into a peer's window again). The outputs of such runs are
// undefined: MoeEpLayer::check reports the failure, with the rank and the stage.
__global__ void ep_barrier_kernel(EpExchangeParams p, int which) {
  if (threadIdx.x != 0) return;
  if (ep_detail::failed(p)) return;
  __threadfence_system();
  const uint64_t epoch = p.epochs[which] + 1;
  for (int d = 0; d < p.peers.world; ++d) {
    ptx::st_release_sys(p.peers.flags[d] + which * ep::kMaxRanks + p.peers.rank, epoch);
  }
  const uint64_t* mine = p.peers.flags[p.peers.rank] + which * ep::kMaxRanks;
  const uint64_t start = ptx::global_timer_ns();
  int32_t failure = 0;
  uint64_t poison = kEpPoisonFlag | static_cast<uint64_t>(p.peers.rank) << 8 | static_cast<uint64_t>(1 + which);
  for (int s = 0; s < p.peers.world && failure == 0; ++s) {
    for (;;) {
      const uint64_t seen = ptx::ld_acquire_sys(mine + s);
      if (seen & kEpPoisonFlag) {
        failure = EpFailure::peer(static_cast<int32_t>(seen >> 8 & 0xff), static_cast<int32_t>(seen & 0xff));
        poison = seen;  // passed on as it came: the rank that gave up first, and where
        break;
      }
      if (static_cast<int64_t>(seen - epoch) >= 0) break;
      if (ptx::global_timer_ns() - start > p.timeout_ns) {
        failure = which == 0 ? EpFailure::kDispatchTimeout : EpFailure::kReturnTimeout;
        break;
      }
      __nanosleep(256);
    }
  }
  if (failure != 0) {
    *reinterpret_cast<volatile int32_t*>(p.failed) = failure;
    for (int d = 0; d < p.peers.world; ++d) {
      for (int b = 0; b < ep::kBarriers; ++b) {
        ptx::st_release_sys(p.peers.flags[d] + b * ep::kMaxRanks + p.peers.rank, poison);
      }
    }
    atomicExch(p.error, failure);
    __threadfence_system();
  }
  p.epochs[which] = epoch;
}

// One warp per received row: a row that held any of this rank's experts gets its weighted fp32
// partial sum (local_out) written back into its source rank's `ret` block of this rank.
__global__ void __launch_bounds__(256) ep_return_kernel(EpExchangeParams p) {
  if (ep_detail::failed(p)) return;
  const int lane = threadIdx.x % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int32_t* recv_ids = reinterpret_cast<const int32_t*>(p.peers.base[p.peers.rank] + p.layout.recv_ids);
  for (int64_t row = warp; row < p.max_t * p.peers.world; row += warps) {
    const bool mine = lane < p.top_k && recv_ids[row * p.top_k + lane] >= 0;
    if (!__any_sync(0xffffffffu, mine)) continue;
    const int s = static_cast<int>(row / p.max_t);
    const int64_t t = row % p.max_t;
    const float4* src = reinterpret_cast<const float4*>(p.local_out + row * p.hidden);
    float4* dst = reinterpret_cast<float4*>(reinterpret_cast<float*>(p.peers.base[s] + p.layout.ret) +
                                            (static_cast<int64_t>(p.peers.rank) * p.max_t + t) * p.hidden);
    for (int64_t i = lane; i < p.hidden / 4; i += 32) dst[i] = src[i];
  }
  __threadfence_system();
}

// One CTA per token of this rank: Σ over the ranks that hold any of its experts, in rank order,
// of their partial sums, then the shared expert, rounded to bf16 once.
__global__ void __launch_bounds__(256) ep_combine_kernel(EpExchangeParams p) {
  __shared__ uint32_t dest_mask;
  const float* ret = reinterpret_cast<const float*>(p.peers.base[p.peers.rank] + p.layout.ret);
  for (int64_t t = blockIdx.x; t < p.tokens; t += gridDim.x) {
    if (threadIdx.x == 0) dest_mask = 0;
    __syncthreads();
    if (threadIdx.x < p.top_k) {
      const int owner = ep_detail::owner_of(p.topk_ids[t * p.top_k + threadIdx.x], p);
      if (owner >= 0) atomicOr(&dest_mask, 1u << owner);
    }
    __syncthreads();
    const uint32_t mask = dest_mask;
    for (int64_t v = threadIdx.x; v < p.hidden / 4; v += blockDim.x) {
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int d = 0; d < p.peers.world; ++d) {
        if (!(mask >> d & 1u)) continue;
        const float4 y = reinterpret_cast<const float4*>(ret + (static_cast<int64_t>(d) * p.max_t + t) * p.hidden)[v];
        sum.x += y.x; sum.y += y.y; sum.z += y.z; sum.w += y.w;
      }
      if (p.shared_out != nullptr) {
        const float4 y = reinterpret_cast<const float4*>(p.shared_out + t * p.hidden)[v];
        sum.x += y.x; sum.y += y.y; sum.z += y.z; sum.w += y.w;
      }
      __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(p.out + t * p.hidden + 4 * v);
      o[0] = __floats2bfloat162_rn(sum.x, sum.y);
      o[1] = __floats2bfloat162_rn(sum.z, sum.w);
    }
    __syncthreads();  // dest_mask is rewritten for the next token
  }
}

}  // namespace megamoe::kernels::sm90
