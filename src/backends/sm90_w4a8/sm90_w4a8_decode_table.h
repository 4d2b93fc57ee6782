// The table form of the W4A8 weight decode (docs/w4a8.md §3, "Table"): the integer part that
// host (tests) and device (sm90_w4a8_decode.cuh, decode_k32_table) share, so that the CPU runs the
// very instruction sequence the GPU does. One k32 A fragment (two prepacked step words, sm90_w4a16_
// layout.h) becomes four PRMT lookups into per-scale rows of 8 e4m3 magnitudes plus the signs.
//
// The table. Per encoded scale byte E (sm90_w4a16_layout.h, "Scale encoding"; E <= 239) one
// 16-byte entry: bytes 0..7 the magnitudes RNE_8(e2m1(c) * s * 2^-k) of row r0's tensor for
// c = 0..7 (c = the code without its sign: m + 2 e0 + 4 e1), bytes 8..15 row r1's (in W13 tiles
// r0 is the gate and r1 the up row, each with its own k; in L2 both halves are the same k). An
// entry is one LDS.64 per (row, step) at E * 16 (+ 8), E read from the scale word with one LOP3
// (and a shift or byte swap). Entry E = 0 is zero: a zero-scale block stores codes 0 anyway.
//
// The K order. PRMT builds each register's 4 bytes from 4 selector nibbles; the cheapest nibble
// order the layout allows puts step-word elements (a4, a0, a5, a1) in bytes 0..3 of row r0's
// register and (a6, a2, a7, a3) in row r1's, i.e. k offsets (8, 0, 9, 1) from 2t: the fragment
// K order of sm90_w4a8_layout.h (k_of_position), which the activations are stored in.
//
// Selectors (bits 0..15 of a PRMT selector: 4 nibbles, bit 3 of each must be 0, else PRMT's
// sign-replicate mode). The layout's bytes (b0..b3 of a step word) hold, by bit:
//     b0: a6.m a6.e0 | a4 (3) | a0.s | a2.m a2.e0      b1: a2.e1 a6.s a6.e1 a4.s | a1 (3) | a2.s
//     b2: a7.m a7.e0 | a5 (3) | a1.s | a3.m a3.e0      b3: a3.e1 a7.s a7.e1 a5.s | a0 (3) | a3.s
// No byte of any shift holds two magnitudes of one row a nibble apart, so every selector merges
// two sources. Both step words are gathered at once by byte (M = their b0/b2 bytes, E = their
// b1/b3), which lines the fields of the even step up in the low half and the odd step's in the
// high half: row r0 = (w >> 2)'s low nibbles (a4, a5) | the high nibbles of b3, b1 (a0, a1); row
// r1 = M's bits 0, 1 and E's bit 2 (a6, a7, whose e1 sits in the next byte) | (w >> 2)'s high
// nibbles (a2, a3). The odd step's selectors are the high halves (one shift each).
// Signs (e4m3 bit 7, RNE being symmetric): bit 7 of E holds a2/a3's, bit 1 a6/a7's, bit 3
// a4/a5's, bit 5 of M a0/a1's; E << 6, E << 4, M << 2 move them to bit 7 of their bytes and one
// PRMT per register picks them in the register's byte order; one LOP3 ORs them in.
//
// Count per k32 fragment, sm_90a SASS: 39 (decode_k32: 59): selectors 13 (4 PRMT, 4 shifts, 5
// LOP3), signs 7 (3 shifts, 4 PRMT), 4 PRMT lookups, 4 LOP3 sign merges, the 4 entry offsets 7
// (4 LOP3, 2 shifts, a PRMT; the table's base folds into LDS's uniform-register operand), 4 LDS.64.
#pragma once

#include <cstdint>
#include <type_traits>

namespace megamoe::kernels::sm90::w4a8 {

inline constexpr int kTableEntries = 240;   // encoded scale bytes 0..239 ((8 + 21) << 3 | 7)
inline constexpr int kTableEntryBytes = 16;  // row r0's 8 magnitudes, then row r1's
inline constexpr int kTableBytes = kTableEntries * kTableEntryBytes;  // 3840: one CTA's table

// prmt.b32 in its default mode: byte i of the result is byte (s >> 4i) & 7 of {b:a}, or, where
// bit 3 of that nibble is set, that byte's bit 7 replicated (PTX ISA, prmt). The device runs
// the instruction itself.
constexpr uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
#if defined(__CUDA_ARCH__)
  if (!std::is_constant_evaluated()) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
    return d;
  }
#endif
  const uint64_t bytes = static_cast<uint64_t>(b) << 32 | a;
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t n = (s >> (4 * i)) & 0xF;
    uint32_t byte = static_cast<uint32_t>(bytes >> (8 * (n & 7))) & 0xFF;
    if (n & 8) byte = (byte & 0x80) ? 0xFF : 0x00;
    d |= byte << (8 * i);
  }
  return d;
}

// The PRMT selectors (bits 0..15) and the sign words (bit 7 of each byte) of the four A
// registers {r0 even, r1 even, r0 odd, r1 odd} of the step words `even`, `odd` (see above).
struct TableOperands {
  uint32_t selector[4];
  uint32_t sign[4];
};
constexpr TableOperands table_operands(uint32_t even, uint32_t odd) {
  const uint32_t m = prmt(even, odd, 0x6420);                                 // b0, b2 of each
  const uint32_t e = prmt(even, odd, 0x7531);                                 // b1, b3 of each
  const uint32_t z = prmt(even >> 2, odd >> 2, 0x6420) & 0x77777777u;         // a4|a2, a5|a3
  const uint32_t y = prmt(even, odd, 0x5713);                                 // b3, b1 of each
  const uint32_t row0 = (z & 0x8F8F8F8Fu) | (y & 0x70707070u);                // a4 a0 a5 a1
  const uint32_t row1 = (((m & 0x03030303u) | (e & 0xFCFCFCFCu)) & 0x07070707u) | (z & 0xF8F8F8F8u);
  const uint32_t e6 = e << 6, e4 = e << 4, m2 = m << 2;
  return {{row0, row1, row0 >> 16, row1 >> 16},
          {prmt(e4, m2, 0x5140), prmt(e6, e, 0x5140), prmt(e4, m2, 0x7362), prmt(e6, e, 0x7362)}};
}

// Byte offset in the table of the row (row r0: h = 0, r1: h = 1) for step 2i + kOdd of a
// prepacked scale word: E * 16 + 8 h, E at bits 4..11 of the word's half (the odd step's after
// swapping the half's bytes, as in f16_scale_pair).
template <int kOdd>
constexpr uint32_t table_offset(uint32_t scale_word, int h) {
  if constexpr (kOdd) scale_word = prmt(scale_word, 0, 0x2301);
  return ((h ? scale_word >> 16 : scale_word) & 0xFF0u) + 8u * static_cast<uint32_t>(h);
}

// One register from its table row (lo: magnitudes 0..3, hi: 4..7), selector and sign word.
constexpr uint32_t table_lookup(uint32_t lo, uint32_t hi, uint32_t selector, uint32_t sign) {
  return prmt(lo, hi, selector) | (sign & 0x80808080u);
}

}  // namespace megamoe::kernels::sm90::w4a8
