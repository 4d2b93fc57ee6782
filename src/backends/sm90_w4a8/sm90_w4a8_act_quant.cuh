// W4A8 activation quantization (docs/w4a8.md §1, §2): per token and block of 128 consecutive
// elements along K, amax, the integer exponent e from amax's fp32 bits (no floating-point
// operation), x * 2^-e (an exact fp32 multiply by a power of two) and
// cvt.rn.satfinite.e4m3x2.f32, RNE_8; bit for bit format::quantize_activation_w4a8. The same
// rule for the hidden states (bf16, widened exactly) and for the SwiGLU output (the fp32 value the
// kernel holds, not rounded to bf16 first). Codes are stored in the K order of the fp8 MMA's
// operands (sm90_w4a8_layout.h: byte p of every 16 holds logical k_of_position(p)).
//
// The pieces: act_scale_exponent (sm90_w4a8_layout.h, host and device), exp2i and
// f32x4_to_e4m3x4 for any code that has a block's amax (an L1 epilogue reducing it across its
// tile), quantize_act_block for one warp per (token, block) where rows are
// gathered or staged (each lane 4 elements; one redux.sync for the amax), and
// quantize_act_kernel, the standalone kernel over a [rows, cols] matrix.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

#include "backends/sm90_w4a8/sm90_w4a8_layout.h"

namespace megamoe::kernels::sm90::w4a8 {

// 2^e as fp32, e in [-126, 127].
__device__ __forceinline__ float exp2i(int e) { return __uint_as_float(static_cast<uint32_t>(127 + e) << 23); }

// RNE_8 of four fp32 values, saturating: byte i from x_i.
__device__ __forceinline__ uint32_t f32x4_to_e4m3x4(float x0, float x1, float x2, float x3) {
  uint32_t r;
  asm("{\n .reg .b16 l, h;\n"
      " cvt.rn.satfinite.e4m3x2.f32 l, %2, %1;\n"  // the first operand goes to the upper byte
      " cvt.rn.satfinite.e4m3x2.f32 h, %4, %3;\n"
      " mov.b32 %0, {l, h};\n}\n"
      : "=r"(r)
      : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
  return r;
}

// One lane's share of a block quantized by a warp: its 4 codes (storage positions 4 * lane + i,
// byte i) and the block's exponent (the same in every lane).
struct ActBlockCodes {
  uint32_t codes;
  int exponent;
};

// One warp quantizes one block: lane l passes the values at storage positions 4l..4l+3, i.e.
// logical k_of_position(4l + i) (load_act_block_lane). All 32 lanes must take part.
__device__ __forceinline__ ActBlockCodes quantize_act_block(const float (&x)[4]) {
  uint32_t amax = 0;
  for (int i = 0; i < 4; ++i) amax = max(amax, __float_as_uint(x[i]) & 0x7FFFFFFFu);
  // Non-negative floats order like their bits: an integer max is the float max.
  amax = __reduce_max_sync(0xFFFFFFFFu, amax);
  const int e = act_scale_exponent(amax);
  const float inv = exp2i(-e);
  return {f32x4_to_e4m3x4(x[0] * inv, x[1] * inv, x[2] * inv, x[3] * inv), e};
}

// The values lane l quantizes, from a block's 128 elements in natural order: logical k
// 16b + 2t + (8, 0, 9, 1), b = l / 4, t = l % 4 (two pair loads; k_of_position).
__device__ __forceinline__ void load_act_block_lane(const __nv_bfloat16* block, int lane, float (&x)[4]) {
  const int k = 16 * (lane / 4) + 2 * (lane % 4);
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(block + k));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(block + k + 8));
  x[0] = hi.x, x[1] = lo.x, x[2] = hi.y, x[3] = lo.y;
}
__device__ __forceinline__ void load_act_block_lane(const float* block, int lane, float (&x)[4]) {
  const int k = 16 * (lane / 4) + 2 * (lane % 4);
  const float2 lo = *reinterpret_cast<const float2*>(block + k);
  const float2 hi = *reinterpret_cast<const float2*>(block + k + 8);
  x[0] = hi.x, x[1] = lo.x, x[2] = hi.y, x[3] = lo.y;
}

// x [rows, cols] (bf16 or fp32, cols a multiple of 128, 16-byte aligned rows) -> codes [rows,
// cols] e4m3 in MMA order and block scales 2^e [rows, cols / 128] as fp32 (the GEMM's promotion
// multiplies by them; storing e would cost it an integer-to-float step per token and block), one
// warp per block, blocks grid-strided. Finite inputs only (docs/w4a8.md §1: others are outside
// the contract).
template <class T>
__global__ void quantize_act_kernel(const T* x, int64_t rows, int64_t cols, uint8_t* codes, float* scales) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t blocks = rows * (cols / kActBlock);
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; b < blocks; b += warps) {
    float v[4];
    load_act_block_lane(x + b * kActBlock, lane, v);
    const ActBlockCodes q = quantize_act_block(v);
    reinterpret_cast<uint32_t*>(codes + b * kActBlock)[lane] = q.codes;
    if (lane == 0) scales[b] = exp2i(q.exponent);
  }
}

}  // namespace megamoe::kernels::sm90::w4a8
