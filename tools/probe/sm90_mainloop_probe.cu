// megamoe_mainloop_probe: what the sm90 W4A16 mainloops can reach on this GPU, apart from
// routing, gathers and scheduling (docs/perf/2026-11-21-h100-w4a16-v15.md). Needs a Hopper GPU.
//
// 1. wgmma m64n128k16 bf16 alone: A from registers (RS) held constant, RS with A decoded from
//    e2m1 codes every k16 step (the library's decode_step), and A from shared memory (SS); four
//    warpgroups per SM; a wgmma.wait_group 0 after every four steps, or wait_group 1 after each.
// 2. The library's own mainloops (gemm_item, gemm_item_overlapped) on synthetic L2-GEMM items of
//    the prefill tiles, with the atomic-combine epilogue: one item of K = 16384 per CTA against
//    eight of K = 2048 (DeepSeek-V3's L2 K): the difference is the cost of item boundaries.
// 3. The absorbing tile's item boundaries: 2 to 16 items per CTA, and plain stores instead of
//    the atomic combine.
// 4. The overlapped tiles' items without their epilogue: what the boundary costs beside it.
//
// Each line reports TFLOP/s from CUDA events (median of the launches), the SM clock implied by
// clock64() over the same time, and the tensor pipe's busy fraction: FLOPs over cycles of the
// slowest CTA times 4096 bf16 FLOP/clk/SM (H100/H200 dense wgmma rate).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include <cute/arch/mma_sm90_gmma.hpp>

#include "kernels/common/ptx_wgmma.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_decode.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_mainloop_overlapped.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_mainloop_pipelined.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_params.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_scheduler.cuh"
#include "backends/sm90_w4a16/sm90_w4a16_tile.cuh"

namespace {

namespace k90 = megamoe::kernels::sm90;
namespace ptx = megamoe::kernels::ptx;
using namespace cute::SM90::GMMA;
using Rs = MMA_64x128x16_F32BF16BF16_RS<Major::K, Major::K>;
using Ss = MMA_64x128x16_F32BF16BF16_SS<Major::K, Major::K>;

constexpr double kFlopPerClkPerSm = 4096.0;  // dense bf16 wgmma, sm_90

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "megamoe_mainloop_probe: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// ---- 1. wgmma alone --------------------------------------------------------------------------

enum class AOperand { kRegistersConstant, kRegistersDecoded, kShared };

// (A from registers: the library's ptx::wgmma_rs<Rs>.)
template <size_t... I>
__device__ __forceinline__ void wgmma_ss(uint64_t a, uint64_t b, float (&d)[64], std::index_sequence<I...>) {
  Ss::fma(a, b, d[I]...);
}

// Four warpgroups; B: four (128, 64) bf16 stages (16 KiB each); A (SS): (64, 64) per warpgroup.
constexpr int kRateSmemBytes = 4 * 16384 + 4 * 8192;

template <AOperand kA, bool kWaitPerStep>
__global__ void __launch_bounds__(512, 1) wgmma_rate_kernel(int chunks, const uint32_t* words_in, float* out,
                                                            long long* cycles) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x, wg = tid / 128;
  for (int i = tid; i < kRateSmemBytes / 4; i += blockDim.x)  // bf16 pairs in [0.5, 2)
    reinterpret_cast<uint32_t*>(smem)[i] = 0x3f003f00u ^ (i * 2654435761u & 0x007f007fu);
  __syncthreads();
  const uint64_t b_desc = ptx::make_sw128_desc(smem);
  const uint64_t a_desc = ptx::make_sw128_desc(smem + 4 * 16384 + wg * 8192);
  uint32_t words[4];
  for (int i = 0; i < 4; ++i) words[i] = words_in[(tid * 4 + i) % 4096];
  const uint32_t scale_word = (words_in[tid % 4096] & 0x07700770u) | 0x00800080u;  // scales near 1
  const uint32_t a_const[4] = {0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u};
  float acc[64];
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
  const long long t0 = clock64();
  for (int c = 0; c < chunks; ++c) {
    const uint64_t b_stage = b_desc + (c & 3) * (16384 / 16);
    uint32_t a[4][4];
    auto make_a = [&](int s, uint32_t(&dst)[4]) {
      if constexpr (kA == AOperand::kRegistersDecoded) {
        // The chunk index changes the codes every chunk, as new weights would.
        if (s % 2 == 0) megamoe::kernels::sm90::w4a16::decode_step<0>(words[s] ^ c, scale_word, dst);
        else megamoe::kernels::sm90::w4a16::decode_step<1>(words[s] ^ c, scale_word, dst);
      } else {
        for (int i = 0; i < 4; ++i) dst[i] = a_const[i];
      }
    };
    if constexpr (!kWaitPerStep) {
#pragma unroll
      for (int s = 0; s < 4; ++s) make_a(s, a[s]);
      ptx::wgmma_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        if constexpr (kA == AOperand::kShared) wgmma_ss(a_desc + s * 2, b_stage + s * 2, acc, std::make_index_sequence<64>{});
        else ptx::wgmma_rs<Rs>(a[s], b_stage + s * 2, acc, std::make_index_sequence<64>{});
      }
      ptx::wgmma_commit();
      ptx::wgmma_wait_all();
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) ptx::keep_in_register(a[s][i]);
    } else {
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        make_a(s, a[s % 2]);
        ptx::wgmma_fence();
        if constexpr (kA == AOperand::kShared) wgmma_ss(a_desc + s * 2, b_stage + s * 2, acc, std::make_index_sequence<64>{});
        else ptx::wgmma_rs<Rs>(a[s % 2], b_stage + s * 2, acc, std::make_index_sequence<64>{});
        ptx::wgmma_commit();
        ptx::wgmma_wait_one();
      }
    }
  }
  ptx::wgmma_wait_all();
  const long long t1 = clock64();
  float sum = 0.0f;
  for (int i = 0; i < 64; ++i) sum += acc[i];
  out[blockIdx.x * blockDim.x + tid] = sum;
  if (tid == 0) cycles[blockIdx.x] = t1 - t0;
}

struct Timing {
  double seconds;     // median over the launches
  double max_cycles;  // the slowest CTA's cycles (last launch)
};

template <class Launch>
Timing time_launches(Launch&& launch, const long long* cycles_dev, int grid) {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "cudaEventCreate");
  check(cudaEventCreate(&b), "cudaEventCreate");
  std::vector<float> ms;
  for (int r = 0; r < 15; ++r) {
    check(cudaEventRecord(a), "cudaEventRecord");
    launch();
    check(cudaEventRecord(b), "cudaEventRecord");
    check(cudaEventSynchronize(b), "kernel");
    float t = 0;
    check(cudaEventElapsedTime(&t, a, b), "cudaEventElapsedTime");
    ms.push_back(t);
  }
  check(cudaGetLastError(), "launch");
  std::vector<long long> cycles(grid);
  check(cudaMemcpy(cycles.data(), cycles_dev, grid * sizeof(long long), cudaMemcpyDeviceToHost), "cudaMemcpy");
  std::sort(ms.begin(), ms.end());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return {ms[ms.size() / 2] * 1e-3, static_cast<double>(*std::max_element(cycles.begin(), cycles.end()))};
}

void report(const char* name, double flop, const Timing& t, int sms) {
  std::printf("  %-52s %7.1f TFLOP/s  %5.0f MHz  tensor %5.1f%%\n", name, flop / t.seconds * 1e-12,
              t.max_cycles / t.seconds * 1e-6, 100.0 * flop / (t.max_cycles * kFlopPerClkPerSm * sms));
}

template <AOperand kA, bool kWaitPerStep>
void wgmma_rate(const char* name, int sms, const uint32_t* words, float* out, long long* cycles) {
  auto* kernel = &wgmma_rate_kernel<kA, kWaitPerStep>;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kRateSmemBytes), "smem attribute");
  const int chunks = 8192;
  const Timing t = time_launches([&] { kernel<<<sms, 512, kRateSmemBytes>>>(chunks, words, out, cycles); }, cycles, sms);
  report(name, 2.0 * 64 * 128 * 16 * 4 * double(chunks) * 4 * sms, t, sms);
}

// ---- 2. the library's mainloops ---------------------------------------------------------------

// CTA b runs items (expert 0, m-block b / 4, n-tile b % 4, K slices 0 .. k_splits - 1) one after
// the other, as a persistent CTA runs claimed items. kEpilogue = false: the overlapped tiles'
// items without their epilogue (section 4).
template <int kWarpgroups, int kBlockN, int kStages, int kMinBlocks, bool kOverlapped, bool kEpilogue = true>
__global__ void __launch_bounds__(kWarpgroups * 128, kMinBlocks)
    mainloop_kernel(k90::W4a16GemmParams p, int width, long long* cycles) {
  uint8_t* smem = k90::detail::aligned_dynamic_smem();
  constexpr int kNTiles = 4;
  k90::detail::WorkItem w{};
  w.expert = 0;
  w.m_block = blockIdx.x / kNTiles;
  w.slot_begin = (blockIdx.x % kNTiles) * width;
  w.slot_end = w.slot_begin + width;
  w.slot_token = p.slot_token;
  k90::detail::StageBarriers bars{};
  if constexpr (kOverlapped && k90::detail::kOverlappedSync<kWarpgroups> == k90::detail::StageSync::kMbarriers) {
    bars = k90::detail::init_stage_barriers<kWarpgroups * 128, kStages>();
    __syncthreads();
  }
  const long long t0 = clock64();
  for (int s = 0; s < p.k_splits; ++s) {
    w.k_split = s;
    if constexpr (kOverlapped) {
      k90::detail::gemm_item_overlapped<false, kWarpgroups, kBlockN, kStages, kEpilogue>(p, w, smem, bars, [] {});
    } else {
      k90::detail::gemm_item<false, kWarpgroups, kBlockN, kStages>(p, w, smem, [] {});
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) cycles[blockIdx.x] = clock64() - t0;
}

struct MainloopBuffers {
  k90::W4a16GemmParams params{};  // weights, B rows, slots; k_splits and m_tiles set per run
  long long* cycles = nullptr;
};

template <int kWarpgroups, int kBlockN, int kStages, int kMinBlocks, bool kOverlapped, bool kEpilogue = true>
void mainloop_rate(const char* name, int sms, int width, int k_total, int items, MainloopBuffers& buf) {
  using Smem = k90::W4a16SmemLayout<kWarpgroups, kBlockN, kStages>;
  auto* kernel = &mainloop_kernel<kWarpgroups, kBlockN, kStages, kMinBlocks, kOverlapped, kEpilogue>;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Smem::kAllocBytes), "smem attribute");
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100), "carveout");
  int per_sm = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kWarpgroups * 128, Smem::kAllocBytes), "occupancy");
  const int grid = sms * std::max(per_sm, 1);
  k90::W4a16GemmParams p = buf.params;
  p.m_tiles = grid / 4 * kWarpgroups;
  p.k_splits = items;
  p.k_chunks_per_split = p.k_chunks / items;
  const Timing t = time_launches([&] { kernel<<<grid, kWarpgroups * 128, Smem::kAllocBytes>>>(p, width, buf.cycles); },
                                 buf.cycles, grid);
  char label[128];
  std::snprintf(label, sizeof(label), "%s, %d x K=%d", name, items, k_total / items);
  report(label, 2.0 * 64 * kWarpgroups * width * double(k_total) * grid, t, sms);
}

}  // namespace

int main() {
  int device = 0, sms = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  if (prop.major != 9 || prop.minor != 0) {
    std::fprintf(stderr, "megamoe_mainloop_probe: %s is sm_%d%d; this probe runs on Hopper (sm_90) only\n", prop.name,
                 prop.major, prop.minor);
    return 1;
  }
  sms = prop.multiProcessorCount;
  std::printf("%s, %d SMs\n", prop.name, sms);

  uint32_t seed = 12345;
  auto next = [&seed] { return seed = seed * 1664525u + 1013904223u; };

  // 1.
  std::vector<uint32_t> words_host(4096);
  for (auto& v : words_host) v = next();
  uint32_t* words;
  float* out;
  long long* cycles;
  check(cudaMalloc(&words, words_host.size() * 4), "cudaMalloc");
  check(cudaMalloc(&out, size_t(sms) * 4 * 512 * 4), "cudaMalloc");
  check(cudaMalloc(&cycles, size_t(sms) * 4 * sizeof(long long)), "cudaMalloc");
  check(cudaMemcpy(words, words_host.data(), words_host.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  std::printf("1. wgmma m64n128k16 bf16 alone, four warpgroups per SM\n");
  wgmma_rate<AOperand::kShared, false>("SS, wait 0 per 4 steps", sms, words, out, cycles);
  wgmma_rate<AOperand::kRegistersConstant, false>("RS constant A, wait 0 per 4 steps", sms, words, out, cycles);
  wgmma_rate<AOperand::kRegistersDecoded, false>("RS decoded A, wait 0 per 4 steps", sms, words, out, cycles);
  wgmma_rate<AOperand::kRegistersDecoded, true>("RS decoded A, wait 1 per step", sms, words, out, cycles);

  // 2. Weights for up to 4 * sms 64-row tiles of K = 16384, B rows for 4 n-tiles of 160.
  const int k_total = 16384, k_chunks = k_total / 64, max_m_tiles = 4 * sms, rows = 4 * 160;
  const size_t code_bytes = size_t(max_m_tiles) * k_chunks * 2048, scale_bytes = size_t(max_m_tiles) * k_chunks * 256;
  std::vector<uint8_t> bytes(code_bytes);
  for (auto& v : bytes) v = static_cast<uint8_t>(next() >> 24);
  MainloopBuffers buf;
  uint8_t *codes, *scales;
  __nv_bfloat16* b_rows;
  float *s2, *slot_weight, *out_acc;
  int32_t* slot_token;
  check(cudaMalloc(&codes, code_bytes), "cudaMalloc");
  check(cudaMalloc(&scales, scale_bytes), "cudaMalloc");
  check(cudaMalloc(&b_rows, size_t(rows) * k_total * 2), "cudaMalloc");
  check(cudaMalloc(&s2, 4), "cudaMalloc");
  check(cudaMalloc(&slot_token, rows * 4), "cudaMalloc");
  check(cudaMalloc(&slot_weight, rows * 4), "cudaMalloc");
  check(cudaMalloc(&out_acc, size_t(rows) * max_m_tiles * 64 * 4), "cudaMalloc");
  check(cudaMemcpy(codes, bytes.data(), code_bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  for (size_t i = 0; i < scale_bytes; ++i) bytes[i] = static_cast<uint8_t>(0x70 + (bytes[i] & 7));  // encoded ~1
  check(cudaMemcpy(scales, bytes.data(), scale_bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  std::vector<__nv_bfloat16> b_host(size_t(rows) * k_total);
  for (auto& v : b_host) v = __float2bfloat16(static_cast<float>((next() >> 9) & 0xff) / 256.0f - 0.5f);
  check(cudaMemcpy(b_rows, b_host.data(), b_host.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  const float one = 1.0f;
  std::vector<int32_t> tokens(rows);
  std::vector<float> weights(rows, 0.5f);
  for (int i = 0; i < rows; ++i) tokens[i] = i;
  check(cudaMemcpy(s2, &one, 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  check(cudaMemcpy(slot_token, tokens.data(), rows * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  check(cudaMemcpy(slot_weight, weights.data(), rows * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  k90::W4a16GemmParams& p = buf.params;
  p.codes = codes;
  p.scales = scales;
  p.k_chunks = k_chunks;
  p.s2_down = s2;
  p.b_src = b_rows;
  p.b_ld = k_total;
  p.num_experts = 1;
  p.slot_token = slot_token;
  p.slot_weight = slot_weight;
  p.out_acc = out_acc;
  p.out_ld = int64_t{max_m_tiles} * 64;
  buf.cycles = cycles;
  std::printf("2. the library's L2 mainloops, atomic epilogue, items of K=16384 or 8 of K=2048 per CTA\n");
  for (int items : {1, 8}) {
    mainloop_rate<2, 128, 4, 2, false>("2 warpgroups, 128 tokens, 4 stages", sms, 128, k_total, items, buf);
    mainloop_rate<2, 128, 4, 2, true>("2 warpgroups, 128 tokens, 4 stages, overlapped", sms, 128, k_total, items, buf);
    mainloop_rate<4, 160, 6, 1, true>("4 warpgroups, 160 tokens, 6 stages, overlapped", sms, 160, k_total, items, buf);
  }
  // 3. The cost of an item boundary: the absorbing tile at 2, 4 and 16 items per CTA, and at 8 with
  // the deterministic epilogue's plain 16-byte stores (y_slot) instead of red.global.add. Every
  // CTA reaches its epilogues at the same moment here, unlike the layer's claimed items.
  std::printf("3. the absorbing tile's item boundaries: items per CTA; plain stores instead of atomics\n");
  for (int items : {2, 4, 16}) {
    mainloop_rate<4, 160, 6, 1, true>("4 warpgroups, 160 tokens, 6 stages, overlapped", sms, 160, k_total, items, buf);
  }
  float* y_slot;
  check(cudaMalloc(&y_slot, size_t(rows) * max_m_tiles * 64 * 4), "cudaMalloc");
  p.y_slot = y_slot;
  mainloop_rate<4, 160, 6, 1, true>("4 warpgroups, 160 tokens, 6 stages, overlapped, slot stores", sms, 160, k_total, 8, buf);
  // 4. The same items without their epilogue: the rest of the boundary's cost (fill, drain, the
  // item loop). On the H100 the absorbing tile ran 8 x K=2048 at 92% without it, 65% with it
  // (docs/perf/2026-11-22-h100-w4a16-v19.md).
  std::printf("4. the overlapped tiles without their epilogue\n");
  for (int items : {1, 8, 16}) {
    mainloop_rate<4, 160, 6, 1, true, false>("4 warpgroups, 160 tokens, 6 stages, no epilogue", sms, 160, k_total, items, buf);
    mainloop_rate<2, 128, 4, 2, true, false>("2 warpgroups, 128 tokens, 4 stages, no epilogue", sms, 128, k_total, items, buf);
  }
  return 0;
}
