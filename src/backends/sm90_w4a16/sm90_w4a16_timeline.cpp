// The host side of the W4A16 kernels' timeline (sm90_w4a16_timeline.h).
#include "backends/sm90_w4a16/sm90_w4a16_timeline.h"

#include <cuda_runtime.h>

#include <atomic>
#include <string>

#include "megamoe/gpu.h"
#include "megamoe/status.h"

namespace megamoe::runtime {

namespace {

// The kernels read one buffer at a time: one recorder may point them at its own.
std::atomic<bool> g_recording{false};

}  // namespace

bool w4a16_timeline_built() { return MEGAMOE_TIMELINE != 0; }

W4a16TimelineRecorder::W4a16TimelineRecorder(int64_t events_per_launch) {
  MEGAMOE_CHECK(w4a16_timeline_built(), kUnsupported, kW4a16TimelineNotBuilt);
  MEGAMOE_CHECK(events_per_launch >= 1 && events_per_launch <= (int64_t{1} << 24), kInvalidArgument,
                "W4a16TimelineRecorder: events_per_launch = ", events_per_launch, " must be in 1..16777216");
  capacity_ = static_cast<int32_t>(events_per_launch);
  gpu::check_cuda(cudaMalloc(&events_, sizeof(W4a16TimelineEvent) * kTimelineParts * capacity_),
                  "cudaMalloc(W4A16 timeline)");
}

W4a16TimelineRecorder::~W4a16TimelineRecorder() {
  if (recording_) {
    cudaDeviceSynchronize();
    try {
      set_w4a16_timeline({nullptr, 0});
    } catch (const Error&) {
      // A destructor does not throw; the kernels keep the pointer only until the process ends.
    }
    g_recording = false;
  }
  cudaFree(events_);
}

void W4a16TimelineRecorder::start() {
  MEGAMOE_CHECK(!recording_, kInvalidArgument, "W4a16TimelineRecorder::start: already recording (call stop() first)");
  bool idle = false;
  MEGAMOE_CHECK(g_recording.compare_exchange_strong(idle, true), kInvalidArgument,
                "W4a16TimelineRecorder::start: another recorder is recording (one at a time: the kernels "
                "write to one buffer)");
  recording_ = true;
  gpu::check_cuda(cudaDeviceSynchronize(), "W4a16TimelineRecorder::start: the work in flight");
  gpu::check_cuda(cudaMemset(events_, 0, sizeof(W4a16TimelineEvent) * kTimelineParts * capacity_),
                  "cudaMemset(W4A16 timeline)");
  set_w4a16_timeline({events_, capacity_});
  gpu::check_cuda(cudaDeviceSynchronize(), "W4a16TimelineRecorder::start");
}

std::vector<W4a16TimelineEvent> W4a16TimelineRecorder::stop() {
  MEGAMOE_CHECK(recording_, kInvalidArgument, "W4a16TimelineRecorder::stop: not recording (call start() first)");
  gpu::check_cuda(cudaDeviceSynchronize(), "W4a16TimelineRecorder::stop: the recorded runs");
  set_w4a16_timeline({nullptr, 0});
  gpu::check_cuda(cudaDeviceSynchronize(), "W4a16TimelineRecorder::stop");
  recording_ = false;
  g_recording = false;
  std::vector<W4a16TimelineEvent> all(static_cast<size_t>(kTimelineParts) * capacity_);
  gpu::check_cuda(cudaMemcpy(all.data(), events_, sizeof(W4a16TimelineEvent) * all.size(), cudaMemcpyDeviceToHost),
                  "cudaMemcpy(W4A16 timeline)");
  std::vector<W4a16TimelineEvent> events;
  for (const W4a16TimelineEvent& e : all) {
    if (e.kind == kTimelineEmpty) continue;
    // A CTA record's `expert` counts the items its share could not hold.
    MEGAMOE_CHECK(e.kind != kTimelineCta || e.expert == 0, kInternal, "W4a16TimelineRecorder: CTA ", e.block,
                  " of launch ", e.launch, " ran ", e.item, " items, ", e.expert, " more than its share of the ",
                  capacity_, " events per launch holds (construct the recorder with more)");
    events.push_back(e);
  }
  return events;
}

}  // namespace megamoe::runtime
