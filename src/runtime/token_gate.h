// Rows that producers elsewhere (the ranks of an expert-parallel layer) deliver into this GPU's
// memory while a run is already queued: the run's dispatch waits for them on the device and
// takes as many rows as arrived. Plain C++: host code fills it, the sm90 dispatch reads it
// (sm90_signal.cuh has the words' format and the wait).
#pragma once

#include <cstdint>

namespace megamoe::runtime {

inline constexpr int kMaxSignalTargets = 16;

// What a bounded wait on signal words does when it fails (a timeout, or a peer's poison): it
// records the failure on the device and in host-mapped memory, and poisons `targets` (this
// rank's words in its peers), so that they fail at once wherever they wait.
struct SignalFailure {
  uint64_t timeout_ns = 0;
  int32_t* failed = nullptr;  // device word: nonzero once any wait of this rank failed
  int32_t* error = nullptr;   // host-mapped copy, read by the host after a synchronisation
  uint64_t* targets[kMaxSignalTargets] = {};
  int32_t target_count = 0;
  int32_t rank = 0;           // reported in the poison
};

// Where a gated run's combine puts each row's fp32 sum where the rows came from elsewhere: straight
// into the return buffer of the rank that sent the row (expert parallelism), not into output_f32.
// Row r came from rank src[r] >> 24, its row src[r] & 0xffffff there; its sum goes to fp32 row
// (first_row + that row) of bases[that rank] + offset. Null src: output_f32 as usual.
inline constexpr int kMaxReturnRanks = 8;
struct ReturnRows {
  char* bases[kMaxReturnRanks] = {};
  int64_t offset = 0;     // bytes
  int64_t first_row = 0;  // this rank's first row in a source's buffer
  const int32_t* src = nullptr;
};

struct TokenGate {
  const uint64_t* words = nullptr;  // [producers] {epoch, rows sent}, in this GPU's memory
  int32_t producers = 0;
  int32_t stage = 0;                // what a failure of this wait reports (sm90_signal.cuh)
  // The rows that arrived, contiguous from row 0 (each producer reserves its rows here).
  const unsigned long long* count = nullptr;
  const uint64_t* epoch = nullptr;  // the run waits for epoch *epoch + 1
  int32_t* rows = nullptr;          // where the gate stores the rows it let through (the combine reads them)
  // Optional: {epoch, rows} (the signal words' format), stored once the dispatch has settled the
  // rows, for GEMM CTAs that start before the dispatch ends (early start); null if none do.
  uint64_t* published = nullptr;
  // Optional: two %globaltimer stamps of CTA 0, its wait's start and end (the layer's stage
  // stamps, MoeEpLayer::stage_stamps); null: none.
  uint64_t* stamps = nullptr;
  SignalFailure failure;
  // Optional: where the combine writes the rows' sums (see ReturnRows). The gate lets no row
  // through (0 rows) once any wait of this rank has failed, so nothing is written into a peer then.
  ReturnRows returns;
};

// What an early-starting GEMM CTA waits on: the dispatch's published {epoch, rows}. The dispatch
// always publishes (0 rows where its own bounded wait failed), so the wait ends; the timeout
// only guards that invariant.
struct GateRows {
  const uint64_t* published = nullptr;
  const uint64_t* epoch = nullptr;  // the run's epoch is *epoch + 1
  uint64_t timeout_ns = 0;
};

}  // namespace megamoe::runtime
