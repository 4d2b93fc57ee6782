// MoePlan, device weights and run(): the host side of the sm90 W4A16 MoE pipeline
//   dispatch -> L1 grouped GEMM (+SwiGLU) -> L2 grouped GEMM (+combine) -> bf16 output.
#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <thread>
#include <vector>

#include "kernels/sm90/sm90_moe_combine.cuh"
#include "kernels/sm90/sm90_moe_dispatch.cuh"
#include "kernels/sm90/sm90_w4a16_grouped_gemm.cuh"
#include "megamoe/gpu.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "runtime/sm90_w4a16_prepack.h"

namespace megamoe {

using gpu::check_cuda;
namespace k90 = kernels::sm90;

// ------------------------------------------------------------------------------------------
// Problem

MoeProblem MoeProblem::from_layer(const MoeLayer& layer, int64_t max_tokens) {
  MoeProblem p;
  p.hidden_size = layer.hidden_size;
  p.intermediate_size = layer.intermediate_size;
  p.num_experts = layer.num_experts;
  p.top_k = layer.routing.top_k;
  p.shared_intermediate_size = layer.shared_expert ? layer.shared_expert->intermediate_size() : 0;
  p.max_tokens = max_tokens;
  p.swiglu_limit = layer.swiglu_limit;
  return p;
}

namespace {

int64_t shared_chunks(const MoeProblem& p) {
  return p.shared_intermediate_size / std::max<int64_t>(p.intermediate_size, 1);
}
int64_t virtual_experts(const MoeProblem& p) { return p.num_experts + shared_chunks(p); }
int64_t slots_per_token(const MoeProblem& p) { return p.top_k + shared_chunks(p); }

void validate_problem(const MoeProblem& p) {
  MEGAMOE_CHECK(p.hidden_size > 0 && p.hidden_size % 64 == 0, kUnsupported,
                "MoePlan: hidden_size = ", p.hidden_size,
                " is not supported; the sm90 kernels need a positive multiple of 64");
  MEGAMOE_CHECK(p.intermediate_size > 0 && p.intermediate_size % 64 == 0, kUnsupported,
                "MoePlan: intermediate_size = ", p.intermediate_size,
                " is not supported; the sm90 kernels need a positive multiple of 64");
  MEGAMOE_CHECK(p.num_experts >= 1 && p.num_experts <= 1024, kUnsupported,
                "MoePlan: num_experts = ", p.num_experts, " is outside the supported 1..1024");
  MEGAMOE_CHECK(p.top_k >= 1 && p.top_k <= std::min<int64_t>(p.num_experts, 16), kInvalidArgument,
                "MoePlan: top_k = ", p.top_k, " must be in 1..min(num_experts, 16)");
  MEGAMOE_CHECK(p.shared_intermediate_size >= 0 &&
                    p.shared_intermediate_size % p.intermediate_size == 0 &&
                    shared_chunks(p) <= 8,
                kUnsupported, "MoePlan: shared_intermediate_size = ", p.shared_intermediate_size,
                " must be 0 or a multiple (at most 8x) of intermediate_size = ",
                p.intermediate_size);
  MEGAMOE_CHECK(p.max_tokens >= 0 && p.max_tokens <= (int64_t{1} << 20), kInvalidArgument,
                "MoePlan: max_tokens = ", p.max_tokens, " must be in 0..1048576");
  MEGAMOE_CHECK(p.max_tokens * slots_per_token(p) < std::numeric_limits<int32_t>::max(),
                kInvalidArgument, "MoePlan: max_tokens * (top_k + shared slices) overflows int32");
  MEGAMOE_CHECK(!p.swiglu_limit || (std::isfinite(*p.swiglu_limit) && *p.swiglu_limit > 0),
                kInvalidArgument, "MoePlan: swiglu_limit must be finite and positive");
}

// The int32 counters the dispatch kernel zeroes: [0] L1 work items, [1] L2 work items, [2] CTAs
// done zeroing (fused launch), then per expert the L1 items done (fused launch).
inline constexpr int64_t kCtasZeroedCounter = 2;
inline constexpr int64_t kL1DoneCounters = 3;
int64_t counter_count(const MoeProblem& p) { return kL1DoneCounters + virtual_experts(p); }

// Workspace: every region 256-byte aligned, sized for max_tokens.
struct WorkspaceLayout {
  size_t expert_offsets, l1_tiles, l2_tiles, invalid, counters, cta_counts, cta_invalid, slot_token, slot_weight,
      token_slot, act, out_acc, y_slot, total;
};
WorkspaceLayout workspace_layout(const MoeProblem& p) {
  WorkspaceLayout w{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += (bytes + 255) / 256 * 256;
    return at;
  };
  const size_t ev = static_cast<size_t>(virtual_experts(p)) + 1;
  const size_t slots = static_cast<size_t>(p.max_tokens * slots_per_token(p));
  w.expert_offsets = take(ev * 4);
  w.l1_tiles = take(ev * 4);
  w.l2_tiles = take(ev * 4);
  w.invalid = take(4);
  w.counters = take(static_cast<size_t>(counter_count(p)) * 4);
  // The multi-CTA dispatch's per-CTA expert counts (large T only).
  w.cta_counts = take(static_cast<size_t>(k90::kDispatchMaxCtas) * static_cast<size_t>(p.num_experts) * 4);
  w.cta_invalid = take(static_cast<size_t>(k90::kDispatchMaxCtas) * 4);
  w.slot_token = take(slots * 4);
  w.slot_weight = take(slots * 4);
  w.token_slot = take(slots * 4);
  w.act = take(slots * static_cast<size_t>(p.intermediate_size) * 2);
  w.out_acc = p.deterministic ? off : take(static_cast<size_t>(p.max_tokens * p.hidden_size) * 4);
  w.y_slot = p.deterministic ? take(slots * static_cast<size_t>(p.hidden_size) * 4) : off;
  w.total = off;
  return w;
}

template <class T>
T* at(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<uint8_t*>(base) + offset);
}

}  // namespace

// ------------------------------------------------------------------------------------------
// Device weights

struct MoeDeviceWeights::Impl {
  MoeProblem shape;  // hidden, intermediate, experts, shared (max_tokens unused)
  uint8_t* w13_codes = nullptr;
  uint8_t* w13_scales = nullptr;
  uint8_t* w2_codes = nullptr;
  uint8_t* w2_scales = nullptr;
  float* s2 = nullptr;  // [3][E']: gate, up, down
  int64_t w13_code_stride = 0, w13_scale_stride = 0, w2_code_stride = 0, w2_scale_stride = 0;
  size_t bytes = 0;
  ~Impl() {
    for (void* ptr : {static_cast<void*>(w13_codes), static_cast<void*>(w13_scales),
                      static_cast<void*>(w2_codes), static_cast<void*>(w2_scales),
                      static_cast<void*>(s2)}) {
      if (ptr) cudaFree(ptr);
    }
  }
};

MoeDeviceWeights::MoeDeviceWeights() : impl_(std::make_unique<Impl>()) {}
MoeDeviceWeights::MoeDeviceWeights(MoeDeviceWeights&&) noexcept = default;
MoeDeviceWeights& MoeDeviceWeights::operator=(MoeDeviceWeights&&) noexcept = default;
MoeDeviceWeights::~MoeDeviceWeights() = default;
size_t MoeDeviceWeights::device_bytes() const { return impl_->bytes; }

MoeDeviceWeights MoeDeviceWeights::upload(const MoeLayer& layer, cudaStream_t stream) {
  layer.validate();
  MoeProblem shape = MoeProblem::from_layer(layer, 0);
  validate_problem(shape);
  const int64_t H = layer.hidden_size, I = layer.intermediate_size;
  const int64_t E = layer.num_experts, chunks = shared_chunks(shape), EV = E + chunks;

  MoeDeviceWeights out;
  Impl& w = *out.impl_;
  w.shape = shape;
  w.w13_code_stride = runtime::prepacked_code_bytes(2 * I, H);
  w.w13_scale_stride = runtime::prepacked_scale_bytes(2 * I, H);
  w.w2_code_stride = runtime::prepacked_code_bytes(H, I);
  w.w2_scale_stride = runtime::prepacked_scale_bytes(H, I);
  auto alloc = [&](uint8_t** ptr, int64_t bytes) {
    check_cuda(cudaMalloc(reinterpret_cast<void**>(ptr), static_cast<size_t>(bytes)), "cudaMalloc(weights)");
    w.bytes += static_cast<size_t>(bytes);
  };
  alloc(&w.w13_codes, EV * w.w13_code_stride);
  alloc(&w.w13_scales, EV * w.w13_scale_stride);
  alloc(&w.w2_codes, EV * w.w2_code_stride);
  alloc(&w.w2_scales, EV * w.w2_scale_stride);
  check_cuda(cudaMalloc(reinterpret_cast<void**>(&w.s2), static_cast<size_t>(3 * EV) * sizeof(float)),
             "cudaMalloc(global scales)");

  // Virtual expert v: a routed expert, or slice v - E of the shared expert.
  auto expert_of = [&](int64_t v) -> const ExpertWeights& {
    return v < E ? layer.experts[static_cast<size_t>(v)] : *layer.shared_expert;
  };
  std::vector<float> s2(static_cast<size_t>(3 * EV));
  for (int64_t v = 0; v < EV; ++v) {
    const ExpertWeights& ex = expert_of(v);
    s2[v] = ex.gate.weight_scale_2;
    s2[EV + v] = ex.up.weight_scale_2;
    s2[2 * EV + v] = ex.down.weight_scale_2;
  }
  check_cuda(cudaMemcpyAsync(w.s2, s2.data(), s2.size() * sizeof(float), cudaMemcpyHostToDevice, stream),
             "cudaMemcpyAsync(global scales)");

  // Prepack in batches of experts on all cores, upload each batch (bounded host memory).
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  const int64_t batch = std::min<int64_t>(EV, threads);
  const size_t per_expert = static_cast<size_t>(w.w13_code_stride + w.w13_scale_stride +
                                                w.w2_code_stride + w.w2_scale_stride);
  std::vector<uint8_t> host(static_cast<size_t>(batch) * per_expert);
  for (int64_t first = 0; first < EV; first += batch) {
    const int64_t n = std::min(batch, EV - first);
    std::vector<std::thread> pool;
    std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      pool.emplace_back([&, i] {
        try {
          const int64_t v = first + i;
          const ExpertWeights& ex = expert_of(v);
          const int64_t col0 = v < E ? 0 : (v - E) * I;
          uint8_t* base = host.data() + static_cast<size_t>(i) * per_expert;
          uint8_t* c13 = base;
          uint8_t* s13 = c13 + w.w13_code_stride;
          uint8_t* c2 = s13 + w.w13_scale_stride;
          uint8_t* sc2 = c2 + w.w2_code_stride;
          runtime::prepack_w13(ex.gate, ex.up, col0, I, {c13, static_cast<size_t>(w.w13_code_stride)},
                               {s13, static_cast<size_t>(w.w13_scale_stride)});
          runtime::prepack_w2(ex.down, col0, I, {c2, static_cast<size_t>(w.w2_code_stride)},
                              {sc2, static_cast<size_t>(w.w2_scale_stride)});
        } catch (...) {
          errors[static_cast<size_t>(i)] = std::current_exception();
        }
      });
    }
    for (auto& th : pool) th.join();
    for (auto& err : errors) {
      if (err) std::rethrow_exception(err);
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = first + i;
      const uint8_t* base = host.data() + static_cast<size_t>(i) * per_expert;
      auto copy = [&](uint8_t* dst, const uint8_t* src, int64_t bytes) {
        check_cuda(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream),
                   "cudaMemcpyAsync(prepacked weights)");
      };
      copy(w.w13_codes + v * w.w13_code_stride, base, w.w13_code_stride);
      copy(w.w13_scales + v * w.w13_scale_stride, base + w.w13_code_stride, w.w13_scale_stride);
      copy(w.w2_codes + v * w.w2_code_stride, base + w.w13_code_stride + w.w13_scale_stride,
           w.w2_code_stride);
      copy(w.w2_scales + v * w.w2_scale_stride,
           base + w.w13_code_stride + w.w13_scale_stride + w.w2_code_stride, w.w2_scale_stride);
    }
    // The host buffer is refilled by the next batch, and a pageable-memory copy may return before
    // its DMA lands: wait, so neither the next batch nor a kernel on another stream races it.
    check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize(weight upload)");
  }
  return out;
}

// ------------------------------------------------------------------------------------------
// Plan

MoePlan MoePlan::create(const MoeProblem& problem, const MoeTuning& tuning) {
  validate_problem(problem);
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  MEGAMOE_CHECK(prop.major == 9 && prop.minor == 0, kUnsupported, "MoePlan: device ", device, " (",
                prop.name, ", sm_", prop.major, prop.minor,
                ") is not supported; this build runs on Hopper (sm_90: H100/H200) only");
  MoePlan plan;
  plan.problem_ = problem;
  plan.tuning_ = tuning;
  plan.num_sms_ = prop.multiProcessorCount;
  return plan;
}

MoeConfig MoePlan::config(int64_t tokens) const {
  const MoeProblem& p = problem_;
  if (tuning_.absorbing_tile && *tuning_.absorbing_tile) {
    MEGAMOE_CHECK(can_absorb(p), kInvalidArgument, "MoeTuning.absorbing_tile: its 256-row blocks need 2I and H multiples of 256; "
                  "this layer has I=", p.intermediate_size, ", H=", p.hidden_size);
    MEGAMOE_CHECK(!tuning_.fused || !*tuning_.fused, kInvalidArgument,
                  "MoeTuning.absorbing_tile runs two launches: it cannot be set with MoeTuning.fused = true");
    MEGAMOE_CHECK(!tuning_.early_start || !*tuning_.early_start, kInvalidArgument,
                  "MoeTuning.absorbing_tile has no early start: it cannot be set with MoeTuning.early_start = true");
  }
  // The heuristic applies tuning_.fused and tuning_.absorbing_tile itself (its tile choice
  // depends on the launch; without the absorbing tile it picks another prefill tile).
  MoeConfig cfg = choose_moe_config(p, tokens, num_sms_, tuning_.fused, tuning_.absorbing_tile);
  MEGAMOE_CHECK(!tuning_.fused || !*tuning_.fused || cfg.fused, kInvalidArgument,
                "MoeTuning.fused: the fused launch is built for the 16- and 32-token decode tiles (",
                kFusedTile.to_string(), ", ", kFusedTile32.to_string(), ") in both GEMMs, up to 24 tokens per expert; at T=",
                tokens, " the heuristic picks ", cfg.to_string());
  if (tuning_.early_start) {
    MEGAMOE_CHECK(!*tuning_.early_start || can_start_early(p, tokens), kInvalidArgument,
                  "MoeTuning.early_start: early start holds up to ", kEarlyStartMaxSelections,
                  " routed selections (T * top_k) and ", kEarlyStartMaxSlots,
                  " slots (T * (top_k + shared slices)); T=", tokens, " has more");
    cfg.early_start = *tuning_.early_start;
  }
  return cfg;
}

size_t MoePlan::workspace_bytes() const { return workspace_layout(problem_).total; }

std::string MoePlan::describe(int64_t tokens) const {
  std::ostringstream os;
  os << "T=" << tokens << " " << config(tokens).to_string()
     << (problem_.deterministic ? " deterministic" : " atomic-combine");
  return os.str();
}

int64_t MoePlan::invalid_id_count(const void* workspace, cudaStream_t stream) const {
  int32_t count = 0;
  const auto layout = workspace_layout(problem_);
  check_cuda(cudaMemcpyAsync(&count, static_cast<const uint8_t*>(workspace) + layout.invalid, 4,
                             cudaMemcpyDeviceToHost, stream),
             "cudaMemcpyAsync(invalid id count)");
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return count;
}

// ------------------------------------------------------------------------------------------
// Run

namespace {

// Launches `kernel` so that it may start while the previous kernel on the stream still runs
// (programmatic dependent launch); the kernel waits for that one's results itself
// (kernels/common/pdl.cuh).
template <class Params>
void launch_dependent(void (*kernel)(Params), unsigned grid, unsigned block, size_t smem,
                      cudaStream_t stream, const Params& params) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&config, kernel, params), "cudaLaunchKernelEx");
}

// Sets a kernel's shared-memory attributes once and returns its resident CTAs per SM.
template <class Kernel>
int prepare_kernel(Kernel* kernel, int threads, int smem_bytes) {
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes),
             "cudaFuncSetAttribute(max dynamic shared memory)");
  // All of the unified L1/shared array as shared memory: the kernels stream through
  // shared-memory stages and have no use for a large L1.
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100),
             "cudaFuncSetAttribute(shared memory carveout)");
  int n = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem_bytes),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return std::max(n, 1);
}

template <bool kIsL1, int kWG, int kBN, int kStages, int kMinBlocksPerSm, bool kOverlapped = false>
void launch_gemm(const k90::W4a16GemmParams& params, int num_sms, int64_t max_work, cudaStream_t stream) {
  using Smem = k90::W4a16SmemLayout<kWG, kBN, kStages>;
  auto* kernel = &k90::w4a16_grouped_gemm_kernel<kIsL1, kWG, kBN, kStages, kMinBlocksPerSm, kOverlapped>;
  static const int blocks_per_sm = prepare_kernel(kernel, kWG * 128, Smem::kAllocBytes);
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(int64_t{num_sms} * blocks_per_sm, max_work));
  launch_dependent(kernel, static_cast<unsigned>(grid), kWG * 128, Smem::kAllocBytes, stream, params);
}

// The whitelist of instantiations (keeps the build in minutes): see sm90_moe_heuristics.cpp.
template <bool kIsL1>
void launch_gemm_config(const GemmConfig& c, const k90::W4a16GemmParams& params, int num_sms,
                        int64_t max_work, cudaStream_t stream) {
  MEGAMOE_CHECK(c.k_splits >= 1 && (c.k_splits == 1 || (!kIsL1 && params.y_slot == nullptr)), kInternal,
                "GEMM config ", c.to_string(), ": only the atomic L2 may split K");
  // The 16-token decode tile is pinned to 6 CTAs per SM (kFusedTileCtasPerSm; <= 80 registers,
  // no spills; eight stages of 6 CTAs fit shared memory): one more warp per SM sub-partition to
  // hide the decode's latency, 2-8% faster than 5 CTAs from T=2 to T=64 (H200, DeepSeek-V3 /
  // Qwen3-30B). The 32-token tile stays at 5 (<= 96 registers; a code change that let ptxas
  // take 109 registers once cost 5% unnoticed). The 48- and 64-token tiles are pinned to 4
  // (<= 128 registers). Stage counts are chosen so that shared memory allows as many CTAs as
  // registers do (the 64-token tile excepted: 3 CTAs, four stages for 4 CTAs measured slower,
  // T=1536 3685 -> 3994 us).
  static_assert(kPrefillTile.warpgroups == 2 && kPrefillTile.block_n == 128 && kPrefillTile.stages == 4 &&
                    !kPrefillTile.overlapped,
                "kPrefillTile is the two-warpgroup 128-token tile instantiated below");
  static_assert(kOverlappedPrefillTile.warpgroups == 2 && kOverlappedPrefillTile.block_n == 128 &&
                    kOverlappedPrefillTile.stages == 4 && kOverlappedPrefillTile.overlapped,
                "kOverlappedPrefillTile is the overlapped two-warpgroup 128-token tile instantiated below");
  static_assert(kAbsorbingTile.warpgroups == 4 && kAbsorbingTile.block_n == 160 && kAbsorbingTile.stages == 6 &&
                    kAbsorbingTile.last_tile_extra == 32 && kAbsorbingTile.overlapped,
                "kAbsorbingTile is the absorbing tile instantiated below");
  static_assert(k90::detail::kTileStep<kAbsorbingTile.block_n> == kAbsorbingTile.block_n - kAbsorbingTile.last_tile_extra,
                "the kernel's tile step (kTileStep) must be kAbsorbingTile's");
  static_assert(kFusedTile.warpgroups == 1 && kFusedTile.block_n == 16 && kFusedTile.stages == 8,
                "kFusedTile is the 16-token tile instantiated below");
  static_assert(kFusedTile32.warpgroups == 1 && kFusedTile32.block_n == 32 && kFusedTile32.stages == 6,
                "kFusedTile32 is the 32-token tile instantiated below");
  // The overlapped K loop: the four-warpgroup tile always, the two-warpgroup tile either way, the
  // one-warpgroup tiles never.
  MEGAMOE_CHECK(c.overlapped == (c.warpgroups == 4) || c.warpgroups == 2, kInternal,
                "no kernel instantiated for GEMM config ", c.to_string());
  if (c.warpgroups == 1 && c.block_n == 16 && c.stages == 8) {
    launch_gemm<kIsL1, 1, 16, 8, kFusedTileCtasPerSm>(params, num_sms, max_work, stream);
  } else if (c.warpgroups == 1 && c.block_n == 32 && c.stages == 6) {
    launch_gemm<kIsL1, 1, 32, 6, kFusedTile32CtasPerSm>(params, num_sms, max_work, stream);
  } else if (c.warpgroups == 1 && c.block_n == 48 && c.stages == 6) {
    launch_gemm<kIsL1, 1, 48, 6, 4>(params, num_sms, max_work, stream);
  } else if (c.warpgroups == 1 && c.block_n == 64 && c.stages == 6) {
    launch_gemm<kIsL1, 1, 64, 6, 4>(params, num_sms, max_work, stream);
  } else if (c.warpgroups == 4 && c.block_n == 160 && c.stages == 6 && c.last_tile_extra == 32) {
    // One CTA (four warpgroups, 512 threads at <= 128 registers) per SM.
    launch_gemm<kIsL1, 4, 160, 6, 1, true>(params, num_sms, max_work, stream);
  } else if (c.warpgroups == 2 && c.block_n == 128 && c.stages == 4) {
    // Two CTAs (four warpgroups) per SM: one warpgroup's wgmmas run while another decodes.
    if (c.overlapped) {
      launch_gemm<kIsL1, 2, 128, 4, 2, true>(params, num_sms, max_work, stream);
    } else {
      launch_gemm<kIsL1, 2, 128, 4, 2>(params, num_sms, max_work, stream);
    }
  } else {
    MEGAMOE_FAIL(kInternal, "no kernel instantiated for GEMM config ", c.to_string());
  }
}

template <int kBN, int kStages, int kCtasPerSm>
void launch_fused_tile(const k90::W4a16FusedParams& params, int num_sms, int64_t max_work, cudaStream_t stream) {
  using Smem = k90::W4a16SmemLayout<1, kBN, kStages>;
  auto* kernel = &k90::w4a16_fused_moe_kernel<1, kBN, kStages, kCtasPerSm>;
  static const int blocks_per_sm = prepare_kernel(kernel, 128, Smem::kAllocBytes);
  // Every CTA must be resident at once (L2 items wait for L1 items held by other CTAs): the grid
  // never exceeds the occupancy of all the device's SMs (see MoeTuning::fused for the limits).
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(int64_t{num_sms} * blocks_per_sm, max_work));
  launch_dependent(kernel, static_cast<unsigned>(grid), 128, Smem::kAllocBytes, stream, params);
}

// The fused L1 + L2 launch; instantiated for the 16- and 32-token decode tiles, with as many CTAs
// per SM as their two-launch kernels (launch_gemm_config). MoePlan::config rejects anything else.
void launch_fused(const MoeConfig& c, const k90::W4a16FusedParams& params, int num_sms, int64_t max_work,
                  cudaStream_t stream) {
  MEGAMOE_CHECK(c.can_fuse(), kInternal, "no fused kernel instantiated for ", c.to_string());
  if (c.l1.block_n == kFusedTile.block_n) {
    launch_fused_tile<kFusedTile.block_n, kFusedTile.stages, kFusedTileCtasPerSm>(params, num_sms, max_work, stream);
  } else {
    launch_fused_tile<kFusedTile32.block_n, kFusedTile32.stages, kFusedTile32CtasPerSm>(params, num_sms, max_work,
                                                                                          stream);
  }
}

}  // namespace

void run(const MoePlan& plan, const MoeDeviceWeights& weights, const MoeRunArgs& args,
         cudaStream_t stream) {
  const MoeProblem& p = plan.problem();
  const auto& w = weights.impl();
  MEGAMOE_CHECK(w.shape.hidden_size == p.hidden_size && w.shape.intermediate_size == p.intermediate_size &&
                    w.shape.num_experts == p.num_experts &&
                    w.shape.shared_intermediate_size == p.shared_intermediate_size,
                kInvalidArgument, "run: the weights (H=", w.shape.hidden_size, ", I=",
                w.shape.intermediate_size, ", E=", w.shape.num_experts, ", shared I=",
                w.shape.shared_intermediate_size, ") do not match the plan (H=", p.hidden_size,
                ", I=", p.intermediate_size, ", E=", p.num_experts, ", shared I=",
                p.shared_intermediate_size, ")");
  MEGAMOE_CHECK(args.tokens >= 0 && args.tokens <= p.max_tokens, kInvalidArgument, "run: tokens = ",
                args.tokens, " must be in 0..max_tokens = ", p.max_tokens);
  if (args.tokens == 0) return;
  MEGAMOE_CHECK(args.hidden && args.topk_ids && args.topk_weights && args.output && args.workspace,
                kInvalidArgument, "run: hidden, topk_ids, topk_weights, output and workspace must be device pointers, not null");
  MEGAMOE_CHECK(reinterpret_cast<uintptr_t>(args.hidden) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(args.output) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(args.workspace) % 256 == 0,
                kInvalidArgument, "run: hidden and output must be 16-byte aligned, workspace 256-byte aligned");

  const MoeConfig cfg = plan.config(args.tokens);
  const auto L = workspace_layout(p);
  const int64_t T = args.tokens, H = p.hidden_size, I = p.intermediate_size;
  const int64_t EV = virtual_experts(p), spt = slots_per_token(p);
  void* ws = args.workspace;

  k90::DispatchParams d{};
  d.topk_ids = args.topk_ids;
  d.topk_weights = args.topk_weights;
  d.tokens = static_cast<int32_t>(T);
  d.top_k = p.top_k;
  d.num_experts = static_cast<int32_t>(p.num_experts);
  d.shared_chunks = static_cast<int32_t>(shared_chunks(p));
  d.l1_m_tiles = static_cast<int32_t>(2 * I / 64);
  d.l2_m_tiles = static_cast<int32_t>(H / 64);
  d.l1_block_m_tiles = cfg.l1.warpgroups;
  d.l2_block_m_tiles = cfg.l2.warpgroups;
  d.l1_block_n = cfg.l1.block_n;
  d.l2_block_n = cfg.l2.block_n;
  d.l1_tile_step = cfg.l1.tile_step();
  d.l2_tile_step = cfg.l2.tile_step();
  d.l2_k_splits = cfg.l2.k_splits;
  d.expert_offsets = at<int32_t>(ws, L.expert_offsets);
  d.l1_tile_offsets = at<int32_t>(ws, L.l1_tiles);
  d.l2_tile_offsets = at<int32_t>(ws, L.l2_tiles);
  d.slot_token = at<int32_t>(ws, L.slot_token);
  d.slot_weight = at<float>(ws, L.slot_weight);
  d.token_slot = at<int32_t>(ws, L.token_slot);
  d.invalid_ids = at<int32_t>(ws, L.invalid);
  d.counters = at<int32_t>(ws, L.counters);
  d.counter_count = static_cast<int32_t>(counter_count(p));
  d.cta_counts = at<int32_t>(ws, L.cta_counts);
  d.cta_invalid = at<int32_t>(ws, L.cta_invalid);
  const int64_t selections = T * p.top_k;
  // With early start the dispatch is off the critical path, and zeroes the combine accumulator
  // itself: the fused launch's L2 items then need no hand-off from every CTA's zeroing (which
  // early start would delay to each CTA's first wait for the dispatch: DeepSeek-V3 T=1 was 2 us
  // slower on H100).
  const bool dispatch_zeroes = cfg.early_start && !p.deterministic;
  d.zero_first = dispatch_zeroes ? at<float>(ws, L.out_acc) : nullptr;
  d.zero_count = dispatch_zeroes ? T * H : 0;
  // The dispatch is launched without programmatic serialization: it starts once everything
  // before it on the stream has completed. The L1 GEMM relies on it to zero the combine
  // accumulator before its own dependency wait (the previous run's combine reads it).
  if (selections <= k90::kDispatchSingleCtaItems) {
    k90::moe_dispatch_kernel<<<1, k90::kDispatchThreads, k90::kDispatchStageBytes, stream>>>(d);
    check_cuda(cudaGetLastError(), "moe_dispatch_kernel launch");
  } else {
    // At least kDispatchThreads selections per CTA, whole tokens, no empty CTA.
    const int64_t want = std::min<int64_t>(k90::kDispatchMaxCtas,
                                           (selections + k90::kDispatchThreads - 1) / k90::kDispatchThreads);
    const int64_t tokens_per_cta = (T + want - 1) / want;
    const int64_t ctas = (T + tokens_per_cta - 1) / tokens_per_cta;
    d.tokens_per_cta = static_cast<int32_t>(tokens_per_cta);
    k90::moe_dispatch_count_kernel<<<static_cast<unsigned>(ctas), k90::kDispatchThreads, 0, stream>>>(d);
    check_cuda(cudaGetLastError(), "moe_dispatch_count_kernel launch");
    launch_dependent(&k90::moe_dispatch_place_kernel, static_cast<unsigned>(ctas), k90::kDispatchThreads, 0,
                     stream, d);
  }

  const float limit = p.swiglu_limit ? *p.swiglu_limit : std::numeric_limits<float>::infinity();
  // Upper bound of the work items, which sizes the grid (the exact count is known only on the
  // device): at most min(E', slots) experts hold tokens, and an expert with c tokens has
  // ceil(c / BLOCK_N) <= (c + BLOCK_N - 1) / BLOCK_N n-tiles. Tight at one token (DeepSeek-V3
  // L1: 576 items, exactly), so no CTA slots are launched only to find no work: extra CTAs
  // crowd the first SMs the block scheduler fills, and the items then share fewer SMs.
  auto max_work = [&](const GemmConfig& c, int64_t m_tiles) {
    const int64_t slots = T * spt, active = std::min(EV, slots);
    // The last tile may absorb a remainder: tiles of tile_step() tokens bound the count.
    const int64_t n_tiles = (slots + active * (c.tile_step() - 1)) / c.tile_step();
    return (m_tiles / c.warpgroups) * c.k_splits * n_tiles;
  };

  k90::W4a16GemmParams g1{};
  g1.codes = w.w13_codes;
  g1.scales = w.w13_scales;
  g1.code_expert_stride = w.w13_code_stride;
  g1.scale_expert_stride = w.w13_scale_stride;
  g1.m_tiles = d.l1_m_tiles;
  g1.k_chunks = static_cast<int32_t>(H / 64);
  g1.k_splits = 1;
  g1.k_chunks_per_split = g1.k_chunks;
  g1.s2_a = w.s2;
  g1.s2_b = w.s2 + EV;
  g1.b_src = reinterpret_cast<const __nv_bfloat16*>(args.hidden);
  g1.b_ld = H;
  g1.expert_offsets = d.expert_offsets;
  g1.tile_offsets = d.l1_tile_offsets;
  g1.work_counter = d.counters;
  g1.num_experts = static_cast<int32_t>(EV);
  g1.slot_token = d.slot_token;
  g1.slot_weight = d.slot_weight;
  g1.act = at<__nv_bfloat16>(ws, L.act);
  g1.act_ld = I;
  g1.swiglu_limit = limit;
  g1.zero_first = p.deterministic || dispatch_zeroes ? nullptr : at<float>(ws, L.out_acc);
  g1.zero_count = g1.zero_first != nullptr ? T * H : 0;
  static_assert(kEarlyStartMaxSelections == k90::kTinyMaxSelections && kEarlyStartMaxSlots == k90::kTinyMaxSlots,
                "the API's early-start limits must be the kernels' (sm90_moe_tiny_schedule.cuh)");
  g1.topk_ids = cfg.early_start ? args.topk_ids : nullptr;
  g1.tokens = d.tokens;
  g1.top_k = d.top_k;
  g1.num_routed = d.num_experts;
  g1.shared_chunks = d.shared_chunks;
  k90::W4a16GemmParams g2 = g1;
  g2.codes = w.w2_codes;
  g2.scales = w.w2_scales;
  g2.code_expert_stride = w.w2_code_stride;
  g2.scale_expert_stride = w.w2_scale_stride;
  g2.m_tiles = d.l2_m_tiles;
  g2.k_chunks = static_cast<int32_t>(I / 64);
  g2.k_splits = cfg.l2.k_splits;
  g2.k_chunks_per_split = (g2.k_chunks + g2.k_splits - 1) / g2.k_splits;
  g2.s2_a = w.s2 + 2 * EV;
  g2.s2_b = nullptr;
  g2.b_src = at<__nv_bfloat16>(ws, L.act);
  g2.b_ld = I;
  g2.tile_offsets = d.l2_tile_offsets;
  g2.work_counter = d.counters + 1;
  g2.act = nullptr;
  g2.out_acc = p.deterministic ? nullptr : at<float>(ws, L.out_acc);
  g2.y_slot = p.deterministic ? at<float>(ws, L.y_slot) : nullptr;
  g2.out_ld = H;
  g2.zero_first = nullptr;
  g2.zero_count = 0;
  g2.topk_ids = nullptr;
  // The kernels' pre-wait prefetch of their first items (prefetch_guessed_item) guesses that every
  // routed expert holds T * k / E tokens. Below one token per expert most guessed experts are
  // empty: the prefetch would fetch weights no item reads, and the two-launch L2's CTAs, resident
  // beside a small L1 grid, would compete with its loads (Qwen3-30B T=1 24.5 -> 27.2 us, H100).
  // Early start knows the L1 items exactly instead.
  auto guess_n_tiles = [&](const GemmConfig& c) -> int32_t {
    const double per_expert = static_cast<double>(T) * p.top_k / static_cast<double>(p.num_experts);
    if (per_expert < 1.0) return 0;
    return static_cast<int32_t>(std::max<int64_t>(1, std::llround(per_expert / c.tile_step())));
  };
  g1.guess_n_tiles = cfg.early_start ? 0 : guess_n_tiles(cfg.l1);
  g2.guess_n_tiles = guess_n_tiles(cfg.l2);
  const int64_t l1_work = max_work(cfg.l1, d.l1_m_tiles), l2_work = max_work(cfg.l2, d.l2_m_tiles);
  if (cfg.fused) {
    k90::W4a16FusedParams f{};
    f.l1 = g1;
    f.l2 = g2;
    f.l1_tiles_done = d.counters + kL1DoneCounters;
    f.ctas_zeroed = d.counters + kCtasZeroedCounter;
    launch_fused(cfg, f, plan.num_sms(), l1_work + l2_work, stream);
  } else {
    launch_gemm_config<true>(cfg.l1, g1, plan.num_sms(), l1_work, stream);
    launch_gemm_config<false>(cfg.l2, g2, plan.num_sms(), l2_work, stream);
  }

  k90::CombineParams c{};
  c.out_acc = p.deterministic ? nullptr : at<float>(ws, L.out_acc);
  c.y_slot = g2.y_slot;
  c.token_slot = d.token_slot;
  c.slot_weight = d.slot_weight;
  c.slots_per_token = static_cast<int32_t>(spt);
  c.tokens = T;
  c.hidden = H;
  c.out = reinterpret_cast<__nv_bfloat16*>(args.output);
  const int64_t vecs = T * H / 8;
  const int64_t blocks = std::min<int64_t>((vecs + 255) / 256, int64_t{plan.num_sms()} * 8);
  launch_dependent(&k90::moe_combine_kernel, static_cast<unsigned>(blocks), 256, 0, stream, c);
}

}  // namespace megamoe
