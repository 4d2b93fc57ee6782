// EpTransport over NCCL 2.28's symmetric memory: a communicator, one window per rank
// (ncclMemAlloc + ncclCommWindowRegister) and every peer's window base as this rank can address
// it (LSA peer pointers: NVLink loads and stores). Host code; nothing here runs per forward.
#pragma once

#include <memory>

#include "ep/ep_transport.h"

namespace megamoe::ep {

// Collective over the config.world_size ranks of `id`, on the current CUDA device: sets
// NCCL_NVLS_ENABLE=0 (no NVLink multicast) before NCCL reads its environment, checks that the
// loaded NCCL is the one the headers describe and creates a non-blocking communicator, so that a
// rank that never joins fails the others after config.timeout_seconds (kCuda) instead of hanging
// them; each collective step of allocate_window is bounded the same way. allocate_window also
// checks that every rank reads what each peer wrote into its window (where the GPUs cannot
// share symmetric memory, registration succeeds with a useless handle: this reports it).
// Throws megamoe::Error: kInvalidArgument (a rank, world size or timeout out of range, checked
// before NCCL is called), kUnsupported (no symmetric memory between these GPUs or a wrong NCCL
// version), kCuda (any other NCCL or CUDA failure).
std::unique_ptr<EpTransport> make_nccl_transport(const EpConfig& config, const EpUniqueId& id);

}  // namespace megamoe::ep
