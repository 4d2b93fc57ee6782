// Synthetic NVFP4 weights: realistic random values, each a pure function of (seed, tensor name,
// index), so that any tensor, row or element can be recomputed alone.
#include "synth/synth_weight.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "megamoe/dtype.h"
#include "megamoe/format.h"
#include "megamoe/presets.h"
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

}  // namespace

namespace synth_detail {

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

float synth_scalar(uint64_t seed, const std::string& name, uint64_t index) {
  return normal_from_bits(CounterStream(seed, name).bits(index));
}

}  // namespace synth_detail

using synth_detail::synth_weight_into;

std::vector<float> synth_weight(uint64_t seed, const std::string& name, int64_t rows,
                                int64_t cols) {
  MEGAMOE_CHECK(rows >= 0 && cols >= 0, kInvalidArgument, "synth_weight('", name, "'): shape [",
                rows, ", ", cols, "] has a negative dimension.");
  std::vector<float> w(size_t(rows * cols));
  synth_weight_into(seed, name, rows, cols, w);
  return w;
}

}  // namespace megamoe
