// Reference W4A16 MoE forward (docs/design.md §2), straight from the NVFP4 bytes.
//
// Numerics, per (token, expert):
//   g = (Σ_k x[k]·Wg[i,k]) · s2_gate     u = (Σ_k x[k]·Wu[i,k]) · s2_up
//   x is the bf16 hidden widened to double; W[i,k] = e2m1 · ue4m3 is decoded exactly into fp32
//   (a product of a 2- and a 4-significant-bit value); each term x·W then has at most 14
//   significant bits and is exact in double. Every dot product is ONE double accumulator summed
//   in plain index order k = 0, 1, ..., K-1, so any straightforward loop reproduces it bit for bit.
//   clamp (when swiglu_limit is set): g = min(g, L), u = clamp(u, -L, L)
//   a = bf16(silu(g)·u): silu(g)·u in double, rounded to bf16 ONCE (directly from double)
//   y = (Σ_i a[i]·Wd[h,i]) · s2_down            (exact terms again, one ordered accumulator)
//   out = bf16(Σ_slots w·y + y_shared): double, slots in top-k order, shared expert last.
//
// Speed: the (token, slot) pairs are grouped by expert, each weight row of an active expert is
// decoded once into an fp32 tile and dotted with every token routed there. Several rows are
// processed together so each token carries several independent accumulators (ILP and SIMD
// across rows) without changing any single dot product's summation order. Work is split over
// (expert, row range) tasks; every output element is written by exactly one task in a fixed
// order, so results do not depend on the thread count.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "megamoe/dtype.h"
#include "megamoe/format.h"
#include "megamoe/reference.h"
#include "megamoe/status.h"
#include "reference/forward_driver.h"

namespace megamoe::reference {

// f64_to_bf16 and the fp32 result of moe_forward_f32 rely on IEEE conversions (round to nearest
// even, overflow to infinity).
static_assert(std::numeric_limits<float>::is_iec559 && std::numeric_limits<double>::is_iec559);

// Going through fp32 first would round twice: 1 + 2^-8 + 2^-30 becomes the bf16 tie 1 + 2^-8
// in fp32 and then 1, not 1 + 2^-7.
uint16_t f64_to_bf16(double v) {
  // Infinities and NaN convert exactly through fp32.
  if (!std::isfinite(v)) return f32_to_bf16(static_cast<float>(v));
  // Round the magnitude; the sign is put back at the end (so -0 and tiny negatives give -0).
  const double a = std::fabs(v);
  int e = 0;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  // bf16 keeps 8 significant bits, so the spacing near a is 2^(e-8); below the normal range
  // it is the subnormal spacing 2^-133.
  const int q = std::max(e - 8, -133);
  const double scaled = std::ldexp(a, -q);  // exact: a power-of-two scaling, stays normal
  double r = std::floor(scaled);
  const double frac = scaled - r;  // exact
  if (frac > 0.5 || (frac == 0.5 && std::fmod(r, 2.0) != 0.0)) r += 1.0;
  // r·2^q is a bf16 value (exact in fp32), or 2^128 when rounding overflowed, which IEEE
  // conversion turns into the infinity RNE asks for.
  return f32_to_bf16(static_cast<float>(std::copysign(std::ldexp(r, q), v)));
}

namespace {

using detail::kTileRows;
using detail::silu;
using detail::Task;
using detail::Unit;

// The two e2m1 values of every packed byte: [byte][0] is the low nibble (even element),
// [byte][1] the high nibble (odd element), docs/design.md §2.
struct E2m1PairTable {
  std::array<std::array<float, 2>, 256> v;
  E2m1PairTable() {
    for (int b = 0; b < 256; ++b) {
      v[b][0] = format::e2m1_to_f32(static_cast<uint8_t>(b & 0xF));
      v[b][1] = format::e2m1_to_f32(static_cast<uint8_t>(b >> 4));
    }
  }
};

// Every ue4m3 scale byte decoded once; invalid bytes (negative, NaN) are flagged.
struct ScaleTable {
  std::array<float, 256> value;
  std::array<bool, 256> valid;
  ScaleTable() {
    for (int b = 0; b < 256; ++b) {
      value[b] = format::e4m3_to_f32(static_cast<uint8_t>(b));
      valid[b] = format::ue4m3_is_valid(static_cast<uint8_t>(b));
    }
  }
};

const E2m1PairTable& e2m1_pairs() {
  static const E2m1PairTable table;
  return table;
}
const ScaleTable& scales() {
  static const ScaleTable table;
  return table;
}

std::string hex_byte(uint8_t b) {
  static constexpr char kDigits[] = "0123456789ABCDEF";
  return std::string{'0', 'x', kDigits[b >> 4], kDigits[b & 0xF]};
}

// Decodes rows [row0, row0 + kTileRows) of W into tile[k * kTileRows + r]: the kTileRows
// weights of one column k are adjacent. Values are e2m1 · ue4m3 without the global scale: exact
// in fp32.
void decode_rows(const Nvfp4Linear& W, int64_t row0, float* tile, const std::string& expert,
                 const char* proj) {
  const E2m1PairTable& pairs = e2m1_pairs();
  const ScaleTable& sc = scales();
  const int64_t K = W.in_features;
  const int64_t blocks = K / format::kNvfp4BlockSize;
  for (int r = 0; r < kTileRows; ++r) {
    const int64_t row = row0 + r;
    const uint8_t* codes = W.weight + row * (K / 2);
    const uint8_t* sbytes = W.weight_scale + row * blocks;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t sbyte = sbytes[b];
      MEGAMOE_CHECK(sc.valid[sbyte], kInvalidArgument, "moe_forward: ", expert, " ", proj,
                    ".weight_scale[", row, ", ", b, "] is the byte ", hex_byte(sbyte),
                    ", not a valid ue4m3 block scale (it must be finite and non-negative: sign "
                    "bit clear, not 0x7F).");
      const float s = sc.value[sbyte];
      float* out = tile + b * format::kNvfp4BlockSize * kTileRows + r;
      const uint8_t* c = codes + b * (format::kNvfp4BlockSize / 2);
      for (int j = 0; j < format::kNvfp4BlockSize / 2; ++j) {
        out[(2 * j) * kTileRows] = pairs.v[c[j]][0] * s;
        out[(2 * j + 1) * kTileRows] = pairs.v[c[j]][1] * s;
      }
    }
  }
}

// kTileRows dot products of one activation row x[0..K) with a decoded tile, each one
// accumulator in index order.
std::array<double, kTileRows> dot_tile(const double* x, const float* tile, int64_t K) {
  std::array<double, kTileRows> acc{};
  for (int64_t k = 0; k < K; ++k) {
    const double xk = x[k];
    for (int r = 0; r < kTileRows; ++r) {
      acc[r] += xk * static_cast<double>(tile[k * kTileRows + r]);
    }
  }
  return acc;
}

// L1 for rows [row_begin, row_end) of the unit's gate and up: a for every pair and those rows.
void run_gate_up(const Task& task, const std::vector<double>& x, int64_t H,
                 const std::optional<float>& limit) {
  Unit& u = *task.unit;
  const ExpertWeights& w = *u.w;
  const int64_t I = w.intermediate_size();
  const double s2_gate = w.gate.weight_scale_2;
  const double s2_up = w.up.weight_scale_2;
  std::vector<float> gate_tile(H * kTileRows), up_tile(H * kTileRows);
  for (int64_t i0 = task.row_begin; i0 < task.row_end; i0 += kTileRows) {
    decode_rows(w.gate, i0, gate_tile.data(), u.name, "gate_proj");
    decode_rows(w.up, i0, up_tile.data(), u.name, "up_proj");
    for (size_t p = 0; p < u.token.size(); ++p) {
      const double* xt = x.data() + u.token[p] * H;
      const std::array<double, kTileRows> g_acc = dot_tile(xt, gate_tile.data(), H);
      const std::array<double, kTileRows> u_acc = dot_tile(xt, up_tile.data(), H);
      for (int r = 0; r < kTileRows; ++r) {
        double g = g_acc[r] * s2_gate;
        double up = u_acc[r] * s2_up;
        if (limit) {
          const double L = *limit;
          g = std::min(g, L);
          up = std::clamp(up, -L, L);
        }
        u.act[p * I + i0 + r] = bf16_to_f32(f64_to_bf16(silu(g) * up));
      }
    }
  }
}

// L2 for rows [row_begin, row_end) of the unit's down projection: y for every pair and rows.
void run_down(const Task& task, std::vector<double>& y, int64_t H) {
  Unit& u = *task.unit;
  const ExpertWeights& w = *u.w;
  const int64_t I = w.intermediate_size();
  const double s2_down = w.down.weight_scale_2;
  std::vector<float> tile(I * kTileRows);
  for (int64_t h0 = task.row_begin; h0 < task.row_end; h0 += kTileRows) {
    decode_rows(w.down, h0, tile.data(), u.name, "down_proj");
    for (size_t p = 0; p < u.token.size(); ++p) {
      const std::array<double, kTileRows> acc = dot_tile(u.act.data() + p * I, tile.data(), I);
      for (int r = 0; r < kTileRows; ++r) y[u.output[p] * H + h0 + r] = acc[r] * s2_down;
    }
  }
}

// The W4A16 numerics (top of this file) for detail::run_forward.
struct W4a16Numerics {
  const MoeLayer& layer;
  void load_hidden(std::span<const uint16_t> hidden_bf16, std::vector<double>& x) const {
    for (size_t i = 0; i < hidden_bf16.size(); ++i) x[i] = bf16_to_f32(hidden_bf16[i]);
  }
  void gate_up(const Task& task, const std::vector<double>& x) const {
    run_gate_up(task, x, layer.hidden_size, layer.swiglu_limit);
  }
  void finish_act(std::vector<Unit>&) const {}  // a is rounded to bf16 element by element
  void down(const Task& task, std::vector<double>& y) const {
    run_down(task, y, layer.hidden_size);
  }
};

}  // namespace

std::vector<uint16_t> moe_forward(const MoeLayer& layer, std::span<const uint16_t> hidden_bf16,
                                  int64_t tokens, const TopK& topk,
                                  const ForwardOptions& opt) {
  detail::check_forward_arguments("moe_forward", layer, hidden_bf16, tokens, topk, opt);
  const int64_t H = layer.hidden_size;
  std::vector<uint16_t> out(tokens * H);
  detail::run_forward(layer, hidden_bf16, tokens, topk, opt, W4a16Numerics{layer},
                      [&](int64_t t, const std::vector<double>& sum) {
    for (int64_t h = 0; h < H; ++h) out[t * H + h] = f64_to_bf16(sum[h]);
  });
  return out;
}

std::vector<float> moe_forward_f32(const MoeLayer& layer, std::span<const uint16_t> hidden_bf16,
                                   int64_t tokens, const TopK& topk,
                                   const ForwardOptions& opt) {
  detail::check_forward_arguments("moe_forward", layer, hidden_bf16, tokens, topk, opt);
  const int64_t H = layer.hidden_size;
  std::vector<float> out(tokens * H);
  detail::run_forward(layer, hidden_bf16, tokens, topk, opt, W4a16Numerics{layer},
                      [&](int64_t t, const std::vector<double>& sum) {
    for (int64_t h = 0; h < H; ++h) out[t * H + h] = static_cast<float>(sum[h]);
  });
  return out;
}

}  // namespace megamoe::reference
