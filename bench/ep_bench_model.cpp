// `megamoe bench --ep N`: the traffic and floors of a point from its routing, and the expert-weight
// bytes per GPU of whole models (ep_bench_model.h).
#include "bench/ep_bench_model.h"

#include <algorithm>
#include <cstdio>
#include <set>

#include "megamoe/format.h"
#include "megamoe/presets.h"
#include "megamoe/status.h"

namespace megamoe::bench {

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

}  // namespace megamoe::bench
