// What the expert-parallel exchange keeps in each rank's window (ep_transport.h), identical on
// every rank: the barriers' signal words and the offsets of the receive and return buffers in the
// window's data bytes. Plain C++: the kernels (sm90_ep_exchange.cuh), the layer and the tests
// read it from here.
#pragma once

#include <cstdint>

#include "ep/ep_transport.h"

namespace megamoe::ep {

// Signal words: [2 barriers (after dispatch, after return)][R sources] uint64, the epoch each
// source has reached; slots for kMaxRanks sources whatever R, so a barrier's slot of source s is
// barrier * kMaxRanks + s.
inline constexpr int kBarriers = 2;
inline constexpr size_t kFlagWords = size_t{kBarriers} * kMaxRanks;

// Byte offsets into the data bytes; every buffer starts 256-byte aligned.
//   recv_x    [R sources][max_t][H] bf16: the tokens each source sent here
//   recv_ids  [R][max_t][k] int32: their top-k ids as this rank's local expert ids, -1 elsewhere
//   recv_w    [R][max_t][k] fp32: their routing weights
//   ret       [R][max_t][H] fp32: this rank's tokens' partial sums, as each rank returns them
struct EpWindowLayout {
  int64_t recv_x, recv_ids, recv_w, ret;
  int64_t bytes;  // the data bytes the window needs
};

constexpr EpWindowLayout ep_window_layout(int world, int64_t max_t, int64_t hidden, int top_k) {
  int64_t off = 0;
  auto take = [&off](int64_t bytes) {
    const int64_t at = off;
    off += (bytes + 255) / 256 * 256;
    return at;
  };
  const int64_t rows = world * max_t;
  EpWindowLayout l{};
  l.recv_x = take(rows * hidden * 2);
  l.recv_ids = take(rows * top_k * 4);
  l.recv_w = take(rows * top_k * 4);
  l.ret = take(rows * hidden * 4);
  l.bytes = off;
  return l;
}

}  // namespace megamoe::ep
