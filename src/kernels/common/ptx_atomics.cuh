// Global-memory reductions and acquire/release wrappers (sm_90): the vector float reduction of
// the atomic combine, the counters a kernel's CTAs hand work to each other through, and the
// system-scope flags of the expert-parallel barrier.
#pragma once

#include <cstdint>

namespace megamoe::kernels::ptx {

// dst[0..3] += (x, y, z, w), 4 consecutive floats (16-byte aligned), one vector reduction (sm_90).
__device__ __forceinline__ void red_add_v4(float* dst, float x, float y, float z, float w) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" :: "l"(dst), "f"(x), "f"(y), "f"(z), "f"(w)
               : "memory");
}

// The fused kernel's L1 -> L2 hand-off through global counters, as CUTLASS's split-K semaphores
// do it. The writer CTA: a CTA barrier after its stores, then one thread publishes with a release
// add (cumulative over the stores the barrier ordered before it); the reader: one thread
// acquires, then a CTA barrier. The data is read through the L2 cache (cp.async.cg bypasses the
// L1 cache): another SM wrote it.
__device__ __forceinline__ void red_release_add(int32_t* counter, int32_t v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" :: "l"(counter), "r"(v) : "memory");
}
__device__ __forceinline__ int32_t ld_acquire(const int32_t* counter) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(counter) : "memory");
  return v;
}
// Spins (one thread) until *counter >= target.
__device__ __forceinline__ void wait_at_least(const int32_t* counter, int32_t target) {
  int ns = 32;
  while (ld_acquire(counter) < target) {
    __nanosleep(ns);
    ns = min(2 * ns, 512);
  }
}

// System-scope release store and acquire load: flags that ranks on other GPUs read and write over
// NVLink (expert parallelism), ordering the stores before them for every GPU of the system.
__device__ __forceinline__ void st_release_sys(uint64_t* ptr, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;\n" :: "l"(ptr), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* ptr) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];\n" : "=l"(v) : "l"(ptr) : "memory");
  return v;
}
// A release and acquire fence for every GPU of the system (MEMBAR.ALL.SYS; __threadfence_system
// is the sequentially consistent MEMBAR.SC.SYS, which the counter hand-offs do not need).
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;\n" ::: "memory"); }
// GPU-scope forms, for words that only this GPU's kernels exchange.
__device__ __forceinline__ void st_release_gpu(uint64_t* ptr, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;\n" :: "l"(ptr), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_gpu(const uint64_t* ptr) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];\n" : "=l"(v) : "l"(ptr) : "memory");
  return v;
}
// Nanoseconds of the global timer (the same clock on every SM; for timeouts, not for timing).
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
// The same for a stage stamp: "memory" keeps it where it is among the loads and stores around it.
__device__ __forceinline__ uint64_t stamp_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t)::"memory");
  return t;
}

}  // namespace megamoe::kernels::ptx
