// What the expert-parallel exchange keeps in each rank's window (ep_transport.h), identical on
// every rank: the signal words and the offsets of the receive and return buffers in the window's
// data bytes. Plain C++: the kernels (sm90_ep_exchange.cuh), the layer and the tests read it.
#pragma once

#include <cstdint>

#include "ep/ep_transport.h"

namespace megamoe::ep {

// Signal words (sm90_signal.cuh's format), slots for kMaxRanks peers whatever R:
//   sent[s]     source s has sent its rows of this run here: {epoch, rows}
//   done[d]     destination d has written its partial sums of this run here: {epoch, 0}
//   recv_count  the rows reserved here this run (the sources' atomics; reset by the return)
inline constexpr int kSentWord = 0;
inline constexpr int kDoneWord = kMaxRanks;
inline constexpr int kRecvCountWord = 2 * kMaxRanks;
inline constexpr size_t kFlagWords = 2 * kMaxRanks + 1;

// Byte offsets into the data bytes; every buffer starts 256-byte aligned. The receive buffers
// hold the rows that arrived this run, contiguous from row 0 in arrival order (at most R * max_t).
//   recv_x    [R * max_t][H] bf16: the tokens
//   recv_ids  [R * max_t][k] int32: their top-k ids as this rank's local expert ids, -1 elsewhere
//   recv_w    [R * max_t][k] fp32: their routing weights (0 where the id is -1)
//   recv_src  [R * max_t] int32: source rank << 24 | the token's row at its source
//   ret       [R][max_t][H] fp32: this rank's tokens' partial sums, as each rank returns them
struct EpWindowLayout {
  int64_t recv_x, recv_ids, recv_w, recv_src, ret;
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
  l.recv_src = take(rows * 4);
  l.ret = take(rows * hidden * 4);
  l.bytes = off;
  return l;
}

}  // namespace megamoe::ep
