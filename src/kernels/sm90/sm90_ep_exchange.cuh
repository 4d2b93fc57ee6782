// The expert-parallel exchange kernels (include/megamoe/ep.h, docs/design.md §7): count-signalled,
// no barrier kernels and no memsets. Per run, on every rank:
//   send      each token row crosses to every rank that owns any of its experts, once, packed
//             with its ids and weights for that rank and its source row; a row's place there is
//             reserved with an atomic on the destination's receive count (rows arrive contiguous
//             from row 0); then one {epoch, rows} word per destination;
//   (local)   the rank's gated dispatch (sm90_signal.cuh) waits for the R words and runs its
//             experts on the rows that arrived, nothing more; the shared expert on its own tokens;
//   return    the local combine writes each received row's fp32 partial sum straight into its
//             source's return slot (a fixed slot: the source's row; runtime::ReturnRows), then
//             the combine kernel's first CTA publishes one {epoch} done word per source;
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

// The stages' %globaltimer stamps of a run (MoeEpLayer::StageStamps, in its order): CTA 0's
// entry, or the last CTA's end, of each exchange kernel; the gate's are the dispatch's, the
// return's those of the combine CTA that claimed it.
enum EpStamp : int {
  kStampSendBegin,
  kStampSendEnd,
  kStampGateBegin,
  kStampGateOpen,
  kStampReturnBegin,
  kStampReturnEnd,
  kStampCombineBegin,
  kStampPartialsArrived,
  kStampCombineEnd,
  kStampCount
};

// A layer's exchange state on its own GPU (device memory, zero at creation).
struct EpState {
  uint64_t epoch;                  // runs completed
  uint32_t send_ctas, combine_ctas;
  uint32_t returned;               // the last run (epoch, low 32 bits) whose return was published
  uint32_t unused;
  int32_t sent[ep::kMaxRanks];     // rows sent to each destination this run
  int32_t rows;                    // rows this rank's gate let through this run
  int32_t failed;                  // SignalFailure::failed
  int32_t invalid[2];              // ids outside [0, E) by the run's parity
  uint64_t gate_rows;              // {epoch, rows} the gate let through (TokenGate::published)
  uint64_t stamps[kStampCount];    // the last run's, EpStamp order
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
  // Local results (this rank's experts' sums go straight to their sources: runtime::ReturnRows).
  const float* shared_out;  // [T, H] fp32: the shared expert on this rank's tokens, or null
  __nv_bfloat16* out;       // [T, H] bf16
  EpState* state;
  runtime::SignalFailure failure;  // targets: this rank's sent and done slots in every peer
};

// Threads per CTA of the exchange kernels; a CTA moves one row at a time, each thread up to
// kExchangeVecs 16-byte vectors of it per pass, every load of a pass issued before its stores:
// one memory round trip per pass, not one per vector (the loads cannot move past stores that may
// alias them; docs/perf v44).
inline constexpr int kExchangeThreads = 256;
inline constexpr int kExchangeVecs = 8;

namespace ep_detail {

__device__ __forceinline__ int owner_of(int64_t id, const EpExchangeParams& p) {
  return id >= 0 && id < p.num_experts ? static_cast<int>(id / p.experts_per_rank) : -1;
}

__device__ __forceinline__ uint64_t run_epoch(const EpExchangeParams& p) {
  return *reinterpret_cast<const volatile uint64_t*>(&p.state->epoch) + 1;
}

// Whether this CTA is the last of its grid to get here (every thread calls it). The CTA's
// stores, peers' included, are ordered before the count (a barrier, then a system-scope release
// fence), and the last CTA's acquire fence orders every CTA's before what it does next. A grid of
// one CTA needs only the barrier: what it does next is a release store (cumulative over the
// stores the barrier ordered before it) or this GPU's own state for the next kernel.
__device__ __forceinline__ bool last_cta(uint32_t* counter) {
  __shared__ bool last;
  __syncthreads();
  if (gridDim.x == 1) return true;
  if (threadIdx.x == 0) {
    ptx::fence_acq_rel_sys();
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (last) {
      *counter = 0;  // every CTA has counted: ready for the next run
      ptx::fence_acq_rel_sys();
    }
  }
  __syncthreads();
  return last;
}

// Thread 0 of CTA 0 stamps `which` (a plain store: read after the run, never waited on).
__device__ __forceinline__ void stamp_first(const EpExchangeParams& p, int which) {
  if (blockIdx.x == 0 && threadIdx.x == 0) p.state->stamps[which] = ptx::stamp_ns();
}

// The CTA copies `n` 16-byte vectors from `src` to each of `dst[d]` for d in `mask`.
template <class Vec>
__device__ __forceinline__ void copy_row(const Vec* src, Vec* const* dst, uint32_t mask, int64_t n) {
  for (int64_t base = threadIdx.x; base < n; base += int64_t{kExchangeThreads} * kExchangeVecs) {
    Vec v[kExchangeVecs];
#pragma unroll
    for (int i = 0; i < kExchangeVecs; ++i) {
      const int64_t j = base + i * kExchangeThreads;
      if (j < n) v[i] = src[j];
    }
    for (uint32_t m = mask; m != 0; m &= m - 1) {
      Vec* const out = dst[__ffs(m) - 1];
#pragma unroll
      for (int i = 0; i < kExchangeVecs; ++i) {
        const int64_t j = base + i * kExchangeThreads;
        if (j < n) out[j] = v[i];
      }
    }
  }
}

// sum[i] += row[base + i * kExchangeThreads] over the pass's vectors within the row's n.
__device__ __forceinline__ void add_pass(float4 (&sum)[kExchangeVecs], const float4* row, int64_t base, int64_t n) {
#pragma unroll
  for (int i = 0; i < kExchangeVecs; ++i) {
    const int64_t j = base + i * kExchangeThreads;
    if (j < n) {
      const float4 v = row[j];
      sum[i].x += v.x; sum[i].y += v.y; sum[i].z += v.z; sum[i].w += v.w;
    }
  }
}

// The ranks that hold any of token t's experts (every thread calls it; ends with a barrier).
__device__ __forceinline__ uint32_t token_owners(const EpExchangeParams& p, int64_t t) {
  __shared__ uint32_t owners;
  if (threadIdx.x == 0) owners = 0;
  __syncthreads();
  if (t < p.tokens && threadIdx.x < p.top_k) {
    const int owner = owner_of(p.topk_ids[t * p.top_k + threadIdx.x], p);
    if (owner >= 0) atomicOr(&owners, 1u << owner);
  }
  __syncthreads();
  const uint32_t out = owners;
  __syncthreads();  // `owners` is rewritten by the next call
  return out;
}

}  // namespace ep_detail

// One CTA per token of this rank (grid-stride): warp 0 reserves the token's row at every rank
// that owns any of its experts and writes its ids, weights and source there; then the CTA copies
// the row to each. The last CTA publishes every destination's {epoch, rows} (0 rows too: the
// destination waits for every source).
__global__ void __launch_bounds__(kExchangeThreads) ep_send_kernel(EpExchangeParams p) {
  __shared__ uint4* row_dst[ep::kMaxRanks];
  __shared__ uint32_t dest_mask;
  allow_dependent_launch();  // the gated dispatch may start its wait for the rows now
  ep_detail::stamp_first(p, kStampSendBegin);
  const int lane = threadIdx.x % 32;
  const uint64_t epoch = ep_detail::run_epoch(p);
  // The same for every thread: the warp's collectives below run on all lanes or none.
  const bool failed = __syncthreads_or(signal_failed(p.failure));
  const int rank = p.peers.rank;
  for (int64_t t = blockIdx.x; t < p.tokens; t += gridDim.x) {
    if (threadIdx.x < 32) {
      int32_t id = -1;
      int owner = -1;
      float weight = 0.0f;
      if (lane < p.top_k) {
        id = p.topk_ids[t * p.top_k + lane];
        weight = p.topk_w[t * p.top_k + lane];
        owner = ep_detail::owner_of(id, p);
        if (owner < 0) atomicAdd(&p.state->invalid[epoch & 1], 1);
      }
      uint32_t mask = __reduce_or_sync(0xffffffffu, owner >= 0 ? 1u << owner : 0u);
      if (failed) mask = 0;
      // Lane d reserves the row at destination d: one round trip for all destinations.
      unsigned long long reserved = 0;
      if (lane < p.peers.world && (mask >> lane & 1u)) {
        reserved = atomicAdd_system(reinterpret_cast<unsigned long long*>(p.peers.flags[lane] + ep::kRecvCountWord), 1ull);
        atomicAdd(&p.state->sent[lane], 1);
      }
      // A row past the receive buffer means the ranks disagree (groups of other sizes, or two
      // runs of one group at once): fail loudly rather than write out of bounds.
      const unsigned long long capacity = static_cast<unsigned long long>(p.peers.world * p.max_t);
      if (__any_sync(0xffffffffu, reserved >= capacity)) {
        if (lane == 0) signal_fail_here(p.failure, EpFailure::kStageSend);
        mask = 0;
      }
      for (uint32_t m = mask; m != 0; m &= m - 1) {
        const int d = __ffs(m) - 1;
        const unsigned long long row = __shfl_sync(0xffffffffu, reserved, d);
        char* const base = p.peers.base[d];
        if (lane < p.top_k) {
          const bool here = owner == d;
          reinterpret_cast<int32_t*>(base + p.layout.recv_ids)[row * p.top_k + lane] =
              here ? static_cast<int32_t>(id - d * p.experts_per_rank) : -1;
          reinterpret_cast<float*>(base + p.layout.recv_w)[row * p.top_k + lane] = here ? weight : 0.0f;
        }
        if (lane == 0) {
          reinterpret_cast<int32_t*>(base + p.layout.recv_src)[row] = rank << 24 | static_cast<int32_t>(t);
          row_dst[d] = reinterpret_cast<uint4*>(reinterpret_cast<__nv_bfloat16*>(base + p.layout.recv_x) + row * p.hidden);
        }
      }
      if (lane == 0) dest_mask = mask;
    }
    __syncthreads();
    ep_detail::copy_row(reinterpret_cast<const uint4*>(p.x + t * p.hidden), row_dst, dest_mask, p.hidden / 8);
    __syncthreads();  // row_dst and dest_mask are rewritten for the next token
  }
  if (ep_detail::last_cta(&p.state->send_ctas) && threadIdx.x < p.peers.world) {
    const int d = static_cast<int>(threadIdx.x);
    const int32_t rows = atomicExch(&p.state->sent[d], 0);
    if (!signal_failed(p.failure)) ptx::st_release_sys(p.peers.flags[d] + ep::kSentWord + rank, signal_word(epoch, rows));
    if (d == 0) p.state->stamps[kStampSendEnd] = ptx::stamp_ns();
  }
}

namespace ep_detail {

// The return, by the combine's first CTA to run (thread 0 claims it; every thread calls this):
// the local combine, which this grid's dependency wait follows, wrote every received row's partial
// sum straight into its source's return slot (runtime::ReturnRows), and its stores, peers'
// included, are complete once its grid is. Resets the receive count (every source's rows of this
// run were reserved: the gate saw their words), then publishes {epoch} into every source's done
// word for this rank, each a system-scope release after them. The first CTA to run, not CTA 0: a
// grid larger than its SMs hold (a loopback rank's partition) runs CTA 0 only once others exit.
__device__ __forceinline__ void publish_return(const EpExchangeParams& p, uint64_t epoch) {
  __shared__ bool first;
  if (threadIdx.x == 0) {
    const uint32_t run = static_cast<uint32_t>(epoch);
    first = atomicExch(&p.state->returned, run) != run;
    if (first) {
      p.state->stamps[kStampReturnBegin] = ptx::stamp_ns();
      *reinterpret_cast<volatile unsigned long long*>(p.peers.flags[p.peers.rank] + ep::kRecvCountWord) = 0;
    }
  }
  __syncthreads();  // the reset, before the done words' release
  if (first && threadIdx.x < p.peers.world && !signal_failed(p.failure)) {
    ptx::st_release_sys(p.peers.flags[threadIdx.x] + ep::kDoneWord + p.peers.rank, signal_word(epoch, 0));
  }
  if (first && threadIdx.x == 0) p.state->stamps[kStampReturnEnd] = ptx::stamp_ns();
}

}  // namespace ep_detail

// One CTA per token of this rank (at least one CTA: the last ends the run's epoch), after the
// local combine (PDL): the return (publish_return), then waits for every rank's done word, then
// Σ over the ranks that hold any of its experts, in rank order, of their partial sums, then the
// shared expert, rounded to bf16 once. Each thread sums up to kExchangeVecs vectors of 4 per
// pass, every rank's loads of a pass issued before its stores.
__global__ void __launch_bounds__(kExchangeThreads) ep_combine_kernel(EpExchangeParams p) {
  grid_dependency_wait();  // the shared expert's output and the local combine are complete from here on
  const uint64_t epoch = ep_detail::run_epoch(p);
  ep_detail::stamp_first(p, kStampCombineBegin);
  ep_detail::publish_return(p, epoch);
  // The first token's ranks while the partial sums are still on their way.
  uint32_t mask = ep_detail::token_owners(p, blockIdx.x);
  if (threadIdx.x == 0) {
    wait_signal_words(p.peers.flags[p.peers.rank] + ep::kDoneWord, p.peers.world, epoch, EpFailure::kStageCombine,
                      p.failure);
  }
  __syncthreads();
  ep_detail::stamp_first(p, kStampPartialsArrived);
  const float4* ret = reinterpret_cast<const float4*>(p.peers.base[p.peers.rank] + p.layout.ret);
  const int64_t n = p.hidden / 4;
  for (int64_t t = blockIdx.x; t < p.tokens; t += gridDim.x) {
    if (t != blockIdx.x) mask = ep_detail::token_owners(p, t);
    const float4* shared = p.shared_out != nullptr ? reinterpret_cast<const float4*>(p.shared_out) + t * n : nullptr;
    for (int64_t base = threadIdx.x; base < n; base += int64_t{kExchangeThreads} * kExchangeVecs) {
      float4 sum[kExchangeVecs];
#pragma unroll
      for (int i = 0; i < kExchangeVecs; ++i) sum[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int d = 0; d < p.peers.world; ++d) {
        if (mask >> d & 1u) ep_detail::add_pass(sum, ret + (static_cast<int64_t>(d) * p.max_t + t) * n, base, n);
      }
      if (shared != nullptr) ep_detail::add_pass(sum, shared, base, n);
#pragma unroll
      for (int i = 0; i < kExchangeVecs; ++i) {
        const int64_t j = base + i * kExchangeThreads;
        if (j < n) {
          __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(p.out + t * p.hidden + 4 * j);
          o[0] = __floats2bfloat162_rn(sum[i].x, sum[i].y);
          o[1] = __floats2bfloat162_rn(sum[i].z, sum[i].w);
        }
      }
    }
  }
  if (ep_detail::last_cta(&p.state->combine_ctas) && threadIdx.x == 0) {
    p.state->invalid[(epoch + 1) & 1] = 0;  // the next run's count
    p.state->stamps[kStampCombineEnd] = ptx::stamp_ns();
    *reinterpret_cast<volatile uint64_t*>(&p.state->epoch) = epoch;
  }
}

}  // namespace megamoe::kernels::sm90
