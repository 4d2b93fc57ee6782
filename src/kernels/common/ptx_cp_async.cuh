// cp.async (sm_80+) and bulk L2-cache prefetch (sm_90) wrappers. A copy with valid == false
// zero-fills its destination without reading global memory (src-size 0).
#pragma once

#include <cstdint>

namespace megamoe::kernels::ptx {

__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(smem_addr), "l"(gmem), "r"(valid ? 16 : 0) : "memory");
}
// 4 bytes, through the L1 cache (.cg takes 16 only); zero-filled where !valid.
__device__ __forceinline__ void cp_async_4(uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
               :: "r"(smem_addr), "l"(gmem), "r"(valid ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }

// Prefetches [ptr, ptr + bytes) into the L2 cache (one thread; bytes a multiple of 16, ptr 16-byte aligned).
__device__ __forceinline__ void prefetch_to_l2_cache(const void* ptr, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" :: "l"(ptr), "r"(bytes) : "memory");
}

}  // namespace megamoe::kernels::ptx
