#include "bench/sm_clock.h"

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <chrono>
#include <string>

namespace megamoe::bench {

// The few NVML entry points used, declared as the driver's libnvidia-ml.so.1 exports them
// (nvml.h is not part of the CUDA toolkit's default install).
struct SmClockSampler::Nvml {
  using Device = struct nvmlDevice_st*;
  using Init = int (*)();
  using Shutdown = int (*)();
  using ByPciBusId = int (*)(const char*, Device*);
  using ClockInfo = int (*)(Device, int, unsigned*);
  using EventReasons = int (*)(Device, unsigned long long*);
  static constexpr int kClockSm = 1;                        // NVML_CLOCK_SM
  static constexpr unsigned long long kSwPowerCap = 0x4;    // nvmlClocksEventReasonSwPowerCap
  void* lib = nullptr;
  Shutdown shutdown = nullptr;
  ClockInfo clock_info = nullptr;
  EventReasons reasons = nullptr;
  Device device = nullptr;
  ~Nvml() {
    if (shutdown) shutdown();
    if (lib) dlclose(lib);
  }
};

std::unique_ptr<SmClockSampler> SmClockSampler::open(int cuda_device, std::string* why) {
  auto nvml = std::make_unique<Nvml>();
  nvml->lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!nvml->lib) {
    if (why) *why = "libnvidia-ml.so.1 not found";
    return nullptr;
  }
  auto init = reinterpret_cast<Nvml::Init>(dlsym(nvml->lib, "nvmlInit_v2"));
  auto by_bus = reinterpret_cast<Nvml::ByPciBusId>(dlsym(nvml->lib, "nvmlDeviceGetHandleByPciBusId_v2"));
  nvml->clock_info = reinterpret_cast<Nvml::ClockInfo>(dlsym(nvml->lib, "nvmlDeviceGetClockInfo"));
  // The reasons' query under its current name, or the name drivers before 535 export.
  nvml->reasons = reinterpret_cast<Nvml::EventReasons>(dlsym(nvml->lib, "nvmlDeviceGetCurrentClocksEventReasons"));
  if (!nvml->reasons) {
    nvml->reasons = reinterpret_cast<Nvml::EventReasons>(dlsym(nvml->lib, "nvmlDeviceGetCurrentClocksThrottleReasons"));
  }
  auto shutdown = reinterpret_cast<Nvml::Shutdown>(dlsym(nvml->lib, "nvmlShutdown"));
  if (!init || !by_bus || !nvml->clock_info || !nvml->reasons || !shutdown) {
    if (why) *why = "libnvidia-ml.so.1 lacks an entry point the sampler needs";
    return nullptr;
  }
  if (init() != 0) {
    if (why) *why = "nvmlInit failed";
    return nullptr;
  }
  nvml->shutdown = shutdown;
  char bus[32] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), cuda_device) != cudaSuccess || by_bus(bus, &nvml->device) != 0) {
    if (why) *why = "NVML does not know CUDA device " + std::to_string(cuda_device);
    return nullptr;
  }
  unsigned mhz = 0;
  if (nvml->clock_info(nvml->device, Nvml::kClockSm, &mhz) != 0) {
    if (why) *why = "NVML cannot read the SM clock";
    return nullptr;
  }
  return std::unique_ptr<SmClockSampler>(new SmClockSampler(std::move(nvml)));
}

SmClockSampler::SmClockSampler(std::unique_ptr<Nvml> nvml) : nvml_(std::move(nvml)) {}

SmClockSampler::~SmClockSampler() {
  if (running_) stop();
}

void SmClockSampler::start() {
  if (running_) stop();
  stats_ = {};
  running_ = true;
  thread_ = std::thread([this] {
    double sum = 0;
    unsigned lowest = ~0u;
    int n = 0, reasons_read = 0, capped = 0;
    while (running_.load(std::memory_order_relaxed)) {
      unsigned mhz = 0;
      unsigned long long why = 0;
      if (nvml_->clock_info(nvml_->device, Nvml::kClockSm, &mhz) == 0) {
        sum += mhz;
        lowest = mhz < lowest ? mhz : lowest;
        ++n;
        if (nvml_->reasons(nvml_->device, &why) == 0) {
          ++reasons_read;
          if (why & Nvml::kSwPowerCap) ++capped;
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
    // The capped share counts only the samples whose reasons were read.
    if (n > 0) stats_ = {sum / n, lowest, reasons_read > 0 ? static_cast<double>(capped) / reasons_read : 0.0, n};
  });
}

SmClockStats SmClockSampler::stop() {
  running_ = false;
  if (thread_.joinable()) thread_.join();
  return stats_;
}

}  // namespace megamoe::bench
