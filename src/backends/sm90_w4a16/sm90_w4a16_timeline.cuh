// What the W4A16 kernels record of their timeline (sm90_w4a16_timeline.h): macros their item
// loops call, which expand to nothing unless the build is configured with -DMEGAMOE_TIMELINE=ON;
// without it the kernels are instruction for instruction those of a build without these lines.
//
// Only thread 0 records. An item's fields and stamps wait in shared memory between its start
// and its end, so nothing of the record stays live in registers across the item's mainloop
// (ptxas's allocation there reacts to what surrounds it: sm90_w4a16_fused_moe_kernel.cuh), and
// each CTA writes a share of the buffer of its own: no atomic on the item path. The shared state
// is 96 bytes per CTA: no tile's CTAs per SM change (registers neither: check ptxas's -v lines).
#pragma once

#include "backends/sm90_w4a16/sm90_w4a16_timeline.h"

#if MEGAMOE_TIMELINE
#include <cstdint>

#include "backends/sm90_w4a16/sm90_w4a16_params.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_scheduler.cuh"

namespace megamoe::kernels::sm90::timeline {

using runtime::W4a16TimelineEvent;

// Internal linkage: every kernel translation unit has its own, and set_w4a16_timeline sets each
// (sm90_w4a16_launch.cuh).
static __device__ runtime::W4a16TimelineBuffer g_buffer;

// The launch a one-GEMM kernel records as.
template <bool kIsL1>
inline constexpr int16_t kGemmLaunch = kIsL1 ? runtime::kTimelineLaunchL1 : runtime::kTimelineLaunchL2;

struct CtaState {
  W4a16TimelineEvent item;  // the running item's record so far
  uint64_t item_clock;      // clock64 at the item's start
  uint64_t start_ns, start_clock;  // the CTA's first item's start
  int32_t items;            // items started
};
__device__ __forceinline__ CtaState& cta_state() {
  __shared__ CtaState state;
  return state;
}

// "memory": the stamps stay where they are among the loads and stores around them.
__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
  return t;
}
__device__ __forceinline__ int32_t smid() {
  uint32_t s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return static_cast<int32_t>(s);
}

__device__ __forceinline__ void item_start(bool first) {
  CtaState& s = cta_state();
  const uint64_t now = globaltimer();
  s.item.start_ns = now;
  s.item.wait_ns = now;
  s.item_clock = clock64();
  if (first) {
    s.items = 0;
    s.start_ns = now;
    s.start_clock = s.item_clock;
  }
}

template <int kWarpgroups, int kBlockN>
__device__ __forceinline__ void item(bool is_l1, const W4a16GemmParams& p, const detail::WorkItem& w, int index) {
  W4a16TimelineEvent& e = cta_state().item;
  e.kind = is_l1 ? runtime::kTimelineL1Item : runtime::kTimelineL2Item;
  e.rows = 64 * kWarpgroups;
  e.item = index;
  e.expert = w.expert;
  // An item's slot_end may be its expert's end (decode_work): the tile takes kBlockN of them.
  e.slots = min(w.slot_end - w.slot_begin, kBlockN);
  e.k_chunks = detail::item_chunks(p, w).chunks;
  e.m_block = static_cast<int16_t>(w.m_block);
  e.k_split = static_cast<int16_t>(w.k_split);
}

__device__ __forceinline__ void item_waited() { cta_state().item.wait_ns = globaltimer(); }

// This CTA's share of `launch`'s part of the buffer (null when nothing is armed), of *slots events.
__device__ __forceinline__ W4a16TimelineEvent* cta_share(int16_t launch, int& slots) {
  const runtime::W4a16TimelineBuffer b = g_buffer;
  slots = b.capacity / static_cast<int>(gridDim.x);
  if (b.events == nullptr || slots == 0) return nullptr;
  return b.events + (launch == runtime::kTimelineLaunchL2 ? b.capacity : 0) + blockIdx.x * slots;
}

// Slot 0 of the share is the CTA's own record; items from slot 1 while they fit.
__device__ __forceinline__ void item_end(int16_t launch) {
  CtaState& s = cta_state();
  W4a16TimelineEvent e = s.item;
  e.end_ns = globaltimer();
  e.cycles = static_cast<uint32_t>(clock64() - s.item_clock);
  e.smid = smid();
  e.block = static_cast<int32_t>(blockIdx.x);
  e.launch = launch;
  const int n = ++s.items;
  int slots;
  W4a16TimelineEvent* share = cta_share(launch, slots);
  if (share != nullptr && n < slots) share[n] = e;
}

// `ran`: whether the CTA ran an item (its state is set only then).
__device__ __forceinline__ void cta_end(int16_t launch, bool ran) {
  const CtaState& s = cta_state();
  W4a16TimelineEvent e{};
  e.end_ns = globaltimer();
  e.start_ns = ran ? s.start_ns : e.end_ns;
  e.wait_ns = e.start_ns;
  e.cycles = ran ? static_cast<uint32_t>(clock64() - s.start_clock) : 0;
  e.smid = smid();
  e.block = static_cast<int32_t>(blockIdx.x);
  e.kind = runtime::kTimelineCta;
  e.launch = launch;
  int slots;
  W4a16TimelineEvent* share = cta_share(launch, slots);
  e.item = ran ? s.items : 0;
  e.expert = max(0, e.item - (slots - 1));
  if (share != nullptr) share[0] = e;
}

}  // namespace megamoe::kernels::sm90::timeline

// Thread 0 at the top of an item's iteration, before the item is decoded; `first`: the CTA's
// first item.
#define MEGAMOE_W4A16_TIMELINE_ITEM_START(first) \
  do {                                           \
    if (threadIdx.x == 0) ::megamoe::kernels::sm90::timeline::item_start(first); \
  } while (0)
// Once the item `w` (index `index` in its GEMM, of parameters `p`) is decoded.
#define MEGAMOE_W4A16_TIMELINE_ITEM(is_l1, warpgroups, block_n, p, w, index)                                  \
  do {                                                                                                       \
    if (threadIdx.x == 0) ::megamoe::kernels::sm90::timeline::item<warpgroups, block_n>(is_l1, p, w, index); \
  } while (0)
// Thread 0 only: the item's inputs are ready (a fused L2 item's wait ended).
#define MEGAMOE_W4A16_TIMELINE_ITEM_WAITED() ::megamoe::kernels::sm90::timeline::item_waited()
// After the item's last CTA barrier.
#define MEGAMOE_W4A16_TIMELINE_ITEM_END(launch) \
  do {                                          \
    if (threadIdx.x == 0) ::megamoe::kernels::sm90::timeline::item_end(launch); \
  } while (0)
// At the kernel's exit; `ran`: whether the CTA ran an item.
#define MEGAMOE_W4A16_TIMELINE_CTA_END(launch, ran) \
  do {                                              \
    if (threadIdx.x == 0) ::megamoe::kernels::sm90::timeline::cta_end(launch, ran); \
  } while (0)
#else
#define MEGAMOE_W4A16_TIMELINE_ITEM_START(first) ((void)0)
#define MEGAMOE_W4A16_TIMELINE_ITEM(is_l1, warpgroups, block_n, p, w, index) ((void)0)
#define MEGAMOE_W4A16_TIMELINE_ITEM_WAITED() ((void)0)
#define MEGAMOE_W4A16_TIMELINE_ITEM_END(launch) ((void)0)
#define MEGAMOE_W4A16_TIMELINE_CTA_END(launch, ran) ((void)0)
#endif
