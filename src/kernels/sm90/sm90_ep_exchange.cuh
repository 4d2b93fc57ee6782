// The expert-parallel exchange kernels (include/megamoe/ep.h, docs/design.md §7): count-signalled,
// no barrier kernels and no memsets. Per run, on every rank:
//   send      each token row crosses to every rank that owns any of its experts, once, packed
//             with its ids and weights for that rank and its source row; a row's place there is
//             reserved with an atomic on the destination's receive count (rows arrive contiguous
//             from row 0); then one {epoch, rows} word per destination;
//   (local)   the rank's gated dispatch (sm90_signal.cuh) waits for the R words and runs its
//             experts on the rows that arrived, nothing more; the shared expert on its own tokens;
//   return    each received row's fp32 partial sum goes to its source's return slot (a fixed
//             slot: the source's row), then one {epoch} done word per source;
//   combine   waits for the R done words, sums the partials in rank order, adds the shared
//             expert, rounds once: bitwise the same whatever the arrival order.
// Epochs advance once per run in device memory (EpState), so graph replays stay in step and no
// word is ever zeroed. A wait that fails (timeout, or a peer's poison) poisons this rank's words
// in every peer and stops every later write into a peer (SignalFailure).
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

#include "ep/ep_transport.h"
#include "ep/ep_window_layout.h"
#include "kernels/common/pdl.cuh"
#include "kernels/sm90/sm90_signal.cuh"
#include "runtime/token_gate.h"

namespace megamoe::kernels::sm90 {

// A layer's exchange state on its own GPU (device memory, zero at creation).
struct EpState {
  uint64_t epoch;                  // runs completed
  uint32_t send_ctas, return_ctas, combine_ctas, unused;
  int32_t sent[ep::kMaxRanks];     // rows sent to each destination this run
  int32_t rows;                    // rows this rank's gate let through this run
  int32_t failed;                  // SignalFailure::failed
  int32_t invalid[2];              // ids outside [0, E) by the run's parity
  uint64_t gate_rows;              // {epoch, rows} the gate let through (TokenGate::published)
};

struct EpExchangeParams {
  ep::EpPeerWindows peers;  // every rank's window and signal words, this rank, the world size
  ep::EpWindowLayout layout;
  int64_t max_t;            // rows per source in the return buffers (R * max_t rows received at most)
  int64_t hidden;           // H, a multiple of 8
  int32_t top_k;
  int64_t experts_per_rank;  // E / R
  int64_t num_experts;       // E
  // This rank's run.
  const __nv_bfloat16* x;   // [T, H]
  const int32_t* topk_ids;  // [T, k] global ids
  const float* topk_w;      // [T, k]
  int64_t tokens;           // T of this rank
  // Local results.
  const float* local_out;   // [rows received, H] fp32: this rank's experts on what it received
  const float* shared_out;  // [T, H] fp32: the shared expert on this rank's tokens, or null
  __nv_bfloat16* out;       // [T, H] bf16
  EpState* state;
  runtime::SignalFailure failure;  // targets: this rank's sent and done slots in every peer
};

namespace ep_detail {

__device__ __forceinline__ int owner_of(int64_t id, const EpExchangeParams& p) {
  return id >= 0 && id < p.num_experts ? static_cast<int>(id / p.experts_per_rank) : -1;
}

__device__ __forceinline__ uint64_t run_epoch(const EpExchangeParams& p) {
  return *reinterpret_cast<const volatile uint64_t*>(&p.state->epoch) + 1;
}

// Whether this CTA is the last of its grid to get here (every thread calls it). The CTA's
// stores, peers' included, are ordered before the count (a barrier, then a system-scope fence,
// as a grid barrier does), so the last CTA sees every CTA's.
__device__ __forceinline__ bool last_cta(uint32_t* counter) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (last) {
      *counter = 0;  // every CTA has counted: ready for the next run
      __threadfence_system();
    }
  }
  __syncthreads();
  return last;
}

}  // namespace ep_detail

// One warp per token of this rank (grid-stride): for each rank that owns any of its experts, a
// row reserved there and filled (16-byte stores); the last CTA then publishes every
// destination's {epoch, rows} (0 rows too: the destination waits for every source).
__global__ void __launch_bounds__(256) ep_send_kernel(EpExchangeParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const uint64_t epoch = ep_detail::run_epoch(p);
  const bool failed = signal_failed(p.failure);
  const int rank = p.peers.rank;
  for (int64_t t = warp; t < p.tokens; t += warps) {
    int32_t id = -1;
    int owner = -1;
    float weight = 0.0f;
    if (lane < p.top_k) {
      id = p.topk_ids[t * p.top_k + lane];
      weight = p.topk_w[t * p.top_k + lane];
      owner = ep_detail::owner_of(id, p);
      if (owner < 0) atomicAdd(&p.state->invalid[epoch & 1], 1);
    }
    if (failed) continue;
    uint32_t mask = __reduce_or_sync(0xffffffffu, owner >= 0 ? 1u << owner : 0u);
    // Lane d reserves the row at destination d: one round trip for all destinations.
    unsigned long long reserved = 0;
    if (lane < p.peers.world && (mask >> lane & 1u)) {
      reserved = atomicAdd_system(reinterpret_cast<unsigned long long*>(p.peers.flags[lane] + ep::kRecvCountWord), 1ull);
      atomicAdd(&p.state->sent[lane], 1);
    }
    // A row past the receive buffer means the ranks disagree (groups of other sizes, or two runs
    // of one group at once): fail loudly rather than write out of bounds.
    const unsigned long long capacity = static_cast<unsigned long long>(p.peers.world * p.max_t);
    if (__any_sync(0xffffffffu, reserved >= capacity)) {
      if (lane == 0) signal_fail_here(p.failure, EpFailure::kStageSend);
      continue;
    }
    while (mask != 0) {
      const int d = __ffs(mask) - 1;
      mask &= mask - 1;
      const unsigned long long row = __shfl_sync(0xffffffffu, reserved, d);
      char* const base = p.peers.base[d];
      if (lane < p.top_k) {
        const bool here = owner == d;
        reinterpret_cast<int32_t*>(base + p.layout.recv_ids)[row * p.top_k + lane] =
            here ? static_cast<int32_t>(id - d * p.experts_per_rank) : -1;
        reinterpret_cast<float*>(base + p.layout.recv_w)[row * p.top_k + lane] = here ? weight : 0.0f;
      }
      if (lane == 0) reinterpret_cast<int32_t*>(base + p.layout.recv_src)[row] = rank << 24 | static_cast<int32_t>(t);
      const uint4* src = reinterpret_cast<const uint4*>(p.x + t * p.hidden);
      uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<__nv_bfloat16*>(base + p.layout.recv_x) + row * p.hidden);
      for (int64_t i = lane; i < p.hidden / 8; i += 32) dst[i] = src[i];
    }
  }
  if (ep_detail::last_cta(&p.state->send_ctas) && threadIdx.x < p.peers.world) {
    const int d = static_cast<int>(threadIdx.x);
    const int32_t rows = atomicExch(&p.state->sent[d], 0);
    if (!signal_failed(p.failure)) ptx::st_release_sys(p.peers.flags[d] + ep::kSentWord + rank, signal_word(epoch, rows));
  }
}

// One warp per row the gate let through (after the local combine, PDL): its partial sum to its
// source's return slot. The last CTA resets the receive count (every source's rows of this run
// have been reserved: the gate saw their words) and publishes {epoch} to every source.
__global__ void __launch_bounds__(256) ep_return_kernel(EpExchangeParams p) {
  grid_dependency_wait();  // the local combine's output is complete from here on
  const int lane = threadIdx.x % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const uint64_t epoch = ep_detail::run_epoch(p);
  const bool failed = signal_failed(p.failure);
  const char* const mine = p.peers.base[p.peers.rank];
  const int64_t rows = failed ? 0 : *reinterpret_cast<const volatile int32_t*>(&p.state->rows);
  for (int64_t j = warp; j < rows; j += warps) {
    const int32_t from = reinterpret_cast<const int32_t*>(mine + p.layout.recv_src)[j];
    const int s = from >> 24;
    const int64_t t = from & 0xffffff;
    const float4* src = reinterpret_cast<const float4*>(p.local_out + j * p.hidden);
    float4* dst = reinterpret_cast<float4*>(reinterpret_cast<float*>(p.peers.base[s] + p.layout.ret) +
                                            (static_cast<int64_t>(p.peers.rank) * p.max_t + t) * p.hidden);
    for (int64_t i = lane; i < p.hidden / 4; i += 32) dst[i] = src[i];
  }
  if (ep_detail::last_cta(&p.state->return_ctas)) {
    if (threadIdx.x == 0) {
      *reinterpret_cast<volatile unsigned long long*>(p.peers.flags[p.peers.rank] + ep::kRecvCountWord) = 0;
      __threadfence_system();
    }
    __syncthreads();
    if (threadIdx.x < p.peers.world && !signal_failed(p.failure)) {
      ptx::st_release_sys(p.peers.flags[threadIdx.x] + ep::kDoneWord + p.peers.rank, signal_word(epoch, 0));
    }
  }
}

// One CTA per token of this rank (at least one CTA: the last ends the run's epoch): waits for
// every rank's done word, then Σ over the ranks that hold any of its experts, in rank order, of
// their partial sums, then the shared expert, rounded to bf16 once.
__global__ void __launch_bounds__(256) ep_combine_kernel(EpExchangeParams p) {
  __shared__ uint32_t dest_mask;
  grid_dependency_wait();  // the shared expert's output (and the return) are complete from here on
  const uint64_t epoch = ep_detail::run_epoch(p);
  if (threadIdx.x == 0) {
    wait_signal_words(p.peers.flags[p.peers.rank] + ep::kDoneWord, p.peers.world, epoch, EpFailure::kStageCombine,
                      p.failure);
  }
  __syncthreads();
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
  if (ep_detail::last_cta(&p.state->combine_ctas) && threadIdx.x == 0) {
    p.state->invalid[(epoch + 1) & 1] = 0;  // the next run's count
    *reinterpret_cast<volatile uint64_t*>(&p.state->epoch) = epoch;
  }
}

}  // namespace megamoe::kernels::sm90
