// NVFP4 numerics (docs/design.md §2, normative): e2m1 elements, ue4m3 block scales (one per 16
// elements along K), the fp32 per-tensor global scale, and MXFP4's ue8m0 block-32 scales.
// Host code only; device decoders live in src/kernels/common.
#pragma once

#include <cstdint>
#include <span>

#include "megamoe/dtype.h"

namespace megamoe {

// Any float-like element of the listed dtypes to f32 (BF16, F16, F32, F8_E4M3, F8_E5M2).
// Throws megamoe::Error(kInvalidArgument) for integer dtypes.
float load_as_f32(DType t, const void* base, int64_t index);

}  // namespace megamoe

namespace megamoe::format {

inline constexpr int kNvfp4BlockSize = 16;  // elements per ue4m3 scale, along K
inline constexpr int kMxfp4BlockSize = 32;  // elements per ue8m0 scale, along K
// Bytes an NVFP4 weight takes in memory: its 4-bit code and its share of the block's scale byte
// (the per-tensor fp32 global scale aside). 0.5625.
inline constexpr double kNvfp4BytesPerWeight = 0.5 + 1.0 / kNvfp4BlockSize;
inline constexpr float kE2m1Max = 6.0f;
inline constexpr float kE4m3Max = 448.0f;
// ModelOpt's global-scale divisor: 6 (e2m1 max) * 448 (e4m3 max).
inline constexpr float kNvfp4GlobalDivisor = 2688.0f;

// ---- E2M1: code bits [3]=sign, [2:1]=exponent, [0]=mantissa; |v| in {0,.5,1,1.5,2,3,4,6}.
float e2m1_to_f32(uint8_t code);  // code & 0xF is used
// Round-to-nearest-even onto the e2m1 grid, saturating at +-6 (infinities too). The sign bit
// follows the input's (so -0 and tiny negatives give 0x8). NaN has no e2m1 code: callers reject
// it first; the function maps it to +0 to stay total.
uint8_t f32_to_e2m1(float x);

// ---- E4M3 (float8_e4m3fn): bias 7, no infinities, 0x7F/0xFF NaN, max 448, min subnormal 2^-9.
float e4m3_to_f32(uint8_t code);  // exact, subnormals included; NaN codes give quiet NaN
// RNE, saturating to +-448 (finite inputs above 448 and +-inf give +-448); NaN gives 0x7F.
uint8_t f32_to_e4m3(float x);
// UE4M3 block scale: an e4m3 byte that must be finite and non-negative (sign bit clear, not
// 0x7F). Returns false for an invalid scale byte.
bool ue4m3_is_valid(uint8_t code);

// ---- E5M2 (float8_e5m2): IEEE-like, bias 15, with inf and NaN.
float e5m2_to_f32(uint8_t code);

// ---- UE8M0 (MXFP4 block-32 scale): value 2^(code-127); 0xFF is NaN.
float ue8m0_to_f32(uint8_t code);

// ---- Nibble packing: element 2j in the low nibble of byte j, element 2j+1 in the high nibble.
inline uint8_t pack_e2m1_pair(uint8_t even, uint8_t odd) {
  return static_cast<uint8_t>((even & 0xF) | ((odd & 0xF) << 4));
}
inline uint8_t e2m1_code_at(const uint8_t* packed, int64_t index) {
  const uint8_t b = packed[index >> 1];
  return (index & 1) ? static_cast<uint8_t>(b >> 4) : static_cast<uint8_t>(b & 0xF);
}

// A 2-D NVFP4 weight [N, K] as stored in a ModelOpt checkpoint (views, not owning).
struct Nvfp4View {
  int64_t rows = 0;             // N (output features)
  int64_t cols = 0;             // K (input features), a multiple of 16
  const uint8_t* codes = nullptr;   // [N, K/2] packed e2m1
  const uint8_t* scales = nullptr;  // [N, K/16] ue4m3
  float global_scale = 1.0f;        // weight_scale_2
};

// Where ModelOpt's exporter ran, which changes two things it writes (docs/design.md §2): the
// global scale (one fp32 ulp apart for about a fifth of amax values) and the NaN byte of an
// all-zero weight's block scales (the platform's default NaN). Published checkpoints are exported
// on GPUs: that is the default.
enum class ExportDevice {
  kGpu,  // s2 = fl32(amax * fl32(1/2688)); zero-weight scale byte 0x7F
  kCpu,  // s2 = fl32(amax / 2688); zero-weight scale byte 0xFF (x86)
};
inline constexpr ExportDevice kDefaultExportDevice = ExportDevice::kGpu;
const char* export_device_name(ExportDevice d);  // "gpu" / "cpu"

// What ModelOpt's exporter writes for a weight whose amax is 0 (an all-zero weight, or a fused
// group that is all zero): weight_scale_2 = 0, every block scale a NaN byte (0x7F or 0xFF, by
// ExportDevice), every code byte 0x77. The signature means "all-zero weight"; NaN and negative
// scales are invalid everywhere else.
inline constexpr uint8_t kZeroWeightScaleByteGpu = 0x7F;
inline constexpr uint8_t kZeroWeightScaleByteCpu = 0xFF;
inline constexpr uint8_t kZeroWeightCodeByte = 0x77;
// True iff `w` is exactly that signature: global_scale is +0 or -0, every block scale byte is a
// NaN (0x7F or 0xFF) and every code byte 0x77 (rows * cols > 0, pointers non-null).
bool is_modelopt_zero_weight(const Nvfp4View& w);
// For owned, writable bytes: where [rows, cols] codes/scales/global_scale are that signature,
// rewrites them to zero codes, zero block scales and global scale 1 (the same all-zero weight,
// decodable by anything that multiplies the three) and returns true; otherwise changes nothing.
bool zero_weight_to_decodable(uint8_t* codes, uint8_t* scales, float& global_scale, int64_t rows,
                              int64_t cols);

// ModelOpt weight recipe (docs/design.md §2), bit for bit:
//   s2 = amax(|W|)/2688 (evaluated as on `device`); per block b = amax_block/(6*s2), 1.0 where
//   the block is all zero, clamped to [2^-9, 448], rounded to e4m3 (RNE); code =
//   e2m1_rne(x/(b*s2)). All fp32, in ModelOpt's evaluation order (weight_quant.cpp documents
//   each step). The code's sign comes from x/(b*s2) < 0 as in ModelOpt, so a -0 weight gets 0x0
//   (f32_to_e2m1 gives 0x8). A matrix whose amax is 0 gets weight_scale_2 = 0 and the
//   zero-weight signature above, as the exporter writes it.
// `w` is row-major [rows, cols] fp32 (callers widen bf16/f16 exactly first); cols % 16 == 0.
// Outputs: codes [rows, cols/2], scales [rows, cols/16]. Returns weight_scale_2.
// Throws megamoe::Error(kInvalidArgument) on non-finite input or bad shapes.
float quantize_weight_modelopt(std::span<const float> w, int64_t rows, int64_t cols,
                               std::span<uint8_t> codes, std::span<uint8_t> scales,
                               ExportDevice device = kDefaultExportDevice);
// Same, with the global scale given: computed from the amax of a tensor streamed in parts, or
// of a fused group (gate and up share one). global_scale == 0 (an amax of 0) writes the
// zero-weight signature of `device` and is only allowed when every element of `w` is zero.
void quantize_weight_with_global_scale(std::span<const float> w, int64_t rows, int64_t cols,
                                       float global_scale, std::span<uint8_t> codes,
                                       std::span<uint8_t> scales,
                                       ExportDevice device = kDefaultExportDevice);
// s2 = amax/2688 as evaluated on `device` (0 where amax == 0, as the exporter writes it).
float modelopt_global_scale(float amax, ExportDevice device = kDefaultExportDevice);

// w[n,k] = e2m1(code) * ue4m3(scale) * global_scale, in fp32 (exact product, one rounding). The
// zero-weight signature (is_modelopt_zero_weight) gives zeros.
void dequantize(const Nvfp4View& w, std::span<float> out);
// The same weights rounded once to bf16 (round to nearest even) from the exact product, not
// through fp32 (which would round twice). `out` holds bf16 bit patterns.
void dequantize_to_bf16(const Nvfp4View& w, std::span<uint16_t> out);

// Activation recipe (docs/design.md §2): gs = 2688/amax (or the reciprocal of a static input_scale);
// sf = e4m3_rne(gs*amax_block/6) saturating at 448; element = e2m1_rne(x*gs/sf) (0 where sf==0).
// x is [rows, cols], cols % 16 == 0. Outputs codes [rows, cols/2], scales [rows, cols/16].
void quantize_activation(std::span<const float> x, int64_t rows, int64_t cols, float gs,
                         std::span<uint8_t> codes, std::span<uint8_t> scales);
// x_hat = e2m1 * sf / gs.
void dequantize_activation(std::span<const uint8_t> codes, std::span<const uint8_t> scales,
                           int64_t rows, int64_t cols, float gs, std::span<float> out);

// MXFP4: e2m1 codes with one ue8m0 scale per 32 elements along K: w = e2m1 * 2^(s-127).
void dequantize_mxfp4(std::span<const uint8_t> codes, std::span<const uint8_t> scales,
                      int64_t rows, int64_t cols, std::span<float> out);

// ---- W4A8 (docs/w4a8.md, normative): e4m3 activations with one power-of-two scale per 128
// elements along K, and NVFP4 weights converted to e4m3 as e2m1 * ue4m3 * 2^-k, one k per tensor.
inline constexpr int kW4a8ActBlockSize = 128;   // activation elements per scale, along K
inline constexpr int kW4a8MinActScaleExp = -126;  // the smallest activation scale is 2^-126

enum class E4m3Overflow {
  kSaturate,  // to +-448, as PTX cvt .satfinite
  kNan,       // to NaN (0x7F with the sign), as PyTorch's .to(torch.float8_e4m3fn)
};
// Round-to-nearest-even of a double straight to e4m3 (one rounding: going through fp32 first
// could round twice), subnormals included. Magnitudes above 464 (the midpoint between 448 and
// the 480 that e4m3fn lacks) and infinities overflow as `overflow` says; 464 itself is a tie and
// goes to 448 (even). NaN gives 0x7F. The sign is kept (tiny negatives give 0x80).
uint8_t f64_to_e4m3(double x, E4m3Overflow overflow = E4m3Overflow::kSaturate);

// The exponent e of the scale 2^e of an activation block whose largest magnitude is amax: the
// smallest integer e >= -126 with amax <= 448 * 2^e (so amax = 0 gives -126). Exact: no
// division, no rounding. Throws kInvalidArgument unless amax is finite and >= 0.
int w4a8_act_scale_exponent(double amax);

// Quantizes x [rows, cols] (cols % 128 == 0) per row and per 128 consecutive elements:
// e = w4a8_act_scale_exponent(max |x|), code = f64_to_e4m3(x * 2^-e) (x * 2^-e is exact and at
// most 448 in magnitude, so nothing saturates). x_hat = e4m3(code) * 2^e.
// Outputs codes [rows, cols] and scale_exponents [rows, cols/128]. Throws kInvalidArgument on
// bad shapes or a non-finite x.
void quantize_activation_w4a8(std::span<const double> x, int64_t rows, int64_t cols,
                              std::span<uint8_t> codes, std::span<int32_t> scale_exponents);

// The weight rescale k of one NVFP4 tensor (per expert and projection): with S the largest of
// its ue4m3 block scales, the smallest integer k with 6 * S * 2^-k <= 448 (k = 0 if every scale
// is 0). Then no product e2m1 * ue4m3 * 2^-k exceeds 448. k runs from -15 (S = 2^-9) to 3
// (S >= 320; ModelOpt's exporter always has S = 448).
// Throws kInvalidArgument on a scale byte that is not a valid ue4m3 (names its index).
int w4a8_weight_rescale_exponent(std::span<const uint8_t> block_scales);

// One weight in the W4A8 MMA: e4m3 RNE of e2m1(code) * ue4m3(scale_byte) * 2^-k (the product is
// exact; this is its one rounding; saturating, which a k from w4a8_weight_rescale_exponent never
// needs).
uint8_t w4a8_weight_e4m3(uint8_t e2m1_code, uint8_t scale_byte, int k);

// What the e4m3 rounding of w4a8_weight_e4m3 does to one tensor's weights.
struct W4a8WeightStats {
  int rescale_exponent = 0;  // k
  int64_t weights = 0;       // elements
  int64_t nonzero = 0;       // elements with e2m1 * ue4m3 != 0
  int64_t rounded = 0;       // moved by the rounding, result in e4m3's normal range (>= 2^-6)
  int64_t subnormal = 0;     // moved, result a nonzero e4m3 subnormal (< 2^-6)
  int64_t flushed = 0;       // nonzero product rounded to 0
  int64_t moved() const { return rounded + subnormal + flushed; }
};
// Throws kInvalidArgument on bad shapes, null pointers or an invalid scale byte.
W4a8WeightStats w4a8_weight_stats(const Nvfp4View& w);

}  // namespace megamoe::format
