// make_nccl_transport (ep_transport_nccl.h) over NCCL 2.28's symmetric memory and device API, and
// EpUniqueId (include/megamoe/ep.h), which names an NCCL communicator.
#include "ep/ep_transport_nccl.h"

#include <nccl.h>
#include <nccl_device.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "megamoe/ep.h"
#include "megamoe/gpu.h"
#include "megamoe/status.h"

namespace megamoe {

namespace {

using Clock = std::chrono::steady_clock;

void check_nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) {
    MEGAMOE_FAIL(kCuda, "NCCL ", what, " failed: ", ncclGetErrorString(r), " (", r, ")");
  }
}

Clock::time_point deadline_after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// A non-blocking communicator's pending operation: polls until it completes or fails (its result)
// or the deadline passes (then the communicator is aborted, and this throws: a peer never joined).
ncclResult_t poll_nccl(ncclComm_t& comm, ncclResult_t started, const char* what, Clock::time_point deadline,
                       double timeout_seconds) {
  // A call on a non-blocking communicator may return ncclSuccess while its work goes on: the
  // communicator's own state says when it is done (the next call before that is refused).
  ncclResult_t state = started;
  if (state == ncclSuccess && comm != nullptr) {
    const ncclResult_t polled = ncclCommGetAsyncError(comm, &state);
    if (polled != ncclSuccess) state = polled;
  }
  while (state == ncclInProgress) {
    if (Clock::now() > deadline) {
      ncclCommAbort(comm);
      comm = nullptr;  // aborted: nothing else may be called on it
      MEGAMOE_FAIL(kCuda, "expert parallelism: NCCL ", what, " did not complete within ", timeout_seconds,
                   " s: a peer rank never joined (every rank must create the layer with the same id)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const ncclResult_t polled = ncclCommGetAsyncError(comm, &state);
    if (polled != ncclSuccess) state = polled;
  }
  return state;
}
void wait_nccl(ncclComm_t& comm, ncclResult_t started, const char* what, Clock::time_point deadline,
               double timeout_seconds) {
  check_nccl(poll_nccl(comm, started, what, deadline, timeout_seconds), what);
}

// The peers' window bases, resolved on the device once (the pointer functions are device
// code), by world rank. They are meaningful only where every rank is in this rank's load/store
// team, in order (checked on the host first, ncclTeamLsa).
__global__ void lsa_bases_kernel(ncclWindow_t win, int world, char** out) {
  const int peer = static_cast<int>(threadIdx.x);
  if (peer < world) out[peer] = static_cast<char*>(ncclGetPeerPointer(win, 0, peer));
}

// Reads the first 8 bytes of every rank's window: each rank wrote its own rank there.
__global__ void peer_check_kernel(char* const* bases, int world, int64_t* out) {
  const int peer = static_cast<int>(threadIdx.x);
  if (peer < world) out[peer] = *reinterpret_cast<const volatile int64_t*>(bases[peer]);
}

}  // namespace

EpUniqueId EpUniqueId::create() {
  static_assert(sizeof(ncclUniqueId) == sizeof(EpUniqueId::bytes), "ncclUniqueId is 128 bytes");
  // NCCL reads its environment once, at its first call: no multicast, ever (it can take the
  // host's shared GPUs out of service).
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  ncclUniqueId id;
  check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  EpUniqueId out;
  std::memcpy(out.bytes.data(), &id, sizeof(id));
  return out;
}

std::string EpUniqueId::to_hex() const {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (char c : bytes) {
    const auto b = static_cast<unsigned char>(c);
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

EpUniqueId EpUniqueId::from_hex(const std::string& hex) {
  EpUniqueId out;
  auto value = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  bool ok = hex.size() == 2 * out.bytes.size();
  for (size_t i = 0; ok && i < out.bytes.size(); ++i) {
    const int hi = value(hex[2 * i]), lo = value(hex[2 * i + 1]);
    ok = hi >= 0 && lo >= 0;
    if (ok) out.bytes[i] = static_cast<char>(hi * 16 + lo);
  }
  MEGAMOE_CHECK(ok, kInvalidArgument, "EpUniqueId: expected 256 hex digits (an NCCL unique id), got ",
                hex.size(), " characters");
  return out;
}

namespace ep {

namespace {

// The start of every rank's window is the transport's own: the peer check below.
constexpr size_t kCheckBytes = 256;

// What the transport holds, released in reverse order, also after a failed setup. The
// communicator is non-blocking: each call may still be in progress when it returns.
struct NcclResources {
  ncclComm_t comm = nullptr;
  void* buffer = nullptr;
  ncclWindow_t window = nullptr;
  char** bases = nullptr;  // device copy for lsa_bases_kernel
  NcclResources() = default;
  NcclResources(const NcclResources&) = delete;
  NcclResources& operator=(const NcclResources&) = delete;
  ~NcclResources() {
    if (bases) cudaFree(bases);
    if (comm) {
      if (window) settle(ncclCommWindowDeregister(comm, window));
    }
    if (buffer) ncclMemFree(buffer);
    if (comm) {
      if (settle(ncclCommFinalize(comm)) != ncclSuccess) {
        ncclCommAbort(comm);  // a peer is gone or the communicator failed: destroying would wait or misbehave
      } else {
        ncclCommDestroy(comm);
      }
    }
  }
  // Polls a call on the communicator for up to 10 s; its final state.
  ncclResult_t settle(ncclResult_t state) const {
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (state == ncclInProgress && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ncclCommGetAsyncError(comm, &state);
    }
    return state;
  }
};

class NcclTransport final : public EpTransport {
 public:
  NcclTransport(const EpConfig& config, const EpUniqueId& id);
  ~NcclTransport() override;
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  void allocate_window(size_t data_bytes, size_t flag_words) override;
  const EpPeerWindows& peers() const override {
    MEGAMOE_CHECK(allocated_, kInternal, "expert parallelism: the NCCL transport's window is used before "
                  "allocate_window");
    return peers_;
  }
  size_t window_bytes() const override { return window_bytes_; }

 private:
  // Every rank's window is zeroed before any peer writes into it: a one-element all-reduce over
  // the communicator, bounded by the deadline like the rest of the setup.
  void setup_barrier(Clock::time_point deadline);
  // The element-wise maximum of `count` values over the ranks, bounded the same way.
  void all_reduce_max(const int64_t* in, int64_t* out, int count, Clock::time_point deadline);
  NcclResources nccl_;
  int rank_ = 0, world_ = 0;
  double timeout_seconds_ = 0;
  EpPeerWindows peers_{};
  size_t window_bytes_ = 0;
  bool allocated_ = false;
};

NcclTransport::NcclTransport(const EpConfig& config, const EpUniqueId& id)
    : rank_(config.rank), world_(config.world_size), timeout_seconds_(config.timeout_seconds) {
  const auto deadline = deadline_after(timeout_seconds_);
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  int version = 0;
  check_nccl(ncclGetVersion(&version), "ncclGetVersion");
  // The device API's structs (ncclDevComm, windows) changed layout after 2.28: the library that
  // was loaded must be the one these headers describe.
  MEGAMOE_CHECK(version == NCCL_VERSION_CODE, kUnsupported, "expert parallelism: the loaded NCCL is version ",
                version, " but this build uses the NCCL ", NCCL_VERSION_CODE,
                " headers (scripts/setup.sh pins nvidia-nccl-cu13==2.28.9); load that libnccl.so.2 first");
  ncclUniqueId uid;
  std::memcpy(&uid, id.bytes.data(), sizeof(uid));
  ncclConfig_t nccl_config = NCCL_CONFIG_INITIALIZER;
  nccl_config.blocking = 0;
  const ncclResult_t init = ncclCommInitRankConfig(&nccl_.comm, world_, uid, rank_, &nccl_config);
  MEGAMOE_CHECK(nccl_.comm != nullptr, kCuda, "NCCL ncclCommInitRankConfig failed: ", ncclGetErrorString(init));
  wait_nccl(nccl_.comm, init, "ncclCommInitRankConfig", deadline, timeout_seconds_);
}

void NcclTransport::allocate_window(size_t data_bytes, size_t flag_words) {
  MEGAMOE_CHECK(!allocated_ && nccl_.buffer == nullptr, kInternal,
                "expert parallelism: the NCCL transport allocates one window");
  MEGAMOE_CHECK(nccl_.comm != nullptr, kCuda, "expert parallelism: the NCCL communicator was aborted");
  const auto deadline = deadline_after(timeout_seconds_);
  const int world = world_, rank = rank_;
  // The window: kCheckBytes of our own (the peer check below), the signal words, then the data
  // bytes; windows are 4 KiB aligned.
  const size_t flag_bytes = flag_area_bytes(flag_words);
  const size_t bytes = (kCheckBytes + flag_bytes + data_bytes + 4095) / 4096 * 4096;
  check_nccl(ncclMemAlloc(&nccl_.buffer, bytes), "ncclMemAlloc(symmetric window)");
  gpu::check_cuda(cudaMemset(nccl_.buffer, 0, bytes), "cudaMemset(symmetric window)");
  gpu::check_cuda(cudaDeviceSynchronize(), "cudaMemset(symmetric window)");
  wait_nccl(nccl_.comm, ncclCommWindowRegister(nccl_.comm, nccl_.buffer, bytes, &nccl_.window, NCCL_WIN_DEFAULT),
            "ncclCommWindowRegister", deadline, timeout_seconds_);
  const ncclTeam_t lsa = ncclTeamLsa(nccl_.comm);
  MEGAMOE_CHECK(lsa.nRanks == world && lsa.rank == rank && lsa.stride == 1, kUnsupported, "expert parallelism: rank ",
                rank, " is rank ", lsa.rank, " of an NVLink load/store team of ", lsa.nRanks, " (stride ", lsa.stride,
                ") in a world of ", world, ": every rank must reach every other over NVLink (the GPUs of one host)");
  gpu::check_cuda(cudaMalloc(&nccl_.bases, sizeof(char*) * static_cast<size_t>(world)), "cudaMalloc");
  lsa_bases_kernel<<<1, 32>>>(nccl_.window, world, nccl_.bases);
  gpu::check_cuda(cudaGetLastError(), "lsa_bases_kernel launch");
  std::vector<char*> bases(static_cast<size_t>(world), nullptr);
  gpu::check_cuda(cudaMemcpy(bases.data(), nccl_.bases, sizeof(char*) * bases.size(), cudaMemcpyDeviceToHost),
                  "cudaMemcpy(peer bases)");
  const int64_t me = rank;
  gpu::check_cuda(cudaMemcpy(nccl_.buffer, &me, sizeof(me), cudaMemcpyHostToDevice), "cudaMemcpy(peer check)");
  setup_barrier(deadline);
  // Every rank must lay its window out the same way (the same group shape): peers write at offsets
  // computed from their own layout.
  const int64_t mine[4] = {static_cast<int64_t>(data_bytes), -static_cast<int64_t>(data_bytes),
                           static_cast<int64_t>(flag_words), -static_cast<int64_t>(flag_words)};
  int64_t agreed[4];
  all_reduce_max(mine, agreed, 4, deadline);
  MEGAMOE_CHECK(agreed[0] == -agreed[1] && agreed[2] == -agreed[3], kInvalidArgument, "expert parallelism: rank ",
                rank, " asks for a window of ", data_bytes, " bytes and ", flag_words,
                " signal words, and its peers for between ", -agreed[1], " and ", agreed[0], " bytes: every rank must "
                "create its group with the same hidden_size, top_k and max_tokens_per_rank");
  // Where NCCL has no symmetric memory between these GPUs (no peer access, no cuMem), window
  // registration succeeds with a handle that does not map the peers: check that every rank's
  // window holds what that rank wrote, through the pointers the kernels will use.
  int64_t* seen = nullptr;
  gpu::check_cuda(cudaMalloc(&seen, sizeof(int64_t) * static_cast<size_t>(world)), "cudaMalloc");
  peer_check_kernel<<<1, 32>>>(nccl_.bases, world, seen);
  std::vector<int64_t> got(static_cast<size_t>(world), -1);
  const cudaError_t checked = cudaMemcpy(got.data(), seen, sizeof(int64_t) * got.size(), cudaMemcpyDeviceToHost);
  cudaFree(seen);
  MEGAMOE_CHECK(checked == cudaSuccess, kUnsupported, "expert parallelism: rank ", rank,
                " cannot read its peers' symmetric memory (", cudaGetErrorString(checked),
                "): the GPUs need CUDA peer access (NVLink) to each other and cuMem (VMM) support");
  for (int p = 0; p < world; ++p) {
    MEGAMOE_CHECK(got[static_cast<size_t>(p)] == p, kUnsupported, "expert parallelism: rank ", rank,
                  " reads ", got[static_cast<size_t>(p)], " from rank ", p,
                  "'s symmetric window instead of its rank: NCCL has no symmetric memory between these GPUs");
  }
  // What the caller gets of each window: the signal words after the check bytes, then the data.
  for (int p = 0; p < world; ++p) {
    char* const window = bases[static_cast<size_t>(p)];
    peers_.flags[p] = reinterpret_cast<uint64_t*>(window + kCheckBytes);
    peers_.base[p] = window + kCheckBytes + flag_bytes;
  }
  peers_.rank = rank;
  peers_.world = world;
  window_bytes_ = flag_bytes + data_bytes;
  allocated_ = true;
}

// A window is freed only once no peer can still write into it: this rank's work has ended, then
// every rank's (a one-element all-reduce, bounded at 10 s; a peer that is gone aborts it, and the
// communicator is then aborted too).
NcclTransport::~NcclTransport() {
  if (!allocated_ || nccl_.comm == nullptr) return;
  try {
    gpu::check_cuda(cudaDeviceSynchronize(), "expert parallelism teardown");
    setup_barrier(deadline_after(10.0));
  } catch (const std::exception&) {
    // A peer did not reach the teardown barrier (setup_barrier has aborted the communicator): it
    // may still write into this window, which is therefore left allocated.
    nccl_.buffer = nullptr;
  }
}

void NcclTransport::all_reduce_max(const int64_t* in, int64_t* out, int count, Clock::time_point deadline) {
  int64_t* dev = nullptr;
  gpu::check_cuda(cudaMalloc(&dev, sizeof(int64_t) * static_cast<size_t>(count)), "cudaMalloc");
  const auto free_dev = [&] { cudaFree(dev); };
  try {
    gpu::check_cuda(cudaMemcpy(dev, in, sizeof(int64_t) * static_cast<size_t>(count), cudaMemcpyHostToDevice),
                    "cudaMemcpy");
    const ncclResult_t started = ncclAllReduce(dev, dev, static_cast<size_t>(count), ncclInt64, ncclMax, nccl_.comm,
                                               nullptr);
    check_nccl(poll_nccl(nccl_.comm, started, "ncclAllReduce(window check)", deadline, timeout_seconds_),
               "ncclAllReduce(window check)");
    cudaError_t done = cudaErrorNotReady;
    while ((done = cudaStreamQuery(nullptr)) == cudaErrorNotReady) {
      if (Clock::now() > deadline) {
        ncclCommAbort(nccl_.comm);
        nccl_.comm = nullptr;
        MEGAMOE_FAIL(kCuda, "expert parallelism: the window check did not complete within ", timeout_seconds_,
                     " s: a peer rank stopped during setup");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    gpu::check_cuda(done, "window check");
    gpu::check_cuda(cudaMemcpy(out, dev, sizeof(int64_t) * static_cast<size_t>(count), cudaMemcpyDeviceToHost),
                    "cudaMemcpy");
  } catch (...) {
    free_dev();
    throw;
  }
  free_dev();
}

void NcclTransport::setup_barrier(Clock::time_point deadline) {
  int32_t* one = nullptr;
  gpu::check_cuda(cudaMalloc(&one, sizeof(int32_t)), "cudaMalloc");
  const ncclResult_t synced = ncclAllReduce(one, one, 1, ncclInt32, ncclSum, nccl_.comm, nullptr);
  const ncclResult_t reduced = poll_nccl(nccl_.comm, synced, "ncclAllReduce(setup barrier)", deadline,
                                         timeout_seconds_);
  check_nccl(reduced, "ncclAllReduce(setup barrier)");
  // The all-reduce's kernel waits for every peer: bounded like the rest of the setup.
  cudaError_t done = cudaErrorNotReady;
  while ((done = cudaStreamQuery(nullptr)) == cudaErrorNotReady) {
    if (Clock::now() > deadline) {
      ncclCommAbort(nccl_.comm);
      nccl_.comm = nullptr;
      MEGAMOE_FAIL(kCuda, "expert parallelism: the setup barrier did not complete within ", timeout_seconds_,
                   " s: a peer rank stopped during setup");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  cudaFree(one);
  gpu::check_cuda(done, "symmetric window setup");
}

}  // namespace

std::unique_ptr<EpTransport> make_nccl_transport(const EpConfig& config, const EpUniqueId& id) {
  MEGAMOE_CHECK(config.world_size >= 1 && config.world_size <= kMaxRanks && config.rank >= 0 &&
                    config.rank < config.world_size,
                kInvalidArgument, "expert parallelism: rank ", config.rank, " of world size ", config.world_size,
                " is out of range (world size 1..", kMaxRanks, ", the GPUs of one host)");
  MEGAMOE_CHECK(config.timeout_seconds > 0 && std::isfinite(config.timeout_seconds), kInvalidArgument,
                "expert parallelism: timeout_seconds = ", config.timeout_seconds,
                " must be a positive number of seconds");
  return std::make_unique<NcclTransport>(config, id);
}

}  // namespace ep
}  // namespace megamoe
