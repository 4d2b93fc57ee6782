// One rank of `megamoe bench --ep N` (ep_bench.h).
#include "bench/ep_bench.h"

#if MEGAMOE_HAS_EP

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_common.h"
#include "bench/ep_bench_baselines.h"
#include "bench/ep_bench_comm.h"
#include "bench/l2_flush.h"
#include "megamoe/checkpoint.h"
#include "megamoe/dtype.h"
#include "megamoe/ep.h"
#include "megamoe/format.h"
#include "megamoe/gpu.h"
#include "megamoe/reference.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "support/device_buffer.h"

namespace megamoe::bench {
namespace {

using support::DeviceBuffer;
static_assert(kEpMaxRelL2 == kMaxRelL2, "the EP benchmark checks with the single-GPU benchmark's bound");

// Parts of a point that draw random inputs, each from its own generator seeded by (seed, part,
// T_r, rank) alone: every rank can draw every rank's routing (the floors and baseline (a)'s
// message sizes need them all) without drawing their tokens.
enum class EpInputPart : uint64_t { kRouting = 11, kHidden = 12 };
std::mt19937_64 ep_input_rng(uint64_t seed, EpInputPart part, int64_t tokens_per_rank, int rank) {
  return std::mt19937_64(
      splitmix64(splitmix64(splitmix64(splitmix64(seed ^ 0xE9B3) ^ static_cast<uint64_t>(part)) ^
                            static_cast<uint64_t>(tokens_per_rank)) ^
                 static_cast<uint64_t>(rank)));
}

std::vector<float> bf16_to_f32_vector(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_f32(v[i]);
  return out;
}

}  // namespace

void run_ep_bench_rank(const EpRankSetup& setup, int rank) {
  const EpBenchOptions& opt = setup.options;
  validate_ep_bench_options(opt);
  const int R = opt.world_size;
  MEGAMOE_CHECK(rank >= 0 && rank < R, kInvalidArgument, "bench --ep: rank ", rank, " of ", R);
  MEGAMOE_CHECK(gpu::device_count() >= R, kUnsupported, "bench --ep ", R, ": rank ", rank, " sees only ",
                gpu::device_count(), " CUDA devices");
  const int64_t max_t = ep_max_tokens_per_rank(opt);
  gpu::check_cuda(cudaSetDevice(rank), "cudaSetDevice");
  cudaStream_t stream;
  gpu::check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const auto t_start = std::chrono::steady_clock::now();
  auto log = [&](const std::string& what) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    std::fprintf(stderr, "bench --ep %d: rank %d: %s [%.0fs]\n", R, rank, what.c_str(), s);
  };

  // ---- the benchmark's communicator, then this GPU's rates (every rank at once)
  const BenchComm comm(EpUniqueId::from_hex(setup.bench_comm_id), R, rank);
  EpRankInfo info;
  cudaDeviceProp prop{};
  gpu::check_cuda(cudaGetDeviceProperties(&prop, rank), "cudaGetDeviceProperties");
  std::snprintf(info.device, sizeof info.device, "%s", prop.name);
  comm.host_barrier(stream);
  info.rates.copy_tbps = measure_copy_tbps(stream, 0);
  comm.host_barrier(stream);
  info.rates.mma_tflops = measure_bf16_tflops(stream, 0);
  const PeerRate peer = measure_peer_rate(comm, stream);
  info.rates.peer_gbps = peer.gbps;
  log("copy " + std::to_string(info.rates.copy_tbps) + " TB/s, bf16 " + std::to_string(info.rates.mma_tflops) +
      " TFLOP/s, peer " + std::to_string(info.rates.peer_gbps) + " GB/s (" + peer.method + ")");

  // ---- the layer: only this rank's experts are read (views of the mapped checkpoint); the CPU
  // reference reads the few experts the checked tokens chose
  const Checkpoint ckpt = Checkpoint::open(setup.checkpoint_dir);
  const ModelConfig config = load_model_config(setup.checkpoint_dir);
  const int64_t layer_index = bench_layer_index(config, opt.layer);
  const MoeLayer layer = load_moe_layer(ckpt, config, layer_index);
  EpShape shape;
  shape.hidden = layer.hidden_size;
  shape.intermediate = layer.intermediate_size;
  shape.shared_intermediate = layer.shared_expert ? layer.shared_expert->intermediate_size() : 0;
  shape.num_experts = layer.num_experts;
  shape.top_k = layer.routing.top_k;
  shape.world = R;
  const int64_t H = shape.hidden, E = shape.num_experts;
  const int k = shape.top_k;
  const EpExpertRange range = ep_expert_range(E, R, rank);
  const MoeLayer local = ep_local_layer(layer, range);
  EpConfig cfg;
  cfg.world_size = R;
  cfg.rank = rank;
  cfg.device = rank;
  cfg.max_tokens_per_rank = max_t;
  cfg.timeout_seconds = opt.ep_timeout;
  cfg.early_start = opt.early_start;
  MoeEpLayer ep = MoeEpLayer::create(local, E, cfg, EpUniqueId::from_hex(setup.layer_comm_id), opt.deterministic);
  info.ep_device_bytes = static_cast<int64_t>(ep.device_bytes() + ep.group().device_bytes());
  log("EP layer: experts [" + std::to_string(range.first) + ", " + std::to_string(range.first + range.count) + ")" +
      (layer.shared_expert ? " + shared" : "") + ", " + std::to_string(info.ep_device_bytes / 1e9) + " GB on GPU " +
      std::to_string(rank));
  std::unique_ptr<UnfusedBaseline> unfused;
  if (opt.baselines) unfused = std::make_unique<UnfusedBaseline>(local, shape, rank, max_t, opt.deterministic, stream);

  // Baseline (b) on rank 0: the whole layer on one GPU, where it fits beside what is there.
  SingleGpuBaseline single;
  const int64_t single_max_t = R * max_t;
  if (opt.baselines && rank == 0) {
    prepare_single_gpu_baseline(single, layer, shape, single_max_t, opt.deterministic, stream);
    log(single.skipped.empty() ? "single-GPU baseline (b) ready" : "single-GPU baseline (b): " + single.skipped);
  }
  {
    size_t free_bytes = 0, total = 0;
    gpu::check_cuda(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo");
    info.free_bytes = static_cast<int64_t>(free_bytes);
  }
  const std::vector<EpRankInfo> infos = comm.all_gather(info, stream);
  const L2Flush flush(opt.flush == "dirty" ? L2FlushMode::kDirty : L2FlushMode::kClean, size_t(prop.l2CacheSize));

  // ---- the report header (rank 0)
  nlohmann::json report;
  if (rank == 0) {
    EpRunInfo run;
    run.device = prop.name;
    run.layer_label = setup.layer_label;
    run.shape = shape;
    run.experts_per_rank = range.count;
    run.max_tokens_per_rank = max_t;
    run.deterministic = opt.deterministic;
    run.iters = opt.iters;
    run.baselines = opt.baselines;
    run.flush = to_string(flush.mode());
    run.nccl_version = NCCL_VERSION_CODE;
    run.peer_rate_method = peer.method;
    run.ranks = infos;
    run.single_skipped = single.skipped;
    report = ep_run_header(run);
  }
  auto write_json = [&] {
    if (rank != 0 || opt.json.empty()) return;
    std::ofstream f(opt.json);
    MEGAMOE_CHECK(f.good(), kIo, "bench --ep: cannot write '", opt.json, "'");
    f << report.dump(2) << "\n";
  };
  write_json();

  bool all_pass = true;
  for (const int64_t T : opt.tokens_per_rank) {
    // ---- inputs: every rank's routing (all ranks draw the same), this rank's tokens
    std::vector<reference::TopK> routing;
    std::vector<std::vector<int32_t>> all_ids;
    for (int s = 0; s < R; ++s) {
      std::mt19937_64 rng = ep_input_rng(opt.seed, EpInputPart::kRouting, T, s);
      routing.push_back(uniform_topk(rng, T, E, k));
      all_ids.push_back(routing.back().ids);
    }
    const reference::TopK& topk = routing[static_cast<size_t>(rank)];
    std::mt19937_64 hidden_rng = ep_input_rng(opt.seed, EpInputPart::kHidden, T, rank);
    const std::vector<uint16_t> x = random_hidden(hidden_rng, T, H);
    EpPointResult point;
    point.tokens_per_rank = T;
    point.baselines = opt.baselines;
    point.traffic = ep_traffic(shape, all_ids);
    for (int r = 0; r < R; ++r) {
      point.floors.push_back(ep_rank_floor(shape, point.traffic[static_cast<size_t>(r)], infos[static_cast<size_t>(r)].rates));
    }
    EpRankPoint mine;
    mine.tokens = T;
    mine.inputs_fnv1a = inputs_fingerprint(x, topk);
    const DeviceBuffer<uint16_t> dx(x);
    const DeviceBuffer<int32_t> dids(topk.ids);
    const DeviceBuffer<float> dw(topk.weights);
    DeviceBuffer<uint16_t> dout(static_cast<size_t>(T * H));
    MoeRunArgs args{};
    args.hidden = dx.get();
    args.topk_ids = dids.get();
    args.topk_weights = dw.get();
    args.tokens = T;
    args.output = dout.get();

    // ---- the EP layer: one eager run, then its captured graph; the graph's output is checked
    comm.host_barrier(stream);  // no rank waits long at the layer's own (bounded) barriers
    ep.run(args, stream);
    ep.check(stream);
    const Graph ep_graph(stream, [&] { ep.run(args, stream); });
    // Poisoned on the stream (a plain cudaMemset runs on the legacy stream, which a non-blocking
    // stream does not wait for).
    gpu::check_cuda(cudaMemsetAsync(dout.get(), 0xFF, dout.size() * 2, stream), "poison");
    comm.host_barrier(stream);
    ep_graph.launch(stream);
    ep.check(stream);
    mine.invalid_ids = ep.invalid_id_count(stream);
    const std::vector<uint16_t> got = dout.download();
    mine.check_nonfinite = count_nonfinite(got);
    const std::vector<int64_t> rows = spread_rows(T, opt.check_tokens);
    int64_t rows_nonfinite = 0;
    mine.check_rows = static_cast<int64_t>(rows.size());
    mine.check_rel_l2 = reference_rel_l2(layer, x, topk, got, rows, &rows_nonfinite);
    mine.us = timed_median_us([&] { ep_graph.launch(stream); }, opt.iters, 2, stream, flush, &comm);
    ep.check(stream);
    if (R > 1) {
      // The stages, from the device's stamps of as many replays again, run as the timed ones.
      std::vector<std::vector<double>> stage(EpRankPoint::kStages);
      for (int it = 0; it < opt.iters; ++it) {
        flush.run(stream, it);
        comm.barrier(stream);
        ep_graph.launch(stream);
        const MoeEpLayer::StageStamps st = ep.stage_stamps(stream);
        const uint64_t at[EpRankPoint::kStages] = {st.send_end,    st.gate_begin,    st.gate_open,
                                                  st.return_begin, st.return_end,    st.combine_begin,
                                                  st.partials_arrived, st.combine_end};
        for (int i = 0; i < EpRankPoint::kStages; ++i) {
          stage[static_cast<size_t>(i)].push_back(1e-3 * static_cast<double>(static_cast<int64_t>(at[i] - st.send_begin)));
        }
      }
      ep.check(stream);
      for (int i = 0; i < EpRankPoint::kStages; ++i) mine.stage_us[i] = median(stage[static_cast<size_t>(i)]);
    }

    // ---- baseline (a): checked against the EP layer's output, then timed whole and compute-only
    if (unfused) {
      unfused->prepare(ep_row_counts(shape, all_ids), topk.ids, T);
      unfused->set_tokens(dx.get());
      comm.host_barrier(stream);
      unfused->run(comm, dx.get(), dids.get(), dw.get(), stream);  // eager: NCCL connects its peers here
      gpu::check_cuda(cudaStreamSynchronize(stream), "baseline (a)");
      // NCCL calls in a capture: relaxed mode (NCCL may call CUDA APIs the strict modes forbid).
      const Graph a_graph(stream, [&] { unfused->run(comm, dx.get(), dids.get(), dw.get(), stream); },
                          cudaStreamCaptureModeRelaxed);
      const Graph compute_graph(stream, [&] { unfused->compute(stream); });
      gpu::check_cuda(cudaMemsetAsync(unfused->output(), 0xFF, static_cast<size_t>(T * H) * 2, stream), "poison");
      comm.barrier(stream);
      a_graph.launch(stream);
      gpu::check_cuda(cudaStreamSynchronize(stream), "baseline (a) replay");
      std::vector<uint16_t> a_out(static_cast<size_t>(T * H));
      gpu::check_cuda(cudaMemcpy(a_out.data(), unfused->output(), a_out.size() * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
      mine.a_rel_l2_vs_ep = rel_l2(a_out, bf16_to_f32_vector(got), &mine.a_nonfinite);
      mine.a_us = timed_median_us([&] { a_graph.launch(stream); }, opt.iters, 2, stream, flush, &comm);
      mine.a_compute_us = timed_median_us([&] { compute_graph.launch(stream); }, opt.iters, 2, stream, flush, &comm);
    }

    // ---- baseline (b), rank 0 alone (the others wait at the gather below)
    if (rank == 0 && opt.baselines) {
      point.single.bytes_needed = single.bytes_needed;
      point.single.skipped = single.skipped;
      if (single.plan) {
        // Every rank's tokens in rank order, as drawn above.
        std::vector<uint16_t> x_all;
        reference::TopK topk_all;
        topk_all.k = k;
        for (int s = 0; s < R; ++s) {
          std::mt19937_64 rng = ep_input_rng(opt.seed, EpInputPart::kHidden, T, s);
          const std::vector<uint16_t> xs = random_hidden(rng, T, H);
          x_all.insert(x_all.end(), xs.begin(), xs.end());
          topk_all.ids.insert(topk_all.ids.end(), routing[static_cast<size_t>(s)].ids.begin(),
                              routing[static_cast<size_t>(s)].ids.end());
          topk_all.weights.insert(topk_all.weights.end(), routing[static_cast<size_t>(s)].weights.begin(),
                                  routing[static_cast<size_t>(s)].weights.end());
        }
        const int64_t T_all = R * T;
        topk_all.tokens = T_all;
        const DeviceBuffer<uint16_t> bx(x_all);
        const DeviceBuffer<int32_t> bids(topk_all.ids);
        const DeviceBuffer<float> bw(topk_all.weights);
        DeviceBuffer<uint16_t> bout(x_all.size());
        const MoeRunArgs b_args{bx.get(), bids.get(), bw.get(), T_all, bout.get(), single.workspace->get()};
        megamoe::run(*single.plan, *single.weights, b_args, stream);
        gpu::check_cuda(cudaStreamSynchronize(stream), "baseline (b)");
        const Graph b_graph(stream, [&] { megamoe::run(*single.plan, *single.weights, b_args, stream); });
        gpu::check_cuda(cudaMemsetAsync(bout.get(), 0xFF, bout.size() * 2, stream), "poison");
        b_graph.launch(stream);
        gpu::check_cuda(cudaStreamSynchronize(stream), "baseline (b) replay");
        const std::vector<uint16_t> b_got = bout.download();
        int64_t b_rows_nonfinite = 0;
        point.single.check_nonfinite = count_nonfinite(b_got);
        point.single.check_rel_l2 =
            reference_rel_l2(layer, x_all, topk_all, b_got, spread_rows(T_all, opt.check_tokens), &b_rows_nonfinite);
        point.single.us = timed_median_us([&] { b_graph.launch(stream); }, opt.iters, 2, stream, flush, nullptr);
        point.single.ran = true;
      }
    }

    // ---- every rank's figures to rank 0
    point.ranks = comm.all_gather(mine, stream);
    const bool pass = ep_point_pass(point);
    all_pass = all_pass && pass;
    if (rank == 0) {
      print_ep_point(point);
      std::fflush(stdout);
      report["points"].push_back(to_json(point));
      report["check_pass"] = all_pass;
      write_json();
    }
    log("T/rank " + std::to_string(T) + " done");
  }

  if (rank == 0) {
    std::ofstream status(setup.status_file);
    status << (all_pass ? "pass" : "fail") << "\n";
    MEGAMOE_CHECK(status.good(), kIo, "bench --ep: cannot write '", setup.status_file, "'");
  }
  // Every rank leaves together: the layer's and NCCL's teardown are collective.
  comm.host_barrier(stream);
  cudaStreamDestroy(stream);
}

}  // namespace megamoe::bench

#else  // no expert parallelism in this build

#include "megamoe/status.h"

namespace megamoe::bench {
void run_ep_bench_rank(const EpRankSetup&, int) {
  MEGAMOE_FAIL(kUnsupported, "megamoe bench --ep: this build has no expert parallelism (configured with "
               "-DMEGAMOE_EP=OFF)");
}
}  // namespace megamoe::bench

#endif
