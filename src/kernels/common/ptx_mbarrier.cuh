// mbarrier (sm_80+, shared::cta addresses) wrappers, including the arrival that fires once this
// thread's cp.async copies have landed.
#pragma once

#include <cstdint>

namespace megamoe::kernels::ptx {

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// Arrives on bar once every cp.async this thread issued before it has landed; .noinc: the
// arrival counts towards the barrier's expected count.
__device__ __forceinline__ void cp_async_mbarrier_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}
// Waits until the phase of parity `parity` of bar has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "MEGAMOE_MBARRIER_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra MEGAMOE_MBARRIER_WAIT;\n"
      "}\n" :: "r"(bar), "r"(parity) : "memory");
}

// Makes mbarrier initialisations visible to the other threads (and the async proxy) before use.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

}  // namespace megamoe::kernels::ptx
