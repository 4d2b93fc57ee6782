// The (sm_90, w4a8) row's launches (docs/w4a8.md §8): the shared dispatch; the hidden states
// quantized per token and 128 columns; L1 (fp8 decode, per-128-K promotion, SwiGLU to fp32);
// a quantized per slot and 128 columns; L2 and its combine epilogue; the shared combine.
#include <algorithm>
#include <iterator>
#include <cstdint>
#include <limits>
#include <utility>

#include "backends/sm90_w4a16/sm90_w4a16_params.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_act_quant.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_grouped_gemm_kernel.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_run.h"
#include "backends/sm90_w4a8/sm90_w4a8_ws_kernel.cuh"
#include "megamoe/gpu.h"
#include "megamoe/status.h"
#include "runtime/sm90/sm90_launch_util.h"
#include "runtime/sm90/sm90_moe_pipeline.h"

namespace megamoe::runtime {

namespace k90 = kernels::sm90;
namespace w4a8 = kernels::sm90::w4a8;

void validate_sm90_w4a8_problem(const MoeProblem& p) {
  validate_sm90_problem(p);
  MEGAMOE_CHECK(p.hidden_size % w4a8::kActBlock == 0, kUnsupported, "MoePlan: precision w4a8 needs hidden_size",
                " to be a multiple of 128 (one activation scale per 128 elements, docs/w4a8.md §1); it is ",
                p.hidden_size, ". Use w4a16, which needs a multiple of 64");
  MEGAMOE_CHECK(p.intermediate_size % w4a8::kActBlock == 0, kUnsupported,
                "MoePlan: precision w4a8 needs intermediate_size to be a multiple of 128 (one activation scale per",
                " 128 elements, docs/w4a8.md §2); it is ", p.intermediate_size,
                ". Use w4a16, which needs a multiple of 64");
}

W4a8WorkspaceLayout w4a8_workspace_layout(const MoeProblem& p) {
  W4a8WorkspaceLayout w{};
  w.base = workspace_layout(p);
  size_t off = w.base.total;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += (bytes + 255) / 256 * 256;
    return at;
  };
  const size_t T = static_cast<size_t>(p.max_tokens), H = static_cast<size_t>(p.hidden_size);
  const size_t S = T * static_cast<size_t>(slots_per_token(p)), I = static_cast<size_t>(p.intermediate_size);
  w.x_codes = take(T * H);
  w.x_scales = take(T * (H / w4a8::kActBlock) * 4);
  w.act_f32 = take(S * I * 4);
  w.a_codes = take(S * I);
  w.a_scales = take(S * (I / w4a8::kActBlock) * 4);
  w.total = off;
  return w;
}

std::string W4a8Config::to_string() const {
  return std::string("L1{") + kW4a8Tiles[l1].name + "} L2{" + kW4a8Tiles[l2].name + "}";
}

W4a8Config w4a8_heuristic(const MoeProblem& p, int64_t tokens) {
  // Slots per routed expert under uniform routing: up to 32 the narrow tile wastes less MMA; above,
  // the absorbing tile, whose 128-token items run the 128-token tile's loop and whose expert's
  // remainder of up to 32 slots costs no item (docs/perf/2026-11-29-h200-w4a8-v43.md). The
  // warp-specialized tiles are not faster than the one-warpgroup tiles on the H200 yet
  // (docs/perf/2026-11-29-h200-w4a8-v40.md), so the heuristic does not pick them.
  const double per_expert = static_cast<double>(tokens) * p.top_k / static_cast<double>(p.num_experts);
  const int tile = per_expert <= 32.0 ? kW4a8TileNarrow32 : kW4a8TileAbsorb160;
  return {tile, tile};
}

namespace {

std::string w4a8_tile_names() {
  std::string names;
  for (const W4a8Tile& t : kW4a8Tiles) names += (names.empty() ? "" : ", ") + std::string(t.name);
  return names;
}

int w4a8_named_tile(const char* field, const std::string& name) {
  for (int i = 0; i < static_cast<int>(std::size(kW4a8Tiles)); ++i) {
    if (name == kW4a8Tiles[i].name) return i;
  }
  MEGAMOE_FAIL(kInvalidArgument, "MoeTuning.", field, " = '", name, "' names no tile of precision w4a8; its tiles are ",
               w4a8_tile_names());
}

}  // namespace

W4a8Config w4a8_config(const MoeProblem& p, const MoeTuning& tuning, int64_t tokens) {
  W4a8Config cfg = w4a8_heuristic(p, tokens);
  if (tuning.l1_tile) cfg.l1 = w4a8_named_tile("l1_tile", *tuning.l1_tile);
  if (tuning.l2_tile) cfg.l2 = w4a8_named_tile("l2_tile", *tuning.l2_tile);
  return cfg;
}

W4a8Config w4a8_config(const MoePlan& plan, int64_t tokens) { return w4a8_config(plan.problem(), plan.tuning(), tokens); }

namespace {

// One GEMM kernel with its CTA size and dynamic shared memory; its occupancy, read once.
template <auto kKernel, int kCtaThreads, int kSmemBytes>
struct W4a8Kernel {
  static int blocks_per_sm() {
    static const int n = prepare_kernel(kKernel, kCtaThreads, kSmemBytes);
    return n;
  }
  static void launch(const k90::W4a8GemmParams& params, int num_sms, int64_t max_work, cudaStream_t stream) {
    const int64_t ctas = std::max<int64_t>(1, std::min<int64_t>(int64_t{num_sms} * blocks_per_sm(), max_work));
    launch_dependent(kKernel, static_cast<unsigned>(ctas), kCtaThreads, kSmemBytes, stream, params);
  }
};
template <bool kIsL1, int kBlockN, bool kOverlap = false>
using W4a8OneWarpgroup = W4a8Kernel<&k90::w4a8_grouped_gemm_kernel<kIsL1, kBlockN, kOverlap>,
                                    k90::detail::kW4a8Threads, k90::detail::kW4a8KernelSmem<kBlockN, kOverlap>>;
template <bool kIsL1, int kMTiles>
using W4a8WarpSpecialized = W4a8Kernel<&k90::w4a8_ws_gemm_kernel<kIsL1, kMTiles>, k90::detail::kW4a8WsThreads,
                                       k90::detail::W4a8WsLayout<kMTiles>::kAllocBytes>;

template <bool kIsL1>
void launch_gemm(int tile, const k90::W4a8GemmParams& params, int num_sms, int64_t max_work, cudaStream_t stream) {
  switch (tile) {
    case kW4a8TileNarrow32:
      return W4a8OneWarpgroup<kIsL1, 32, kW4a8Tiles[kW4a8TileNarrow32].overlapped>::launch(params, num_sms, max_work,
                                                                                          stream);
    case kW4a8TileSingle128:
      return W4a8OneWarpgroup<kIsL1, 128, kW4a8Tiles[kW4a8TileSingle128].overlapped>::launch(params, num_sms, max_work,
                                                                                            stream);
    case kW4a8TileTall128: return W4a8WarpSpecialized<kIsL1, 2>::launch(params, num_sms, max_work, stream);
    case kW4a8TileAbsorb160:
      return W4a8OneWarpgroup<kIsL1, 160, kW4a8Tiles[kW4a8TileAbsorb160].overlapped>::launch(params, num_sms, max_work,
                                                                                            stream);
    default: return W4a8WarpSpecialized<kIsL1, 1>::launch(params, num_sms, max_work, stream);
  }
}

// A plain launch (no programmatic serialization): it starts once the kernel before it has
// completed, so the next kernel's grid dependency wait covers that one too.
template <class T>
void launch_quantize(const T* x, int64_t rows, int64_t cols, uint8_t* codes, float* scales, int num_sms,
                     cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t blocks = rows * (cols / w4a8::kActBlock), per_cta = kThreads / 32;
  const int64_t ctas = std::max<int64_t>(1, std::min<int64_t>((blocks + per_cta - 1) / per_cta, int64_t{num_sms} * 16));
  w4a8::quantize_act_kernel<T><<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(x, rows, cols, codes, scales);
  gpu::check_cuda(cudaGetLastError(), "quantize_act_kernel launch");
}

// Upper bound of a GEMM's work items (sizes its grid): min(E', slots) experts hold tokens, each
// in items of tile_step slots but its last (the absorbing tile's may take more: never more items).
int64_t max_work_items(const PipelineRun& r, const W4a8Tile& tile, int64_t m_tiles) {
  const int64_t slots = r.tokens * r.slots_per_token, active = std::min(r.virtual_experts, slots);
  return m_tiles / tile.block_m_tiles * ((slots + active * (tile.tile_step - 1)) / tile.tile_step);
}

GemmSchedule schedule_of(const W4a8Tile& tile) { return {tile.block_m_tiles, tile.block_n, tile.tile_step, 1}; }

k90::W4a8GemmParams gemm_params(const PipelineRun& r, const Sm90PrepackedWeights& w, const k90::DispatchParams& d,
                                bool l1) {
  const MoeProblem& p = r.problem;
  const int64_t EV = r.virtual_experts;
  k90::W4a8GemmParams q{};
  k90::W4a16GemmParams& g = q.g;
  g.codes = l1 ? w.w13_codes : w.w2_codes;
  g.scales = l1 ? w.w13_scales : w.w2_scales;
  g.code_expert_stride = l1 ? w.w13_code_stride : w.w2_code_stride;
  g.scale_expert_stride = l1 ? w.w13_scale_stride : w.w2_scale_stride;
  g.m_tiles = l1 ? d.l1_m_tiles : d.l2_m_tiles;
  g.k_chunks = static_cast<int32_t>((l1 ? p.hidden_size : p.intermediate_size) / 64);
  g.k_splits = 1;
  g.k_chunks_per_split = g.k_chunks;
  g.expert_offsets = d.expert_offsets;
  g.tile_offsets = l1 ? d.l1_tile_offsets : d.l2_tile_offsets;
  g.work_counter = d.counters + (l1 ? kL1WorkCounter : kL2WorkCounter);
  g.num_experts = static_cast<int32_t>(EV);
  g.num_routed = d.num_experts;
  g.slot_token = d.slot_token;
  g.slot_weight = d.slot_weight;
  g.act_ld = p.intermediate_size;
  g.out_ld = p.hidden_size;
  g.swiglu_limit = p.swiglu_limit ? *p.swiglu_limit : std::numeric_limits<float>::infinity();
  if (l1) {
    g.s2_gate = w.w4a8_s2;
    g.s2_up = w.w4a8_s2 + EV;
  } else {
    g.s2_down = w.w4a8_s2 + 2 * EV;
    g.out_acc = p.deterministic ? nullptr : workspace_at<float>(r.args.workspace, r.layout.out_acc);
    g.y_slot = p.deterministic ? workspace_at<float>(r.args.workspace, r.layout.y_slot) : nullptr;
  }
  q.exponent_addends = w.w4a8_addends + (l1 ? 0 : EV);
  return q;
}

}  // namespace

void run_sm90_w4a8(const MoePlan& plan, const Sm90PrepackedWeights& w, const MoeRunArgs& args, cudaStream_t stream) {
  const MoeProblem& p = plan.problem();
  const int64_t T = args.tokens, H = p.hidden_size, I = p.intermediate_size;
  const W4a8WorkspaceLayout L = w4a8_workspace_layout(p);
  const PipelineRun r = PipelineRun::make(p, args, L.base, /*early_start=*/false);
  const W4a8Config cfg = w4a8_config(plan, T);
  const W4a8Tile &t1 = kW4a8Tiles[cfg.l1], &t2 = kW4a8Tiles[cfg.l2];
  const k90::DispatchParams d = dispatch_params(r, schedule_of(t1), schedule_of(t2));
  void* ws = args.workspace;
  if (!p.deterministic) {
    // L2 adds into the combine accumulator; the previous run's combine, its last reader, is
    // complete (stream order).
    gpu::check_cuda(cudaMemsetAsync(workspace_at<float>(ws, L.base.out_acc), 0, static_cast<size_t>(T * H) * 4, stream),
                    "cudaMemsetAsync(combine accumulator)");
  }
  launch_dispatch(d, T * p.top_k, stream);
  launch_quantize(reinterpret_cast<const __nv_bfloat16*>(args.hidden), T, H, workspace_at<uint8_t>(ws, L.x_codes),
                  workspace_at<float>(ws, L.x_scales), plan.num_sms(), stream);

  k90::W4a8GemmParams g1 = gemm_params(r, w, d, /*l1=*/true);
  g1.b_codes = workspace_at<uint8_t>(ws, L.x_codes);
  g1.b_scales = workspace_at<float>(ws, L.x_scales);
  g1.act_f32 = workspace_at<float>(ws, L.act_f32);
  launch_gemm<true>(cfg.l1, g1, plan.num_sms(), max_work_items(r, t1, d.l1_m_tiles), stream);

  // Every slot row up to the bound: rows past the routed slots (invalid ids) are never read.
  const int64_t slots = T * r.slots_per_token;
  launch_quantize(static_cast<const float*>(g1.act_f32), slots, I, workspace_at<uint8_t>(ws, L.a_codes),
                  workspace_at<float>(ws, L.a_scales), plan.num_sms(), stream);

  k90::W4a8GemmParams g2 = gemm_params(r, w, d, /*l1=*/false);
  g2.b_codes = workspace_at<uint8_t>(ws, L.a_codes);
  g2.b_scales = workspace_at<float>(ws, L.a_scales);
  launch_gemm<false>(cfg.l2, g2, plan.num_sms(), max_work_items(r, t2, d.l2_m_tiles), stream);
  launch_combine(combine_params(r, d), plan.num_sms(), stream);
}

void load_w4a8_kernels() {
  W4a8OneWarpgroup<true, 32, kW4a8Tiles[kW4a8TileNarrow32].overlapped>::blocks_per_sm();
  W4a8OneWarpgroup<false, 32, kW4a8Tiles[kW4a8TileNarrow32].overlapped>::blocks_per_sm();
  W4a8OneWarpgroup<true, 128, kW4a8Tiles[kW4a8TileSingle128].overlapped>::blocks_per_sm();
  W4a8OneWarpgroup<false, 128, kW4a8Tiles[kW4a8TileSingle128].overlapped>::blocks_per_sm();
  W4a8OneWarpgroup<true, 160, kW4a8Tiles[kW4a8TileAbsorb160].overlapped>::blocks_per_sm();
  W4a8OneWarpgroup<false, 160, kW4a8Tiles[kW4a8TileAbsorb160].overlapped>::blocks_per_sm();
  W4a8WarpSpecialized<true, 1>::blocks_per_sm();
  W4a8WarpSpecialized<false, 1>::blocks_per_sm();
  W4a8WarpSpecialized<true, 2>::blocks_per_sm();
  W4a8WarpSpecialized<false, 2>::blocks_per_sm();
  cudaFuncAttributes a{};
  gpu::check_cuda(cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(&w4a8::quantize_act_kernel<__nv_bfloat16>)),
                  "load quantize_act_kernel<bf16>");
  gpu::check_cuda(cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(&w4a8::quantize_act_kernel<float>)),
                  "load quantize_act_kernel<fp32>");
}

}  // namespace megamoe::runtime
