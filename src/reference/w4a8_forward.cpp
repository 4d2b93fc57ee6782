// Exact CPU emulation of the W4A8 MoE forward (docs/w4a8.md, normative): what a W4A8 kernel
// computes, with every rounding the document defines and no other. Shares the routing, grouping,
// threading and combine of the W4A16 reference (forward_driver.h); only the inside of an expert
// differs.
//
// Per (token, expert), with x the bf16 hidden:
//   x_hat = e4m3(x·2^-e)·2^e          per token and 128 hidden elements, 2^e its power-of-two scale
//   W_hat = e4m3(e2m1·ue4m3·2^-k)     per projection one k (the weight rescale), RNE, exact input
//   g = (Σ_blocks Σ_{k in block} x_hat·Wg_hat) · (s2_gate·2^k_gate)        u likewise
//     Each block's partial sum is exact in double whatever its order (every term is a multiple of
//     2^(e-18) and the block's sum stays below 2^(e+25)); the blocks are then summed in double in
//     ascending K order, and multiplied once by the global scale times 2^k (an exact product).
//   clamp and a = silu(g)·u in double exactly as W4A16, but not rounded to bf16:
//   a_hat = e4m3(a·2^-e)·2^e           per (token, slot) and 128 intermediate elements
//   y = (Σ_blocks Σ a_hat·Wd_hat) · (s2_down·2^k_down); the combine and the final rounding are
//   W4A16's.
// The emulation stores x_hat and a_hat as doubles (exact), so a block's partial sum carries its
// activation scale already: Σ x_hat·W_hat = 2^e · Σ e4m3·e4m3, both exact.

#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <memory>
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

namespace {

using detail::kTileRows;
using detail::silu;
using detail::Task;
using detail::Unit;

constexpr int kBlock = format::kW4a8ActBlockSize;
constexpr const char* kFn = "moe_forward_w4a8";
// The rescale exponents w4a8_weight_rescale_exponent can return.
constexpr int kMinRescale = -15;
constexpr int kMaxRescale = 3;

// The e4m3 weight value W_hat of every (ue4m3 byte, e2m1 code) for one rescale k. Invalid scale
// bytes (>= 0x7F) never reach it: scales are validated first.
struct WeightTable {
  std::array<std::array<float, 16>, 128> v;
  explicit WeightTable(int k) {
    for (int s = 0; s < 128; ++s) {
      for (int c = 0; c < 16; ++c) {
        v[s][c] = format::e4m3_to_f32(format::w4a8_weight_e4m3(static_cast<uint8_t>(c),
                                                               static_cast<uint8_t>(s), k));
      }
    }
  }
};

const WeightTable& weight_table(int k) {
  static const std::vector<std::unique_ptr<WeightTable>> tables = [] {
    std::vector<std::unique_ptr<WeightTable>> t;
    for (int k = kMinRescale; k <= kMaxRescale; ++k) t.push_back(std::make_unique<WeightTable>(k));
    return t;
  }();
  return *tables[k - kMinRescale];
}

// a = silu(g)·u after the layer's clamp (§5), in double.
double swiglu(const MoeLayer& layer, double g, double up) {
  if (layer.swiglu_limit) {
    const double L = *layer.swiglu_limit;
    g = std::min(g, L);
    up = std::clamp(up, -L, L);
  }
  return silu(g) * up;
}

// One projection as the W4A8 MMA sees it: its rescale k and the global scale it is folded into.
struct W4a8Linear {
  const Nvfp4Linear* w = nullptr;
  int k = 0;
  double scale = 0.0;  // weight_scale_2 · 2^k, exact in double
  const WeightTable* table = nullptr;
};

struct W4a8Expert {
  W4a8Linear gate, up, down;
};

std::string hex_byte(uint8_t b) {
  static constexpr char kDigits[] = "0123456789ABCDEF";
  return std::string{'0', 'x', kDigits[b >> 4], kDigits[b & 0xF]};
}

// Validates every block scale (naming the first bad one as W4A16's reference does) and derives k.
W4a8Linear prepare_linear(const Nvfp4Linear& w, const std::string& expert, const char* proj) {
  const int64_t blocks_per_row = w.in_features / format::kNvfp4BlockSize;
  const int64_t blocks = w.out_features * blocks_per_row;
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t b = w.weight_scale[i];
    MEGAMOE_CHECK(format::ue4m3_is_valid(b), kInvalidArgument, kFn, ": ", expert, " ", proj,
                  ".weight_scale[", i / blocks_per_row, ", ", i % blocks_per_row,
                  "] is the byte ", hex_byte(b),
                  ", not a valid ue4m3 block scale (it must be finite and non-negative: sign "
                  "bit clear, not 0x7F).");
  }
  W4a8Linear out;
  out.w = &w;
  out.k = format::w4a8_weight_rescale_exponent({w.weight_scale, static_cast<size_t>(blocks)});
  out.scale = std::ldexp(static_cast<double>(w.weight_scale_2), out.k);
  out.table = &weight_table(out.k);
  return out;
}

W4a8Expert prepare_expert(const ExpertWeights& w, const std::string& name) {
  return {prepare_linear(w.gate, name, "gate_proj"), prepare_linear(w.up, name, "up_proj"),
          prepare_linear(w.down, name, "down_proj")};
}

// Decodes rows [row0, row0 + kTileRows) into tile[k * kTileRows + r] as W_hat (without the
// global scale), the layout of the W4A16 reference's tiles.
void decode_rows(const W4a8Linear& L, int64_t row0, float* tile) {
  const Nvfp4Linear& W = *L.w;
  const int64_t K = W.in_features;
  const int64_t blocks = K / format::kNvfp4BlockSize;
  for (int r = 0; r < kTileRows; ++r) {
    const int64_t row = row0 + r;
    const uint8_t* codes = W.weight + row * (K / 2);
    const uint8_t* sbytes = W.weight_scale + row * blocks;
    for (int64_t b = 0; b < blocks; ++b) {
      const std::array<float, 16>& v = L.table->v[sbytes[b]];
      float* out = tile + b * format::kNvfp4BlockSize * kTileRows + r;
      const uint8_t* c = codes + b * (format::kNvfp4BlockSize / 2);
      for (int j = 0; j < format::kNvfp4BlockSize / 2; ++j) {
        out[(2 * j) * kTileRows] = v[c[j] & 0xF];  // element 2j: the low nibble
        out[(2 * j + 1) * kTileRows] = v[c[j] >> 4];
      }
    }
  }
}

// kTileRows dot products of x_hat[0..K) with a decoded tile: per 128-element block an exact
// partial sum, the partials added in ascending block order.
std::array<double, kTileRows> dot_tile_blocked(const double* x, const float* tile, int64_t K) {
  std::array<double, kTileRows> acc{};
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
    std::array<double, kTileRows> part{};
    for (int64_t k = k0; k < k0 + kBlock; ++k) {
      const double xk = x[k];
      for (int r = 0; r < kTileRows; ++r) {
        part[r] += xk * static_cast<double>(tile[k * kTileRows + r]);
      }
    }
    for (int r = 0; r < kTileRows; ++r) acc[r] += part[r];
  }
  return acc;
}

// x_hat of `n` values (n % 128 == 0): one scale per 128 consecutive values.
void quantize_dequantize(const double* x, int64_t n, double* out) {
  std::vector<uint8_t> codes(n);
  std::vector<int32_t> exps(n / kBlock);
  format::quantize_activation_w4a8({x, static_cast<size_t>(n)}, 1, n, codes, exps);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = std::ldexp(static_cast<double>(format::e4m3_to_f32(codes[i])), exps[i / kBlock]);
  }
}

struct W4a8Numerics {
  const MoeLayer& layer;
  std::vector<std::optional<W4a8Expert>> routed;  // prepared where used
  std::optional<W4a8Expert> shared;

  const W4a8Expert& of(const Unit& u) const {
    if (layer.shared_expert && u.w == &*layer.shared_expert) return *shared;
    return *routed[static_cast<size_t>(u.w - layer.experts.data())];
  }

  void load_hidden(std::span<const uint16_t> hidden_bf16, std::vector<double>& x) const {
    for (size_t i = 0; i < hidden_bf16.size(); ++i) x[i] = bf16_to_f32(hidden_bf16[i]);
    quantize_dequantize(x.data(), static_cast<int64_t>(x.size()), x.data());
  }

  // g and u per pair and row, then a = silu(g)·u unrounded (finish_act quantizes it).
  void gate_up(const Task& task, const std::vector<double>& x) const {
    Unit& u = *task.unit;
    const W4a8Expert& e = of(u);
    const int64_t H = layer.hidden_size;
    const int64_t I = u.w->intermediate_size();
    std::vector<float> gate_tile(H * kTileRows), up_tile(H * kTileRows);
    for (int64_t i0 = task.row_begin; i0 < task.row_end; i0 += kTileRows) {
      decode_rows(e.gate, i0, gate_tile.data());
      decode_rows(e.up, i0, up_tile.data());
      for (size_t p = 0; p < u.token.size(); ++p) {
        const double* xt = x.data() + u.token[p] * H;
        const std::array<double, kTileRows> g_acc = dot_tile_blocked(xt, gate_tile.data(), H);
        const std::array<double, kTileRows> u_acc = dot_tile_blocked(xt, up_tile.data(), H);
        for (int r = 0; r < kTileRows; ++r) {
          u.act[p * I + i0 + r] = swiglu(layer, g_acc[r] * e.gate.scale, u_acc[r] * e.up.scale);
        }
      }
    }
  }

  // a_hat: per (token, slot) and 128 intermediate elements. A kernel holds a in fp32, so a value
  // beyond fp32's range has no W4A8 result to emulate: it is rejected.
  void finish_act(std::vector<Unit>& units) const {
    for (Unit& u : units) {
      const int64_t I = u.w->intermediate_size();
      for (size_t p = 0; p < u.token.size(); ++p) {
        double* a = u.act.data() + p * I;
        for (int64_t i = 0; i < I; ++i) {
          MEGAMOE_CHECK(std::fabs(a[i]) <= FLT_MAX, kInvalidArgument, kFn, ": the SwiGLU output "
                        "of ", u.name, " for token ", u.token[p], " (of its chunk), element ", i,
                        ", is ", a[i], ", beyond fp32's range: W4A8 needs finite fp32 values.");
        }
        quantize_dequantize(a, I, a);
      }
    }
  }

  void down(const Task& task, std::vector<double>& y) const {
    Unit& u = *task.unit;
    const W4a8Expert& e = of(u);
    const int64_t H = layer.hidden_size;
    const int64_t I = u.w->intermediate_size();
    std::vector<float> tile(I * kTileRows);
    for (int64_t h0 = task.row_begin; h0 < task.row_end; h0 += kTileRows) {
      decode_rows(e.down, h0, tile.data());
      for (size_t p = 0; p < u.token.size(); ++p) {
        const std::array<double, kTileRows> acc =
            dot_tile_blocked(u.act.data() + p * I, tile.data(), I);
        for (int r = 0; r < kTileRows; ++r) y[u.output[p] * H + h0 + r] = acc[r] * e.down.scale;
      }
    }
  }
};

// Checks what W4A8 adds to moe_forward's contract and prepares every expert the routing uses.
W4a8Numerics prepare(const MoeLayer& layer, std::span<const uint16_t> hidden_bf16,
                     int64_t tokens, const TopK& topk, const ForwardOptions& opt) {
  detail::check_forward_arguments(kFn, layer, hidden_bf16, tokens, topk, opt);
  MEGAMOE_CHECK(layer.hidden_size % kBlock == 0 && layer.intermediate_size % kBlock == 0,
                kInvalidArgument, kFn, ": hidden_size ", layer.hidden_size,
                " and intermediate_size ", layer.intermediate_size,
                " must be multiples of 128: W4A8 has one activation scale per 128 elements "
                "along K.");
  if (layer.shared_expert) {
    const int64_t I = layer.shared_expert->intermediate_size();
    MEGAMOE_CHECK(I % kBlock == 0, kInvalidArgument, kFn,
                  ": the shared expert's intermediate size ", I,
                  " must be a multiple of 128 (one activation scale per 128 elements along K).");
  }
  const int64_t H = layer.hidden_size;
  for (int64_t i = 0; i < tokens * H; ++i) {
    MEGAMOE_CHECK(std::isfinite(bf16_to_f32(hidden_bf16[i])), kInvalidArgument, kFn,
                  ": hidden[", i / H, ", ", i % H, "] is ", bf16_to_f32(hidden_bf16[i]),
                  "; W4A8 quantizes the hidden states to e4m3, which needs finite values.");
  }
  W4a8Numerics num{layer, std::vector<std::optional<W4a8Expert>>(layer.num_experts), {}};
  for (const int32_t id : topk.ids) {
    if (!num.routed[id]) {
      num.routed[id] = prepare_expert(layer.experts[id], "expert " + std::to_string(id));
    }
  }
  if (layer.shared_expert && tokens > 0) {
    num.shared = prepare_expert(*layer.shared_expert, "the shared expert");
  }
  return num;
}

}  // namespace

W4a8ProjectionOutput w4a8_project(const MoeLayer& layer, int expert, W4a8Projection proj,
                                  std::span<const double> in) {
  constexpr const char* kProjFn = "w4a8_project";
  layer.validate();
  MEGAMOE_CHECK(expert == kW4a8SharedExpert || (expert >= 0 && expert < layer.num_experts), kInvalidArgument,
                kProjFn, ": expert ", expert, " is neither a routed expert (0..", layer.num_experts - 1,
                ") nor kW4a8SharedExpert (-1)");
  MEGAMOE_CHECK(expert != kW4a8SharedExpert || layer.shared_expert, kInvalidArgument, kProjFn,
                ": the layer has no shared expert");
  const ExpertWeights& w = expert == kW4a8SharedExpert ? *layer.shared_expert : layer.experts[expert];
  const char* name = proj == W4a8Projection::kGate ? "gate_proj" : proj == W4a8Projection::kUp ? "up_proj" : "down_proj";
  const Nvfp4Linear& lin = proj == W4a8Projection::kGate ? w.gate : proj == W4a8Projection::kUp ? w.up : w.down;
  MEGAMOE_CHECK(static_cast<int64_t>(in.size()) == lin.in_features && lin.in_features % kBlock == 0,
                kInvalidArgument, kProjFn, ": ", name, " takes ", lin.in_features,
                " inputs (a multiple of 128), got ", in.size());
  const W4a8Linear L = prepare_linear(lin, expert == kW4a8SharedExpert ? "the shared expert" : "expert " + std::to_string(expert), name);
  const int64_t K = lin.in_features, blocks16 = K / format::kNvfp4BlockSize;
  W4a8ProjectionOutput out{std::vector<double>(lin.out_features), std::vector<double>(lin.out_features)};
  for (int64_t n = 0; n < lin.out_features; ++n) {
    const uint8_t* codes = lin.weight + n * (K / 2);
    const uint8_t* sbytes = lin.weight_scale + n * blocks16;
    double value = 0.0, magnitude = 0.0;
    for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
      double part = 0.0, part_mag = 0.0;  // exact (docs/w4a8.md §4)
      for (int64_t k = k0; k < k0 + kBlock; ++k) {
        const uint8_t c = k % 2 == 0 ? codes[k / 2] & 0xF : codes[k / 2] >> 4;
        const double term = in[k] * static_cast<double>(L.table->v[sbytes[k / format::kNvfp4BlockSize]][c]);
        part += term;
        part_mag += std::fabs(term);
      }
      value += part;
      magnitude += part_mag;
    }
    out.value[n] = value * L.scale;
    out.magnitude[n] = magnitude * L.scale;
  }
  return out;
}

std::vector<double> w4a8_swiglu(const MoeLayer& layer, std::span<const double> gate, std::span<const double> up) {
  MEGAMOE_CHECK(gate.size() == up.size(), kInvalidArgument, "w4a8_swiglu: ", gate.size(), " gate and ", up.size(),
                " up values; they must be as many");
  std::vector<double> a(gate.size());
  for (size_t i = 0; i < a.size(); ++i) a[i] = swiglu(layer, gate[i], up[i]);
  return a;
}

std::vector<double> w4a8_quantize_dequantize(std::span<const double> x) {
  MEGAMOE_CHECK(x.size() % kBlock == 0, kInvalidArgument, "w4a8_quantize_dequantize: ", x.size(),
                " values; W4A8 quantizes whole blocks of 128");
  std::vector<double> out(x.size());
  quantize_dequantize(x.data(), static_cast<int64_t>(x.size()), out.data());
  return out;
}

std::vector<uint16_t> moe_forward_w4a8(const MoeLayer& layer,
                                       std::span<const uint16_t> hidden_bf16, int64_t tokens,
                                       const TopK& topk, const ForwardOptions& opt) {
  const W4a8Numerics num = prepare(layer, hidden_bf16, tokens, topk, opt);
  const int64_t H = layer.hidden_size;
  std::vector<uint16_t> out(tokens * H);
  detail::run_forward(layer, hidden_bf16, tokens, topk, opt, num,
                      [&](int64_t t, const std::vector<double>& sum) {
                        for (int64_t h = 0; h < H; ++h) out[t * H + h] = f64_to_bf16(sum[h]);
                      });
  return out;
}

std::vector<float> moe_forward_w4a8_f32(const MoeLayer& layer,
                                        std::span<const uint16_t> hidden_bf16, int64_t tokens,
                                        const TopK& topk, const ForwardOptions& opt) {
  const W4a8Numerics num = prepare(layer, hidden_bf16, tokens, topk, opt);
  const int64_t H = layer.hidden_size;
  std::vector<float> out(tokens * H);
  detail::run_forward(layer, hidden_bf16, tokens, topk, opt, num,
                      [&](int64_t t, const std::vector<double>& sum) {
                        for (int64_t h = 0; h < H; ++h) {
                          out[t * H + h] = static_cast<float>(sum[h]);
                        }
                      });
  return out;
}

}  // namespace megamoe::reference
