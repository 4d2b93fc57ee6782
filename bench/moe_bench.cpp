#include "bench/moe_bench.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <tuple>

#include <nlohmann/json.hpp>

#include "bench/bench_common.h"
#include "bench/l2_flush.h"
#include "bench/sm90_bf16_baseline.h"
#include "bench/sm_clock.h"
#include "backends/sm90_w4a16/sm90_w4a16_timeline.h"
#include "megamoe/checkpoint.h"
#include "megamoe/dtype.h"
#include "megamoe/format.h"
#include "megamoe/gpu.h"
#include "megamoe/presets.h"
#include "megamoe/reference.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "support/device_buffer.h"

namespace megamoe::bench {
namespace {

using support::DeviceBuffer;

// The parts of a run that draw random inputs. Each draws from its own generator, seeded by
// (seed, part, T) alone, so a timed point's tokens and routing are the same whatever else the run
// does: which other T it times, how many tokens it checks, whether the baseline (and its cosine
// check) runs. (Through docs/perf v26 one generator fed every part in turn, so the same point
// drew different inputs under different options: DeepSeek-V3 T=16 activated 105 experts in v23's
// runs and 98 in v26's.)
enum class InputPart : uint64_t { kAccuracy = 1, kCosine = 2, kPoint = 3 };

std::mt19937_64 input_rng(uint64_t seed, InputPart part, int64_t T) {
  return std::mt19937_64(splitmix64(splitmix64(splitmix64(seed ^ 0xBE7C) ^ static_cast<uint64_t>(part)) ^
                                    static_cast<uint64_t>(T)));
}

double cosine(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = bf16_to_f32(a[i]), y = bf16_to_f32(b[i]);
    ab += x * y;
    aa += x * x;
    bb += y * y;
  }
  return ab / std::sqrt(std::max(aa * bb, 1e-300));
}

// Copies a host fp32 matrix into device bf16 at `dst`.
void upload_bf16(const std::vector<float>& w, uint16_t* dst) {
  std::vector<uint16_t> h(w.size());
  for (size_t i = 0; i < w.size(); ++i) h[i] = f32_to_bf16(w[i]);
  check_cuda(cudaMemcpy(dst, h.data(), h.size() * 2, cudaMemcpyHostToDevice), "H2D weights");
}

// Dequantizes an NVFP4 linear on the GPU into rows [row0, row0 + out) of `dst` (row-major bf16).
void dequant_to(const Nvfp4Linear& lin, uint16_t* dst) {
  DeviceBuffer<uint8_t> codes(size_t(lin.out_features * lin.in_features / 2));
  DeviceBuffer<uint8_t> scales(size_t(lin.out_features * lin.in_features / 16));
  check_cuda(cudaMemcpy(codes.get(), lin.weight, codes.size(), cudaMemcpyHostToDevice), "H2D");
  check_cuda(cudaMemcpy(scales.get(), lin.weight_scale, scales.size(), cudaMemcpyHostToDevice), "H2D");
  gpu::dequantize_nvfp4(codes.get(), scales.get(), lin.weight_scale_2, lin.out_features, lin.in_features, dst, nullptr);
  check_cuda(cudaDeviceSynchronize(), "dequantize");
}

// A run's timeline events as JSON (bench/timeline_report.py reads them): times in ns from the
// earliest event's start.
nlohmann::json timeline_events_json(const std::vector<runtime::W4a16TimelineEvent>& events) {
  uint64_t t0 = UINT64_MAX;
  for (const auto& e : events) t0 = std::min(t0, e.start_ns);
  auto launch_name = [](int16_t launch) {
    return launch == runtime::kTimelineLaunchFused ? "fused" : launch == runtime::kTimelineLaunchL1 ? "l1" : "l2";
  };
  nlohmann::json out = nlohmann::json::array();
  for (const auto& e : events) {
    nlohmann::json j = {{"launch", launch_name(e.launch)}, {"sm", e.smid}, {"cta", e.block},
                        {"start_ns", e.start_ns - t0}, {"end_ns", e.end_ns - t0}, {"cycles", e.cycles}};
    if (e.kind == runtime::kTimelineCta) {
      j["kind"] = "cta";
      j["items"] = e.item;
    } else {
      j["kind"] = e.kind == runtime::kTimelineL1Item ? "l1" : "l2";
      j["wait_ns"] = e.wait_ns - t0;
      j["item"] = e.item;
      j["expert"] = e.expert;
      j["m_block"] = e.m_block;
      j["k_split"] = e.k_split;
      j["slots"] = e.slots;
      j["k_chunks"] = e.k_chunks;
      j["rows"] = e.rows;
      j["weight_bytes"] = static_cast<int64_t>(format::kNvfp4BytesPerWeight * e.rows * e.k_chunks * 64);
    }
    out.push_back(std::move(j));
  }
  return out;
}

}  // namespace

int run_bench(const BenchOptions& opt) {
  MEGAMOE_CHECK(opt.replays >= 20, kInvalidArgument, "bench: --replays = ", opt.replays, " must be >= 20");
  MEGAMOE_CHECK(opt.warm_ms >= 0 && opt.warm_ms <= 60000, kInvalidArgument, "bench: --warm-ms = ", opt.warm_ms,
                " must be in 0..60000");
  MEGAMOE_CHECK(opt.check_tokens >= 1 && opt.check_tokens <= 64, kInvalidArgument, "bench: --check-tokens = ",
                opt.check_tokens, " must be in 1..64 (every timed point is checked against the CPU reference)");
  MEGAMOE_CHECK(!opt.tokens.empty(), kInvalidArgument, "bench: the token list is empty");
  for (int64_t t : opt.tokens) {
    MEGAMOE_CHECK(t >= 1 && t <= 65536, kInvalidArgument, "bench: token count ", t, " must be in 1..65536");
  }
  MEGAMOE_CHECK(opt.checkpoint.empty() || (opt.num_experts == 0 && opt.shared_experts == -1), kInvalidArgument,
                "bench: --num-experts and --shared-experts shape a synthesized layer; with --checkpoint the "
                "layer is the checkpoint's (drop them, or use --preset to synthesize)");
  const L2FlushMode flush_mode = parse_l2_flush_mode(opt.flush);
  MEGAMOE_CHECK(opt.timeline.empty() || runtime::w4a16_timeline_built(), kUnsupported, "bench --timeline: ",
                runtime::kW4a16TimelineNotBuilt);
  MEGAMOE_CHECK(gpu::device_count() > 0, kUnsupported, "bench: no CUDA device found; the benchmark needs a Hopper GPU");
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  // The SM clock during each point's timed replays (sm_clock.h), where NVML is available.
  std::string no_clock;
  const std::unique_ptr<SmClockSampler> sm_clock = SmClockSampler::open(0, &no_clock);
  if (!sm_clock) std::fprintf(stderr, "bench: no SM clock readings (%s)\n", no_clock.c_str());
  const auto t_start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count(); };

  // ---- ceilings of this device, measured now
  const double copy_tbps = measure_copy_tbps(stream, opt.warm_ms);
  const double mma_tflops = measure_bf16_tflops(stream, opt.warm_ms);
  // The precision timed beside W4A16 (none when it is w4a16 itself).
  const Precision other = parse_precision(opt.precision);
  const bool beside = other != Precision::kW4a16;
  const double fp8_tflops = beside ? measure_fp8_tflops(stream, opt.warm_ms) : 0.0;
  std::fprintf(stderr, "bench: %s, %d SMs: copy %.2f TB/s, bf16 GEMM %.0f TFLOP/s%s [%.0fs]\n", prop.name,
               prop.multiProcessorCount, copy_tbps, mma_tflops,
               beside ? (", fp8 GEMM " + std::to_string(static_cast<int>(fp8_tflops + 0.5)) + " TFLOP/s").c_str() : "",
               elapsed());

  // ---- the layer: a synthesized checkpoint (or the caller's), loaded like any other
  std::string ckpt_dir = opt.checkpoint;
  uint64_t seed = opt.seed;
  bool synthesized = false;
  if (ckpt_dir.empty()) {
    SynthOptions so;
    so.seed = seed;
    so.num_experts = opt.num_experts;
    so.shared_experts = opt.shared_experts;
    so.progress = true;
    ckpt_dir = synthesize_bench_checkpoint(opt.preset, opt.work_dir, so);
    synthesized = true;
    std::fprintf(stderr, "bench: synthesized %s in %s [%.0fs]\n", find_preset(opt.preset).name.c_str(),
                 ckpt_dir.c_str(), elapsed());
  }
  const Checkpoint ckpt = Checkpoint::open(ckpt_dir);
  const ModelConfig config = load_model_config(ckpt_dir);
  const int64_t layer_index = bench_layer_index(config, opt.layer);
  const MoeLayer layer = load_moe_layer(ckpt, config, layer_index);
  const int64_t H = layer.hidden_size, I = layer.intermediate_size, E = layer.num_experts;
  const int k = layer.routing.top_k;
  const int64_t shared_I = layer.shared_expert ? layer.shared_expert->intermediate_size() : 0;
  const std::string prefix = moe_prefix(layer_index);

  const int64_t max_T = *std::max_element(opt.tokens.begin(), opt.tokens.end());
  MoeProblem problem = MoeProblem::from_layer(layer, std::max<int64_t>(max_T, 64));
  problem.deterministic = opt.deterministic;
  MoeTuning tuning;
  tuning.fused = opt.fused;
  tuning.early_start = opt.early_start;
  tuning.absorbing_tile = opt.absorbing_tile;
  tuning.l1_k_splits = opt.l1_k_splits;
  tuning.fused_ctas_per_sm = opt.fused_ctas_per_sm;
  tuning.l1_tile = opt.l1_tile;
  tuning.l2_tile = opt.l2_tile;
  const MoePlan plan = MoePlan::create(problem, tuning);
  // An override that cannot run at some T (MoeTuning: MoePlan::describe(T) throws) skips that timed
  // point with its reason instead of ending the run; the untimed checks (accuracy line, cosine) run
  // on the heuristic's own plan there.
  const MoePlan heuristic_plan = MoePlan::create(problem);
  auto tuning_error = [&](int64_t T) -> std::string {
    try {
      (void)plan.describe(T);
      return {};
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kInvalidArgument) throw;  // not an override it rejects: a real failure
      return e.what();
    }
  };
  auto plan_for_check = [&](int64_t T) -> const MoePlan& {
    const std::string why = tuning_error(T);
    if (why.empty()) return plan;
    std::fprintf(stderr, "bench: the tuning does not apply at T=%lld (%s): the check at T=%lld runs the heuristic's configuration\n",
                 (long long)T, why.c_str(), (long long)T);
    return heuristic_plan;
  };
  std::optional<MoePlan> other_plan;
  if (beside) {
    MoeProblem p = problem;
    p.precision = other;
    MoeTuning other_tuning;
    other_tuning.l1_tile = opt.w4a8_l1_tile;
    other_tuning.l2_tile = opt.w4a8_l2_tile;
    other_plan = MoePlan::create(p, other_tuning);
  }
  const MoeDeviceWeights weights = MoeDeviceWeights::upload(layer, stream);
  DeviceBuffer<uint8_t> workspace(std::max(plan.workspace_bytes(), beside ? other_plan->workspace_bytes() : 0));
  std::fprintf(stderr, "bench: layer %lld: H=%lld I=%lld E=%lld top-%d shared I=%lld; NVFP4 weights %.2f GB on device, workspace %.2f GB [%.0fs]\n",
               (long long)layer_index, (long long)H, (long long)I, (long long)E, k, (long long)shared_I,
               weights.device_bytes() / 1e9, workspace.size() / 1e9, elapsed());

  auto run_ours = [&](const MoePlan& with, const uint16_t* x, const int32_t* ids, const float* w, int64_t T,
                      uint16_t* out) {
    MoeRunArgs a{x, ids, w, T, out, workspace.get()};
    run(with, weights, a, stream);
  };

  int status = 0;
  nlohmann::json report;

  // ---- accuracy: against the CPU reference on a few tokens
  {
    const int64_t T = opt.check_tokens;
    std::mt19937_64 rng = input_rng(seed, InputPart::kAccuracy, T);
    const auto x = random_hidden(rng, T, H);
    const auto topk = uniform_topk(rng, T, E, k);
    DeviceBuffer<uint16_t> dx(x.size()), dout(x.size());
    DeviceBuffer<int32_t> dids(topk.ids.size());
    DeviceBuffer<float> dw(topk.weights.size());
    dx.upload(x);
    dids.upload(topk.ids);
    dw.upload(topk.weights);
    // One eager run of `with` (output poisoned first) against the reference of the precision it
    // resolves to at T.
    auto check = [&](const MoePlan& with, bool w4a8) {
      check_cuda(cudaMemset(dout.get(), 0xFF, dout.size() * 2), "poison");
      run_ours(with, dx.get(), dids.get(), dw.get(), T, dout.get());
      check_cuda(cudaStreamSynchronize(stream), "run");
      int64_t bad = 0;
      const double err = reference_rel_l2(layer, x, topk, dout.download(), spread_rows(T, T), &bad, w4a8);
      const bool ok = err <= (w4a8 ? kMaxW4a8RelL2 : kMaxRelL2) && bad == 0;
      status |= ok ? 0 : 1;
      return std::tuple{err, bad, ok};
    };
    const auto [err, bad, ok] = check(plan_for_check(T), false);
    std::printf("accuracy vs CPU reference (T=%lld): rel L2 %.3g, non-finite %lld: %s\n", (long long)T, err,
                (long long)bad, ok ? "PASS" : "FAIL");
    report["accuracy"] = {{"tokens", T}, {"rel_l2", err}, {"non_finite", bad}, {"pass", ok}};
    if (beside) {
      const bool w4a8 = other_plan->resolved_precision(T) == Precision::kW4a8;
      const auto [err2, bad2, ok2] = check(*other_plan, w4a8);
      std::printf("accuracy of %s vs the CPU %s (T=%lld): rel L2 %.3g (allowed %.0e), non-finite %lld: %s\n",
                  opt.precision.c_str(), w4a8 ? "W4A8 emulation" : "reference", (long long)T, err2,
                  w4a8 ? kMaxW4a8RelL2 : kMaxRelL2, (long long)bad2, ok2 ? "PASS" : "FAIL");
      report[opt.precision]["accuracy"] = {{"tokens", T}, {"rel_l2", err2}, {"non_finite", bad2}, {"pass", ok2}};
    }
  }

  // ---- bf16 baseline weights: the unquantized originals first (cosine), then the dequantized
  std::unique_ptr<Bf16BaselineMoe> base;
  if (opt.baseline) {
    base = std::make_unique<Bf16BaselineMoe>(H, I, E, shared_I, layer.swiglu_limit);
    const int64_t ev = E + (shared_I > 0 ? 1 : 0);
    auto expert_name = [&](int64_t e) {
      return e < E ? prefix + ".experts." + std::to_string(e) : prefix + ".shared_experts";
    };
    if (synthesized) {
      // Regenerate the unquantized weights (a pure function of seed and name) in parallel.
      const int threads = int(std::max(1u, std::thread::hardware_concurrency()));
      for (int64_t first = 0; first < ev; first += threads) {
        const int64_t n = std::min<int64_t>(threads, ev - first);
        std::vector<std::vector<float>> g(n), u(n), d(n);
        std::vector<std::thread> pool;
        for (int64_t i = 0; i < n; ++i) {
          pool.emplace_back([&, i] {
            const int64_t e = first + i, ie = base->expert_intermediate(e);
            g[i] = synth_weight(seed, expert_name(e) + ".gate_proj.weight", ie, H);
            u[i] = synth_weight(seed, expert_name(e) + ".up_proj.weight", ie, H);
            d[i] = synth_weight(seed, expert_name(e) + ".down_proj.weight", H, ie);
          });
        }
        for (auto& th : pool) th.join();
        for (int64_t i = 0; i < n; ++i) {
          const int64_t e = first + i, ie = base->expert_intermediate(e);
          upload_bf16(g[i], base->w13(e));
          upload_bf16(u[i], base->w13(e) + ie * H);
          upload_bf16(d[i], base->w2(e));
        }
      }
      const int64_t T = 64;
      std::mt19937_64 rng = input_rng(seed, InputPart::kCosine, T);
      const auto x = random_hidden(rng, T, H);
      const auto topk = uniform_topk(rng, T, E, k);
      DeviceBuffer<uint16_t> dx(x.size()), d_ours(x.size()), d_base(x.size());
      DeviceBuffer<int32_t> dids(topk.ids.size());
      DeviceBuffer<float> dw(topk.weights.size());
      dx.upload(x);
      dids.upload(topk.ids);
      dw.upload(topk.weights);
      run_ours(plan_for_check(T), dx.get(), dids.get(), dw.get(), T, d_ours.get());
      base->set_routing(topk);
      base->run(dx.get(), d_base.get(), stream);
      check_cuda(cudaStreamSynchronize(stream), "cosine runs");
      const std::vector<uint16_t> ours_out = d_ours.download(), base_out = d_base.download();
      const double cos = cosine(ours_out, base_out);
      std::printf("cosine similarity vs the unquantized bf16 layer (T=%lld): %.6f\n", (long long)T, cos);
      report["cosine_vs_unquantized"] = cos;
      if (beside) {
        // docs/w4a8.md §7's table on the GPU: the other precision against the unquantized layer
        // and against the exact W4A16 output.
        run_ours(*other_plan, dx.get(), dids.get(), dw.get(), T, d_ours.get());
        check_cuda(cudaStreamSynchronize(stream), "cosine run");
        const std::vector<uint16_t> other_out = d_ours.download();
        std::vector<float> exact(ours_out.size());
        for (size_t i = 0; i < exact.size(); ++i) exact[i] = bf16_to_f32(ours_out[i]);
        int64_t bad = 0;
        const double cos2 = cosine(other_out, base_out), vs_exact = rel_l2(other_out, exact, &bad);
        std::printf("%s: cosine vs the unquantized bf16 layer %.6f, rel L2 vs the W4A16 output %.4f (T=%lld)\n",
                    opt.precision.c_str(), cos2, vs_exact, (long long)T);
        report[opt.precision]["cosine_vs_unquantized"] = cos2;
        report[opt.precision]["rel_l2_vs_w4a16"] = vs_exact;
      }
    }
    for (int64_t e = 0; e < ev; ++e) {
      const ExpertWeights& ex = e < E ? layer.experts[size_t(e)] : *layer.shared_expert;
      const int64_t ie = base->expert_intermediate(e);
      dequant_to(ex.gate, base->w13(e));
      dequant_to(ex.up, base->w13(e) + ie * H);
      dequant_to(ex.down, base->w2(e));
    }
    std::fprintf(stderr, "bench: bf16 baseline ready [%.0fs]\n", elapsed());
  }

  // ---- timing
  const L2Flush flush(flush_mode, size_t(prop.l2CacheSize));
  std::printf("\n%s, %d SMs; copy %.2f TB/s, bf16 %.0f TFLOP/s (measured now). Layer H=%lld I=%lld E=%lld top-%d%s, %s; "
              "%s L2 flush; %s\n",
              prop.name, prop.multiProcessorCount, copy_tbps, mma_tflops, (long long)H, (long long)I, (long long)E, k,
              shared_I ? " +shared" : "", opt.deterministic ? "deterministic" : "atomic combine", to_string(flush.mode()),
              opt.warm_ms > 0 ? ("each timing after " + std::to_string(opt.warm_ms) + " ms of untimed load").c_str()
                              : "timed without warm-up load");
  std::printf("%7s %7s %10s %10s %8s %9s %9s %12s %8s %9s %7s", "T", "active", "floor_us", "us", "%floor", "TFLOP/s",
              "GB/s", "bf16_us", "speedup", "rel_err", "sm_MHz");
  if (beside) {
    std::printf(" %8s %10s %10s %8s %9s %9s", "prec", "floor_us", "us", "%floor", "vs_w4a16", "rel_err");
  }
  std::printf("\n");
  report["device"] = prop.name;
  report["copy_tbps"] = copy_tbps;
  report["bf16_tflops"] = mma_tflops;
  if (beside) report["fp8_tflops"] = fp8_tflops;
  report["l2_flush"] = to_string(flush.mode());
  report["warm_ms"] = opt.warm_ms;
  report["layer"] = {{"H", H}, {"I", I}, {"E", E}, {"top_k", k}, {"shared_I", shared_I}, {"preset", opt.checkpoint.empty() ? opt.preset : ckpt_dir}};
  report["points"] = nlohmann::json::array();
  // --timeline: one more run per point, recorded (sm90_w4a16_timeline.h).
  std::unique_ptr<runtime::W4a16TimelineRecorder> recorder;
  nlohmann::json timeline;
  if (!opt.timeline.empty()) {
    recorder = std::make_unique<runtime::W4a16TimelineRecorder>();
    timeline = {{"device", prop.name}, {"sms", prop.multiProcessorCount}, {"layer", report["layer"]},
                {"l2_flush", report["l2_flush"]}, {"points", nlohmann::json::array()}};
  }
  for (int64_t T : opt.tokens) {
    if (const std::string why = tuning_error(T); !why.empty()) {
      std::printf("%7lld skipped: %s\n", (long long)T, why.c_str());
      std::fflush(stdout);
      report["points"].push_back({{"tokens", T}, {"skipped", why}});
      if (recorder) timeline["points"].push_back({{"tokens", T}, {"skipped", why}});
      continue;
    }
    std::mt19937_64 rng = input_rng(seed, InputPart::kPoint, T);
    const auto x = random_hidden(rng, T, H);
    const auto topk = uniform_topk(rng, T, E, k);
    const int64_t active = int64_t(std::set<int32_t>(topk.ids.begin(), topk.ids.end()).size());
    const double weights_bytes = format::kNvfp4BytesPerWeight * 3.0 * H * (double(active) * I + double(shared_I));
    const double flops = 2.0 * 3.0 * H * double(T) * (double(k) * I + double(shared_I));
    const double floor_us = std::max(weights_bytes / (copy_tbps * 1e12), flops / (mma_tflops * 1e12)) * 1e6;
    DeviceBuffer<uint16_t> dx(x.size()), dout(x.size());
    DeviceBuffer<int32_t> dids(topk.ids.size());
    DeviceBuffer<float> dw(topk.weights.size());
    dx.upload(x);
    dids.upload(topk.ids);
    dw.upload(topk.weights);
    // One plan at this point: a warm-up run outside capture, the graph's replays timed after an L2
    // flush each (the SM clock sampled where asked), then the timed graph's own output: poisoned,
    // replayed once, downloaded.
    struct Timed {
      double us;
      SmClockStats clock;
      std::vector<uint16_t> got;
    };
    auto time_plan = [&](const MoePlan& with, bool sample_clock) {
      run_ours(with, dx.get(), dids.get(), dw.get(), T, dout.get());
      check_cuda(cudaStreamSynchronize(stream), "warm-up");
      const Graph g(stream, [&] { run_ours(with, dx.get(), dids.get(), dw.get(), T, dout.get()); });
      run_untimed_for([&] { g.launch(stream); }, stream, &flush, opt.warm_ms);
      Timed r{};
      if (sample_clock && sm_clock) sm_clock->start();
      r.us = event_median_us([&] { g.launch(stream); }, opt.replays, 2, stream, &flush, 0);
      if (sample_clock && sm_clock) r.clock = sm_clock->stop();
      check_cuda(cudaMemsetAsync(dout.get(), 0xFF, dout.size() * 2, stream), "poison");
      g.launch(stream);
      check_cuda(cudaStreamSynchronize(stream), "checked replay");
      r.got = dout.download();
      return r;
    };
    // Every value finite and check_tokens rows spread over [0, T) against the CPU reference (the
    // W4A8 emulation where the plan runs W4A8) on the same inputs.
    const std::vector<int64_t> rows = spread_rows(T, opt.check_tokens);
    struct Checked {
      double err;
      int64_t nonfinite;
      bool ok;
    };
    auto check = [&](const std::vector<uint16_t>& got, bool w4a8) {
      int64_t rows_nonfinite = 0;  // a part of nonfinite, which counts the whole output
      const int64_t nonfinite = count_nonfinite(got);
      const double err = reference_rel_l2(layer, x, topk, got, rows, &rows_nonfinite, w4a8);
      const bool ok = nonfinite == 0 && err <= (w4a8 ? kMaxW4a8RelL2 : kMaxRelL2);
      status |= ok ? 0 : 1;
      return Checked{err, nonfinite, ok};
    };
    const Timed ours = time_plan(plan, /*sample_clock=*/true);
    const double us = ours.us;
    const SmClockStats& clock = ours.clock;
    double base_us = 0;
    if (base) {
      base->set_routing(topk);
      DeviceBuffer<uint16_t> bout(x.size());
      base->run(dx.get(), bout.get(), stream);
      check_cuda(cudaStreamSynchronize(stream), "baseline warm-up");
      const Graph g(stream, [&] { base->run(dx.get(), bout.get(), stream); });
      base_us = event_median_us([&] { g.launch(stream); }, opt.replays, 2, stream, &flush, opt.warm_ms);
    }
    const auto [check_err, nonfinite, check_ok] = check(ours.got, false);
    const double pct = 100.0 * floor_us / us;
    // sm_MHz: the mean SM clock over our timed replays ("-": no reading).
    const std::string mhz = clock.samples > 0 ? std::to_string(static_cast<int>(clock.mean_mhz + 0.5)) : "-";
    std::printf("%7lld %7lld %10.1f %10.1f %7.1f%% %9.1f %9.0f %12.1f %7.2fx %9.2e %7s%s", (long long)T,
                (long long)active, floor_us, us, pct, flops / us * 1e-6, weights_bytes / us * 1e-3, base_us,
                base_us > 0 ? base_us / us : 0.0, check_err, mhz.c_str(), check_ok ? "" : " FAIL");
    nlohmann::json other_point;
    if (beside) {
      // The same inputs through the other plan, graph-replayed after the same flush; its floor
      // takes the fp8 GEMM rate where the point runs W4A8.
      const Precision ran = other_plan->resolved_precision(T);
      const bool w4a8 = ran == Precision::kW4a8;
      const double other_floor =
          std::max(weights_bytes / (copy_tbps * 1e12), flops / ((w4a8 ? fp8_tflops : mma_tflops) * 1e12)) * 1e6;
      const Timed other = time_plan(*other_plan, /*sample_clock=*/false);
      const double other_us = other.us;
      const auto [other_err, other_nonfinite, other_ok] = check(other.got, w4a8);
      std::printf(" %8s %10.1f %10.1f %7.1f%% %8.2fx %9.2e%s", precision_name(ran), other_floor, other_us,
                  100.0 * other_floor / other_us, us / other_us, other_err, other_ok ? "" : " FAIL");
      other_point = {{"precision", precision_name(ran)}, {"floor_us", other_floor}, {"us", other_us},
                     {"pct_floor", 100.0 * other_floor / other_us}, {"speedup_vs_w4a16", us / other_us},
                     {"config", other_plan->describe(T)}, {"check_rel_l2", other_err},
                     {"check_non_finite", other_nonfinite}, {"check_pass", other_ok}};
    }
    std::printf("\n");
    if (!check_ok) {
      std::printf("        T=%lld: %lld non-finite outputs, rel L2 %.3g on %lld checked tokens (allowed %.0e)\n",
                  (long long)T, (long long)nonfinite, check_err, (long long)rows.size(), kMaxRelL2);
    }
    std::fflush(stdout);
    report["points"].push_back({{"tokens", T}, {"active_experts", active}, {"floor_us", floor_us}, {"us", us},
                                {"pct_floor", pct}, {"tflops", flops / us * 1e-6}, {"weight_gbps", weights_bytes / us * 1e-3},
                                {"bf16_us", base_us}, {"config", plan.describe(T)}, {"check_rel_l2", check_err},
                                {"check_non_finite", nonfinite}, {"check_pass", check_ok},
                                {"inputs_fnv1a", hex64(inputs_fingerprint(x, topk))}});
    if (beside) report["points"].back()[opt.precision] = other_point;
    if (clock.samples > 0) {
      report["points"].back()["sm_clock"] = {{"mean_mhz", clock.mean_mhz}, {"min_mhz", clock.min_mhz},
                                             {"power_capped_share", clock.power_capped}, {"samples", clock.samples}};
    }
    if (recorder) {
      // Eager, after a flush as each timed replay; the SM clock is the timed replays' (one run is
      // shorter than a sample), and the events' cycles give the clock the run itself saw.
      recorder->start();
      flush.run(stream, 0);
      run_ours(plan, dx.get(), dids.get(), dw.get(), T, dout.get());
      timeline["points"].push_back({{"tokens", T}, {"config", plan.describe(T)}, {"us", us},
                                    {"sm_clock_mhz", clock.samples > 0 ? nlohmann::json(clock.mean_mhz) : nlohmann::json()},
                                    {"events", timeline_events_json(recorder->stop())}});
    }
  }
  if (!opt.json.empty()) {
    std::ofstream f(opt.json);
    MEGAMOE_CHECK(f.good(), kIo, "bench: cannot write '", opt.json, "'");
    f << report.dump(2) << "\n";
  }
  if (recorder) {
    std::ofstream f(opt.timeline);
    MEGAMOE_CHECK(f.good(), kIo, "bench: cannot write '", opt.timeline, "'");
    f << timeline.dump() << "\n";
  }
  cudaStreamDestroy(stream);
  return status;
}

}  // namespace megamoe::bench
