// `megamoe bench --ep-loopback N` (ep_loopback_bench.h).
#include "bench/ep_loopback_bench.h"

#if MEGAMOE_HAS_EP

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_common.h"
#include "bench/l2_flush.h"
#include "bench/stream_hold.h"
#include "megamoe/checkpoint.h"
#include "megamoe/ep.h"
#include "megamoe/gpu.h"
#include "megamoe/presets.h"
#include "megamoe/reference.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "support/device_buffer.h"

namespace megamoe::bench {
namespace {

using support::DeviceBuffer;

struct RankInputs {
  int64_t tokens = 0;
  std::vector<uint16_t> hidden;
  reference::TopK topk;
  std::unique_ptr<DeviceBuffer<uint16_t>> d_hidden, d_out;
  std::unique_ptr<DeviceBuffer<int32_t>> d_ids;
  std::unique_ptr<DeviceBuffer<float>> d_w;
  MoeRunArgs args() const {
    MoeRunArgs a{};
    a.tokens = tokens;
    if (tokens > 0) {
      a.hidden = d_hidden->get();
      a.topk_ids = d_ids->get();
      a.topk_weights = d_w->get();
      a.output = d_out->get();
    }
    return a;
  }
};

float elapsed_us(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  check_cuda(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  return 1000.0f * ms;
}

}  // namespace

int run_ep_loopback_bench(const EpBenchOptions& opt) {
  validate_ep_bench_options(opt);
  MEGAMOE_CHECK(gpu::device_count() > 0, kUnsupported, "megamoe bench --ep-loopback: no CUDA device found");
  const int R = opt.world_size;
  check_cuda(cudaSetDevice(0), "cudaSetDevice");
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");

  // ---- the layer: a synthesized checkpoint (or the caller's), loaded like any other
  std::string ckpt_dir = opt.checkpoint;
  if (ckpt_dir.empty()) {
    SynthOptions so;
    so.seed = opt.seed;
    so.num_experts = opt.num_experts;
    so.shared_experts = opt.shared_experts;
    so.progress = true;
    ckpt_dir = synthesize_bench_checkpoint(opt.preset, opt.work_dir, so);
  }
  const Checkpoint ckpt = Checkpoint::open(ckpt_dir);
  const ModelConfig config = load_model_config(ckpt_dir);
  const int64_t layer_index = bench_layer_index(config, opt.layer);
  const MoeLayer layer = load_moe_layer(ckpt, config, layer_index);
  const int64_t H = layer.hidden_size, E = layer.num_experts;
  const int k = layer.routing.top_k;

  const EpLoopback loopback = EpLoopback::create(R, 0);
  EpConfig cfg;
  cfg.world_size = R;
  cfg.max_tokens_per_rank = ep_max_tokens_per_rank(opt);
  cfg.timeout_seconds = opt.ep_timeout;
  cfg.early_start = opt.early_start;
  std::vector<MoeEpLayer> ranks;
  size_t bytes_per_rank = 0;
  for (int r = 0; r < R; ++r) {
    cfg.rank = r;
    ranks.push_back(MoeEpLayer::create(ep_local_layer(layer, ep_expert_range(E, R, r)), E, cfg, loopback,
                                       opt.deterministic));
    bytes_per_rank = std::max(bytes_per_rank, ranks.back().device_bytes() + ranks.back().group().device_bytes());
  }
  std::fprintf(stderr, "bench --ep-loopback %d: %s, %d virtual ranks of %d SMs, max %lld tokens per rank, %.2f GB "
               "per rank\n", R, prop.name, R, loopback.sms_per_rank(), (long long)cfg.max_tokens_per_rank,
               bytes_per_rank / 1e9);

  const L2Flush flush(parse_l2_flush_mode(opt.flush), static_cast<size_t>(prop.l2CacheSize));
  cudaStream_t kick = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&kick, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaEvent_t release = nullptr;
  check_cuda(cudaEventCreate(&release), "cudaEventCreate");
  std::vector<cudaEvent_t> ends(R);
  std::vector<MoeEpLayer::StageEvents> stages(R);
  for (int r = 0; r < R; ++r) {
    check_cuda(cudaEventCreate(&ends[r]), "cudaEventCreate");
    for (cudaEvent_t* e : {&stages[r].start, &stages[r].sent, &stages[r].computed, &stages[r].done}) {
      check_cuda(cudaEventCreate(e), "cudaEventCreate");
    }
  }

  // Long enough for the host to enqueue every rank's run behind the release (eager runs launch
  // about ten kernels each).
  const uint64_t hold_ns = uint64_t{100000} * static_cast<uint64_t>(R);
  // Flushes the L2, then queues every rank's work (`enqueue(r)` on its stream) behind one event
  // that the held `kick` stream records: the ranks start together.
  auto released_together = [&](int round, auto&& enqueue) {
    flush.run(kick, round);
    hold_stream(kick, hold_ns);
    check_cuda(cudaEventRecord(release, kick), "cudaEventRecord");
    for (int r = 0; r < R; ++r) {
      check_cuda(cudaStreamWaitEvent(loopback.stream(r), release, 0), "cudaStreamWaitEvent");
      enqueue(r);
    }
  };
  bool all_pass = true;
  nlohmann::json points = nlohmann::json::array();
  std::printf("\n## megamoe bench --ep-loopback %d: %s layer %lld (H=%lld, E=%lld, top_k=%d), %s, %d SMs per "
              "virtual rank\n", R, opt.checkpoint.empty() ? opt.preset.c_str() : ckpt_dir.c_str(),
              (long long)layer_index, (long long)H, (long long)E, k, prop.name, loopback.sms_per_rank());
  std::printf("(SM partitions of one GPU exchanging through its memory: not a multi-GPU figure)\n\n");
  std::printf("| T/rank | layer µs | eager µs | send µs | local (wait + experts) µs | return + combine (wait + sum) µs | exchange share | "
              "rel L2 | check |\n|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
  for (const int64_t T : opt.tokens_per_rank) {
    std::vector<RankInputs> in(R);
    for (int r = 0; r < R; ++r) {
      std::mt19937_64 rng(splitmix64(splitmix64(opt.seed ^ 0x100B) ^ static_cast<uint64_t>(T) * 131 ^
                                     static_cast<uint64_t>(r)));
      RankInputs& x = in[r];
      x.tokens = T;
      x.hidden = random_hidden(rng, T, H);
      x.topk = uniform_topk(rng, T, E, k);
      x.d_hidden = std::make_unique<DeviceBuffer<uint16_t>>(x.hidden);
      x.d_ids = std::make_unique<DeviceBuffer<int32_t>>(x.topk.ids);
      x.d_w = std::make_unique<DeviceBuffer<float>>(x.topk.weights);
      x.d_out = std::make_unique<DeviceBuffer<uint16_t>>(static_cast<size_t>(T * H));
      x.d_out->poison();
    }
    check_cuda(cudaDeviceSynchronize(), "inputs");  // the ranks' streams do not wait for the null stream

    // Eager runs with stage events, released together as the replays below: the stages of the
    // slowest rank (by its whole run), medians.
    std::vector<double> eager, send, local, combine;
    for (int it = 0; it < opt.iters + 3; ++it) {
      released_together(it, [&](int r) { ranks[r].run(in[r].args(), loopback.stream(r), stages[r]); });
      for (int r = 0; r < R; ++r) ranks[r].check(loopback.stream(r));
      if (it < 3) continue;
      int slowest = 0;
      float slowest_us = -1;
      for (int r = 0; r < R; ++r) {
        const float us = elapsed_us(stages[r].start, stages[r].done);
        if (us > slowest_us) slowest_us = us, slowest = r;
      }
      const MoeEpLayer::StageEvents& s = stages[slowest];
      eager.push_back(slowest_us);
      send.push_back(elapsed_us(s.start, s.sent));
      local.push_back(elapsed_us(s.sent, s.computed));
      combine.push_back(elapsed_us(s.computed, s.done));
    }

    // The check: every rank's output of the last eager run, check_tokens rows each.
    double worst = 0;
    int64_t nonfinite_total = 0;
    for (int r = 0; r < R; ++r) {
      const std::vector<uint16_t> got = in[r].d_out->download();
      int64_t nonfinite = 0;
      worst = std::max(worst, reference_rel_l2(layer, in[r].hidden, in[r].topk, got,
                                               spread_rows(T, std::min<int64_t>(T, opt.check_tokens)), &nonfinite));
      nonfinite_total += nonfinite;
    }
    const bool pass = nonfinite_total == 0 && worst <= kEpMaxRelL2;
    all_pass = all_pass && pass;

    // Graph replays: every rank's graph waits for the release, recorded on `kick` after the hold;
    // the time is release → the last rank's end.
    std::vector<std::unique_ptr<Graph>> graphs;
    for (int r = 0; r < R; ++r) {
      graphs.push_back(std::make_unique<Graph>(loopback.stream(r), [&] { ranks[r].run(in[r].args(), loopback.stream(r)); }));
    }
    std::vector<double> layer_us;
    for (int it = 0; it < opt.iters + 3; ++it) {
      released_together(it, [&](int r) {
        graphs[r]->launch(loopback.stream(r));
        check_cuda(cudaEventRecord(ends[r], loopback.stream(r)), "cudaEventRecord");
      });
      double us = 0;
      for (int r = 0; r < R; ++r) {
        check_cuda(cudaEventSynchronize(ends[r]), "replay");
        us = std::max<double>(us, elapsed_us(release, ends[r]));
      }
      if (it >= 3) layer_us.push_back(us);
    }
    for (int r = 0; r < R; ++r) ranks[r].check(loopback.stream(r));

    const double d = median(send), l = median(local), c = median(combine), e = median(eager);
    const double share = (d + c) / std::max(1e-9, d + l + c);
    std::printf("| %lld | %.1f | %.1f | %.1f | %.1f | %.1f | %.0f%% | %.2e | %s |\n", (long long)T,
                median(layer_us), e, d, l, c, 100.0 * share, worst, pass ? "pass" : "FAIL");
    std::fflush(stdout);
    points.push_back({{"tokens_per_rank", T}, {"layer_us", median(layer_us)}, {"eager_us", e}, {"send_us", d},
                      {"local_us", l}, {"return_combine_us", c}, {"exchange_share", share},
                      {"rel_l2", worst}, {"pass", pass}});
  }
  if (!opt.json.empty()) {
    nlohmann::json report = {{"kind", "ep-loopback"}, {"world_size", R}, {"device", prop.name},
                             {"sms_per_rank", loopback.sms_per_rank()},
                             {"max_tokens_per_rank", cfg.max_tokens_per_rank},
                             {"layer", {{"H", H}, {"E", E}, {"top_k", k}, {"preset", opt.preset}}},
                             {"points", points}};
    std::ofstream f(opt.json);
    f << report.dump(2) << "\n";
    MEGAMOE_CHECK(f.good(), kIo, "bench --ep-loopback: cannot write '", opt.json, "'");
  }
  for (cudaEvent_t e : ends) cudaEventDestroy(e);
  for (auto& s : stages) {
    for (cudaEvent_t e : {s.start, s.sent, s.computed, s.done}) cudaEventDestroy(e);
  }
  cudaEventDestroy(release);
  cudaStreamDestroy(kick);
  return all_pass ? 0 : 1;
}

}  // namespace megamoe::bench

#else

#include "megamoe/status.h"

namespace megamoe::bench {
int run_ep_loopback_bench(const EpBenchOptions&) {
  MEGAMOE_FAIL(kUnsupported, "megamoe bench --ep-loopback: this build has no expert parallelism (configured with "
               "-DMEGAMOE_EP=OFF)");
}
}  // namespace megamoe::bench

#endif
