// wgmma (sm_90a) wrappers: the bf16 m64nNk16 instructions with A from registers, their
// fence / commit / wait, and the shared-memory descriptor of a K-major 128-byte-swizzled B tile.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/arch/mma_sm90_gmma_ext.hpp>  // N = 48

namespace megamoe::kernels::ptx {

// wgmma m64nNk16 bf16 -> f32 with A from registers, B K-major in shared memory.
template <int N> struct WgmmaRS;  // defined for the N below: add one to instantiate another width
#define MEGAMOE_WGMMA_RS(N)                                                                  \
  template <> struct WgmmaRS<N> {                                                            \
    using Op = cute::SM90::GMMA::MMA_64x##N##x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K,  \
                                                                 cute::SM90::GMMA::Major::K>; \
  };
MEGAMOE_WGMMA_RS(16)
MEGAMOE_WGMMA_RS(32)
MEGAMOE_WGMMA_RS(48)
MEGAMOE_WGMMA_RS(64)
MEGAMOE_WGMMA_RS(96)
MEGAMOE_WGMMA_RS(128)
MEGAMOE_WGMMA_RS(160)
#undef MEGAMOE_WGMMA_RS

template <class Op, size_t... I>
__device__ __forceinline__ void wgmma_rs(const uint32_t (&a)[4], uint64_t desc_b,
                                         float (&d)[sizeof...(I)], std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], desc_b, d[I]...);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_one() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
template <class T>
__device__ __forceinline__ void keep_in_register(T& r) {
  if constexpr (sizeof(T) == 4) asm volatile("" : "+r"(*reinterpret_cast<uint32_t*>(&r)) :: "memory");
}
__device__ __forceinline__ void keep_in_register(float& r) { asm volatile("" : "+f"(r) :: "memory"); }

// Shared-memory matrix descriptor for a K-major bf16 tile with 128-byte swizzle: rows of 64
// elements (128 B), 8-row atoms of 1024 B stacked along N (stride byte offset 1024).
__device__ __forceinline__ uint64_t make_sw128_desc(const void* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);  // start address, 16-byte units
  desc |= static_cast<uint64_t>(1) << 16;                 // leading byte offset (unused: SW128 K-major)
  desc |= static_cast<uint64_t>(1024 >> 4) << 32;         // stride byte offset: next 8-row atom
  desc |= static_cast<uint64_t>(1) << 62;                 // layout: 128-byte swizzle
  return desc;
}

}  // namespace megamoe::kernels::ptx
