// Hopper W4A16 grouped GEMM, warp-specialised decode mainloop: the configuration for few tokens
// per expert, where the layer streams weights and the loop is bound by instruction issue.
//
// One producer warp moves data, one consumer warpgroup decodes and multiplies:
//   producer  A: the (64, 64) code tile (2048 B) and its scales (256 B) of each K chunk are
//                contiguous in the prepacked layout, so one lane issues two bulk copies
//                (cp.async.bulk, completion counted in bytes on the stage's `full` barrier);
//             B: the chunk's (BLOCK_N, 64) bf16 token rows are gathered (L1: hidden[slot_token])
//                and 128-byte swizzled, which a bulk copy cannot do: 16-byte cp.async by the 32
//                lanes, each lane's completion arriving on `full` (cp.async.mbarrier.arrive.noinc);
//   consumers wait on `full`, decode NVFP4 -> bf16 A fragments in registers, run RS wgmma, and
//                release the stage on its `empty` barrier once the wgmma group has completed.
// Compared with the cooperative cp.async mainloop (sm90_w4a16_grouped_gemm.cuh), the consumers
// run no address arithmetic, copies or CTA-wide barriers (about a third of that loop's
// instructions), and the producer fills the next work item's stages during the epilogue.
// Same work schedule, same prepacked layout, same epilogues as that kernel.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>
#include <utility>

#include "kernels/sm90/sm90_w4a16_decode.cuh"
#include "kernels/sm90/sm90_w4a16_grouped_gemm.cuh"

namespace megamoe::kernels::sm90 {

namespace detail {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
// Spins until the phase with the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
// Arrives on `bar` when all of this thread's earlier cp.async have landed (the arrival is
// already counted in the barrier's expected count: .noinc).
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}
// Global -> shared bulk copy (async proxy), completion counted in bytes on `bar`. A CTA launched
// without clusters is its own cluster, so its shared::cta addresses are valid shared::cluster ones.
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

}  // namespace detail

// Shared memory of the warp-specialised kernel: per stage a B tile, a code tile and a scale
// tile, then the full and empty barriers of every stage.
template <int kBlockN, int kStages>
struct W4a16WsSmemLayout {
  static constexpr int kBTileBytes = kBlockN * w4a16::kChunkK * 2;  // (BLOCK_N, 64) bf16
  static constexpr int kBOffset = 0;
  static constexpr int kCodeOffset = kBOffset + kStages * kBTileBytes;
  static constexpr int kScaleOffset = kCodeOffset + kStages * w4a16::kCodeBytesPerTile;
  static constexpr int kFullOffset = kScaleOffset + kStages * w4a16::kScaleBytesPerTile;
  static constexpr int kEmptyOffset = kFullOffset + kStages * 8;
  static constexpr int kBytes = kEmptyOffset + kStages * 8;
  static constexpr int kAllocBytes = kBytes + 1024;  // room to align the base to 1024 B
  static_assert(kBTileBytes % 1024 == 0,
                "BLOCK_N must be a multiple of 8 so each B stage is whole 1024-byte swizzle atoms");
};

inline constexpr int kWsConsumerThreads = w4a16::kThreadsPerWarpgroup;  // warps 0..3
inline constexpr int kWsThreads = kWsConsumerThreads + 32;              // + producer warp 4

template <bool kIsL1, int kBlockN, int kStages, int kMinBlocksPerSm>
__global__ void __launch_bounds__(kWsThreads, kMinBlocksPerSm)
w4a16_ws_grouped_gemm_kernel(const W4a16GemmParams p) {
  using namespace w4a16;
  using Smem = W4a16WsSmemLayout<kBlockN, kStages>;
  using Op = typename detail::WgmmaRS<kBlockN>::Op;
  constexpr int kAcc = kBlockN / 2;  // fp32 accumulators per thread: (64, BLOCK_N) / 128
  static_assert(kStages >= 3, "need kStages >= 3: a chunk in the MMA, one being decoded, one landing");
  static_assert(kBlockN % 8 == 0 && kBlockN <= 32, "the decode mainloop is for narrow N (8..32)");
  constexpr int kPieces = kBlockN * 8 / 32;  // B pieces of 16 bytes per producer lane per chunk
  constexpr uint32_t kATxBytes = kCodeBytesPerTile + kScaleBytesPerTile;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t smem_misalign = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 1023u;
  uint8_t* smem = smem_raw + ((1024u - smem_misalign) & 1023u);
  const uint32_t smem_u32 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t full_bar = smem_u32 + Smem::kFullOffset;    // + 8 * stage
  const uint32_t empty_bar = smem_u32 + Smem::kEmptyOffset;  // + 8 * stage

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      // full: the producer lane's expect_tx arrival + the 32 lanes' cp.async arrivals.
      detail::mbar_init(full_bar + 8 * s, 1 + 32);
      // empty: one arrival per consumer warp.
      detail::mbar_init(empty_bar + 8 * s, kWsConsumerThreads / 32);
    }
  }
  allow_dependent_launch();
  grid_dependency_wait();  // the dispatch (L1) or L1 (L2) results are complete from here on
  if constexpr (kIsL1) {
    if (p.zero_first != nullptr) detail::zero_grid_stride(p.zero_first, p.zero_count);
  }
  __syncthreads();  // barriers initialised
  const int total_work = p.tile_offsets[p.num_experts];

  if (warp == kWsConsumerThreads / 32) {
    // ---------------------------------------------------------------- producer warp
    uint32_t stage = 0, phase = 0;
    for (int work = blockIdx.x; work < total_work; work += gridDim.x) {
      const detail::WorkItem w = detail::decode_work<kBlockN>(p, work);
      const int k_begin = w.k_split * p.k_chunks_per_split;
      const int k_end = min(k_begin + p.k_chunks_per_split, p.k_chunks);
      const int64_t a_tile0 = static_cast<int64_t>(w.m_block) * p.k_chunks + k_begin;
      const uint8_t* code_src = p.codes + w.expert * p.code_expert_stride + a_tile0 * kCodeBytesPerTile;
      const uint8_t* scale_src = p.scales + w.expert * p.scale_expert_stride + a_tile0 * kScaleBytesPerTile;
      // B pieces of this lane: piece i = lane + 32 j is 16-byte column c of row r; it lands at
      // column c ^ (r % 8) (128-byte swizzle). Rows past the expert's slots are zero-filled.
      const char* b_src[kPieces];
      uint32_t b_dst[kPieces];
      bool b_valid[kPieces];
#pragma unroll
      for (int j = 0; j < kPieces; ++j) {
        const int i = lane + 32 * j;
        const int r = i / 8, c = i % 8;
        const int slot = w.slot_begin + r;
        b_valid[j] = slot < w.slot_end;
        const int64_t src_row = !b_valid[j] ? 0 : (kIsL1 ? p.slot_token[slot] : slot);
        b_src[j] = reinterpret_cast<const char*>(p.b_src + src_row * p.b_ld + k_begin * kChunkK + c * 8);
        b_dst[j] = smem_u32 + Smem::kBOffset + r * 128 + ((c ^ (r & 7)) * 16);
      }
      for (int kc = k_begin; kc < k_end; ++kc) {
        detail::mbar_wait(empty_bar + 8 * stage, phase ^ 1);  // the consumers released it
        if (lane == 0) {
          detail::mbar_arrive_expect_tx(full_bar + 8 * stage, kATxBytes);
          detail::bulk_copy_g2s(smem_u32 + Smem::kCodeOffset + stage * kCodeBytesPerTile, code_src,
                                kCodeBytesPerTile, full_bar + 8 * stage);
          detail::bulk_copy_g2s(smem_u32 + Smem::kScaleOffset + stage * kScaleBytesPerTile, scale_src,
                                kScaleBytesPerTile, full_bar + 8 * stage);
        }
#pragma unroll
        for (int j = 0; j < kPieces; ++j) {
          detail::cp_async_16(b_dst[j] + stage * Smem::kBTileBytes, b_src[j], b_valid[j]);
          b_src[j] += kChunkK * 2;
        }
        detail::cp_async_arrive_noinc(full_bar + 8 * stage);
        code_src += kCodeBytesPerTile;
        scale_src += kScaleBytesPerTile;
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    // Stay until the consumers have released every stage: no copy of this warp is in flight
    // when the CTA retires.
    for (int s = 0; s < kStages; ++s) {
      detail::mbar_wait(empty_bar + 8 * stage, phase ^ 1);
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumer warpgroup
  const int g = lane / 4, t = lane % 4;
  uint32_t stage = 0, phase = 0;

  for (int work = blockIdx.x; work < total_work; work += gridDim.x) {
    const detail::WorkItem w = detail::decode_work<kBlockN>(p, work);
    const int k_begin = w.k_split * p.k_chunks_per_split;
    const int k_end = min(k_begin + p.k_chunks_per_split, p.k_chunks);

    float acc[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;

    // Software pipeline over K chunks, A fragments double-buffered in registers: chunk i's
    // wgmma group runs on the tensor cores while the warps decode chunk i + 1 into the other
    // buffer, so the integer pipes (decode) and the tensor cores (MMA) overlap inside each
    // warp instead of alternating. wait_group 1 after committing chunk i retires chunk i - 1,
    // whose buffer and shared-memory stage are then free.
    uint32_t a[2][kStepsPerChunk][4];
    uint32_t chunk_stage[2];
    auto decode_chunk = [&](auto buf) {
      constexpr int kBuf = decltype(buf)::value;
      chunk_stage[kBuf] = stage;
      detail::mbar_wait(full_bar + 8 * stage, phase);
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
      const uint32_t st = chunk_stage[kBuf];
      const uint4 q = *reinterpret_cast<const uint4*>(smem + Smem::kCodeOffset + st * kCodeBytesPerTile + tid * 16);
      const uint2 sc = *reinterpret_cast<const uint2*>(smem + Smem::kScaleOffset + st * kScaleBytesPerTile +
                                                       (warp * 8 + g) * 8);
      const uint32_t words[4] = {q.x, q.y, q.z, q.w};
      const uint32_t scale_pairs[2] = {sc.x, sc.y};
#pragma unroll
      for (int s = 0; s < kStepsPerChunk; ++s) {
        // Scales (row r0, row r0 + 8) of k-block s of this chunk.
        decode_step(words[s], static_cast<uint16_t>(scale_pairs[s / 2] >> (16 * (s % 2))), a[kBuf][s]);
      }
    };
    auto release = [&](uint32_t st) {
      __syncwarp();
      if (lane == 0) detail::mbar_arrive(empty_bar + 8 * st);
    };
    // One pipeline step: MMA chunk i from buffer kBuf, retire chunk i - 1, decode chunk i + 1.
    auto step = [&](auto buf, int i, int n) {
      constexpr int kBuf = decltype(buf)::value;
      detail::wgmma_fence();
      const uint64_t desc = detail::make_sw128_desc(smem + Smem::kBOffset + chunk_stage[kBuf] * Smem::kBTileBytes);
#pragma unroll
      for (int s = 0; s < kStepsPerChunk; ++s) {
        // k16 step s starts 32 bytes further along the swizzled 128-byte rows.
        detail::wgmma_rs<Op>(a[kBuf][s], desc + static_cast<uint64_t>(s * 2), acc, std::make_index_sequence<kAcc>{});
      }
      detail::wgmma_commit();
      detail::wgmma_wait<1>();
      if (i > 0) release(chunk_stage[kBuf ^ 1]);
      if (i + 1 < n) decode_chunk(std::integral_constant<int, kBuf ^ 1>{});
    };

    const int n = k_end - k_begin;
#ifdef MEGAMOE_EXPERIMENT_NO_COMPUTE
    for (int i = 0; i < n; ++i) {
      detail::mbar_wait(full_bar + 8 * stage, phase);
      release(stage);
      if (++stage == kStages) { stage = 0; phase ^= 1; }
    }
    if (n < 0)
#endif
    decode_chunk(std::integral_constant<int, 0>{});
    int i = 0;
    for (; i + 2 <= n; i += 2) {
      step(std::integral_constant<int, 0>{}, i, n);
      step(std::integral_constant<int, 1>{}, i + 1, n);
    }
    if (i < n) step(std::integral_constant<int, 0>{}, i, n);
    detail::wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < kAcc; ++j) detail::keep_in_register(acc[j]);
#ifdef MEGAMOE_EXPERIMENT_NO_COMPUTE
    if (n < 0)
#endif
    release(chunk_stage[(n - 1) % 2]);

    detail::store_tile<kIsL1, kBlockN>(p, acc, w, w.m_block, warp, g, t);
  }
}

}  // namespace megamoe::kernels::sm90
