// The CPU side of `megamoe bench --ep N` (ep_bench_model.h).
#include "bench/ep_bench_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include "megamoe/format.h"
#include "megamoe/status.h"

namespace megamoe::bench {

namespace {

// The expert count and top-k a synthesized layer gets (synth.cpp's routing_for caps top_k at the
// experts there are; a grouped router may cap it further, which the rank's layer then checks).
struct SynthShape {
  int64_t experts = 0;
  int top_k = 0;
};
SynthShape synth_shape(const EpBenchOptions& opt) {
  const ModelPreset& p = find_preset(opt.preset);
  SynthShape s;
  s.experts = opt.num_experts > 0 ? opt.num_experts : p.num_experts;
  s.top_k = static_cast<int>(std::min<int64_t>(p.top_k, s.experts));
  return s;
}

template <class T>
T field(const nlohmann::json& j, const char* name) {
  MEGAMOE_CHECK(j.is_object() && j.contains(name), kInvalidArgument, "bench --ep: the rank setup has no '", name, "'");
  try {
    return j.at(name).get<T>();
  } catch (const nlohmann::json::exception& e) {
    MEGAMOE_FAIL(kInvalidArgument, "bench --ep: the rank setup's '", name, "' has the wrong type (", e.what(), ")");
  }
}

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

void validate_ep_bench_options(const EpBenchOptions& opt) {
  const int R = opt.world_size;
  MEGAMOE_CHECK(R >= 1 && R <= 8, kInvalidArgument, "bench --ep ", R,
                ": the world size must be 1..8 (the GPUs of one host)");
  MEGAMOE_CHECK(!opt.tokens_per_rank.empty(), kInvalidArgument, "bench --ep: the --tokens-per-rank list is empty");
  for (int64_t t : opt.tokens_per_rank) {
    MEGAMOE_CHECK(t >= 1 && t <= 65536, kInvalidArgument, "bench --ep: tokens per rank ", t,
                  " must be in 1..65536");
  }
  const int64_t largest = *std::max_element(opt.tokens_per_rank.begin(), opt.tokens_per_rank.end());
  MEGAMOE_CHECK(opt.max_tokens_per_rank == 0 || (opt.max_tokens_per_rank >= largest && opt.max_tokens_per_rank <= 65536),
                kInvalidArgument, "bench --ep: --max-tokens-per-rank ", opt.max_tokens_per_rank,
                " must be 0 (the largest point) or in ", largest, "..65536 (at least every --tokens-per-rank)");
  MEGAMOE_CHECK(opt.iters >= 20, kInvalidArgument, "bench --ep: --iters = ", opt.iters, " must be >= 20");
  MEGAMOE_CHECK(opt.check_tokens >= 1 && opt.check_tokens <= 64, kInvalidArgument, "bench --ep: --check-tokens = ",
                opt.check_tokens, " must be in 1..64 (every rank's output is checked against the CPU reference)");
  MEGAMOE_CHECK(opt.flush == "clean" || opt.flush == "dirty", kInvalidArgument, "bench --ep: L2 flush '", opt.flush,
                "' is not one of: clean, dirty");
  MEGAMOE_CHECK(opt.ep_timeout > 0 && opt.ep_timeout <= 3600, kInvalidArgument, "bench --ep: --ep-timeout = ",
                opt.ep_timeout, " must be in (0, 3600]");
  MEGAMOE_CHECK(opt.deadline >= 0, kInvalidArgument, "bench --ep: --ep-deadline = ", opt.deadline,
                " must be >= 0 (0: none)");
  if (!opt.checkpoint.empty()) {
    MEGAMOE_CHECK(opt.num_experts == 0 && opt.shared_experts == -1, kInvalidArgument,
                  "bench --ep: --num-experts and --shared-experts shape a synthesized layer; with --checkpoint the "
                  "layer is the checkpoint's (drop them, or use --preset to synthesize)");
    return;  // the checkpoint's expert count is checked where it is loaded (ep_expert_range)
  }
  MEGAMOE_CHECK(opt.num_experts >= 0 && opt.shared_experts >= -1, kInvalidArgument,
                "bench --ep: --num-experts must be >= 0 and --shared-experts >= -1");
  const SynthShape s = synth_shape(opt);  // throws for an unknown preset, listing the valid ones
  MEGAMOE_CHECK(s.experts % R == 0, kInvalidArgument, "bench --ep ", R, ": the ", s.experts, " routed experts of ",
                opt.preset, " do not split evenly over ", R, " ranks (the number of experts must be a multiple of "
                "the world size)");
  MEGAMOE_CHECK(s.experts / R >= s.top_k, kInvalidArgument, "bench --ep ", R, ": ", s.experts / R,
                " experts per rank is fewer than top_k = ", s.top_k, " (each rank's local layer takes a token's k "
                "ids); use fewer ranks or more experts");
}

int64_t ep_max_tokens_per_rank(const EpBenchOptions& opt) {
  if (opt.max_tokens_per_rank > 0) return opt.max_tokens_per_rank;
  return opt.tokens_per_rank.empty() ? 0 : *std::max_element(opt.tokens_per_rank.begin(), opt.tokens_per_rank.end());
}

nlohmann::json to_json(const EpRankSetup& s) {
  const EpBenchOptions& o = s.options;
  nlohmann::json opt = {{"world_size", o.world_size},
                        {"preset", o.preset},
                        {"checkpoint", o.checkpoint},
                        {"layer", o.layer},
                        {"tokens_per_rank", o.tokens_per_rank},
                        {"max_tokens_per_rank", o.max_tokens_per_rank},
                        {"num_experts", o.num_experts},
                        {"shared_experts", o.shared_experts},
                        {"flush", o.flush},
                        {"iters", o.iters},
                        {"check_tokens", o.check_tokens},
                        {"baselines", o.baselines},
                        {"deterministic", o.deterministic},
                        {"seed", o.seed},
                        {"json", o.json},
                        {"work_dir", o.work_dir},
                        {"ep_timeout", o.ep_timeout},
                        {"deadline", o.deadline}};
  return {{"options", opt},
          {"checkpoint_dir", s.checkpoint_dir},
          {"layer_label", s.layer_label},
          {"layer_comm_id", s.layer_comm_id},
          {"bench_comm_id", s.bench_comm_id},
          {"status_file", s.status_file}};
}

EpRankSetup ep_rank_setup_from_json(const nlohmann::json& j) {
  EpRankSetup s;
  const nlohmann::json opt = field<nlohmann::json>(j, "options");
  EpBenchOptions& o = s.options;
  o.world_size = field<int>(opt, "world_size");
  o.preset = field<std::string>(opt, "preset");
  o.checkpoint = field<std::string>(opt, "checkpoint");
  o.layer = field<int64_t>(opt, "layer");
  o.tokens_per_rank = field<std::vector<int64_t>>(opt, "tokens_per_rank");
  o.max_tokens_per_rank = field<int64_t>(opt, "max_tokens_per_rank");
  o.num_experts = field<int64_t>(opt, "num_experts");
  o.shared_experts = field<int64_t>(opt, "shared_experts");
  o.flush = field<std::string>(opt, "flush");
  o.iters = field<int>(opt, "iters");
  o.check_tokens = field<int>(opt, "check_tokens");
  o.baselines = field<bool>(opt, "baselines");
  o.deterministic = field<bool>(opt, "deterministic");
  o.seed = field<uint64_t>(opt, "seed");
  o.json = field<std::string>(opt, "json");
  o.work_dir = field<std::string>(opt, "work_dir");
  o.ep_timeout = field<double>(opt, "ep_timeout");
  o.deadline = field<double>(opt, "deadline");
  s.checkpoint_dir = field<std::string>(j, "checkpoint_dir");
  s.layer_label = field<std::string>(j, "layer_label");
  s.layer_comm_id = field<std::string>(j, "layer_comm_id");
  s.bench_comm_id = field<std::string>(j, "bench_comm_id");
  s.status_file = field<std::string>(j, "status_file");
  return s;
}

// ---- traffic and floors

namespace {

// The ranks that own any of a token's experts, as a bit mask (ids outside [0, E) own none).
uint32_t destinations(const EpShape& shape, const int32_t* ids) {
  const int64_t per_rank = shape.num_experts / shape.world;
  uint32_t mask = 0;
  for (int j = 0; j < shape.top_k; ++j) {
    if (ids[j] >= 0 && ids[j] < shape.num_experts) mask |= 1u << (ids[j] / per_rank);
  }
  return mask;
}

void check_shape(const EpShape& shape, const std::vector<std::vector<int32_t>>& ids) {
  MEGAMOE_CHECK(shape.world >= 1 && shape.world <= 8 && shape.num_experts % shape.world == 0 && shape.top_k >= 1 &&
                    static_cast<int>(ids.size()) == shape.world,
                kInvalidArgument, "ep_traffic: world ", shape.world, ", ", shape.num_experts, " experts, top_k ",
                shape.top_k, ", ids of ", ids.size(), " ranks");
  for (const auto& v : ids) {
    MEGAMOE_CHECK(v.size() % static_cast<size_t>(shape.top_k) == 0, kInvalidArgument,
                  "ep_traffic: a rank's ids are not [T, top_k]");
  }
}

}  // namespace

std::vector<std::vector<int64_t>> ep_row_counts(const EpShape& shape, const std::vector<std::vector<int32_t>>& ids) {
  check_shape(shape, ids);
  const int R = shape.world;
  std::vector<std::vector<int64_t>> count(static_cast<size_t>(R), std::vector<int64_t>(static_cast<size_t>(R), 0));
  for (int s = 0; s < R; ++s) {
    const auto& v = ids[static_cast<size_t>(s)];
    for (size_t t = 0; t < v.size() / static_cast<size_t>(shape.top_k); ++t) {
      const uint32_t mask = destinations(shape, v.data() + t * static_cast<size_t>(shape.top_k));
      for (int d = 0; d < R; ++d) count[static_cast<size_t>(s)][static_cast<size_t>(d)] += (mask >> d) & 1u;
    }
  }
  return count;
}

std::vector<EpRankTraffic> ep_traffic(const EpShape& shape, const std::vector<std::vector<int32_t>>& ids) {
  check_shape(shape, ids);
  const int R = shape.world;
  const int64_t per_rank = shape.num_experts / R;
  std::vector<EpRankTraffic> out(static_cast<size_t>(R));
  std::vector<std::set<int32_t>> active(static_cast<size_t>(R));
  const auto count = ep_row_counts(shape, ids);
  for (int s = 0; s < R; ++s) {
    const auto& v = ids[static_cast<size_t>(s)];
    out[static_cast<size_t>(s)].tokens = static_cast<int64_t>(v.size()) / shape.top_k;
    for (int32_t id : v) {
      if (id < 0 || id >= shape.num_experts) continue;
      const size_t owner = static_cast<size_t>(id / per_rank);
      ++out[owner].received_selections;
      active[owner].insert(id);
    }
    for (int d = 0; d < R; ++d) {
      const int64_t rows = count[static_cast<size_t>(s)][static_cast<size_t>(d)];
      out[static_cast<size_t>(d)].received_rows += rows;
      if (d == s) continue;  // a rank's rows to itself stay in its own memory
      out[static_cast<size_t>(s)].rows_out += rows;
      out[static_cast<size_t>(d)].rows_in += rows;
    }
  }
  const double dispatch_row = 2.0 * shape.hidden + 8.0 * shape.top_k;  // bf16 row + int32 ids + fp32 weights
  const double return_row = 4.0 * shape.hidden;                         // fp32 partial sum
  for (int r = 0; r < R; ++r) {
    EpRankTraffic& t = out[static_cast<size_t>(r)];
    t.active_local_experts = static_cast<int64_t>(active[static_cast<size_t>(r)].size());
    t.nvlink_bytes_out = t.rows_out * dispatch_row + t.rows_in * return_row;
    t.nvlink_bytes_in = t.rows_in * dispatch_row + t.rows_out * return_row;
  }
  return out;
}

EpFloor ep_rank_floor(const EpShape& shape, const EpRankTraffic& traffic, const EpRates& rates) {
  EpFloor f;
  const double H = static_cast<double>(shape.hidden);
  f.weight_bytes = format::kNvfp4BytesPerWeight * 3.0 * H *
                   (static_cast<double>(traffic.active_local_experts) * shape.intermediate + shape.shared_intermediate);
  f.flops = 2.0 * 3.0 * H *
            (static_cast<double>(traffic.received_selections) * shape.intermediate +
             static_cast<double>(traffic.tokens) * shape.shared_intermediate);
  f.nvlink_bytes = std::max(traffic.nvlink_bytes_out, traffic.nvlink_bytes_in);
  // One rank alone moves nothing over NVLink and has no peer rate.
  MEGAMOE_CHECK(rates.copy_tbps > 0 && rates.mma_tflops > 0 && (rates.peer_gbps > 0 || f.nvlink_bytes == 0),
                kInvalidArgument, "ep_rank_floor: the rates must be positive (copy ", rates.copy_tbps, " TB/s, MMA ",
                rates.mma_tflops, " TFLOP/s, peer ", rates.peer_gbps, " GB/s)");
  f.hbm_us = f.weight_bytes / (rates.copy_tbps * 1e12) * 1e6;
  f.mma_us = f.flops / (rates.mma_tflops * 1e12) * 1e6;
  f.nvlink_us = f.nvlink_bytes > 0 ? f.nvlink_bytes / (rates.peer_gbps * 1e9) * 1e6 : 0.0;
  f.us = f.hbm_us;
  f.bound = "hbm";
  if (f.mma_us > f.us) f.us = f.mma_us, f.bound = "mma";
  if (f.nvlink_us > f.us) f.us = f.nvlink_us, f.bound = "nvlink";
  return f;
}

// ---- weight estimates

int64_t preset_moe_layers(const std::string& preset) {
  // config.json of the released models: num_hidden_layers 61 both, first_k_dense_replace 3 (V3/R1)
  // and 1 (K2).
  if (preset == "deepseek-v3") return 61 - 3;
  if (preset == "kimi-k2") return 61 - 1;
  MEGAMOE_FAIL(kInvalidArgument, "ep_weight_estimate: no layer count recorded for '", preset,
               "' (deepseek-v3 and kimi-k2 only)");
}

EpWeightEstimate ep_weight_estimate(const ModelPreset& p, int world) {
  MEGAMOE_CHECK(world >= 1 && p.num_experts % world == 0, kInvalidArgument, "ep_weight_estimate: ", p.num_experts,
                " experts of ", p.name, " do not split over ", world, " GPUs");
  EpWeightEstimate e;
  e.model = p.name;
  e.world = world;
  e.moe_layers = preset_moe_layers(p.name);
  e.routed_experts_per_gpu = p.num_experts / world;
  const double expert = format::kNvfp4BytesPerWeight * 3.0 * static_cast<double>(p.hidden_size) * static_cast<double>(p.intermediate_size);
  const double shared = expert * p.n_shared_experts;  // the shared expert is n_shared_experts * I wide
  e.bytes_per_layer = static_cast<double>(e.routed_experts_per_gpu) * expert + shared;
  e.bytes_per_gpu = e.bytes_per_layer * static_cast<double>(e.moe_layers);
  e.model_bytes = (static_cast<double>(p.num_experts) * expert + shared) * static_cast<double>(e.moe_layers);
  return e;
}

std::vector<EpWeightEstimate> ep_weight_estimate_table() {
  std::vector<EpWeightEstimate> rows;
  for (const char* model : {"deepseek-v3", "kimi-k2"}) {
    for (int world : {4, 8}) rows.push_back(ep_weight_estimate(find_preset(model), world));
  }
  return rows;
}

std::string format_weight_estimates(const std::vector<EpWeightEstimate>& rows) {
  std::string s = "expert weights per GPU (NVFP4, one copy; routed E/R + the shared expert), whole model:\n";
  char buf[256];
  std::snprintf(buf, sizeof buf, "%-12s %4s %10s %12s %14s %14s %12s\n", "model", "EP", "MoE layers", "experts/GPU",
                "GB/layer/GPU", "GB/GPU", "model GB");
  s += buf;
  for (const EpWeightEstimate& e : rows) {
    std::snprintf(buf, sizeof buf, "%-12s %4d %10lld %10lld+1 %14.3f %14.1f %12.1f\n", e.model.c_str(), e.world,
                  static_cast<long long>(e.moe_layers), static_cast<long long>(e.routed_experts_per_gpu),
                  e.bytes_per_layer / 1e9, e.bytes_per_gpu / 1e9, e.model_bytes / 1e9);
    s += buf;
  }
  return s;
}

nlohmann::json to_json(const EpWeightEstimate& e) {
  return {{"model", e.model},
          {"world_size", e.world},
          {"moe_layers", e.moe_layers},
          {"routed_experts_per_gpu", e.routed_experts_per_gpu},
          {"bytes_per_layer_per_gpu", e.bytes_per_layer},
          {"bytes_per_gpu", e.bytes_per_gpu},
          {"model_bytes", e.model_bytes}};
}

// ---- results

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

}  // namespace megamoe::bench
