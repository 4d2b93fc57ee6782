// `megamoe bench --ep N`: the report rank 0 prints and writes: the run's header, and per point its
// checks, its line of the table and its JSON (ep_bench_model.h).
#include "bench/ep_bench_model.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

namespace megamoe::bench {

namespace {

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

double max_over(const std::vector<EpRankPoint>& r, double EpRankPoint::*m) {
  double v = -1e300;
  for (const EpRankPoint& x : r) v = std::max(v, x.*m);
  return v;
}

}  // namespace

bool ep_point_pass(const EpPointResult& p) {
  bool ok = !p.ranks.empty();
  for (const EpRankPoint& r : p.ranks) {
    ok = ok && r.check_nonfinite == 0 && r.invalid_ids == 0 && r.check_rel_l2 <= kEpMaxRelL2;
    if (p.baselines) ok = ok && r.a_nonfinite == 0 && r.a_rel_l2_vs_ep <= kEpMaxRelL2;
  }
  if (p.single.ran) ok = ok && p.single.check_nonfinite == 0 && p.single.check_rel_l2 <= kEpMaxRelL2;
  return ok;
}

std::string ep_table_header() {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%7s %7s %10s %10s %6s %7s %10s %10s %7s %8s %10s %9s %9s", "T/rank", "tokens",
                "us", "floor_us", "bound", "%floor", "a_us", "a_comp_us", "vs_a", "us/comp", "1gpu_us", "rel_err",
                "a_vs_ep");
  return buf;
}

std::string ep_table_row(const EpPointResult& p) {
  const double us = max_over(p.ranks, &EpRankPoint::us);
  double floor_us = 0;
  std::string bound = "-";
  for (const EpFloor& f : p.floors) {
    if (f.us > floor_us) floor_us = f.us, bound = f.bound;
  }
  const double err = max_over(p.ranks, &EpRankPoint::check_rel_l2);
  std::string a_us = "-", a_comp = "-", vs_a = "-", per_comp = "-", a_vs_ep = "-";
  if (p.baselines) {
    const double a = max_over(p.ranks, &EpRankPoint::a_us), c = max_over(p.ranks, &EpRankPoint::a_compute_us);
    a_us = fmt("%.1f", a);
    a_comp = fmt("%.1f", c);
    vs_a = fmt("%.2fx", a / us);
    per_comp = fmt("%.2f", us / c);
    a_vs_ep = fmt("%.2e", max_over(p.ranks, &EpRankPoint::a_rel_l2_vs_ep));
  }
  const std::string single = p.single.ran ? fmt("%.1f", p.single.us) : (p.baselines ? "no fit" : "-");
  char buf[512];
  std::snprintf(buf, sizeof buf, "%7lld %7lld %10.1f %10.1f %6s %6.1f%% %10s %10s %7s %8s %10s %9.2e %9s%s",
                static_cast<long long>(p.tokens_per_rank), static_cast<long long>(p.tokens_per_rank * p.ranks.size()),
                us, floor_us, bound.c_str(), 100.0 * floor_us / us, a_us.c_str(), a_comp.c_str(), vs_a.c_str(),
                per_comp.c_str(), single.c_str(), err, a_vs_ep.c_str(), ep_point_pass(p) ? "" : " FAIL");
  return buf;
}

nlohmann::json to_json(const EpPointResult& p) {
  const double us = max_over(p.ranks, &EpRankPoint::us);
  nlohmann::json j;
  j["tokens_per_rank"] = p.tokens_per_rank;
  j["tokens"] = p.tokens_per_rank * static_cast<int64_t>(p.ranks.size());
  j["us"] = us;  // the slowest rank's median
  double floor_us = 0;
  std::string bound;
  for (const EpFloor& f : p.floors) {
    if (f.us > floor_us) floor_us = f.us, bound = f.bound;
  }
  j["floor_us"] = floor_us;
  j["floor_bound"] = bound;
  j["pct_floor"] = 100.0 * floor_us / us;
  j["check_pass"] = ep_point_pass(p);
  j["ranks"] = nlohmann::json::array();
  for (size_t r = 0; r < p.ranks.size(); ++r) {
    const EpRankPoint& m = p.ranks[r];
    const EpRankTraffic& t = p.traffic[r];
    const EpFloor& f = p.floors[r];
    nlohmann::json rj = {{"rank", r},
                         {"us", m.us},
                         {"check_rel_l2", m.check_rel_l2},
                         {"check_rows", m.check_rows},
                         {"check_non_finite", m.check_nonfinite},
                         {"invalid_ids", m.invalid_ids},
                         {"active_local_experts", t.active_local_experts},
                         {"received_selections", t.received_selections},
                         {"received_rows", t.received_rows},
                         {"nvlink_rows_out", t.rows_out},
                         {"nvlink_rows_in", t.rows_in},
                         {"nvlink_bytes_out", t.nvlink_bytes_out},
                         {"nvlink_bytes_in", t.nvlink_bytes_in},
                         {"floor", {{"us", f.us},
                                    {"bound", f.bound},
                                    {"hbm_us", f.hbm_us},
                                    {"mma_us", f.mma_us},
                                    {"nvlink_us", f.nvlink_us},
                                    {"weight_bytes", f.weight_bytes},
                                    {"flops", f.flops},
                                    {"nvlink_bytes", f.nvlink_bytes}}}};
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(m.inputs_fnv1a));
    rj["inputs_fnv1a"] = hex;
    if (m.stage_us[0] >= 0) {
      nlohmann::json st;
      for (int i = 0; i < EpRankPoint::kStages; ++i) st[kEpStageNames[i]] = m.stage_us[i];
      rj["stages_us_from_send_begin"] = st;
    }
    if (p.baselines) {
      rj["unfused_us"] = m.a_us;
      rj["unfused_compute_us"] = m.a_compute_us;
      rj["unfused_rel_l2_vs_ep"] = m.a_rel_l2_vs_ep;
      rj["unfused_non_finite"] = m.a_nonfinite;
    }
    j["ranks"].push_back(rj);
  }
  if (p.baselines) {
    const double a = max_over(p.ranks, &EpRankPoint::a_us), c = max_over(p.ranks, &EpRankPoint::a_compute_us);
    // (a): NCCL all-to-all dispatch, the single-GPU layer on the received rows, all-to-all back,
    // weighted sum; its compute-only part is the local layer + shared expert alone.
    j["unfused"] = {{"us", a}, {"compute_us", c}, {"speedup", a / us}, {"us_over_compute", us / c}};
    nlohmann::json s = {{"ran", p.single.ran}, {"bytes_needed", p.single.bytes_needed}};
    if (p.single.ran) {
      s["us"] = p.single.us;
      s["check_rel_l2"] = p.single.check_rel_l2;
      s["check_non_finite"] = p.single.check_nonfinite;
      s["speedup"] = p.single.us / us;
    } else {
      s["skipped"] = p.single.skipped;
    }
    j["single_gpu"] = s;
  }
  return j;
}

// ---- the run's header and a point's lines (rank 0)

nlohmann::json ep_run_header(const EpRunInfo& run) {
  const EpShape& shape = run.shape;
  const int R = shape.world;
  const int64_t H = shape.hidden, E = shape.num_experts;
  const int k = shape.top_k;
  nlohmann::json report;
  const std::vector<EpWeightEstimate> estimates = ep_weight_estimate_table();
  std::printf("\nexpert parallelism over %d GPUs (%s); layer %s: H=%lld I=%lld E=%lld top-%d%s, %lld experts per rank; "
              "max %lld tokens per rank; %s; %s L2 flush; median of %d graph replays, the slowest rank's\n",
              R, run.device.c_str(), run.layer_label.c_str(), (long long)H, (long long)shape.intermediate,
              (long long)E, k, shape.shared_intermediate ? " +shared" : "", (long long)run.experts_per_rank,
              (long long)run.max_tokens_per_rank, run.deterministic ? "deterministic" : "atomic combine",
              run.flush.c_str(), run.iters);
  report["mode"] = "ep";
  report["device"] = run.device;
  report["ep"] = {{"world_size", R},
                  {"max_tokens_per_rank", run.max_tokens_per_rank},
                  {"deterministic", run.deterministic},
                  {"iters", run.iters},
                  {"nccl_version", run.nccl_version},
                  {"peer_rate_method", run.peer_rate_method}};
  report["l2_flush"] = run.flush;
  report["layer"] = {{"H", H}, {"I", shape.intermediate}, {"E", E}, {"top_k", k},
                     {"shared_I", shape.shared_intermediate}, {"preset", run.layer_label}};
  report["ranks"] = nlohmann::json::array();
  for (int r = 0; r < R; ++r) {
    const EpRankInfo& in = run.ranks[static_cast<size_t>(r)];
    std::printf("  rank %d: %s, copy %.2f TB/s, bf16 %.0f TFLOP/s, NVLink to rank %d %.0f GB/s (%s); EP layer "
                "%.2f GB on the GPU (the layer's and its group's device_bytes), %.1f GB free after setup\n",
                r, in.device, in.rates.copy_tbps, in.rates.mma_tflops, (r + 1) % R, in.rates.peer_gbps,
                run.peer_rate_method.c_str(), in.ep_device_bytes / 1e9, in.free_bytes / 1e9);
    report["ranks"].push_back({{"rank", r}, {"device", in.device}, {"copy_tbps", in.rates.copy_tbps},
                               {"bf16_tflops", in.rates.mma_tflops}, {"peer_gbps", in.rates.peer_gbps},
                               {"ep_device_bytes", in.ep_device_bytes}, {"free_bytes", in.free_bytes}});
  }
  if (run.baselines) {
    std::printf("  baseline (a): NCCL send/recv all-to-all of the rows, this library's single-GPU layer on the "
                "received rows (fp32 partial sums), all-to-all back, weighted sum; (b): the single-GPU layer on "
                "all R*T_r tokens on GPU 0%s%s\n",
                run.single_skipped.empty() ? "" : ": ", run.single_skipped.c_str());
  }
  std::printf("%s", format_weight_estimates(estimates).c_str());
  report["weight_estimates"] = nlohmann::json::array();
  for (const EpWeightEstimate& e : estimates) report["weight_estimates"].push_back(to_json(e));
  report["points"] = nlohmann::json::array();
  std::printf("\n%s\n", ep_table_header().c_str());
  std::fflush(stdout);
  return report;
}

void print_ep_point(const EpPointResult& point) {
  const int R = static_cast<int>(point.ranks.size());
  std::printf("%s\n", ep_table_row(point).c_str());
  for (int r = 0; r < R; ++r) {
    const double* st = point.ranks[static_cast<size_t>(r)].stage_us;
    if (st[0] < 0) continue;
    // Offsets from the send's start, on the rank's own clock: the send, the dispatch's wait for
    // the peers' rows, the local experts, the return, the wait for the peers' partial sums.
    std::printf("        rank %d stages, us from send start: sent %.1f | gate %.1f -> open %.1f | return %.1f -> "
                "%.1f | combine %.1f -> partials %.1f -> end %.1f\n",
                r, st[0], st[1], st[2], st[3], st[4], st[5], st[6], st[7]);
  }
  if (!ep_point_pass(point)) {
    for (int r = 0; r < R; ++r) {
      const EpRankPoint& m = point.ranks[static_cast<size_t>(r)];
      std::printf("        rank %d: EP output rel L2 %.3g on %lld checked tokens, %lld non-finite, %lld invalid "
                  "ids; baseline (a) vs EP rel L2 %.3g, %lld non-finite (allowed %.0e)\n",
                  r, m.check_rel_l2, (long long)m.check_rows, (long long)m.check_nonfinite,
                  (long long)m.invalid_ids, m.a_rel_l2_vs_ep, (long long)m.a_nonfinite, kEpMaxRelL2);
    }
    if (point.single.ran) {
      std::printf("        single GPU (b): rel L2 %.3g, %lld non-finite\n", point.single.check_rel_l2,
                  (long long)point.single.check_nonfinite);
    }
  }
}

}  // namespace megamoe::bench
