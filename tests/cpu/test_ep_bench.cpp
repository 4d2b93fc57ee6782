// The CPU parts of `megamoe bench --ep N` (bench/ep_bench_model.h): option validation, what the
// launcher hands the ranks, the traffic and floor arithmetic of a point, the expert-weight bytes
// per GPU of whole models (against the tensors of synthesized layers), the report; and the
// launcher of expert-parallel ranks (tools/megamoe/ep_launch.h), run on /bin/sh children. The
// GPU runs are in test_tool.cpp (ToolSynth.BenchExpertParallel, skipped below 2 GPUs).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/ep_bench_model.h"
#include "megamoe/presets.h"
#include "megamoe/safetensors.h"
#include "megamoe/status.h"
#include "tests/common/test_util.h"
#include "tools/megamoe/ep_launch.h"

namespace megamoe::bench {
namespace {

namespace fs = std::filesystem;

// The message of the megamoe::Error `fn` throws ("" if none).
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

EpBenchOptions valid_options() {
  EpBenchOptions o;
  o.world_size = 2;
  return o;
}

TEST(EpBenchOptions, DefaultsAreValidAndEveryRefusalNamesItsOption) {
  EXPECT_NO_THROW(validate_ep_bench_options(valid_options()));
  EXPECT_EQ(ep_max_tokens_per_rank(valid_options()), 4096);
  struct Case {
    const char* what;
    std::function<void(EpBenchOptions&)> change;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {"world 0", [](EpBenchOptions& o) { o.world_size = 0; }, {"1..8"}},
      {"world 9", [](EpBenchOptions& o) { o.world_size = 9; }, {"1..8"}},
      {"no tokens", [](EpBenchOptions& o) { o.tokens_per_rank.clear(); }, {"--tokens-per-rank", "empty"}},
      {"tokens 0", [](EpBenchOptions& o) { o.tokens_per_rank = {0}; }, {"1..65536"}},
      {"tokens 65537", [](EpBenchOptions& o) { o.tokens_per_rank = {1, 65537}; }, {"65537", "1..65536"}},
      {"max below a point", [](EpBenchOptions& o) { o.max_tokens_per_rank = 100; }, {"--max-tokens-per-rank", "4096"}},
      {"iters", [](EpBenchOptions& o) { o.iters = 19; }, {"--iters", ">= 20"}},
      {"check tokens", [](EpBenchOptions& o) { o.check_tokens = 65; }, {"--check-tokens", "1..64"}},
      {"flush", [](EpBenchOptions& o) { o.flush = "warm"; }, {"clean", "dirty"}},
      {"timeout", [](EpBenchOptions& o) { o.ep_timeout = 0; }, {"--ep-timeout"}},
      {"deadline", [](EpBenchOptions& o) { o.deadline = -1; }, {"--ep-deadline"}},
      {"preset", [](EpBenchOptions& o) { o.preset = "gpt-9"; }, {"'gpt-9'", "deepseek-v3"}},
      {"uneven split", [](EpBenchOptions& o) { o.world_size = 3; }, {"256", "3 ranks", "multiple"}},
      {"kimi over 5", [](EpBenchOptions& o) { o.preset = "kimi-k2"; o.world_size = 5; }, {"384", "5 ranks"}},
      {"fewer than top_k", [](EpBenchOptions& o) { o.num_experts = 16; o.world_size = 4; }, {"4 experts per rank", "top_k = 8"}},
      {"synth options with a checkpoint", [](EpBenchOptions& o) { o.checkpoint = "/x"; o.shared_experts = 0; },
       {"--shared-experts", "--checkpoint"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    EpBenchOptions o = valid_options();
    c.change(o);
    const std::string what = error_of([&] { validate_ep_bench_options(o); });
    ASSERT_FALSE(what.empty()) << "accepted";
    for (const std::string& s : c.says) EXPECT_NE(what.find(s), std::string::npos) << what;
  }
  // What does fit: Kimi-K2 over 8 GPUs (48 experts each), DeepSeek-V3 over 1, 2, 4, 8, a layer of 16
  // experts over 2 (8 each, top_k 8), an explicit max above the points, a checkpoint of any size.
  for (auto change : std::vector<std::function<void(EpBenchOptions&)>>{
           [](EpBenchOptions& o) { o.preset = "kimi-k2"; o.world_size = 8; },
           [](EpBenchOptions& o) { o.world_size = 1; },
           [](EpBenchOptions& o) { o.world_size = 8; },
           [](EpBenchOptions& o) { o.num_experts = 16; },
           [](EpBenchOptions& o) { o.max_tokens_per_rank = 8192; },
           [](EpBenchOptions& o) { o.checkpoint = "/x"; o.world_size = 3; }}) {
    EpBenchOptions o = valid_options();
    change(o);
    EXPECT_NO_THROW(validate_ep_bench_options(o));
  }
  EpBenchOptions o = valid_options();
  o.max_tokens_per_rank = 8192;
  EXPECT_EQ(ep_max_tokens_per_rank(o), 8192);
}

TEST(EpBenchOptions, RankSetupRoundTripsThroughJson) {
  EpRankSetup s;
  s.options.world_size = 4;
  s.options.preset = "kimi-k2";
  s.options.tokens_per_rank = {3, 17};
  s.options.max_tokens_per_rank = 64;
  s.options.num_experts = 32;
  s.options.shared_experts = 0;
  s.options.flush = "dirty";
  s.options.iters = 25;
  s.options.check_tokens = 7;
  s.options.baselines = false;
  s.options.deterministic = true;
  s.options.early_start = false;
  s.options.seed = 0xFFFFFFFFFFFFFFF1ull;  // above 2^63: must stay exact
  s.options.json = "/tmp/out.json";
  s.options.work_dir = "/tmp/w";
  s.options.ep_timeout = 12.5;
  s.options.deadline = 300;
  s.checkpoint_dir = "/tmp/ckpt";
  s.layer_label = "kimi-k2-routed-E32";
  s.layer_comm_id = std::string(256, 'a');
  s.bench_comm_id = std::string(256, 'b');
  s.status_file = "/tmp/status";
  const nlohmann::json j = nlohmann::json::parse(to_json(s).dump());
  const EpRankSetup t = ep_rank_setup_from_json(j);
  EXPECT_EQ(to_json(t), to_json(s));
  EXPECT_EQ(t.options.seed, s.options.seed);
  EXPECT_EQ(t.options.tokens_per_rank, s.options.tokens_per_rank);
  EXPECT_EQ(t.options.deterministic, true);
  EXPECT_EQ(t.options.early_start, false);
  EXPECT_EQ(t.bench_comm_id, s.bench_comm_id);
  nlohmann::json broken = j;
  broken["options"].erase("iters");
  EXPECT_NE(error_of([&] { ep_rank_setup_from_json(broken); }).find("'iters'"), std::string::npos);
  broken = j;
  broken["options"]["iters"] = "many";
  EXPECT_NE(error_of([&] { ep_rank_setup_from_json(broken); }).find("wrong type"), std::string::npos);
}

// 2 ranks, 4 experts (2 each), top-2, H 64. Rank 0: token 0 -> {0, 1} (rank 0 only), token 1 ->
// {1, 2} (both ranks). Rank 1: token 0 -> {2, 3} (rank 1 only), token 1 -> {0, 3} (both), token 2
// -> {3, -1} (an invalid id is ignored: rank 1 only).
EpShape tiny_shape() {
  return {.hidden = 64, .intermediate = 32, .shared_intermediate = 64, .num_experts = 4, .top_k = 2, .world = 2};
}
const std::vector<std::vector<int32_t>> kTinyIds = {{0, 1, 1, 2}, {2, 3, 0, 3, 3, -1}};

TEST(EpBenchTraffic, CountsRowsSelectionsAndNvlinkBytesByHand) {
  const EpShape shape = tiny_shape();
  const auto counts = ep_row_counts(shape, kTinyIds);
  ASSERT_EQ(counts.size(), 2u);
  EXPECT_EQ(counts[0], (std::vector<int64_t>{2, 1}));  // both tokens to rank 0, token 1 to rank 1
  EXPECT_EQ(counts[1], (std::vector<int64_t>{1, 3}));  // token 1 to rank 0; all three to rank 1
  const auto t = ep_traffic(shape, kTinyIds);
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].tokens, 2);
  EXPECT_EQ(t[1].tokens, 3);
  // Rank 0's experts {0, 1}: selections 0, 1, 1 (rank 0's tokens) + 0 (rank 1's) = 4, active {0, 1}.
  EXPECT_EQ(t[0].received_selections, 4);
  EXPECT_EQ(t[0].active_local_experts, 2);
  EXPECT_EQ(t[0].received_rows, 3);
  // Rank 1's experts {2, 3}: 2 (rank 0's) + 2, 3, 3, 3 = 5, active {2, 3}.
  EXPECT_EQ(t[1].received_selections, 5);
  EXPECT_EQ(t[1].active_local_experts, 2);
  EXPECT_EQ(t[1].received_rows, 4);
  EXPECT_EQ(t[0].rows_out, 1);
  EXPECT_EQ(t[0].rows_in, 1);
  EXPECT_EQ(t[1].rows_out, 1);
  EXPECT_EQ(t[1].rows_in, 1);
  // A dispatched row: 64 bf16 + 2 ids + 2 weights = 144 bytes; a returned one: 64 fp32 = 256.
  EXPECT_EQ(t[0].nvlink_bytes_out, 144 + 256);
  EXPECT_EQ(t[0].nvlink_bytes_in, 144 + 256);
  // Malformed input is refused.
  EXPECT_THROW(ep_traffic(shape, {{0, 1}}), Error);        // one rank's ids for a world of 2
  EXPECT_THROW(ep_traffic(shape, {{0, 1, 2}, {}}), Error);  // not [T, k]
}

TEST(EpBenchTraffic, FloorIsTheLargestOfHbmMmaAndNvlink) {
  const EpShape shape = tiny_shape();
  const auto t = ep_traffic(shape, kTinyIds);
  EpRates rates;
  rates.copy_tbps = 1.0;  // 1e12 B/s: 1 MB = 1 µs
  rates.mma_tflops = 1.0;
  rates.peer_gbps = 1.0;  // 1e9 B/s: 1 KB = 1 µs
  const EpFloor f = ep_rank_floor(shape, t[0], rates);
  // Weights: 0.5625 * 3 * 64 * (2 active * 32 + 64 shared) = 13824 bytes.
  EXPECT_DOUBLE_EQ(f.weight_bytes, 13824.0);
  // FLOPs: 2 * 3 * 64 * (4 selections * 32 + 2 tokens * 64) = 98304.
  EXPECT_DOUBLE_EQ(f.flops, 98304.0);
  EXPECT_DOUBLE_EQ(f.nvlink_bytes, 400.0);
  EXPECT_DOUBLE_EQ(f.hbm_us, 13824e-6);
  EXPECT_DOUBLE_EQ(f.mma_us, 98304e-6);
  EXPECT_DOUBLE_EQ(f.nvlink_us, 0.4);
  EXPECT_DOUBLE_EQ(f.us, 0.4);
  EXPECT_EQ(f.bound, "nvlink");
  rates.peer_gbps = 1e6;
  EXPECT_EQ(ep_rank_floor(shape, t[0], rates).bound, "mma");
  rates.mma_tflops = 1e6;
  EXPECT_EQ(ep_rank_floor(shape, t[0], rates).bound, "hbm");
  // One rank alone moves nothing over NVLink and needs no peer rate.
  EpShape one = shape;
  one.world = 1;
  const auto t1 = ep_traffic(one, {{0, 1, 1, 2, 2, 3}});
  EXPECT_EQ(t1[0].nvlink_bytes_out, 0.0);
  rates.peer_gbps = 0;
  EXPECT_EQ(ep_rank_floor(one, t1[0], rates).nvlink_us, 0.0);
  EXPECT_THROW(ep_rank_floor(shape, t[0], rates), Error);  // bytes to move, no rate
}

// DeepSeek-V3 with its shared expert, the issue's targets: EP2 at 1 token per rank is bound by
// ~9 experts' bytes (~72 µs on an H100), at 4096 by the MMA (~4.2 ms), whatever R.
TEST(EpBenchTraffic, DeepseekFloorsMatchTheIssueTable) {
  const ModelPreset& p = find_preset("deepseek-v3");
  const EpShape shape{.hidden = p.hidden_size,
                      .intermediate = p.intermediate_size,
                      .shared_intermediate = p.intermediate_size,
                      .num_experts = p.num_experts,
                      .top_k = p.top_k,
                      .world = 2};
  EpRates h100{3.01, 786.0, 384.0};
  // One token per rank, experts 0..7 and 128..135: each rank has 8 active.
  const std::vector<std::vector<int32_t>> one = {{0, 1, 2, 3, 4, 5, 6, 7}, {128, 129, 130, 131, 132, 133, 134, 135}};
  const auto t = ep_traffic(shape, one);
  const EpFloor f = ep_rank_floor(shape, t[0], h100);
  EXPECT_EQ(f.bound, "hbm");
  EXPECT_NEAR(f.us, 9 * 24772608.0 / 3.01e12 * 1e6, 1e-9);
  EXPECT_NEAR(f.us, 74.1, 0.1);
  EXPECT_EQ(t[0].rows_out, 0);  // every token stays home
  // 4096 tokens per rank, top-8 anywhere: 32768 selections land per rank on average; with every
  // selection on rank 0 the MMA floor of rank 0 is 2 * 3 * H * (2 * 32768 * I + 4096 * I).
  std::vector<std::vector<int32_t>> many(2);
  for (int s = 0; s < 2; ++s)
    for (int t2 = 0; t2 < 4096; ++t2)
      for (int j = 0; j < 8; ++j) many[static_cast<size_t>(s)].push_back((t2 + j) % 128);
  const auto tm = ep_traffic(shape, many);
  EXPECT_EQ(tm[0].received_selections, 2 * 4096 * 8);
  EXPECT_EQ(tm[1].received_selections, 0);
  const EpFloor fm = ep_rank_floor(shape, tm[0], h100);
  EXPECT_EQ(fm.bound, "mma");
  EXPECT_NEAR(fm.us, 2.0 * 3 * 7168 * (65536.0 * 2048 + 4096.0 * 2048) / 786e12 * 1e6, 1e-6);
  // Rank 1 sends every row to rank 0 and gets every partial back.
  EXPECT_EQ(tm[1].rows_out, 4096);
  EXPECT_EQ(tm[1].nvlink_bytes_out, 4096.0 * (2 * 7168 + 64));
  EXPECT_EQ(tm[1].nvlink_bytes_in, 4096.0 * 4 * 7168);
}

// The NVFP4 bytes of each expert of a synthesized layer, counted in its file: the sizes of the
// codes (.weight) and block scales (.weight_scale) that synth wrote. The 4-byte global and input
// scales are left out, as the model leaves them out.
struct ExpertBytes {
  std::vector<double> routed;  // by expert index
  double shared = 0;
};
ExpertBytes count_expert_bytes(const fs::path& checkpoint, int64_t layer) {
  const auto file = SafetensorsFile::open((checkpoint / "model.safetensors").string());
  const std::string routed = moe_prefix(layer) + ".experts.", shared = moe_prefix(layer) + ".shared_experts.";
  ExpertBytes bytes;
  for (const TensorInfo& t : file->tensors()) {
    if (!t.name.ends_with(".weight") && !t.name.ends_with(".weight_scale")) continue;
    if (t.name.starts_with(shared)) {
      bytes.shared += static_cast<double>(t.nbytes());
    } else if (t.name.starts_with(routed)) {
      const size_t e = std::stoul(t.name.substr(routed.size()));
      if (bytes.routed.size() <= e) bytes.routed.resize(e + 1);
      bytes.routed[e] += static_cast<double>(t.nbytes());
    }
  }
  return bytes;
}

// The model's weight bytes (the estimates per GPU and per model, a rank's floor) against that
// count, on DeepSeek-V3 and Kimi-K2 layers synthesized small: H 256, I 128, 8 experts and 0, 1
// or 2 shared experts (the model reads nothing else of the preset but its name, for the layer
// count).
TEST(EpBenchWeights, ModelCountsTheBytesSynthWrites) {
  const testing::ScratchDir dir("megamoe_ep_bench");
  for (const char* model : {"deepseek-v3", "kimi-k2"}) {
    for (int n_shared : {0, 1, 2}) {
      SCOPED_TRACE(std::string(model) + ", " + std::to_string(n_shared) + " shared experts");
      ModelPreset p = find_preset(model);
      p.hidden_size = 256;
      p.intermediate_size = 128;
      p.num_experts = 8;
      p.n_shared_experts = n_shared;
      const fs::path checkpoint = dir.path() / (std::string(model) + "_" + std::to_string(n_shared));
      SynthOptions opt;
      opt.threads = 2;
      synth_checkpoint(p, checkpoint.string(), opt);
      const ExpertBytes bytes = count_expert_bytes(checkpoint, p.layer);
      ASSERT_EQ(bytes.routed.size(), 8u);
      EXPECT_EQ(bytes.shared > 0, n_shared > 0);
      double all_routed = 0;
      for (double b : bytes.routed) all_routed += b;

      for (int world : {1, 2, 4, 8}) {
        SCOPED_TRACE("EP" + std::to_string(world));
        const EpWeightEstimate e = ep_weight_estimate(p, world);
        const int per_rank = 8 / world;
        for (int r = 0; r < world; ++r) {
          double owned = bytes.shared;
          for (int x = r * per_rank; x < (r + 1) * per_rank; ++x) owned += bytes.routed[static_cast<size_t>(x)];
          EXPECT_EQ(e.bytes_per_layer, owned) << "rank " << r;
        }
        EXPECT_EQ(e.model_bytes, (all_routed + bytes.shared) * static_cast<double>(e.moe_layers));
      }

      // A rank's floor reads its active experts and the shared one: rank 0 of 2 owns experts 0..3,
      // of which its token picks 0 and 2 and rank 1's token 2 and 5.
      const EpShape shape{.hidden = p.hidden_size,
                          .intermediate = p.intermediate_size,
                          .shared_intermediate = n_shared * p.intermediate_size,
                          .num_experts = p.num_experts,
                          .top_k = 2,
                          .world = 2};
      const auto traffic = ep_traffic(shape, {{0, 2}, {2, 5}});
      const EpFloor floor = ep_rank_floor(shape, traffic[0], EpRates{1.0, 1.0, 1.0});
      EXPECT_EQ(floor.weight_bytes, bytes.routed[0] + bytes.routed[2] + bytes.shared);
    }
  }
}

TEST(EpBenchWeights, BytesPerGpuOfDeepseekAndKimi) {
  // One expert of either model (H 7168, I 2048): 3·7168·2048 codes of half a byte and a scale byte
  // per 16 (ModelCountsTheBytesSynthWrites checks that rate against written layers).
  const double expert = 24772608.0;
  const auto rows = ep_weight_estimate_table();
  ASSERT_EQ(rows.size(), 4u);
  struct Want {
    const char* model;
    int world;
    int64_t layers, per_gpu;
  };
  const Want want[] = {{"deepseek-v3", 4, 58, 64}, {"deepseek-v3", 8, 58, 32}, {"kimi-k2", 4, 60, 96}, {"kimi-k2", 8, 60, 48}};
  for (size_t i = 0; i < 4; ++i) {
    SCOPED_TRACE(want[i].model + std::string(" EP") + std::to_string(want[i].world));
    EXPECT_EQ(rows[i].model, want[i].model);
    EXPECT_EQ(rows[i].world, want[i].world);
    EXPECT_EQ(rows[i].moe_layers, want[i].layers);
    EXPECT_EQ(rows[i].routed_experts_per_gpu, want[i].per_gpu);
    EXPECT_DOUBLE_EQ(rows[i].bytes_per_layer, (want[i].per_gpu + 1) * expert);
    EXPECT_DOUBLE_EQ(rows[i].bytes_per_gpu, (want[i].per_gpu + 1) * expert * want[i].layers);
  }
  // The figures docs/design.md §7 quotes (GB = 1e9 bytes).
  EXPECT_NEAR(rows[0].bytes_per_gpu / 1e9, 93.4, 0.05);
  EXPECT_NEAR(rows[1].bytes_per_gpu / 1e9, 47.4, 0.05);
  EXPECT_NEAR(rows[2].bytes_per_gpu / 1e9, 144.2, 0.05);
  EXPECT_NEAR(rows[3].bytes_per_gpu / 1e9, 72.8, 0.05);
  EXPECT_NEAR(rows[0].model_bytes / 1e9, 369.3, 0.05);  // 58 layers x 257 experts
  EXPECT_NEAR(rows[2].model_bytes / 1e9, 572.2, 0.05);  // 60 layers x 385 experts
  EXPECT_THROW(preset_moe_layers("qwen3-30b-a3b"), Error);
  EXPECT_THROW(ep_weight_estimate(find_preset("deepseek-v3"), 3), Error);
  const std::string table = format_weight_estimates(rows);
  EXPECT_NE(table.find("kimi-k2"), std::string::npos) << table;
  EXPECT_NE(table.find("93.4"), std::string::npos) << table;
  EXPECT_EQ(to_json(rows[3])["bytes_per_gpu"].get<double>(), rows[3].bytes_per_gpu);
}

EpPointResult tiny_point() {
  EpPointResult p;
  p.tokens_per_rank = 3;
  p.baselines = true;
  p.traffic = ep_traffic(tiny_shape(), kTinyIds);
  EpRates rates{1.0, 1.0, 1.0};
  for (const EpRankTraffic& t : p.traffic) p.floors.push_back(ep_rank_floor(tiny_shape(), t, rates));
  for (int r = 0; r < 2; ++r) {
    EpRankPoint m;
    m.tokens = 3;
    m.us = r == 0 ? 10.0 : 12.0;
    m.check_rel_l2 = 1e-3;
    m.check_rows = 3;
    m.a_us = r == 0 ? 30.0 : 36.0;
    m.a_compute_us = 8.0;
    m.a_rel_l2_vs_ep = 5e-4;
    m.inputs_fnv1a = 0x0123456789abcdefull + static_cast<uint64_t>(r);
    p.ranks.push_back(m);
  }
  p.single.ran = true;
  p.single.us = 20.0;
  p.single.check_rel_l2 = 1e-3;
  return p;
}

TEST(EpBenchReport, JsonShapeAndVerdict) {
  EpPointResult p = tiny_point();
  EXPECT_TRUE(ep_point_pass(p));
  const nlohmann::json j = to_json(p);
  EXPECT_EQ(j["tokens_per_rank"], 3);
  EXPECT_EQ(j["tokens"], 6);
  EXPECT_EQ(j["us"], 12.0);  // the slowest rank
  EXPECT_EQ(j["floor_bound"], "nvlink");
  EXPECT_DOUBLE_EQ(j["floor_us"].get<double>(), 0.4);
  EXPECT_DOUBLE_EQ(j["pct_floor"].get<double>(), 100.0 * 0.4 / 12.0);
  EXPECT_EQ(j["check_pass"], true);
  ASSERT_EQ(j["ranks"].size(), 2u);
  EXPECT_EQ(j["ranks"][1]["inputs_fnv1a"], "0123456789abcdf0");
  EXPECT_EQ(j["ranks"][0]["active_local_experts"], 2);
  EXPECT_EQ(j["ranks"][1]["floor"]["bound"], "nvlink");
  EXPECT_EQ(j["unfused"]["us"], 36.0);
  EXPECT_EQ(j["unfused"]["compute_us"], 8.0);
  EXPECT_DOUBLE_EQ(j["unfused"]["speedup"].get<double>(), 3.0);
  EXPECT_DOUBLE_EQ(j["unfused"]["us_over_compute"].get<double>(), 1.5);
  EXPECT_EQ(j["single_gpu"]["ran"], true);
  EXPECT_DOUBLE_EQ(j["single_gpu"]["speedup"].get<double>(), 20.0 / 12.0);
  const std::string row = ep_table_row(p);
  EXPECT_NE(row.find("12.0"), std::string::npos) << row;
  EXPECT_NE(row.find("3.00x"), std::string::npos) << row;
  EXPECT_EQ(row.find("FAIL"), std::string::npos) << row;
  // The header names every column the row fills.
  EXPECT_NE(ep_table_header().find("a_comp_us"), std::string::npos);

  // Each failed check fails the point, and the row says so.
  const std::vector<std::function<void(EpPointResult&)>> breaks = {
      [](EpPointResult& q) { q.ranks[1].check_rel_l2 = 3e-3; },
      [](EpPointResult& q) { q.ranks[0].check_nonfinite = 1; },
      [](EpPointResult& q) { q.ranks[0].invalid_ids = 2; },
      [](EpPointResult& q) { q.ranks[1].a_rel_l2_vs_ep = 1.0; },
      [](EpPointResult& q) { q.ranks[1].a_nonfinite = 5; },
      [](EpPointResult& q) { q.single.check_rel_l2 = 0.5; },
  };
  for (size_t i = 0; i < breaks.size(); ++i) {
    SCOPED_TRACE(i);
    EpPointResult q = tiny_point();
    breaks[i](q);
    EXPECT_FALSE(ep_point_pass(q));
    EXPECT_NE(ep_table_row(q).find("FAIL"), std::string::npos);
    EXPECT_EQ(to_json(q)["check_pass"], false);
  }
  // Without baselines: no unfused or single-GPU figures, and their fields do not count.
  EpPointResult n = tiny_point();
  n.baselines = false;
  n.single = EpSingleGpuPoint{};
  n.ranks[0].a_rel_l2_vs_ep = 1.0;
  EXPECT_TRUE(ep_point_pass(n));
  EXPECT_FALSE(to_json(n).contains("unfused"));
  EXPECT_FALSE(to_json(n).contains("single_gpu"));
  // A single-GPU baseline that does not fit says why.
  EpPointResult s = tiny_point();
  s.single = EpSingleGpuPoint{};
  s.single.skipped = "does not fit: ...";
  EXPECT_EQ(to_json(s)["single_gpu"]["skipped"], "does not fit: ...");
  EXPECT_NE(ep_table_row(s).find("no fit"), std::string::npos);
  // A rank's stage stamps are written under their names where it has them (world size 1 has none).
  EXPECT_FALSE(to_json(p)["ranks"][0].contains("stages_us_from_send_begin"));
  EpPointResult st = tiny_point();
  for (int i = 0; i < EpRankPoint::kStages; ++i) st.ranks[1].stage_us[i] = 1.5 * (i + 1);
  const nlohmann::json sj = to_json(st);
  EXPECT_FALSE(sj["ranks"][0].contains("stages_us_from_send_begin"));
  ASSERT_TRUE(sj["ranks"][1].contains("stages_us_from_send_begin"));
  EXPECT_DOUBLE_EQ(sj["ranks"][1]["stages_us_from_send_begin"]["send_end"].get<double>(), 1.5);
  EXPECT_DOUBLE_EQ(sj["ranks"][1]["stages_us_from_send_begin"]["combine_end"].get<double>(), 12.0);
  EXPECT_EQ(sj["ranks"][1]["stages_us_from_send_begin"].size(), static_cast<size_t>(EpRankPoint::kStages));
}

// ---- the launcher of the ranks

// The parent's entries of the three variables are dropped by name and the forced ones appended
// once. (No test sets a value that would allow NVLink multicast, not even in a string: the parent
// here holds the safe values, out of place.)
TEST(EpLaunch, RankEnvironmentNeverAllowsMulticast) {
  const char* parent[] = {"PATH=/bin", "NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1",
                          "NVSHMEM_DISABLE_NVLS=1", "NCCL_NVLS_ENABLE_X=keep", "HOME=/h", nullptr};
  const std::vector<std::string> env = tool::ep_rank_environment(parent);
  const std::vector<std::string> want = {"PATH=/bin", "NCCL_NVLS_ENABLE_X=keep", "HOME=/h", "NCCL_NVLS_ENABLE=0",
                                         "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1"};
  EXPECT_EQ(env, want);
  EXPECT_EQ(tool::ep_rank_environment(nullptr).size(), 3u);
}

class EpLaunchRuns : public ::testing::Test {
 protected:
  // Rank r runs `sh -c SCRIPT r` ($1 is the rank).
  tool::EpRankLaunch shell(const std::string& script, int world) {
    tool::EpRankLaunch l;
    l.command = "test --ep " + std::to_string(world);
    l.world_size = world;
    l.executable = "/bin/sh";
    l.rank_argv = [script](int r) { return std::vector<std::string>{"sh", "-c", script, "sh", std::to_string(r)}; };
    return l;
  }
  const testing::ScratchDir scratch_{"megamoe_ep_launch"};
  const fs::path dir_ = scratch_.path();
};

TEST_F(EpLaunchRuns, EveryRankRunsWithTheForcedEnvironment) {
  // Whatever the caller's environment holds, the ranks see the launcher's values.
  const std::string script = "echo \"$1 $NCCL_NVLS_ENABLE $TORCH_SYMM_MEM_DISABLE_MULTICAST $NVSHMEM_DISABLE_NVLS\" > '" +
                             dir_.string() + "/rank'$1";
  ASSERT_NO_THROW(tool::run_ep_ranks(shell(script, 4)));
  for (int r = 0; r < 4; ++r) {
    std::ifstream f(dir_ / ("rank" + std::to_string(r)));
    std::string line;
    std::getline(f, line);
    EXPECT_EQ(line, std::to_string(r) + " 0 1 1");
  }
}

TEST_F(EpLaunchRuns, AFailedRankEndsTheOthersAndIsNamed) {
  // Rank 2 fails at once; the others would sleep for a minute.
  const auto start = std::chrono::steady_clock::now();
  const std::string what =
      error_of([&] { tool::run_ep_ranks(shell("if [ $1 = 2 ]; then exit 3; fi; exec sleep 60", 4)); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(what.find("test --ep 4: rank 2 failed (exit status 3)"), std::string::npos) << what;
  EXPECT_LT(seconds, 20.0);
  // A rank killed by a signal.
  EXPECT_NE(error_of([&] { tool::run_ep_ranks(shell("kill -9 $$", 1)); }).find("rank 0 failed (signal 9)"),
            std::string::npos);
}

TEST_F(EpLaunchRuns, TheDeadlineEndsEveryRank) {
  tool::EpRankLaunch l = shell("exec sleep 60", 2);
  l.deadline_seconds = 0.5;
  const auto start = std::chrono::steady_clock::now();
  const std::string what = error_of([&] { tool::run_ep_ranks(l); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(what.find("did not finish within 0.5 s"), std::string::npos) << what;
  EXPECT_LT(seconds, 20.0);
}

TEST_F(EpLaunchRuns, AProgramThatCannotStartIsReported) {
  tool::EpRankLaunch l = shell("exit 0", 2);
  l.executable = (dir_ / "no-such-program").string();
  const std::string what = error_of([&] { tool::run_ep_ranks(l); });
  // glibc reports the failed exec from posix_spawn itself (ENOENT): kIo. Where it cannot, the
  // child exits with 127 and the rank is reported as failed.
  EXPECT_TRUE(what.find("could not start rank 0") != std::string::npos ||
              what.find("rank 0 failed (exit status 127)") != std::string::npos)
      << what;
  EXPECT_NE(error_of([&] {
              tool::EpRankLaunch bad = shell("exit 0", 9);
              tool::run_ep_ranks(bad);
            }).find("1..8"),
            std::string::npos);
}

}  // namespace
}  // namespace megamoe::bench
