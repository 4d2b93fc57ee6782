// The driver shared by the CPU reference forwards (moe_forward.cpp: W4A16, w4a8_forward.cpp:
// W4A8): argument checks, grouping of (token, slot) pairs by expert, token chunks, threads and
// the combine. Internal to src/reference.
//
// A precision plugs in as a `Numerics` object with four const members:
//   load_hidden(span<const uint16_t> bf16 [tokens, H], vector<double>& x)   the L1 input
//   gate_up(const Task&, const vector<double>& x)   fills unit->act for the task's rows of I
//   finish_act(vector<Unit>&)                       runs once every act row is complete
//   down(const Task&, vector<double>& y)            y rows (not yet weighted) of the task's rows
// Results do not depend on the thread count or the chunking as long as each member writes only
// its own outputs in a fixed order.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <exception>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "megamoe/dtype.h"
#include "megamoe/format.h"
#include "megamoe/reference.h"
#include "megamoe/status.h"

namespace megamoe::reference::detail {

// SwiGLU's silu, in double, the one formula of both precisions.
inline double silu(double g) { return g / (1.0 + std::exp(-g)); }

// Rows of a weight matrix decoded and dotted together: each token then runs kTileRows
// independent accumulators per projection.
constexpr int kTileRows = 4;
// Rows of one task: enough work to amortize a task, few enough to balance 2-3 threads.
constexpr int64_t kRowsPerTask = 64;
// Every row count here (H, I, the shared I) is a multiple of the NVFP4 block size (validate()
// checks it), so row ranges split into whole tiles.
static_assert(format::kNvfp4BlockSize % kTileRows == 0 && kRowsPerTask % kTileRows == 0);
// Budget for the per-(token, slot) double outputs of one token chunk (ForwardOptions).
constexpr int64_t kChunkBytes = int64_t{64} << 20;

// One expert (routed or shared) and the (token, slot) pairs it serves in the current chunk.
struct Unit {
  const ExpertWeights* w = nullptr;
  std::string name;             // "expert 5" / "the shared expert", for error messages
  std::vector<int64_t> token;   // chunk-local token of each pair
  std::vector<int64_t> output;  // row of the chunk's y buffer ([tokens, slots, H]) of each pair
  std::vector<double> act;      // [pairs, I]: the L2 input a of each pair, exactly, as double
};

struct Task {
  Unit* unit;
  int64_t row_begin;
  int64_t row_end;
};

inline std::vector<Task> split_rows(std::vector<Unit>& units, int64_t (*rows_of)(const Unit&)) {
  std::vector<Task> tasks;
  for (Unit& u : units) {
    const int64_t rows = rows_of(u);
    for (int64_t r = 0; r < rows; r += kRowsPerTask) {
      tasks.push_back({&u, r, std::min(rows, r + kRowsPerTask)});
    }
  }
  return tasks;
}

// Runs fn(task) for every task on up to `threads` threads (the caller's included). Tasks write
// disjoint outputs, so the schedule does not change results. If tasks throw, the exception of
// the lowest-numbered failing task is rethrown after every thread has finished.
template <typename Fn>
void parallel_for(const std::vector<Task>& tasks, int threads, Fn fn) {
  std::atomic<size_t> next{0};
  std::mutex mu;
  size_t failed_task = tasks.size();
  std::exception_ptr failure;
  auto worker = [&] {
    for (size_t i = next.fetch_add(1); i < tasks.size(); i = next.fetch_add(1)) {
      try {
        fn(tasks[i]);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (i < failed_task) {
          failed_task = i;
          failure = std::current_exception();
        }
      }
    }
  };
  const int n = static_cast<int>(std::min<size_t>(static_cast<size_t>(threads), tasks.size()));
  std::vector<std::thread> pool;
  for (int i = 1; i < n; ++i) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
}

// The arguments every forward takes; `fn` names the caller in the messages.
inline void check_forward_arguments(const char* fn, const MoeLayer& layer,
                                   std::span<const uint16_t> hidden_bf16,
                                   int64_t tokens, const TopK& topk,
                                   const ForwardOptions& opt) {
  layer.validate();
  const int64_t H = layer.hidden_size;
  const int64_t E = layer.num_experts;
  MEGAMOE_CHECK(opt.threads >= 0, kInvalidArgument, fn, ": threads is ", opt.threads,
                "; it must be >= 0 (0: one per hardware thread).");
  MEGAMOE_CHECK(opt.chunk_tokens >= 0, kInvalidArgument, fn, ": chunk_tokens is ",
                opt.chunk_tokens, "; it must be >= 0 (0: sized by memory).");
  MEGAMOE_CHECK(tokens >= 0, kInvalidArgument, fn, ": tokens is ", tokens,
                "; it must be >= 0.");
  MEGAMOE_CHECK(static_cast<int64_t>(hidden_bf16.size()) / H == tokens &&
                    static_cast<int64_t>(hidden_bf16.size()) % H == 0,
                kInvalidArgument, fn, ": hidden holds ", hidden_bf16.size(),
                " values; expected tokens (", tokens, ") x hidden_size (", H, ").");
  MEGAMOE_CHECK(topk.tokens == tokens, kInvalidArgument, fn, ": the top-k routing is for ",
                topk.tokens, " tokens but hidden holds ", tokens, ".");
  MEGAMOE_CHECK(topk.k >= 1, kInvalidArgument, fn, ": top-k k is ", topk.k,
                "; it must be >= 1.");
  const int64_t k = topk.k;
  MEGAMOE_CHECK(static_cast<int64_t>(topk.ids.size()) == tokens * k &&
                    static_cast<int64_t>(topk.weights.size()) == tokens * k,
                kInvalidArgument, fn, ": top-k ids hold ", topk.ids.size(),
                " values and weights ", topk.weights.size(), "; both must hold tokens (", tokens,
                ") x k (", k, ").");
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t id = topk.ids[t * k + j];
      const float wt = topk.weights[t * k + j];
      MEGAMOE_CHECK(id >= 0 && id < E, kInvalidArgument, fn, ": top-k id of token ", t,
                    ", slot ", j, " is ", id, "; expert ids must be in [0, ", E, ").");
      MEGAMOE_CHECK(std::isfinite(wt), kInvalidArgument, fn, ": top-k weight of token ",
                    t, ", slot ", j, " is ", wt, "; weights must be finite.");
    }
  }
}

// The forward on checked arguments: hands each token's double sums (length H) to
// store(token, sums), in token order. What happens inside an expert is the precision's
// (`Numerics`, see the top of this file); routing, grouping, threading and the combine are shared.
template <typename Numerics, typename Store>
void run_forward(const MoeLayer& layer, std::span<const uint16_t> hidden_bf16, int64_t tokens,
                 const TopK& topk, const ForwardOptions& opt, const Numerics& numerics,
                 Store store) {
  const int64_t H = layer.hidden_size;
  const int64_t E = layer.num_experts;
  const int64_t k = topk.k;

  const int threads = opt.threads > 0
                          ? opt.threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const bool shared = layer.shared_expert.has_value();
  const int64_t slots = k + (shared ? 1 : 0);  // the shared expert's output is slot k
  const int64_t chunk =
      opt.chunk_tokens > 0
          ? opt.chunk_tokens
          : std::max<int64_t>(1, kChunkBytes / (slots * H * int64_t{sizeof(double)}));

  for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
    const int64_t nt = std::min(chunk, tokens - t0);

    std::vector<double> x(nt * H);
    numerics.load_hidden(hidden_bf16.subspan(t0 * H, nt * H), x);

    // Group the chunk's (token, slot) pairs by expert, in ascending expert order.
    std::vector<std::vector<int64_t>> pairs_of(E);
    for (int64_t t = 0; t < nt; ++t) {
      for (int64_t j = 0; j < k; ++j) pairs_of[topk.ids[(t0 + t) * k + j]].push_back(t * k + j);
    }
    std::vector<Unit> units;
    for (int64_t e = 0; e < E; ++e) {
      if (pairs_of[e].empty()) continue;
      Unit u;
      u.w = &layer.experts[e];
      u.name = "expert " + std::to_string(e);
      for (int64_t pair : pairs_of[e]) {
        const int64_t t = pair / k;
        u.token.push_back(t);
        u.output.push_back(t * slots + pair % k);
      }
      units.push_back(std::move(u));
    }
    if (shared) {
      Unit u;
      u.w = &*layer.shared_expert;
      u.name = "the shared expert";
      for (int64_t t = 0; t < nt; ++t) {
        u.token.push_back(t);
        u.output.push_back(t * slots + k);
      }
      units.push_back(std::move(u));
    }
    for (Unit& u : units) u.act.assign(u.token.size() * u.w->intermediate_size(), 0.0);

    const std::vector<Task> l1 =
        split_rows(units, [](const Unit& u) { return u.w->intermediate_size(); });
    parallel_for(l1, threads, [&](const Task& task) { numerics.gate_up(task, x); });
    numerics.finish_act(units);

    std::vector<double> y(nt * slots * H);
    const std::vector<Task> l2 =
        split_rows(units, [](const Unit& u) { return u.w->down.out_features; });
    parallel_for(l2, threads, [&](const Task& task) { numerics.down(task, y); });

    // Combine in top-k order, then the shared expert, in double.
    std::vector<double> sum(H);
    for (int64_t t = 0; t < nt; ++t) {
      std::fill(sum.begin(), sum.end(), 0.0);
      for (int64_t j = 0; j < k; ++j) {
        const double wt = topk.weights[(t0 + t) * k + j];
        const double* yj = y.data() + (t * slots + j) * H;
        for (int64_t h = 0; h < H; ++h) sum[h] += wt * yj[h];
      }
      if (shared) {
        const double* ys = y.data() + (t * slots + k) * H;
        for (int64_t h = 0; h < H; ++h) sum[h] += ys[h];
      }
      store(t0 + t, sum);
    }
  }
}

}  // namespace megamoe::reference::detail
