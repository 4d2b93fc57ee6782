// Signal words between the ranks of an expert-parallel layer (src/runtime/token_gate.h): 64-bit
// words that one rank stores (release, system scope) into another's memory and the other waits
// on (acquire), bounded. Epochs advance once per run and are never reset, so no word needs
// zeroing between runs.
//   bit 63      poison: the writer gave up; bits 8..15 the rank that failed first, 0..7 its stage
//   bits 32..62 the run's epoch (modulo 2^31)
//   bits 0..31  a count (the rows a producer sent), or 0
#pragma once

#include <cstdint>

#include "kernels/common/ptx_atomics.cuh"
#include "runtime/token_gate.h"

namespace megamoe::kernels::sm90 {

inline constexpr uint64_t kSignalPoison = uint64_t{1} << 63;

// What failed, in a rank's error word: the kind, and for a peer's failure which peer and where.
struct EpFailure {
  static constexpr int32_t kDispatchTimeout = 1;  // this rank waited too long for its peers' rows
  static constexpr int32_t kCombineTimeout = 2;   // ... for its peers' partial sums
  static constexpr int32_t kPeerGaveUp = 3;       // a peer poisoned its signal words
  static constexpr int32_t kOverflow = 4;         // more rows than a receive buffer holds: the
                                                  // ranks' groups differ, or two runs overlapped
  // The stages a wait reports (the kinds of a timeout).
  static constexpr int32_t kStageDispatch = kDispatchTimeout;
  static constexpr int32_t kStageCombine = kCombineTimeout;
  static constexpr int32_t kStageSend = kOverflow;
  __host__ __device__ static constexpr int32_t peer(int32_t peer_rank, int32_t peer_stage) {
    return kPeerGaveUp | peer_rank << 8 | peer_stage << 16;
  }
  __host__ __device__ static constexpr int32_t kind(int32_t word) { return word & 0xff; }
  __host__ __device__ static constexpr int32_t peer_rank(int32_t word) { return word >> 8 & 0xff; }
  __host__ __device__ static constexpr int32_t peer_stage(int32_t word) { return word >> 16 & 0xff; }
};

__host__ __device__ constexpr uint64_t signal_word(uint64_t epoch, uint32_t count) {
  return (epoch & 0x7fffffffu) << 32 | count;
}

__device__ __forceinline__ bool signal_failed(const runtime::SignalFailure& f) {
  return *reinterpret_cast<const volatile int32_t*>(f.failed) != 0;
}

// Records a failure and poisons the peers (`poison` as received, or this rank's own). The first
// failure of the rank is kept: a later one (its own poison seen by another of its waits, say)
// changes nothing.
__device__ __forceinline__ void signal_fail(const runtime::SignalFailure& f, int32_t failure, uint64_t poison) {
  if (atomicCAS(f.failed, 0, failure) != 0) return;
  for (int i = 0; i < f.target_count; ++i) ptx::st_release_sys(f.targets[i], poison);
  atomicExch(f.error, failure);
  __threadfence_system();
}

// This rank's own failure, at `stage`, poisoning its peers.
__device__ __forceinline__ void signal_fail_here(const runtime::SignalFailure& f, int32_t stage) {
  signal_fail(f, stage, kSignalPoison | static_cast<uint64_t>(f.rank) << 8 | static_cast<uint64_t>(stage));
}

// One thread: waits until each of words[0, n) carries `epoch`, up to f.timeout_ns; the counts
// summed. Every word is polled each round, so a poison anywhere fails the wait at once. On a
// timeout or a poison the failure is recorded, the peers poisoned, and it returns -1; it returns
// -1 at once where this rank has already failed.
__device__ __forceinline__ int64_t wait_signal_words(const uint64_t* words, int n, uint64_t epoch, int32_t stage,
                                                     const runtime::SignalFailure& f) {
  if (signal_failed(f)) return -1;
  const uint64_t want = epoch & 0x7fffffffu;
  const uint64_t start = ptx::global_timer_ns();
  uint32_t pending = n >= 32 ? ~0u : (1u << n) - 1;
  int64_t total = 0;
  for (;;) {
    for (uint32_t left = pending; left != 0; left &= left - 1) {
      const int s = __ffs(left) - 1;
      const uint64_t seen = ptx::ld_acquire_sys(words + s);
      if (seen & kSignalPoison) {
        signal_fail(f, EpFailure::peer(static_cast<int32_t>(seen >> 8 & 0xff), static_cast<int32_t>(seen & 0xff)),
                    seen);
        return -1;
      }
      if ((seen >> 32) == want) {
        total += static_cast<uint32_t>(seen);
        pending &= ~(1u << s);
      }
    }
    if (pending == 0) return total;
    if (ptx::global_timer_ns() - start > f.timeout_ns) {
      signal_fail_here(f, stage);
      return -1;
    }
    __nanosleep(64);
  }
}

// One thread of the dispatch, once the run's rows are settled: publishes them to early-starting
// GEMM CTAs (GateRows), released after the gate's acquire of the producers' words, so that a CTA
// that acquires this word also sees the rows (causality order).
__device__ __forceinline__ void publish_gate_rows(const runtime::TokenGate& g, int32_t rows) {
  if (g.published == nullptr) return;
  const uint64_t epoch = *reinterpret_cast<const volatile uint64_t*>(g.epoch) + 1;
  ptx::st_release_gpu(g.published, signal_word(epoch, static_cast<uint32_t>(rows)));
}

// One thread of an early-starting GEMM CTA: the rows the dispatch published for this run. A
// timeout breaks the invariant that the dispatch, running before this grid, always publishes:
// the kernel traps rather than schedule rows it never saw.
__device__ __forceinline__ int32_t wait_gate_rows(const runtime::GateRows& g) {
  const uint64_t want = (*reinterpret_cast<const volatile uint64_t*>(g.epoch) + 1) & 0x7fffffffu;
  const uint64_t start = ptx::global_timer_ns();
  for (;;) {
    const uint64_t seen = ptx::ld_acquire_gpu(g.published);
    if ((seen >> 32) == want) return static_cast<int32_t>(static_cast<uint32_t>(seen));
    if (ptx::global_timer_ns() - start > g.timeout_ns) __trap();
    __nanosleep(32);
  }
}

// The dispatch's gate (every thread of the CTA calls it; one waits): the rows the run takes, at
// most `bound`; 0 where the wait failed (the layer's outputs are then undefined, and the failure
// is reported by the host's check). Ends with a barrier.
__device__ __forceinline__ int32_t gate_tokens(const runtime::TokenGate& g, int32_t bound) {
  __shared__ int32_t rows;
  if (threadIdx.x == 0) {
    const uint64_t epoch = *reinterpret_cast<const volatile uint64_t*>(g.epoch) + 1;
    const bool stamp = g.stamps != nullptr && blockIdx.x == 0;
    if (stamp) g.stamps[0] = ptx::stamp_ns();
    const int64_t sent = wait_signal_words(g.words, g.producers, epoch, g.stage, g.failure);
    if (stamp) g.stamps[1] = ptx::stamp_ns();
    int32_t n = 0;
    if (sent >= 0) {
      const unsigned long long arrived = *reinterpret_cast<const volatile unsigned long long*>(g.count);
      // Every producer reserved its rows before it signalled: the two agree unless memory is corrupt.
      n = static_cast<int32_t>(min(static_cast<unsigned long long>(bound), arrived));
      if (arrived != static_cast<unsigned long long>(sent) || arrived > static_cast<unsigned long long>(bound)) {
        signal_fail_here(g.failure, g.stage);
        n = 0;
      }
    }
    rows = n;
    if (blockIdx.x == 0) *g.rows = n;
  }
  __syncthreads();
  return rows;
}

}  // namespace megamoe::kernels::sm90
