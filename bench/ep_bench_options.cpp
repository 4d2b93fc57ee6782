// `megamoe bench --ep N`: the options and their validation, and the rank setup the launcher hands
// every rank (ep_bench_model.h).
#include "bench/ep_bench_model.h"

#include <algorithm>
#include <string>
#include <vector>

#include "megamoe/presets.h"
#include "megamoe/status.h"

namespace megamoe::bench {

namespace {

// The expert count and top-k a synthesized layer gets (synth_layer.cpp's routing_for caps top_k
// at the experts there are; a grouped router may cap it further, which the rank's layer then checks).
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
                        {"early_start", o.early_start},
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
  o.early_start = field<bool>(opt, "early_start");
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

}  // namespace megamoe::bench
