// Starting the ranks of an expert-parallel command (`megamoe run --ep N`, `megamoe bench --ep N`):
// one process per GPU, this executable run again with per-rank arguments, in an environment that
// never allows NVLink multicast. Plain POSIX (no CUDA), so the CPU tests exercise it.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace megamoe::tool {

// The environment of a rank: `parent` (a null-terminated `environ`-style array) without any
// NCCL_NVLS_ENABLE, TORCH_SYMM_MEM_DISABLE_MULTICAST or NVSHMEM_DISABLE_NVLS, then those three set
// to 0, 1 and 1: NVLink multicast can take the host's shared GPUs out of service, so neither the
// ranks nor anything they start (NCCL, torch, NVSHMEM) may use it, whatever the caller's
// environment says.
std::vector<std::string> ep_rank_environment(const char* const* parent);

struct EpRankLaunch {
  std::string command;  // names the command in messages, e.g. "megamoe run --ep 2"
  int world_size = 0;   // processes to start: ranks 0..world_size-1
  // The argument vector (argv[0] included) of rank r's process.
  std::function<std::vector<std::string>(int rank)> rank_argv;
  // The program each rank runs: this executable again by default (tests start /bin/sh).
  std::string executable = "/proc/self/exe";
  // > 0: a run not finished after this many seconds ends every rank (SIGTERM) and fails, instead
  // of waiting for ever on a rank stuck in a collective whose peer hangs. 0: no limit.
  double deadline_seconds = 0;
};

// Starts the ranks (environment: ep_rank_environment of this process's) and waits for all of
// them. The first rank that fails (non-zero exit or a signal) ends the others with SIGTERM: they
// would otherwise wait for it at a barrier until their timeout. Throws megamoe::Error: kIo when a
// rank cannot be started (those already started are ended first), kInternal naming the first
// rank that failed and how ("its message is above": the ranks share this process's stderr), or
// the deadline that passed.
void run_ep_ranks(const EpRankLaunch& launch);

}  // namespace megamoe::tool
