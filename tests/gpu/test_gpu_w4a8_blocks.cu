// The sm90 W4A8 building blocks on the device (backends/sm90_w4a8/), bit for bit against the W4A8
// definitions (docs/w4a8.md, format::): the weight decode of every valid (scale byte, code) pair
// at every rescale exponent k, through the fp8 A fragment, its register layout, and a real fp8
// wgmma fed by the decode and by the activation codes in the fragment's K order; the activation
// quantization of bf16 and fp32 rows; the rescale exponents from prepacked scales. Their host
// side: tests/cpu/test_w4a8_blocks.cpp.
#include <gtest/gtest.h>

#include <cuda_bf16.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "backends/sm90_w4a16/sm90_w4a16_layout.h"
#include "backends/sm90_w4a16/sm90_w4a16_prepack.h"
#include "backends/sm90_w4a16/sm90_w4a16_weights.h"
#include "backends/sm90_w4a8/sm90_w4a8_act_quant.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_decode.cuh"
#include "backends/sm90_w4a8/sm90_w4a8_layout.h"
#include "backends/sm90_w4a8/sm90_w4a8_rescale.h"
#include "gpu_test_util.h"
#include "kernels/common/ptx_wgmma.cuh"
#include "megamoe/dtype.h"
#include "megamoe/format.h"
#include "tests/common/error_matchers.h"
#include "tests/common/w4a8_decode_cases.h"
#include "tests/common/test_util.h"

namespace megamoe {
namespace {

namespace w4a8 = kernels::sm90::w4a8;
namespace w4a16 = kernels::sm90::w4a16;
using testing::DeviceBuffer;

constexpr int kRows = w4a16::kTileM;  // one 64-row tile
constexpr int kK = 128;               // two 64-wide chunks: four k32 fragments per thread
constexpr int kFragments = kK / w4a8::kFragmentK;

// Every thread of one warpgroup decodes its four k32 fragments of a prepacked (64, 128) tile
// column: out[((fragment * 128) + thread) * 4 + register].
__global__ void decode_fragments_kernel(const uint8_t* codes, const uint8_t* scales, uint32_t exponent_addend,
                                        uint32_t* out) {
  const int tid = static_cast<int>(threadIdx.x), quad = tid / 4;
  for (int chunk = 0; chunk < kK / w4a16::kChunkK; ++chunk) {
    const uint4 words = reinterpret_cast<const uint4*>(codes + chunk * w4a16::kCodeBytesPerTile)[tid];
    const uint2 scale = reinterpret_cast<const uint2*>(scales + chunk * w4a16::kScaleBytesPerTile)[quad];
    uint32_t a[4];
    w4a8::decode_k32(words.x, words.y, scale.x, exponent_addend, a);
    for (int r = 0; r < 4; ++r) out[((2 * chunk) * 128 + tid) * 4 + r] = a[r];
    w4a8::decode_k32(words.z, words.w, scale.y, exponent_addend, a);
    for (int r = 0; r < 4; ++r) out[((2 * chunk + 1) * 128 + tid) * 4 + r] = a[r];
  }
}

// A (64, 128) weight matrix and its prepacked bytes (sm90_w4a16_layout.h).
struct Tile {
  std::vector<uint8_t> codes, scales;  // checkpoint layout
  std::vector<uint8_t> packed_codes, packed_scales;

  Tile(std::vector<uint8_t> c, std::vector<uint8_t> s) : codes(std::move(c)), scales(std::move(s)) {
    const Nvfp4Linear lin = make_owned_linear(kRows, kK, codes, scales, 1.0f);
    packed_codes.resize(static_cast<size_t>(runtime::prepacked_code_bytes(kRows, kK)));
    packed_scales.resize(static_cast<size_t>(runtime::prepacked_scale_bytes(kRows, kK)));
    runtime::prepack_w2(lin, 0, kK, packed_codes, packed_scales);
  }
  uint8_t scale(int row, int k) const { return scales[static_cast<size_t>(row * (kK / 16) + k / 16)]; }
  // The code the decode sees: the prepack clears the codes of zero-scale blocks.
  uint8_t code(int row, int k) const {
    return scale(row, k) == 0 ? 0 : format::e2m1_code_at(codes.data() + row * (kK / 2), k);
  }
};

// Byte `byte` of register `reg` of fragment `fragment` of warpgroup thread `tid` holds the weight
// at (row, logical k): the wgmma m64nNk32 e4m3 A layout (PTX ISA; CUTLASS GMMA::ALayout_64x32),
// written out here, then the K permutation the activations follow.
struct FragmentByte {
  int row, k;
};
FragmentByte fragment_byte(int fragment, int tid, int reg, int byte) {
  const int warp = tid / 32, g = (tid % 32) / 4, t = tid % 4;
  const int fragment_k = 4 * t + byte + 16 * (reg / 2);
  return {16 * warp + g + 8 * (reg % 2), w4a8::kFragmentK * fragment + w4a8::k_of_position(fragment_k)};
}

std::vector<uint8_t> decode_on_device(const Tile& tile, int k) {
  DeviceBuffer<uint8_t> codes(tile.packed_codes), scales(tile.packed_scales);
  DeviceBuffer<uint32_t> out(static_cast<size_t>(kFragments * 128 * 4));
  out.poison();  // 0xFF is NaN in e4m3: no decoded weight (satfinite) is ever that byte
  decode_fragments_kernel<<<1, 128>>>(codes.get(), scales.get(), w4a8::scale_exponent_addend(k), out.get());
  gpu::check_cuda(cudaDeviceSynchronize(), "decode_fragments_kernel");
  const std::vector<uint32_t> words = out.download();
  std::vector<uint8_t> bytes(words.size() * 4);
  for (size_t i = 0; i < words.size(); ++i) {
    for (int b = 0; b < 4; ++b) bytes[4 * i + static_cast<size_t>(b)] = static_cast<uint8_t>(words[i] >> (8 * b));
  }
  return bytes;
}

template <class Check>
void for_each_fragment_byte(const std::vector<uint8_t>& bytes, Check check) {
  for (int f = 0; f < kFragments; ++f) {
    for (int tid = 0; tid < 128; ++tid) {
      for (int reg = 0; reg < 4; ++reg) {
        for (int byte = 0; byte < 4; ++byte) {
          check(fragment_byte(f, tid, reg, byte), bytes[static_cast<size_t>(((f * 128 + tid) * 4 + reg) * 4 + byte)],
                f, tid, reg, byte);
        }
      }
    }
  }
}

TEST(GpuW4a8Decode, EveryScaleCodeAndRescaleExponentIsTheDefinedWeight) {
  MEGAMOE_REQUIRE_GPU();
  for (int k = w4a8::kMinRescaleExponent; k <= w4a8::kMaxRescaleExponent; ++k) {
    SCOPED_TRACE(::testing::Message() << "k = " << k);
    // 512 blocks cycle through every scale byte a tensor of this k may hold (127 at k = 3); each
    // block holds all 16 codes, in an order that depends on the row and the block.
    const std::vector<uint8_t> valid = testing::w4a8_scales_for(k);
    std::vector<uint8_t> codes(kRows * kK / 2), scales(kRows * kK / 16);
    for (size_t b = 0; b < scales.size(); ++b) scales[b] = valid[b % valid.size()];
    for (int r = 0; r < kRows; ++r) {
      for (int kk = 0; kk < kK; ++kk) {
        const uint8_t code = static_cast<uint8_t>((kk % 16 + 3 * r + 5 * (kk / 16)) % 16);
        uint8_t& byte = codes[static_cast<size_t>(r * (kK / 2) + kk / 2)];
        byte = kk % 2 ? static_cast<uint8_t>((byte & 0x0F) | code << 4) : static_cast<uint8_t>((byte & 0xF0) | code);
      }
    }
    const Tile tile(codes, scales);
    int64_t mismatches = 0;
    const auto check = [&](FragmentByte at, uint8_t got, int f, int tid, int reg, int byte) {
      const uint8_t code = tile.code(at.row, at.k), scale = tile.scale(at.row, at.k);
      const uint8_t want = format::w4a8_weight_e4m3(code, scale, k);
      if (got != want && ++mismatches <= 8) {
        ADD_FAILURE() << "fragment " << f << ", thread " << tid << ", register " << reg << ", byte " << byte
                      << " (row " << at.row << ", k " << at.k << "): code " << int(code) << ", scale byte 0x"
                      << std::hex << int(scale) << ": got 0x" << int(got) << ", want 0x" << int(want);
      }
    };
    for_each_fragment_byte(decode_on_device(tile, k), check);
    ASSERT_EQ(mismatches, 0);
  }
}

// Known values at known places: with every scale 1 (k = 3), codes 0..7 decode to 8 distinct
// bytes, so a matrix whose codes spell one base-8 digit of each element's row or k tells, byte
// by byte, which element every register byte holds.
TEST(GpuW4a8Decode, EveryRegisterByteHoldsItsFragmentElement) {
  MEGAMOE_REQUIRE_GPU();
  std::array<int, 256> digit_of_byte;
  digit_of_byte.fill(-1);
  for (int c = 0; c < 8; ++c) digit_of_byte[format::w4a8_weight_e4m3(static_cast<uint8_t>(c), 0x38, 3)] = c;
  // Digits of (row, k): row % 8, row / 8, k % 8, k / 8 % 8, k / 64.
  const auto digit = [](int d, int row, int k) {
    const int v[5] = {row % 8, row / 8, k % 8, k / 8 % 8, k / 64};
    return v[d];
  };
  std::vector<std::vector<uint8_t>> runs;
  for (int d = 0; d < 5; ++d) {
    std::vector<uint8_t> codes(kRows * kK / 2);
    for (int r = 0; r < kRows; ++r) {
      for (int k = 0; k < kK; k += 2) {
        codes[static_cast<size_t>(r * (kK / 2) + k / 2)] =
            static_cast<uint8_t>(digit(d, r, k) | digit(d, r, k + 1) << 4);
      }
    }
    runs.push_back(decode_on_device(Tile(codes, std::vector<uint8_t>(kRows * kK / 16, 0x38)), 3));
  }
  for (size_t i = 0; i < runs[0].size(); ++i) {
    int d[5];
    for (size_t r = 0; r < 5; ++r) {
      d[r] = digit_of_byte[runs[r][i]];
      ASSERT_GE(d[r], 0) << "byte " << i << " of run " << r << " is 0x" << std::hex << int(runs[r][i]);
    }
    const int reg_byte = static_cast<int>(i % 16);
    const int tid = static_cast<int>(i / 16 % 128), f = static_cast<int>(i / 16 / 128);
    const FragmentByte want = fragment_byte(f, tid, reg_byte / 4, reg_byte % 4);
    ASSERT_EQ(d[0] + 8 * d[1], want.row) << "fragment " << f << ", thread " << tid << ", register " << reg_byte / 4
                                          << ", byte " << reg_byte % 4;
    ASSERT_EQ(d[2] + 8 * d[3] + 64 * d[4], want.k) << "fragment " << f << ", thread " << tid << ", register "
                                                   << reg_byte / 4 << ", byte " << reg_byte % 4;
  }
}

// ---- a real fp8 wgmma: decoded weights (A, registers) times activation codes in the fragment's
// K order (B, K-major shared memory with the 128-byte swizzle of the mainloops).

constexpr int kTokens = 16;

__global__ void __launch_bounds__(128) wgmma_kernel(const uint8_t* codes, const uint8_t* scales,
                                                    uint32_t exponent_addend, const uint8_t* act, float* out) {
  __shared__ __align__(1024) uint8_t b_tile[kTokens * kK];
  const int tid = static_cast<int>(threadIdx.x);
  // Row n's 16-byte chunk c goes to chunk c ^ (n % 8) (SW128; one row of 128 bytes per token).
  for (int i = tid; i < kTokens * 8; i += 128) {
    const int n = i / 8, c = i % 8;
    reinterpret_cast<uint4*>(b_tile)[n * 8 + (c ^ (n % 8))] = reinterpret_cast<const uint4*>(act)[n * 8 + c];
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the wgmma reads through the async proxy
  __syncthreads();
  uint32_t a[kFragments][4];
  for (int chunk = 0; chunk < kK / w4a16::kChunkK; ++chunk) {
    const uint4 words = reinterpret_cast<const uint4*>(codes + chunk * w4a16::kCodeBytesPerTile)[tid];
    const uint2 scale = reinterpret_cast<const uint2*>(scales + chunk * w4a16::kScaleBytesPerTile)[tid / 4];
    w4a8::decode_k32(words.x, words.y, scale.x, exponent_addend, a[2 * chunk]);
    w4a8::decode_k32(words.z, words.w, scale.y, exponent_addend, a[2 * chunk + 1]);
  }
  float d[8] = {};
  const uint64_t desc = kernels::ptx::make_sw128_desc(b_tile);
  kernels::ptx::wgmma_fence();
  using Mma = cute::SM90::GMMA::MMA_64x16x32_F32E4M3E4M3_RS_TN<>;
  for (int f = 0; f < kFragments; ++f) {
    // k32 step f starts 32 bytes further into each swizzled row (16-byte units in the descriptor).
    Mma::fma(a[f][0], a[f][1], a[f][2], a[f][3], desc + 2 * f, d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]);
  }
  kernels::ptx::wgmma_commit();
  kernels::ptx::wgmma_wait_all();
  // Accumulator layout (GMMA::CLayout_64xN): d[v0 + 2 v1 + 4 v2] = (row 16w + g + 8 v1, token 2t + v0 + 8 v2).
  const int warp = tid / 32, g = (tid % 32) / 4, t = tid % 4;
  for (int v = 0; v < 8; ++v) {
    out[(16 * warp + g + 8 * ((v >> 1) & 1)) * kTokens + 2 * t + (v & 1) + 8 * (v >> 2)] = d[v];
  }
}

TEST(GpuW4a8Decode, FragmentsAndActivationCodesFeedTheFp8Wgmma) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  std::vector<uint8_t> codes(kRows * kK / 2), scales(kRows * kK / 16);
  for (uint8_t& c : codes) c = static_cast<uint8_t>(rng());
  for (uint8_t& s : scales) s = static_cast<uint8_t>(rng.uniform_int(0, 0x7E));
  const int k = format::w4a8_weight_rescale_exponent(scales);
  const Tile tile(codes, scales);
  // Activations: bf16 rows quantized on the device (codes in the fragment's K order).
  std::vector<uint16_t> hidden = testing::random_hidden(rng, kTokens, kK, testing::HiddenValues::kWideExponents);
  DeviceBuffer<uint16_t> d_hidden(hidden);
  DeviceBuffer<uint8_t> d_act(static_cast<size_t>(kTokens * kK));
  DeviceBuffer<float> d_act_scale(kTokens);
  const auto* hidden_bf16 = reinterpret_cast<const __nv_bfloat16*>(d_hidden.get());
  w4a8::quantize_act_kernel<<<1, 128>>>(hidden_bf16, kTokens, kK, d_act.get(), d_act_scale.get());
  DeviceBuffer<uint8_t> d_codes(tile.packed_codes), d_scales(tile.packed_scales);
  DeviceBuffer<float> d_out(static_cast<size_t>(kRows * kTokens));
  d_out.poison();
  wgmma_kernel<<<1, 128>>>(d_codes.get(), d_scales.get(), w4a8::scale_exponent_addend(k), d_act.get(), d_out.get());
  gpu::check_cuda(cudaDeviceSynchronize(), "wgmma_kernel");
  const std::vector<float> got = d_out.download();

  // The same product on the host from the definitions: sum over k of W_hat[m, k] * q[n, k].
  const std::vector<float> widened = testing::widen(hidden);
  std::vector<uint8_t> q(static_cast<size_t>(kTokens * kK));
  std::vector<int32_t> e(kTokens);
  format::quantize_activation_w4a8(std::vector<double>(widened.begin(), widened.end()), kTokens, kK, q, e);
  for (int m = 0; m < kRows; ++m) {
    for (int n = 0; n < kTokens; ++n) {
      double sum = 0.0, magnitude = 0.0;
      for (int kk = 0; kk < kK; ++kk) {
        const uint8_t w = format::w4a8_weight_e4m3(tile.code(m, kk), tile.scale(m, kk), k);
        const double term =
            static_cast<double>(format::e4m3_to_f32(w)) * format::e4m3_to_f32(q[static_cast<size_t>(n * kK + kk)]);
        sum += term;
        magnitude += std::fabs(term);
      }
      // The fp8 MMA adds its exact products with a limited internal precision (docs/w4a8.md §4):
      // 2^-10 of the terms' magnitude is far above that and far below any misplaced element.
      const double g = got[static_cast<size_t>(m * kTokens + n)];
      ASSERT_LE(std::fabs(g - sum), std::ldexp(magnitude, -10) + 1e-30)
          << "row " << m << ", token " << n << ": got " << g << ", want " << sum;
    }
  }
}

// ---- activation quantization

// Codes (fragment K order) and block scales 2^e from the device, compared with the definition on x.
template <class T>
void expect_act_quant_matches(const std::vector<T>& x, const std::vector<double>& exact, int64_t rows, int64_t cols) {
  DeviceBuffer<T> d_x(x);
  DeviceBuffer<uint8_t> d_codes(static_cast<size_t>(rows * cols));
  DeviceBuffer<float> d_scale(static_cast<size_t>(rows * cols / w4a8::kActBlock));
  d_codes.poison();      // 0xFF: NaN, never a code (satfinite)
  d_scale.poison(0xFF);  // NaN: never a scale
  using Device = std::conditional_t<std::is_same_v<T, uint16_t>, __nv_bfloat16, float>;
  const auto* x_device = reinterpret_cast<const Device*>(d_x.get());
  w4a8::quantize_act_kernel<<<3, 256>>>(x_device, rows, cols, d_codes.get(), d_scale.get());
  gpu::check_cuda(cudaDeviceSynchronize(), "quantize_act_kernel");
  const std::vector<uint8_t> codes = d_codes.download();
  const std::vector<float> scales = d_scale.download();

  std::vector<uint8_t> want_codes(static_cast<size_t>(rows * cols));
  std::vector<int32_t> want_exps(static_cast<size_t>(rows * cols / w4a8::kActBlock));
  format::quantize_activation_w4a8(exact, rows, cols, want_codes, want_exps);
  for (size_t b = 0; b < want_exps.size(); ++b) {
    ASSERT_EQ(scales[b], std::ldexp(1.0f, want_exps[b])) << "row " << b / (cols / 128) << ", block " << b % (cols / 128);
    for (int p = 0; p < w4a8::kActBlock; ++p) {
      const size_t at = b * w4a8::kActBlock, k = at + static_cast<size_t>(w4a8::k_of_position(p));
      ASSERT_EQ(codes[at + static_cast<size_t>(p)], want_codes[k])
          << "row " << b / (cols / 128) << ", column " << k % static_cast<size_t>(cols) << " (stored at " << p
          << " of its block), x = " << exact[k] << ", block exponent " << want_exps[b];
    }
  }
}

// What a block's values look like; the widths stress the exponent rule and the subnormal and
// flushed ends of e4m3.
enum class Block { kNormal, kMixed, kTiny, kSubnormal, kZero, kSignedZero, kAtBoundary, kHuge };

double block_value(testing::Rng& rng, Block kind, int i, int exponent) {
  switch (kind) {
    case Block::kNormal: return std::ldexp(rng.normal(), exponent);
    case Block::kMixed:  // down to 2^-24 of the largest: onto e4m3's subnormals and flushed
      return std::ldexp(rng.normal(), exponent + rng.uniform_int(-24, 0));
    case Block::kTiny: return std::ldexp(rng.normal(), -118);
    case Block::kSubnormal: return std::ldexp(rng.uniform_int(-127, 127), -133);  // bf16 subnormals: the clamp
    case Block::kZero: return 0.0;
    case Block::kSignedZero: return i % 3 == 0 ? -0.0 : 0.0;
    case Block::kAtBoundary:  // amax 448 * 2^e exactly, or the next bf16 above it
      if (i != 7) return std::ldexp(rng.normal(), exponent);
      return std::ldexp(448.0, exponent) * (rng.uniform_int(0, 1) ? 1.0 : 1.0 + 1.0 / 128);
    case Block::kHuge: return std::ldexp(rng.normal(), 120);
  }
  return 0.0;
}

TEST(GpuW4a8ActQuant, Bf16RowsAreTheDefinedCodesAndExponents) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t rows = 37, cols = 7 * w4a8::kActBlock;
  std::vector<uint16_t> x(static_cast<size_t>(rows * cols));
  for (size_t b = 0; b < x.size(); b += w4a8::kActBlock) {
    const Block kind = static_cast<Block>(rng.uniform_int(0, 7));
    const int exponent = rng.uniform_int(-40, 40);
    for (int i = 0; i < w4a8::kActBlock; ++i) {
      x[b + static_cast<size_t>(i)] = f32_to_bf16(static_cast<float>(block_value(rng, kind, i, exponent)));
    }
  }
  const std::vector<float> widened = testing::widen(x);
  expect_act_quant_matches(x, std::vector<double>(widened.begin(), widened.end()), rows, cols);
}

// The SwiGLU output: fp32 straight from the registers. Values with all 24 significant bits (ties
// and near-ties of e4m3 rounding after the scaling), exact midpoints, fp32 subnormals.
TEST(GpuW4a8ActQuant, Fp32RowsAreTheDefinedCodesAndExponents) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t rows = 29, cols = 5 * w4a8::kActBlock;
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (size_t b = 0; b < x.size(); b += w4a8::kActBlock) {
    const int kind = rng.uniform_int(0, 4);
    const int exponent = rng.uniform_int(-60, 60);
    for (int i = 0; i < w4a8::kActBlock; ++i) {
      float v = 0.0f;
      switch (kind) {
        case 0: v = static_cast<float>(std::ldexp(rng.uniform(-1.0, 1.0), exponent)); break;
        case 1:  // e4m3 midpoints once scaled: (2m + 1) * 2^(q-1) for the block's scale 2^e
          v = static_cast<float>(std::ldexp(2 * rng.uniform_int(-15, 15) + 1, exponent - rng.uniform_int(4, 14)));
          break;
        case 2: v = std::bit_cast<float>(static_cast<uint32_t>(rng()) & 0x807FFFFFu); break;  // subnormal, any sign
        case 3: v = static_cast<float>(std::ldexp(rng.normal(), exponent + rng.uniform_int(-30, 0))); break;
        default: v = static_cast<float>(std::ldexp(i == 0 ? 448.0 : rng.normal(), exponent)); break;
      }
      x[b + static_cast<size_t>(i)] = v;
    }
  }
  expect_act_quant_matches(x, std::vector<double>(x.begin(), x.end()), rows, cols);
}

// ---- the rescale exponents from the prepacked scales on the device

TEST(GpuW4a8Rescale, PrepackedOnDeviceEqualsHost) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int64_t H = 128, I = 64;
  MoeLayer layer = testing::random_layer(rng, H, I, 5, 2, 2 * I, std::nullopt, {testing::ScaleCodes::kUpToRandomTop});
  // An all-zero tensor (k = 0) and one whose largest scale is 2^-9 (k = -15).
  for (const auto [expert, all_zero] : {std::pair<size_t, bool>{1, true}, {3, false}}) {
    const Nvfp4Linear& up = layer.experts[expert].up;
    std::vector<uint8_t> codes(up.weight, up.weight + up.out_features * up.in_features / 2);
    std::vector<uint8_t> scales(static_cast<size_t>(up.out_features * up.in_features / 16));
    for (uint8_t& b : scales) b = all_zero ? 0 : static_cast<uint8_t>(rng() % 2);
    layer.experts[expert].up =
        make_owned_linear(up.out_features, up.in_features, std::move(codes), std::move(scales), up.weight_scale_2);
  }
  const auto weights = runtime::upload_sm90_prepacked(layer, nullptr);
  const MoeProblem shape = MoeProblem::from_layer(layer, 1);
  const runtime::W4a8RescaleExponents want = runtime::w4a8_rescale_exponents(layer);
  const runtime::W4a8RescaleExponents got =
      runtime::w4a8_rescale_exponents_prepacked(shape, weights->w13_scales, weights->w2_scales, nullptr);
  EXPECT_EQ(got.routed, want.routed);
  EXPECT_EQ(got.shared, want.shared);
  EXPECT_EQ(want.routed[1][1], 0);
  EXPECT_EQ(want.routed[3][1], -15);

  // A byte no scale encodes to (5: below the smallest, (12 << 3)) in expert 4's W13, up rows
  // (the high half of a scale word).
  const uint16_t bad_half = w4a16::scale_half(0x05, 0);
  uint8_t* at = weights->w13_scales + 4 * weights->w13_scale_stride + 2;
  gpu::check_cuda(cudaMemcpy(at, &bad_half, sizeof(bad_half), cudaMemcpyHostToDevice), "cudaMemcpy");
  EXPECT_MEGAMOE_ERROR(
      runtime::w4a8_rescale_exponents_prepacked(shape, weights->w13_scales, weights->w2_scales, nullptr),
      kInvalidArgument, "w13", "expert 4", "up rows", "0x05");
}

}  // namespace
}  // namespace megamoe
