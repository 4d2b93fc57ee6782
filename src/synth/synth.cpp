// Synthetic NVFP4 MoE checkpoints: realistic random weights, generated as a pure function of
// (seed, tensor name) and quantized with the ModelOpt recipe, streamed to disk expert by expert.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "megamoe/dtype.h"
#include "megamoe/format.h"
#include "megamoe/presets.h"
#include "megamoe/safetensors.h"
#include "megamoe/status.h"

namespace megamoe {

namespace {

// ---- Counter-based random numbers -----------------------------------------------------------
// Every random value is a hash of (stream key, index): there is no generator state, so one
// tensor, one row or one element can be recomputed alone, in any order, on any thread.

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;  // splitmix64's increment

// splitmix64's output function: a bijective 64-bit mixer with full avalanche.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// FNV-1a: a fixed, platform-independent string hash (std::hash is neither).
uint64_t hash_name(std::string_view s) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (const char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001B3ull;
  }
  return h;
}

class CounterStream {
 public:
  CounterStream(uint64_t seed, std::string_view name) : key_(mix64(seed ^ hash_name(name))) {}
  // Value i is splitmix64's (i+1)-th output from state `key`: 64 well-mixed bits.
  uint64_t bits(uint64_t i) const { return mix64(key_ + (i + 1) * kGolden); }
  // An independent stream for another quantity of the same tensor (row scales, outliers, ...).
  CounterStream sub(uint64_t domain) const { return CounterStream(key_, domain); }

 private:
  CounterStream(uint64_t key, uint64_t domain) : key_(mix64(key ^ mix64(domain * kGolden))) {}
  uint64_t key_;
};

// An approximately standard normal value from the low 48 bits of `h`: the Irwin-Hall sum of four
// 12-bit uniforms, centred and scaled to unit variance. It is the classic cheap normal (one hash
// and a few integer operations per element, against ~3x that for Box-Muller's log/sin/cos, which
// matters for the 11 G weights of a DeepSeek-V3 layer), uses no libm so it is reproducible
// everywhere, and is bounded at +-3.46; the heavy tails of real weights come from the log-normal
// row/block scales and the explicit outliers below. Bits 48..63 stay free for rare events.
float normal_from_bits(uint64_t h) {
  const int sum = static_cast<int>(h & 0xFFF) + static_cast<int>((h >> 12) & 0xFFF) +
                  static_cast<int>((h >> 24) & 0xFFF) + static_cast<int>((h >> 36) & 0xFFF);
  // Mean 4 * 4095/2 = 8190; variance 4 * (4096^2 - 1)/12 ~= 4096^2/3.
  return static_cast<float>(sum - 8190) * (1.7320508f / 4096.0f);
}

// A uniform value in [0, 1) from the top 24 bits of `h`.
float uniform_from_bits(uint64_t h) { return static_cast<float>(h >> 40) * (1.0f / 16777216.0f); }

// The 16 bits that normal_from_bits leaves unused: rare events compare them with a threshold.
uint32_t event_bits(uint64_t h) { return static_cast<uint32_t>(h >> 48); }

// ---- The weight distribution ----------------------------------------------------------------
constexpr float kWeightStd = 0.02f;    // typical std of a trained projection weight
constexpr float kRowLogStd = 0.35f;    // per-row log-normal magnitude (channels differ in norm)
constexpr float kBlockLogStd = 0.25f;  // per-16-block log-normal magnitude along a row
// About 1 block in 512 is nearly dead (2^-10 of its row's magnitude): its ue4m3 scale lands in
// the subnormal range (codes 0x01-0x07), which real checkpoints have and decoders get wrong
// (docs/design.md §5).
constexpr uint32_t kDeadBlockEvents = 128;  // out of 2^16
constexpr float kDeadBlockFactor = 1.0f / 1024.0f;
// About 1e-4 of the elements are outliers of 10x-30x the local magnitude, as in real weights.
constexpr uint32_t kOutlierEvents = 7;  // out of 2^16: 1.07e-4
constexpr float kOutlierMin = 10.0f;
constexpr float kOutlierMax = 30.0f;
// amax(|W|), which sets the global scale, is not left to the luck of the outliers: every tensor
// is clamped to a planted peak of kPeakRatio x its std, jittered per module (log-normal) so that
// experts differ. gate, up and down of one module share the jitter and differ by their std
// factors below, so their global scales (weight_scale_2) are always clearly different, as in
// real checkpoints (docs/design.md §2): a kernel that applied one projection's scale to another fails
// every test on synthetic layers.
constexpr float kPeakRatio = 80.0f;
constexpr float kPeakLogStd = 0.2f;
constexpr float kUpProjFactor = 1.5f;
constexpr float kDownProjFactor = 0.75f;

enum StreamDomain : uint64_t {
  kRowDomain = 1,
  kBlockDomain = 2,
  kOutlierDomain = 3,
  kPeakDomain = 4
};

// "a.b.experts.3" for "a.b.experts.3.up_proj.weight": the module whose projections share a peak.
std::string parent_module(const std::string& name) {
  const size_t last = name.rfind('.');
  if (last == std::string::npos || last == 0) return name;
  const size_t before = name.rfind('.', last - 1);
  return before == std::string::npos ? name : name.substr(0, before);
}

float projection_factor(const std::string& name) {
  if (name.find("up_proj") != std::string::npos) return kUpProjFactor;
  if (name.find("down_proj") != std::string::npos) return kDownProjFactor;
  return 1.0f;
}

// synth_weight into a caller-owned buffer (the generator reuses one buffer per thread).
void synth_weight_into(uint64_t seed, const std::string& name, int64_t rows, int64_t cols,
                       std::span<float> out) {
  const CounterStream elements(seed, name);
  const CounterStream row_stream = elements.sub(kRowDomain);
  const CounterStream block_stream = elements.sub(kBlockDomain);
  const CounterStream outlier_stream = elements.sub(kOutlierDomain);
  const float tensor_std = kWeightStd * projection_factor(name);
  const uint64_t peak_bits = CounterStream(seed, parent_module(name)).sub(kPeakDomain).bits(0);
  const float peak = tensor_std * kPeakRatio * std::exp(kPeakLogStd * normal_from_bits(peak_bits));
  const int64_t blocks_per_row = (cols + format::kNvfp4BlockSize - 1) / format::kNvfp4BlockSize;

  for (int64_t r = 0; r < rows; ++r) {
    const float row_std =
        tensor_std * std::exp(kRowLogStd * normal_from_bits(row_stream.bits(uint64_t(r))));
    for (int64_t b = 0; b < blocks_per_row; ++b) {
      const uint64_t hb = block_stream.bits(uint64_t(r * blocks_per_row + b));
      float block_std = row_std * std::exp(kBlockLogStd * normal_from_bits(hb));
      if (event_bits(hb) < kDeadBlockEvents) block_std *= kDeadBlockFactor;
      const int64_t c_end = std::min(cols, (b + 1) * format::kNvfp4BlockSize);
      for (int64_t c = b * format::kNvfp4BlockSize; c < c_end; ++c) {
        const uint64_t i = uint64_t(r * cols + c);
        const uint64_t h = elements.bits(i);
        float x = block_std * normal_from_bits(h);
        if (event_bits(h) < kOutlierEvents) {
          const uint64_t ho = outlier_stream.bits(i);
          const float magnitude =
              block_std * (kOutlierMin + (kOutlierMax - kOutlierMin) * uniform_from_bits(ho));
          x = (ho & 1) ? -magnitude : magnitude;
        }
        out[size_t(i)] = round_to_bf16(std::clamp(x, -peak, peak));
      }
    }
  }
  // The peak itself, at a position of its own, with a sign of its own. Rounding is monotonic, so
  // amax of the result is exactly bf16(peak).
  const uint64_t numel = uint64_t(rows * cols);
  if (numel > 0) {
    const uint64_t where = elements.sub(kPeakDomain).bits(0);
    out[size_t(where % numel)] = round_to_bf16((where >> 63) ? -peak : peak);
  }
}

// The index-th approximately standard normal value of the scalar quantity `name` (biases, input
// amax): drawn from its own stream, like a weight element.
float synth_scalar(uint64_t seed, const std::string& name, uint64_t index) {
  return normal_from_bits(CounterStream(seed, name).bits(index));
}

// ---- The layer to write -----------------------------------------------------------------------

// The routing of a preset with `num_experts` routed experts. A reduced expert count (small test
// layers) keeps the preset's routing where it still fits and otherwise shrinks it to the nearest
// valid one: ungrouped noaux_tc when the groups no longer divide the experts into groups of at
// least two (a group's score is the sum of its top-2), and top_k capped at the experts that the
// chosen groups can offer.
RoutingConfig routing_for(const ModelPreset& preset, int64_t num_experts) {
  RoutingConfig r = preset.routing;
  if (r.kind == RoutingKind::kNoauxTc) {
    if (r.n_group > 1 && (num_experts % r.n_group != 0 || num_experts / r.n_group < 2)) {
      r.n_group = 1;
      r.topk_group = 1;
    }
    const int64_t candidates = int64_t(r.topk_group) * (num_experts / r.n_group);
    r.top_k = int(std::min<int64_t>(r.top_k, candidates));
  } else {
    r.top_k = int(std::min<int64_t>(r.top_k, num_experts));
  }
  return r;
}

void check_preset(const ModelPreset& p, int64_t num_experts) {
  const std::string who = "model preset '" + p.name + "'";
  MEGAMOE_CHECK(
      p.architecture == "DeepseekV3ForCausalLM" || p.architecture == "Qwen3MoeForCausalLM",
      kInvalidArgument, who, " has architecture '", p.architecture,
      "'; synth writes DeepseekV3ForCausalLM or Qwen3MoeForCausalLM configs.");
  MEGAMOE_CHECK(p.hidden_size > 0 && p.hidden_size % format::kNvfp4BlockSize == 0 &&
                    p.intermediate_size > 0 && p.intermediate_size % format::kNvfp4BlockSize == 0,
                kInvalidArgument, who, " has hidden_size ", p.hidden_size,
                " and intermediate_size ", p.intermediate_size,
                "; both must be positive multiples of 16 (the NVFP4 block size).");
  MEGAMOE_CHECK(num_experts > 0, kInvalidArgument, who, " has ", num_experts,
                " routed experts; at least 1 is required.");
  MEGAMOE_CHECK(p.routing.top_k >= 1, kInvalidArgument, who, " has top_k ", p.routing.top_k,
                "; at least 1 is required.");
  MEGAMOE_CHECK(p.n_shared_experts >= 0, kInvalidArgument, who, " has ", p.n_shared_experts,
                " shared experts; 0 or more are allowed.");
  MEGAMOE_CHECK(p.layer >= 0, kInvalidArgument, who, " has layer ", p.layer,
                "; a layer index is 0 or more.");
  if (p.architecture == "Qwen3MoeForCausalLM") {
    MEGAMOE_CHECK(p.routing.kind == RoutingKind::kSoftmaxTopK && p.n_shared_experts == 0,
                  kInvalidArgument, who,
                  " is a Qwen3MoeForCausalLM model, which routes with softmax top-k and has no "
                  "shared expert.");
  } else {
    MEGAMOE_CHECK(p.routing.kind == RoutingKind::kNoauxTc && p.routing.n_group >= 1 &&
                      p.routing.topk_group >= 1 && p.routing.topk_group <= p.routing.n_group,
                  kInvalidArgument, who,
                  " is a DeepseekV3ForCausalLM model, which routes with noaux_tc and needs "
                  "1 <= topk_group <= n_group.");
  }
}

// config.json with HF's field names for the preset's architecture, describing a model whose layer
// `preset.layer` is the (first) MoE layer.
nlohmann::json model_config_json(const ModelPreset& p, int64_t num_experts,
                                 const RoutingConfig& r) {
  nlohmann::json c;
  c["architectures"] = {p.architecture};
  c["hidden_size"] = p.hidden_size;
  c["moe_intermediate_size"] = p.intermediate_size;
  c["num_experts_per_tok"] = r.top_k;
  c["num_hidden_layers"] = p.layer + 1;
  c["norm_topk_prob"] = r.renormalize;
  c["hidden_act"] = "silu";
  c["torch_dtype"] = "bfloat16";
  if (p.architecture == "DeepseekV3ForCausalLM") {
    c["model_type"] = "deepseek_v3";
    c["n_routed_experts"] = num_experts;
    c["n_shared_experts"] = p.n_shared_experts;
    c["first_k_dense_replace"] = p.layer;  // layers below are dense, so `layer` is the first MoE
    c["moe_layer_freq"] = 1;
    c["scoring_func"] = "sigmoid";
    c["topk_method"] = "noaux_tc";
    c["n_group"] = r.n_group;
    c["topk_group"] = r.topk_group;
    c["routed_scaling_factor"] = r.routed_scaling_factor;
    if (p.swiglu_limit) c["swiglu_limit"] = *p.swiglu_limit;
  } else {
    c["model_type"] = "qwen3_moe";
    c["num_experts"] = num_experts;
    c["decoder_sparse_step"] = 1;
    c["mlp_only_layers"] = nlohmann::json::array();
    if (r.routed_scaling_factor != 1.0f) c["routed_scaling_factor"] = r.routed_scaling_factor;
  }
  c["quantization_config"] = {{"quant_method", "modelopt"}, {"quant_algo", "NVFP4"}};
  return c;
}

void write_json(const std::filesystem::path& path, const nlohmann::json& j) {
  std::ofstream f(path);
  f << j.dump(2) << '\n';
  f.close();
  MEGAMOE_CHECK(f.good(), kIo, "cannot write '", path.string(), "'.");
}

// One NVFP4 projection of an expert: the unit of generation work.
struct Projection {
  std::string prefix;  // e.g. model.layers.3.mlp.experts.17.up_proj
  int64_t rows = 0;    // out features
  int64_t cols = 0;    // in features
  float input_amax = 0.0f;
};

struct QuantizedProjection {
  std::vector<uint8_t> codes;   // [rows, cols/2]
  std::vector<uint8_t> scales;  // [rows, cols/16]
  float weight_scale_2 = 0.0f;
};

// Activation amax behind the static input_scale: post-norm hidden states (the input of gate and
// up, which therefore share it) reach ~16, SwiGLU outputs (the input of down) ~4; each expert
// gets its own log-normal draw.
float input_amax(uint64_t seed, const std::string& expert_prefix, bool down) {
  const std::string what = expert_prefix + (down ? ".down_input" : ".hidden_input");
  return (down ? 4.0f : 16.0f) * std::exp(0.3f * synth_scalar(seed, what, 0));
}

std::vector<Projection> layer_projections(const ModelPreset& p, int64_t num_experts,
                                          uint64_t seed) {
  const std::string mlp = moe_prefix(p.layer);
  std::vector<Projection> out;
  auto add_expert = [&](const std::string& expert, int64_t inter) {
    const float hidden_amax = input_amax(seed, expert, false);
    out.push_back({expert + ".gate_proj", inter, p.hidden_size, hidden_amax});
    out.push_back({expert + ".up_proj", inter, p.hidden_size, hidden_amax});
    out.push_back({expert + ".down_proj", p.hidden_size, inter, input_amax(seed, expert, true)});
  };
  for (int64_t e = 0; e < num_experts; ++e) {
    add_expert(mlp + ".experts." + std::to_string(e), p.intermediate_size);
  }
  if (p.n_shared_experts > 0) {
    add_expert(mlp + ".shared_experts", p.n_shared_experts * p.intermediate_size);
  }
  return out;
}

template <typename T>
std::span<const uint8_t> as_bytes(const std::vector<T>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T)};
}
std::span<const uint8_t> as_bytes(const float& f) {
  return {reinterpret_cast<const uint8_t*>(&f), sizeof(float)};
}

// Progress lines on stderr, at most one a second (and the last).
class ProgressLine {
 public:
  ProgressLine(bool enabled, std::string what, size_t total)
      : enabled_(enabled), what_(std::move(what)), total_(total) {}
  void update(size_t done, uint64_t bytes) {
    if (!enabled_) return;
    const auto now = std::chrono::steady_clock::now();
    if (done != total_ && now - last_ < std::chrono::seconds(1)) return;
    last_ = now;
    const double secs = std::chrono::duration<double>(now - start_).count();
    const double left = done > 0 ? secs * double(total_ - done) / double(done) : 0.0;
    std::fprintf(stderr,
                 "%s: %zu/%zu projections (%.0f%%), %.2f GB, %.1f s elapsed, ~%.0f s left\n",
                 what_.c_str(), done, total_, 100.0 * double(done) / double(total_),
                 double(bytes) * 1e-9, secs, left);
  }

 private:
  bool enabled_;
  std::string what_;
  size_t total_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_ = start_;
};

}  // namespace

std::vector<float> synth_weight(uint64_t seed, const std::string& name, int64_t rows,
                                int64_t cols) {
  MEGAMOE_CHECK(rows >= 0 && cols >= 0, kInvalidArgument, "synth_weight('", name, "'): shape [",
                rows, ", ", cols, "] has a negative dimension.");
  std::vector<float> w(size_t(rows * cols));
  synth_weight_into(seed, name, rows, cols, w);
  return w;
}

void synth_checkpoint(const ModelPreset& model_preset, const std::string& out_dir,
                      const SynthOptions& opt) {
  MEGAMOE_CHECK(opt.shared_experts >= -1, kInvalidArgument, "the number of shared experts to write, ",
                opt.shared_experts, ", is not allowed; use -1 for the ", model_preset.n_shared_experts,
                " of preset '", model_preset.name, "', 0 for none, or a positive count.");
  ModelPreset preset = model_preset;
  if (opt.shared_experts >= 0) preset.n_shared_experts = opt.shared_experts;
  MEGAMOE_CHECK(opt.num_experts >= 0, kInvalidArgument, "the number of routed experts to write, ",
                opt.num_experts, ", is negative; use 0 for the ", preset.num_experts,
                " of preset '", preset.name, "' or a positive count.");
  MEGAMOE_CHECK(opt.threads >= 0, kInvalidArgument, "the thread count ", opt.threads,
                " is negative; use 0 for all cores or a positive count.");
  MEGAMOE_CHECK(!out_dir.empty(), kInvalidArgument,
                "the output directory of the synthetic checkpoint is an empty path.");
  const int64_t num_experts = opt.num_experts > 0 ? opt.num_experts : preset.num_experts;
  check_preset(preset, num_experts);
  const RoutingConfig routing = routing_for(preset, num_experts);

  const std::filesystem::path dir(out_dir);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  MEGAMOE_CHECK(!ec && std::filesystem::is_directory(dir), kIo,
                "cannot create the output directory '", out_dir, "'",
                ec ? ": " + ec.message() : std::string(), ".");

  // Everything is declared up front: the writer puts the header first and then takes the data in
  // this order, so experts can be generated, quantized and written one after another.
  const std::string mlp = moe_prefix(preset.layer);
  const std::string router_name = mlp + ".gate.weight";
  const std::string bias_name = mlp + ".gate.e_score_correction_bias";
  const bool with_bias = routing.kind == RoutingKind::kNoauxTc;
  const std::vector<Projection> projections = layer_projections(preset, num_experts, opt.seed);
  std::vector<TensorSpec> specs;
  specs.push_back({router_name, DType::BF16, {num_experts, preset.hidden_size}});
  if (with_bias) specs.push_back({bias_name, DType::F32, {num_experts}});
  for (const Projection& p : projections) {
    specs.push_back({p.prefix + ".weight", DType::U8, {p.rows, p.cols / 2}});
    specs.push_back(
        {p.prefix + ".weight_scale", DType::F8_E4M3, {p.rows, p.cols / format::kNvfp4BlockSize}});
    specs.push_back({p.prefix + ".weight_scale_2", DType::F32, {}});
    specs.push_back({p.prefix + ".input_scale", DType::F32, {}});
  }
  SafetensorsWriter writer((dir / "model.safetensors").string(), std::move(specs),
                           {{"format", "pt"}});

  write_json(dir / "config.json", model_config_json(preset, num_experts, routing));
  write_json(dir / "hf_quant_config.json", {{"producer", {{"name", "megamoe"}}},
                                            {"quantization",
                                             {{"quant_algo", "NVFP4"},
                                              {"group_size", format::kNvfp4BlockSize},
                                              {"exclude_modules", {"lm_head", mlp + ".gate"}}}}});

  // The router stays BF16 (it is excluded from quantization, as in real NVFP4 checkpoints). Drawn
  // like any weight (std ~0.02), its logits on unit-RMS hidden states spread with std
  // ~0.02*sqrt(H), about 1-2 for these models: a realistic mix of clear and close choices.
  {
    const std::vector<float> router =
        synth_weight(opt.seed, router_name, num_experts, preset.hidden_size);
    std::vector<uint16_t> router_bf16(router.size());
    std::transform(router.begin(), router.end(), router_bf16.begin(), f32_to_bf16);
    writer.append(router_name, as_bytes(router_bf16));
  }
  if (with_bias) {
    // Load-balancing biases are small next to the sigmoid scores in (0, 1) but move choices.
    std::vector<float> bias(static_cast<size_t>(num_experts));
    for (int64_t e = 0; e < num_experts; ++e) {
      bias[size_t(e)] = 0.05f * synth_scalar(opt.seed, bias_name, uint64_t(e));
    }
    writer.append(bias_name, as_bytes(bias));
  }

  // Workers generate and quantize projections in parallel; this thread writes them in order.
  // At most `window` projections are in flight, which bounds memory to a few projections per
  // thread whatever the layer size.
  const size_t total = projections.size();
  const int threads = int(
      std::min<size_t>(total, opt.threads > 0 ? size_t(opt.threads)
                                              : std::max(1u, std::thread::hardware_concurrency())));
  const size_t window = size_t(2 * threads);
  std::mutex mu;
  std::condition_variable cv;
  size_t next_task = 0;
  size_t next_write = 0;
  std::vector<std::optional<QuantizedProjection>> done(total);
  std::exception_ptr error;

  auto fail = [&](std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu);
    if (!error) error = e;
    cv.notify_all();
  };
  auto worker = [&] {
    std::vector<float> w;
    for (;;) {
      size_t i;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock,
                [&] { return error || next_task >= total || next_task < next_write + window; });
        if (error || next_task >= total) return;
        i = next_task++;
      }
      try {
        const Projection& p = projections[i];
        w.resize(size_t(p.rows * p.cols));
        synth_weight_into(opt.seed, p.prefix + ".weight", p.rows, p.cols, w);
        QuantizedProjection q;
        q.codes.resize(size_t(p.rows * p.cols / 2));
        q.scales.resize(size_t(p.rows * p.cols / format::kNvfp4BlockSize));
        q.weight_scale_2 = format::quantize_weight_modelopt(w, p.rows, p.cols, q.codes, q.scales);
        std::lock_guard<std::mutex> lock(mu);
        done[i] = std::move(q);
        cv.notify_all();
      } catch (...) {
        fail(std::current_exception());
        return;
      }
    }
  };

  std::vector<std::thread> pool;
  ProgressLine progress(opt.progress, "synth " + preset.name, total);
  uint64_t bytes_written = 0;
  try {
    for (int t = 0; t < threads; ++t) pool.emplace_back(worker);
    for (size_t i = 0; i < total; ++i) {
      QuantizedProjection q;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return error || done[i].has_value(); });
        if (error) break;
        q = std::move(*done[i]);
        done[i].reset();
        next_write = i + 1;
        cv.notify_all();
      }
      const Projection& p = projections[i];
      const float input_scale = p.input_amax / format::kNvfp4GlobalDivisor;
      writer.append(p.prefix + ".weight", as_bytes(q.codes));
      writer.append(p.prefix + ".weight_scale", as_bytes(q.scales));
      writer.append(p.prefix + ".weight_scale_2", as_bytes(q.weight_scale_2));
      writer.append(p.prefix + ".input_scale", as_bytes(input_scale));
      bytes_written += q.codes.size() + q.scales.size() + 2 * sizeof(float);
      progress.update(i + 1, bytes_written);
    }
  } catch (...) {
    fail(std::current_exception());
  }
  for (std::thread& t : pool) t.join();
  if (error) std::rethrow_exception(error);
  writer.finish();
}

}  // namespace megamoe
