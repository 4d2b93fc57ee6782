// What the CPU and GPU suites share: fresh seeds named in every failure, one random engine, random
// NVFP4 linears, experts, layers, hidden states and routings, the error measures and the bound
// the GPU output is held to, and scratch directories. Host code only: no CUDA here.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <random>
#include <span>
#include <string_view>
#include <vector>

#include "megamoe/moe.h"
#include "megamoe/reference.h"

namespace megamoe::testing {

// ---- seeds

// A seed drawn afresh each run: the suites see new data every time, so a property that holds
// must hold for every draw (a failure names its seed, to be replayed).
uint64_t fresh_seed();

// fresh_seed() (or a given seed), named as "seed N" in the trace of every failure while this
// object lives: at the top of a test, or as a fixture's member for the whole test. It is the seed
// wherever one is expected: `const SeedTrace seed; Rng rng(seed);`.
class SeedTrace {
 public:
  // The caller's file and line (__builtin_FILE/LINE: clang 14, the sanitizer build's compiler, has
  // no std::source_location).
  explicit SeedTrace(const char* file = __builtin_FILE(), int line = __builtin_LINE());
  explicit SeedTrace(uint64_t seed, const char* file = __builtin_FILE(), int line = __builtin_LINE());
  operator uint64_t() const { return value_; }

 private:
  uint64_t value_;
  ::testing::ScopedTrace trace_;
};

// ---- random data

// The engine behind every generator here (a std::uniform_random_bit_generator, so std::
// distributions and std::shuffle take it too), with the draws the tests use most.
class Rng {
 public:
  using result_type = std::mt19937_64::result_type;
  explicit Rng(uint64_t seed) : engine_(seed) {}
  static constexpr result_type min() { return std::mt19937_64::min(); }
  static constexpr result_type max() { return std::mt19937_64::max(); }
  result_type operator()() { return engine_(); }

  int uniform_int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(engine_); }  // [lo, hi]
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(engine_); }
  double normal() { return std::normal_distribution<double>(0.0, 1.0)(engine_); }

 private:
  std::mt19937_64 engine_;
};

// How a random linear's ue4m3 block scales are drawn.
enum class ScaleCodes {
  // 2^-4..2^3 around a level per row, as a real checkpoint's: outputs look like a real layer's.
  kRealistic,
  // Every valid byte 0x00..0x7E uniformly: zero blocks under nonzero codes, subnormal scales, 448.
  kEveryCode,
  // Uniformly 0x00..top, top drawn per tensor in 0x30..0x7E: the largest scale (hence W4A8's
  // rescale exponent) differs between tensors.
  kUpToRandomTop,
};

// How a random linear's global scale (weight_scale_2) is drawn.
enum class GlobalScale {
  kUnitGain,     // U(0.5, 2) / (3·sqrt(in)) with realistic scales: outputs of order 1 from N(0, 1) inputs
  kAnyExponent,  // U(1, 2)·2^j, j uniform in -12..-4: the exponent varies from tensor to tensor
};

struct LinearDraw {
  ScaleCodes scales = ScaleCodes::kRealistic;
  GlobalScale global = GlobalScale::kUnitGain;
};

// A random [out, in] NVFP4 linear: every code byte uniform (all 16 e2m1 codes), scales as `draw`
// says, a global scale of its own.
Nvfp4Linear random_linear(Rng& rng, int64_t out, int64_t in, LinearDraw draw = {});
// gate and up [I, H], down [H, I], each drawn as `draw` says.
ExpertWeights random_expert(Rng& rng, int64_t H, int64_t I, LinearDraw draw = {});
// E routed experts of intermediate size I, top-k routing of the default kind, a shared expert of
// intermediate size shared_I when it is > 0, the SwiGLU clamp `limit`; every linear as `draw`.
MoeLayer random_layer(Rng& rng, int64_t H, int64_t I, int64_t E, int top_k, int64_t shared_I = 0,
                      std::optional<float> limit = std::nullopt, LinearDraw draw = {});

// How random hidden states' values are drawn (bf16).
enum class HiddenValues {
  kNormal,         // N(0, 1), as `megamoe bench` draws them
  kWideExponents,  // N(0, 1)·2^j, j uniform in -4..4 per value
  // Each run of 128 consecutive values (W4A8's activation groups where H is a multiple of 128)
  // N(0, 1)·2^j, j uniform in -6..6 per run, and one run in ten all zero.
  kScaledBlocks,
};
// [T, H] bf16 hidden states.
std::vector<uint16_t> random_hidden(Rng& rng, int64_t T, int64_t H, HiddenValues values = HiddenValues::kNormal);

// A routing written out: ids and weights [tokens, k].
reference::TopK make_topk(int64_t tokens, int k, std::vector<int32_t> ids, std::vector<float> weights);
// What a router gives: k distinct experts per token (the first on `only_expert` when it is >= 0),
// positive weights that sum to 1.
reference::TopK random_topk(Rng& rng, int64_t T, int64_t E, int k, int only_expert = -1);
// k = 1 with exactly counts[e] tokens on expert e (T = their sum), in random token order.
reference::TopK counted_topk(Rng& rng, const std::vector<int>& counts);
// Any routing the reference must take, not only a router's: ids uniform in [0, E) with repeats
// (token 0's first two slots always share an expert when k >= 2), weights uniform in [-0.5, 1.5).
reference::TopK arbitrary_topk(Rng& rng, int64_t T, int64_t E, int k);

// ---- errors and bounds

// Issue 3's bound on the relative L2 error of a GPU layer's output against the CPU reference's,
// both rounded to bf16 once: about bf16's relative half-ulp (2^-9 = 1.95e-3). The kernels' fp32
// sums (in schedule order) and SFU silu move a value a few fp32 ulps before that rounding
// (docs/design.md §2), which flips some elements by one bf16 ulp; a lost scale, a wrong row or a
// wrong expert gives an error of order 1.
inline constexpr double kMaxRelL2 = 2e-3;

// ‖got − want‖₂ / ‖want‖₂ over the elements where got is finite (‖got − want‖₂ where want is all
// zero), and how many elements of got are not (NaN or ±inf: an unwritten or overflowed output).
struct ErrorStats {
  double rel_l2 = 0;
  int64_t nonfinite = 0;
};
ErrorStats compare(std::span<const float> got, std::span<const float> want);
ErrorStats compare(std::span<const uint16_t> got_bf16, std::span<const float> want);
// The relative L2 error over every element: NaN where got holds a non-finite value, so that any
// bound on it fails.
double rel_l2(std::span<const float> got, std::span<const float> want);
double rel_l2(std::span<const float> got, std::span<const double> want);

std::vector<float> widen(std::span<const uint16_t> bf16);

// ---- files

// A fresh directory under the system's temporary directory, named after the running test (and
// this process and a random number, so that concurrent runs do not collide), removed with
// everything in it when this object goes.
class ScratchDir {
 public:
  explicit ScratchDir(std::string_view prefix = "megamoe");
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace megamoe::testing
