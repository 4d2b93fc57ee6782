// The sm90 W4A16 kernels' timeline (builds configured with -DMEGAMOE_TIMELINE=ON): per work item
// its SM, CTA, GEMM, expert and %globaltimer stamps, per CTA its span. What the kernels record
// (sm90_w4a16_timeline.cuh) and the host side that arms them and reads the events back
// (`megamoe bench --timeline`, docs/perf/README.md; bench/timeline_report.py reads the result).
#pragma once

#include <cstdint>
#include <vector>

#ifndef MEGAMOE_TIMELINE
#error "MEGAMOE_TIMELINE must be defined to 0 or 1 (CMakeLists.txt's MEGAMOE_TIMELINE option defines it)"
#endif

namespace megamoe::runtime {

enum W4a16TimelineKind : int16_t {
  kTimelineEmpty = 0,  // a slot no CTA wrote (the buffer is zeroed when armed)
  kTimelineCta = 1,    // one per CTA: from its first item's start (its item loop's entry) to its exit
  kTimelineL1Item = 2,
  kTimelineL2Item = 3,
};

// Which launch wrote an event: each gets its own part of the buffer.
enum W4a16TimelineLaunch : int16_t {
  kTimelineLaunchL1 = 0,     // the one-GEMM kernel running L1
  kTimelineLaunchL2 = 1,     // the one-GEMM kernel running L2
  kTimelineLaunchFused = 2,  // the fused L1 + L2 kernel
};

// One event, 64 bytes. Times are %globaltimer ns (one clock for every SM); `cycles` counts the
// SM's clock over the same span (clock64), so cycles / ns is the SM clock the item ran at.
struct alignas(16) W4a16TimelineEvent {
  uint64_t start_ns;  // item: the top of its iteration of the item loop (before it is decoded)
  uint64_t wait_ns;   // item: when its inputs were ready: a fused L2 item's wait for its expert's
                      // L1 tiles ended; start_ns for every other item
  uint64_t end_ns;    // item: its CTA's barrier after it (and, fused L1, its completion published)
  uint32_t cycles;
  int32_t smid;
  int32_t block;
  int32_t item;       // item: its index in its GEMM's list; CTA: the items it ran
  int32_t expert;     // item: its (virtual) expert; CTA: the items it ran but could not record
  int32_t slots;      // item: its tokens (slots)
  int32_t k_chunks;   // item: its 64-wide K chunks
  int16_t m_block;    // item: its block of `rows` weight rows
  int16_t k_split;
  int16_t rows;       // weight rows per item (64 per warpgroup)
  int16_t kind;       // W4a16TimelineKind
  int16_t launch;     // W4a16TimelineLaunch
  int16_t reserved;
};
static_assert(sizeof(W4a16TimelineEvent) == 64, "the event is 64 bytes: one line of stores per item");

// What the kernels record into (a __device__ variable of each kernel's translation unit, set by
// set_w4a16_timeline): `capacity` events per launch part (part 0: L1 or fused, part 1: L2), each
// part split evenly over the launch's CTAs; a CTA's first slot is its own record. Null: record
// nothing.
struct W4a16TimelineBuffer {
  W4a16TimelineEvent* events;
  int32_t capacity;
};
inline constexpr int kTimelineParts = 2;

// Whether this build's kernels record (-DMEGAMOE_TIMELINE=ON), and what the timeline's entry
// points say where they do not.
bool w4a16_timeline_built();
inline constexpr const char* kW4a16TimelineNotBuilt =
    "this build records no kernel timeline: configure a build directory with -DMEGAMOE_TIMELINE=ON";

// Points every W4A16 kernel at `buffer` (defined with the launchers, sm90_w4a16_launch.cu): a
// synchronous copy into each translation unit's variable, so no run may be in flight. Builds
// without the timeline: megamoe::Error(kUnsupported).
void set_w4a16_timeline(const W4a16TimelineBuffer& buffer);

// Records the W4A16 kernels' events of the runs between start() and stop(), in device memory of
// its own (64 bytes per event). One recorder records at a time.
class W4a16TimelineRecorder {
 public:
  // Room for `events_per_launch` events (CTA records included) in each launch of a run.
  // megamoe::Error(kUnsupported) in builds without the timeline, kInvalidArgument outside
  // 1..2^24.
  explicit W4a16TimelineRecorder(int64_t events_per_launch = int64_t{1} << 20);
  ~W4a16TimelineRecorder();
  W4a16TimelineRecorder(const W4a16TimelineRecorder&) = delete;
  W4a16TimelineRecorder& operator=(const W4a16TimelineRecorder&) = delete;

  // Zeroes the events and points the kernels at them. Synchronises the device (no run may be in
  // flight: the kernels read the pointer at any time).
  void start();
  // Synchronises the device, points the kernels at nothing and returns the events recorded since
  // start(), in buffer order (launch, CTA, then each CTA's items in the order it ran them).
  // megamoe::Error(kInternal) where a CTA ran more items than its share holds.
  std::vector<W4a16TimelineEvent> stop();

 private:
  W4a16TimelineEvent* events_ = nullptr;
  int32_t capacity_ = 0;
  bool recording_ = false;
};

}  // namespace megamoe::runtime
