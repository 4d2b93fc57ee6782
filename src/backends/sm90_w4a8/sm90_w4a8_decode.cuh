// Decode of one k32 step of the W4A16 prepacked weights (sm90_w4a16_layout.h) into the four
// e4m3x4 A registers of an fp8 RS wgmma (m64nNk32), each weight RNE_8(e2m1 * s * 2^-k)
// (docs/w4a8.md §3, format::w4a8_weight_e4m3) bit for bit. The fragment's K order and the
// constant that carries k: sm90_w4a8_layout.h.
//
// The f16 form of docs/w4a8.md §3: per pair of weights, the e2m1 pair as f16x2 bits
// (f16_code_pair: e2m1 * 2^-14, a bit move; a prmt lookup would need the pair's magnitudes as
// selector nibbles 8 bits apart, and this layout holds them 16 apart), one HMUL2 by the block
// scale s * 2^(9-k) (e2m1 * s * 2^(-5-k), exact), one by 32 (e2m1 * s * 2^-k, exact), and
// cvt.rn.satfinite.e4m3x2.f16x2, the one rounding; two conversions fill a register (F2FP ...
// MERGE_C, no extra move). Why two multiplies: an e2m1 bit pattern is exact only with the f16
// exponent's upper bits clear (else codes 0 and 1 come out wrong), so it is e2m1 * 2^-14, and
// s * 2^(14-k) would overflow f16 for s * 2^-k > 4. Exactness: e2m1 * s has at most 6
// significant bits and is a multiple of 2^-10, so the first product is a multiple of
// 2^(-15-k) >= 2^-18 and at most 448/32, representable in f16 (subnormal quantum 2^-24); the
// second only moves the exponent into the normal range.
//
// Cost of one k32 fragment (16 weights), sm_90a SASS: 59 instructions (the codes: 30 LOP3 /
// IMAD / SHF, 15 per step word; the scales: 5; 16 HMUL2, some issued as HFMA2.MMA; 8 F2FP), and
// 4 PRMT into the fragment K order, 63.
// The table form of docs/w4a8.md §3 (decode_k32_table below, sm90_w4a8_decode_table.h) takes 39:
// its PRMT selectors are gathered from both step words at once, at the price of a per-CTA
// shared-memory table (3840 bytes, filled per item), 4 LDS.64 per fragment whose rows differ per
// quad (bank conflicts possible), and a different K order within each 16 for the activations.
#pragma once

#include <cuda_fp16.h>
#include <cstdint>

#include "backends/sm90_w4a16/sm90_w4a16_layout.h"
#include "backends/sm90_w4a8/sm90_w4a8_decode_table.h"
#include "backends/sm90_w4a8/sm90_w4a8_layout.h"

namespace megamoe::kernels::sm90::w4a8 {

// The f16x2 {lo: row r0, hi: row r1} of s * 2^(9-k) for step 2i + kOdd of a prepacked scale word
// (sm90_w4a8_layout.h, f16_scale_pair): LOP3 and LEA (the addend a uniform register), and a PRMT
// for the odd step. Written in PTX: as C++, ptxas shifts before masking and adds separately.
template <int kOdd>
__device__ __forceinline__ uint32_t scale_pair_to_f16x2(uint32_t word, uint32_t exponent_addend) {
  if constexpr (kOdd) word = __byte_perm(word, 0, 0x2301);
  uint32_t pair;
  asm("{\n .reg .b32 t;\n and.b32 t, %1, %2;\n mad.lo.u32 %0, t, 8, %3;\n}\n"
      : "=r"(pair)
      : "r"(word), "n"(w4a16::kScaleMask), "r"(exponent_addend));
  return pair;
}

// code * (low or high half of s, twice) * 32: ptxas folds the half selection into the multiply
// (HMUL2 ... R.H0_H0 / R.H1_H1) and takes 32 as an immediate.
template <int kHigh>
__device__ __forceinline__ uint32_t scaled_pair(uint32_t code, uint32_t scale) {
  const __half2 s = *reinterpret_cast<const __half2*>(&scale);
  const __half2 p = __hmul2(*reinterpret_cast<const __half2*>(&code), kHigh ? __high2half2(s) : __low2half2(s));
  const __half2 r = __hmul2(p, __half2half2(__ushort_as_half(0x5000)));  // 32
  return *reinterpret_cast<const uint32_t*>(&r);
}

// Two f16x2 pairs to four e4m3 bytes {lo.x, lo.y, hi.x, hi.y}, RNE with saturation.
__device__ __forceinline__ uint32_t f16x2x2_to_e4m3x4(uint32_t lo, uint32_t hi) {
  uint32_t r;
  asm("{\n .reg .b16 l, h;\n"
      " cvt.rn.satfinite.e4m3x2.f16x2 l, %1;\n"
      " cvt.rn.satfinite.e4m3x2.f16x2 h, %2;\n"
      " mov.b32 %0, {l, h};\n}\n"
      : "=r"(r)
      : "r"(lo), "r"(hi));
  return r;
}

// One step word with its f16 scale pair -> the e4m3x4 registers of rows r0 (bytes a4, a0, a5, a1)
// and r1 (a6, a2, a7, a3): the fragment K order (sm90_w4a8_layout.h), one PRMT per register
// from the conversions' {a0, a1, a4, a5}.
__device__ __forceinline__ void decode_step_e4m3(uint32_t word, uint32_t scale, uint32_t& row0, uint32_t& row1) {
  row0 = __byte_perm(f16x2x2_to_e4m3x4(scaled_pair<0>(f16_code_pair(word, 0), scale),
                                       scaled_pair<0>(f16_code_pair(word, 2), scale)),
                     0, 0x1302);
  row1 = __byte_perm(f16x2x2_to_e4m3x4(scaled_pair<1>(f16_code_pair(word, 1), scale),
                                       scaled_pair<1>(f16_code_pair(word, 3), scale)),
                     0, 0x1302);
}

// One k32 step: the step words of k16 steps 2i and 2i + 1 of a chunk, their scale word i
// (sm90_w4a16_layout.h) and the tensor's scale_exponent_addend(k) -> the A registers a[0..3] of
// wgmma m64nNk32 .e4m3 (fragment K order: sm90_w4a8_layout.h).
__device__ __forceinline__ void decode_k32(uint32_t word_even, uint32_t word_odd, uint32_t scale_word,
                                           uint32_t exponent_addend, uint32_t (&a)[4]) {
  decode_step_e4m3(word_even, scale_pair_to_f16x2<0>(scale_word, exponent_addend), a[0], a[1]);
  decode_step_e4m3(word_odd, scale_pair_to_f16x2<1>(scale_word, exponent_addend), a[2], a[3]);
}

// ---- the table form (sm90_w4a8_decode_table.h: layout of the table, selectors, K order)

// Fills a CTA's decode table at shared address `table` (kTableBytes, 16-byte aligned) for the
// tensors of rows r0 (half 0) and r1 (half 1) with their decode_k32 constant, exponent_addend =
// scale_exponent_addend(k) per half: entry E, half h holds RNE_8(e2m1(c) * s * 2^-k) for c = 0..7,
// s the scale of encoded byte E. Computed with decode_k32's f16 products (exact, one rounding),
// 8 bytes per thread and step; entry 0 is zero (a zero-scale block's codes are 0, so only the
// sign could be read). Entries of scales too large for k are never read (their f16 may
// overflow). The caller syncs the CTA before the first lookup.
__device__ __forceinline__ void fill_decode_table(uint32_t table, uint32_t exponent_addend, int thread, int threads) {
  // e2m1(c) * 2^-14 as f16 is c << 9 (f16_code_pair): the pairs (0, 1), (2, 3), (4, 5), (6, 7).
  constexpr uint32_t kCodes[4] = {0x02000000u, 0x06000400u, 0x0A000800u, 0x0E000C00u};
  for (int i = thread; i < 2 * kTableEntries; i += threads) {
    const uint32_t entry = static_cast<uint32_t>(i) >> 1;
    // f16 of s * 2^(9 - k): E << 7 (value s * 2^6) plus the half's exponent addend.
    const uint32_t scale = (entry << 7) + ((i & 1) ? exponent_addend >> 16 : exponent_addend & 0xFFFFu);
    uint32_t lo = f16x2x2_to_e4m3x4(scaled_pair<0>(kCodes[0], scale), scaled_pair<0>(kCodes[1], scale));
    uint32_t hi = f16x2x2_to_e4m3x4(scaled_pair<0>(kCodes[2], scale), scaled_pair<0>(kCodes[3], scale));
    if (entry == 0) lo = hi = 0;
    asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(table + static_cast<uint32_t>(i) * 8u), "r"(lo), "r"(hi)
                 : "memory");
  }
}

// One table row: the 8 magnitudes of one (row, step) scale.
__device__ __forceinline__ uint2 load_table_row(uint32_t address) {
  uint2 r;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "r"(address));
  return r;
}

// decode_k32's inputs and outputs, in the table form: the same step words and scale word, the
// CTA's table (fill_decode_table) in place of the exponent addend, and the A registers in the
// fragment K order. The table rows are
// loaded first so their latency overlaps the selector arithmetic.
__device__ __forceinline__ void decode_k32_table(uint32_t word_even, uint32_t word_odd, uint32_t scale_word,
                                                 uint32_t table, uint32_t (&a)[4]) {
  const uint2 t0 = load_table_row(table + table_offset<0>(scale_word, 0));
  const uint2 t1 = load_table_row(table + table_offset<0>(scale_word, 1));
  const uint2 t2 = load_table_row(table + table_offset<1>(scale_word, 0));
  const uint2 t3 = load_table_row(table + table_offset<1>(scale_word, 1));
  const TableOperands op = table_operands(word_even, word_odd);
  a[0] = table_lookup(t0.x, t0.y, op.selector[0], op.sign[0]);
  a[1] = table_lookup(t1.x, t1.y, op.selector[1], op.sign[1]);
  a[2] = table_lookup(t2.x, t2.y, op.selector[2], op.sign[2]);
  a[3] = table_lookup(t3.x, t3.y, op.selector[3], op.sign[3]);
}

}  // namespace megamoe::kernels::sm90::w4a8
