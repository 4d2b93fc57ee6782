// The NCCL side of expert parallelism: a communicator, one symmetric window (the same size on
// every rank) and the window's base address on every rank as this rank can address it (LSA peer
// pointers: NVLink loads and stores). Host code; nothing here runs per forward.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "megamoe/ep.h"

namespace megamoe::ep {

class SymmetricComm {
 public:
  // Collective over the `world` ranks of `id`. Sets NCCL_NVLS_ENABLE=0 (no NVLink multicast)
  // before NCCL reads its environment, then: communicator, ncclMemAlloc(window_bytes),
  // ncclCommWindowRegister, the peers' window bases (ncclGetLsaPointer), and a check that every
  // rank reads what each peer wrote into its window (where the GPUs cannot share symmetric
  // memory, registration succeeds with a useless handle: this reports it). The communicator is
  // non-blocking, so a rank that never joins fails the others after `timeout_seconds` (kCuda)
  // instead of hanging them. Throws megamoe::Error (kUnsupported: no symmetric memory
  // between these GPUs or a wrong NCCL version; kCuda: any other NCCL or CUDA failure).
  SymmetricComm(const EpUniqueId& id, int world, int rank, size_t window_bytes, double timeout_seconds);
  ~SymmetricComm();
  SymmetricComm(const SymmetricComm&) = delete;
  SymmetricComm& operator=(const SymmetricComm&) = delete;

  // Every rank's window base (index = rank), in this process's address space.
  const std::vector<char*>& peer_bases() const { return peers_; }
  char* local_base() const { return peers_[static_cast<size_t>(rank_)]; }
  size_t window_bytes() const { return bytes_; }

 private:
  struct Nccl;
  std::unique_ptr<Nccl> nccl_;
  int rank_ = 0;
  size_t bytes_ = 0;
  std::vector<char*> peers_;
};

}  // namespace megamoe::ep
