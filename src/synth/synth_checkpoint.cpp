// Synthetic NVFP4 MoE checkpoints: the layer's weights generated and quantized with the ModelOpt
// recipe on worker threads, streamed to disk in order, projection by projection.
#include <algorithm>
#include <chrono>
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
#include <thread>
#include <vector>

#include "megamoe/dtype.h"
#include "megamoe/format.h"
#include "megamoe/presets.h"
#include "megamoe/safetensors.h"
#include "megamoe/status.h"
#include "synth/synth_layer.h"
#include "synth/synth_weight.h"

namespace megamoe {

using synth_detail::check_preset;
using synth_detail::layer_projections;
using synth_detail::model_config_json;
using synth_detail::Projection;
using synth_detail::routing_for;
using synth_detail::synth_scalar;
using synth_detail::synth_weight_into;

namespace {

void write_json(const std::filesystem::path& path, const nlohmann::json& j) {
  std::ofstream f(path);
  f << j.dump(2) << '\n';
  f.close();
  MEGAMOE_CHECK(f.good(), kIo, "cannot write '", path.string(), "'.");
}

struct QuantizedProjection {
  std::vector<uint8_t> codes;   // [rows, cols/2]
  std::vector<uint8_t> scales;  // [rows, cols/16]
  float weight_scale_2 = 0.0f;
};

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
