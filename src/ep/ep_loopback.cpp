// EpLoopback (include/megamoe/ep.h) and its transport (ep_transport_loopback.h): one green
// context, and one stream on it, per virtual rank; the windows are device buffers of this GPU.
// The driver's green-context API is reached through the runtime's entry-point query, so the
// library does not link libcuda (CPU-only machines load it without a driver).
#include "ep/ep_transport_loopback.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <type_traits>
#include <utility>
#include <string>
#include <vector>

#include "megamoe/gpu.h"
#include "megamoe/status.h"

namespace megamoe {

namespace {

// The driver functions used here, resolved once per loopback.
struct GreenApi {
  decltype(&::cuDeviceGetDevResource) get_resource = nullptr;
  decltype(&::cuDevSmResourceSplitByCount) split = nullptr;
  decltype(&::cuDevResourceGenerateDesc) make_desc = nullptr;
  decltype(&::cuGreenCtxCreate) create = nullptr;
  decltype(&::cuGreenCtxDestroy) destroy = nullptr;
  decltype(&::cuGreenCtxStreamCreate) stream_create = nullptr;

  static GreenApi load() {
    GreenApi api;
    auto get = [](const char* name, auto& fn, unsigned version) {
      void* ptr = nullptr;
      cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
      const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &ptr, version, cudaEnableDefault, &found);
      MEGAMOE_CHECK(e == cudaSuccess && found == cudaDriverEntryPointSuccess && ptr != nullptr, kUnsupported,
                    "EpLoopback: the CUDA driver has no ", name, " (green contexts need a driver for CUDA 12.5 or "
                    "newer): ", cudaGetErrorString(e));
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(ptr);
    };
    get("cuDeviceGetDevResource", api.get_resource, 12040);
    get("cuDevSmResourceSplitByCount", api.split, 12040);
    get("cuDevResourceGenerateDesc", api.make_desc, 12040);
    get("cuGreenCtxCreate", api.create, 12040);
    get("cuGreenCtxDestroy", api.destroy, 12040);
    get("cuGreenCtxStreamCreate", api.stream_create, 12050);
    return api;
  }
};

void check_cu(CUresult r, const char* what) {
  MEGAMOE_CHECK(r == CUDA_SUCCESS, kCuda, "EpLoopback: ", what, " failed (CUresult ", static_cast<int>(r), ")");
}

}  // namespace

struct EpLoopback::Impl {
  int world = 0, device = 0, sms_per_rank = 0;
  GreenApi api;
  std::vector<CUgreenCtx> contexts;
  std::vector<cudaStream_t> streams;
  // Window sets in the order the ranks ask for them: windows[k][rank] (flag words, then data).
  struct WindowSet {
    size_t data_bytes = 0, flag_words = 0;
    std::vector<char*> buffers;
  };
  std::mutex mutex;
  std::vector<WindowSet> windows;
  std::vector<size_t> requests;  // window sets each rank has asked for

  ~Impl() {
    // Every rank's work has ended before a window it may still write into is freed.
    cudaSetDevice(device);
    cudaDeviceSynchronize();
    for (WindowSet& set : windows) {
      for (char* b : set.buffers) cudaFree(b);
    }
    for (cudaStream_t s : streams) cudaStreamDestroy(s);
    for (CUgreenCtx g : contexts) api.destroy(g);
  }
};

EpLoopback EpLoopback::create(int world_size, int device) {
  MEGAMOE_CHECK(world_size >= 1 && world_size <= ep::kMaxRanks, kInvalidArgument, "EpLoopback: world size ",
                world_size, " is out of range (1..", ep::kMaxRanks, ")");
  const int devices = gpu::device_count();
  MEGAMOE_CHECK(device >= 0 && device < devices, kInvalidArgument, "EpLoopback: device ", device,
                " does not exist (this host has ", devices, " CUDA devices)");
  gpu::check_cuda(cudaSetDevice(device), "cudaSetDevice");
  gpu::check_cuda(cudaFree(nullptr), "cudaFree(0): primary context");  // green contexts retain it
  EpLoopback out;
  out.impl_ = std::make_shared<Impl>();
  Impl& m = *out.impl_;
  m.world = world_size;
  m.device = device;
  m.requests.assign(static_cast<size_t>(world_size), 0);
  m.api = GreenApi::load();
  CUdevResource all{};
  check_cu(m.api.get_resource(static_cast<CUdevice>(device), &all, CU_DEV_RESOURCE_TYPE_SM),
           "cuDeviceGetDevResource");
  // Equal groups of whole alignment units: the split rounds minCount up to them.
  const unsigned align = std::max(1u, all.sm.smCoscheduledAlignment);
  const unsigned min_size = std::max(all.sm.minSmPartitionSize, align);
  unsigned per_rank = all.sm.smCount / static_cast<unsigned>(world_size) / align * align;
  MEGAMOE_CHECK(per_rank >= min_size, kUnsupported, "EpLoopback: ", all.sm.smCount, " SMs do not split into ",
                world_size, " groups of at least ", min_size, " SMs (the green-context split's minimum); use fewer "
                "virtual ranks");
  std::vector<CUdevResource> groups(static_cast<size_t>(world_size));
  unsigned made = static_cast<unsigned>(world_size);
  CUdevResource rest{};
  check_cu(m.api.split(groups.data(), &made, &all, &rest, 0, per_rank), "cuDevSmResourceSplitByCount");
  MEGAMOE_CHECK(made == static_cast<unsigned>(world_size), kUnsupported, "EpLoopback: the driver split ",
                all.sm.smCount, " SMs into ", made, " groups of ", per_rank, ", not ", world_size);
  m.sms_per_rank = static_cast<int>(groups[0].sm.smCount);
  for (const CUdevResource& g : groups) {
    MEGAMOE_CHECK(g.sm.smCount == groups[0].sm.smCount, kInternal, "EpLoopback: unequal SM groups (",
                  g.sm.smCount, " and ", groups[0].sm.smCount, ")");
  }
  for (CUdevResource& g : groups) {
    CUdevResourceDesc desc = nullptr;
    check_cu(m.api.make_desc(&desc, &g, 1), "cuDevResourceGenerateDesc");
    CUgreenCtx ctx = nullptr;
    check_cu(m.api.create(&ctx, desc, static_cast<CUdevice>(device), CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate");
    m.contexts.push_back(ctx);
    CUstream stream = nullptr;
    check_cu(m.api.stream_create(&stream, ctx, CU_STREAM_NON_BLOCKING, 0), "cuGreenCtxStreamCreate");
    m.streams.push_back(stream);
  }
  return out;
}

int EpLoopback::world_size() const { return impl_->world; }
int EpLoopback::device() const { return impl_->device; }
int EpLoopback::sms_per_rank() const { return impl_->sms_per_rank; }
cudaStream_t EpLoopback::stream(int rank) const {
  MEGAMOE_CHECK(rank >= 0 && rank < impl_->world, kInvalidArgument, "EpLoopback::stream: rank ", rank,
                " is out of range (0..", impl_->world - 1, ")");
  return impl_->streams[static_cast<size_t>(rank)];
}

namespace ep {

namespace {

class LoopbackTransport final : public EpTransport {
 public:
  LoopbackTransport(std::shared_ptr<EpLoopback::Impl> group, int rank) : group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return group_->world; }
  const EpPeerWindows& peers() const override {
    MEGAMOE_CHECK(allocated_, kInternal, "expert parallelism: the loopback window is used before allocate_window");
    return peers_;
  }
  size_t window_bytes() const override { return window_bytes_; }

  void allocate_window(size_t data_bytes, size_t flag_words) override {
    MEGAMOE_CHECK(!allocated_, kInternal, "expert parallelism: a loopback endpoint allocates one window");
    EpLoopback::Impl& g = *group_;
    const std::lock_guard<std::mutex> lock(g.mutex);
    // This rank's k-th window set, k = how many sets this rank has asked for (counted per rank).
    const size_t k = g.requests[static_cast<size_t>(rank_)]++;
    const size_t flag_bytes = flag_area_bytes(flag_words);
    if (k == g.windows.size()) {
      EpLoopback::Impl::WindowSet set;
      set.data_bytes = data_bytes;
      set.flag_words = flag_words;
      gpu::check_cuda(cudaSetDevice(g.device), "cudaSetDevice");
      for (int r = 0; r < g.world; ++r) {
        char* b = nullptr;
        gpu::check_cuda(cudaMalloc(&b, flag_bytes + data_bytes), "cudaMalloc(loopback window)");
        set.buffers.push_back(b);
        gpu::check_cuda(cudaMemset(b, 0, flag_bytes + data_bytes), "cudaMemset(loopback window)");
      }
      gpu::check_cuda(cudaDeviceSynchronize(), "loopback window setup");
      g.windows.push_back(std::move(set));
    }
    const EpLoopback::Impl::WindowSet& set = g.windows[k];
    MEGAMOE_CHECK(set.data_bytes == data_bytes && set.flag_words == flag_words, kInvalidArgument,
                  "expert parallelism: loopback rank ", rank_, " asks for a window of ", data_bytes, " bytes and ",
                  flag_words, " signal words where its peers made ", set.data_bytes, " and ", set.flag_words,
                  ": every rank must create the same layers in the same order");
    for (int r = 0; r < g.world; ++r) {
      char* const b = set.buffers[static_cast<size_t>(r)];
      peers_.flags[r] = reinterpret_cast<uint64_t*>(b);
      peers_.base[r] = b + flag_bytes;
    }
    peers_.rank = rank_;
    peers_.world = g.world;
    window_bytes_ = flag_bytes + data_bytes;
    allocated_ = true;
  }

 private:
  std::shared_ptr<EpLoopback::Impl> group_;
  int rank_;
  EpPeerWindows peers_{};
  size_t window_bytes_ = 0;
  bool allocated_ = false;
};

}  // namespace

std::unique_ptr<EpTransport> make_loopback_transport(const EpLoopback& loopback, int rank) {
  const auto& impl = EpLoopbackAccess::impl(loopback);
  MEGAMOE_CHECK(impl != nullptr, kInvalidArgument, "expert parallelism: the EpLoopback was moved from");
  MEGAMOE_CHECK(rank >= 0 && rank < impl->world, kInvalidArgument, "expert parallelism: loopback rank ", rank,
                " is out of range (world size ", impl->world, ")");
  return std::make_unique<LoopbackTransport>(impl, rank);
}

}  // namespace ep
}  // namespace megamoe
