// Helpers shared by the subcommands of the `megamoe` tool.
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>

#include "commands.h"
#include "megamoe/status.h"

namespace megamoe::tool {

Progress::Progress(std::string command, uint64_t total_bytes)
    : command_(std::move(command)),
      total_(total_bytes),
      start_(std::chrono::steady_clock::now()),
      last_(start_) {}

void Progress::update(uint64_t done_bytes, const std::string& current) {
  const auto now = std::chrono::steady_clock::now();
  if (now - last_ < std::chrono::seconds(1)) return;
  last_ = now;
  const double pct = total_ > 0 ? 100.0 * double(done_bytes) / double(total_) : 100.0;
  std::fprintf(stderr, "megamoe %s: %5.1f%% (%s of %s, %.1f s) %s\n", command_.c_str(), pct,
               human_bytes(done_bytes).c_str(), human_bytes(total_).c_str(),
               std::chrono::duration<double>(now - start_).count(), current.c_str());
}

void Progress::finish(const std::string& summary) {
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  std::fprintf(stderr, "megamoe %s: %s in %.1f s\n", command_.c_str(), summary.c_str(), secs);
}

std::string human_bytes(uint64_t bytes) {
  static const char* const kUnits[] = {"B", "kB", "MB", "GB", "TB"};
  double v = double(bytes);
  size_t u = 0;
  while (v >= 1000.0 && u + 1 < std::size(kUnits)) {
    v /= 1000.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.2f %s", v, kUnits[u]);
  return buf;
}

bool is_wide_float(DType t) { return t == DType::BF16 || t == DType::F16 || t == DType::F32; }

void widen_to_f32(DType t, const uint8_t* src, int64_t count, float* dst) {
  // Element by element through memcpy: the mapped bytes carry no alignment guarantee.
  switch (t) {
    case DType::BF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = bf16_to_f32(h);
      }
      return;
    case DType::F16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = f16_to_f32(h);
      }
      return;
    case DType::F32:
      std::memcpy(dst, src, size_t(count) * sizeof(float));
      return;
    default:
      MEGAMOE_FAIL(kInternal, "widen_to_f32 called with dtype ", dtype_name(t),
                   "; only BF16, F16 and F32 are widened.");
  }
}

void parallel_ranges(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& fn) {
  if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
  const int64_t parts = std::min<int64_t>(threads, n);
  if (parts <= 1) {
    if (n > 0) fn(0, n);
    return;
  }
  std::exception_ptr error;
  std::mutex mu;
  std::vector<std::thread> pool;
  for (int64_t p = 0; p < parts; ++p) {
    pool.emplace_back([&, p] {
      try {
        fn(n * p / parts, n * (p + 1) / parts);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
      }
    });
  }
  for (std::thread& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

void check_distinct_files(const std::string& in, const std::string& out) {
  std::error_code ec;
  MEGAMOE_CHECK(!std::filesystem::equivalent(in, out, ec), kInvalidArgument, "the output '", out,
                "' is the input file '", in, "'; write the result to a different file.");
}

void check_output_is_not_an_input(const std::string& out, const std::vector<std::string>& inputs) {
  struct stat o {};
  if (::stat(out.c_str(), &o) != 0) return;  // a new file cannot be an input
  for (const std::string& in : inputs) {
    struct stat i {};
    if (::stat(in.c_str(), &i) != 0) continue;
    MEGAMOE_CHECK(i.st_dev != o.st_dev || i.st_ino != o.st_ino, kInvalidArgument, "the output '",
                  out, "' is the input file '", in,
                  "'; write the result to a different file (never onto a file being read).");
  }
}

std::vector<std::string> checkpoint_input_files(const Checkpoint& ckpt) {
  std::vector<std::string> files;
  for (const auto& f : ckpt.files()) files.push_back(f->path());
  std::error_code ec;
  if (std::filesystem::is_directory(ckpt.path(), ec)) {
    for (const char* name : {"config.json", "hf_quant_config.json", "model.safetensors.index.json"}) {
      files.push_back((std::filesystem::path(ckpt.path()) / name).string());
    }
  }
  return files;
}

CLI::Option* add_precision_option(CLI::App& app, Precision& precision, const std::string& what) {
  // Checked while parsing, so a bad value fails as a command-line error before any work starts,
  // with parse_precision's message (the same words as every other API's).
  const CLI::Validator known(
      [](std::string& value) -> std::string {
        try {
          parse_precision(value);
          return {};
        } catch (const Error& e) {
          return e.what();
        }
      },
      "w4a16|w4a8|auto");
  return app
      .add_option_function<std::string>(
          "--precision", [&precision](const std::string& value) { precision = parse_precision(value); }, what)
      ->check(known)
      ->default_str(precision_name(precision));
}

namespace {
std::optional<std::string> strip_suffix(const std::string& name, std::string_view suffix) {
  if (name.size() <= suffix.size() || !name.ends_with(suffix)) return std::nullopt;
  return name.substr(0, name.size() - suffix.size());
}
}  // namespace

std::optional<std::string> nvfp4_linear_base(const Checkpoint& ckpt, const TensorInfo& t) {
  if (auto base = strip_suffix(t.name, ".weight_packed")) return base;
  if (t.dtype != DType::U8) return std::nullopt;
  auto base = strip_suffix(t.name, ".weight");
  if (!base) return std::nullopt;
  const auto scale = ckpt.find(*base + ".weight_scale");
  if (!scale || scale->info->dtype != DType::F8_E4M3) return std::nullopt;
  return base;
}

}  // namespace megamoe::tool
