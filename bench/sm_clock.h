// The SM clock while a point is timed, read from NVML (the driver's management library).
//
// Under sustained load an H100 lowers its SM clock to stay under its power limit (SW power cap:
// 1.98 GHz down to ~1.4-1.5 GHz within ~0.1 s of a DeepSeek-V3 layer's load,
// docs/perf/2026-11-22-h100-w4a16-v26.md), so a point's time depends on the clock it ran at. The
// bench samples the clock on a thread of its own while a point's timed replays run and reports
// the mean, and the share of samples the driver flagged as power capped.
//
// NVML is loaded at run time (dlopen of libnvidia-ml.so.1, which the driver installs): no build
// dependency, and where it is missing the bench reports no clock instead of failing.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>

namespace megamoe::bench {

struct SmClockStats {
  double mean_mhz = 0;        // mean of the samples
  unsigned min_mhz = 0;       // lowest sample
  double power_capped = 0;    // share of samples with the SW power cap reason active
  int samples = 0;            // 0: nothing measured (no NVML, or a window shorter than a sample)
};

class SmClockSampler {
 public:
  // The sampler of CUDA device `cuda_device`, or null (with the reason in *why) where NVML is not
  // available.
  static std::unique_ptr<SmClockSampler> open(int cuda_device, std::string* why);
  ~SmClockSampler();
  SmClockSampler(const SmClockSampler&) = delete;
  SmClockSampler& operator=(const SmClockSampler&) = delete;

  // Samples every ~0.5 ms from start() until stop(), which returns the window's statistics.
  void start();
  SmClockStats stop();

 private:
  struct Nvml;
  explicit SmClockSampler(std::unique_ptr<Nvml> nvml);
  std::unique_ptr<Nvml> nvml_;
  std::thread thread_;
  std::atomic<bool> running_{false};
  SmClockStats stats_;
};

}  // namespace megamoe::bench
