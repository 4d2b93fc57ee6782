// Helpers shared by the benchmarks (single-GPU `megamoe bench`, moe_bench.cpp, and the
// expert-parallel `megamoe bench --ep`, ep_bench.cpp): timing, the device's measured ceilings, the
// random inputs and the output checks against the CPU reference.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "bench/l2_flush.h"
#include "megamoe/checkpoint.h"
#include "megamoe/moe.h"
#include "megamoe/presets.h"
#include "megamoe/reference.h"
#include "megamoe/gpu.h"

namespace megamoe::bench {

using gpu::check_cuda;


// Issue 3's bound on the layer's relative L2 error against the CPU reference.
constexpr double kMaxRelL2 = 2e-3;
// A W4A8 output against the plain W4A8 emulation (docs/w4a8.md §4.1): the fp8 MMA's truncation
// (~2e-4 of g and u) moves ~0.5% of the SwiGLU outputs across an e4m3 rounding boundary, each by
// one e4m3 step, which puts the output ~0.2-1.4% (measured) from the emulation whatever the shape.
// An error of order 1 (a wrong row, scale or block) is far beyond this bound.
constexpr double kMaxW4a8RelL2 = 5e-2;

double median(std::vector<double> v);

// Runs flush + `fn` untimed for `ms` milliseconds (BenchOptions::warm_ms; nothing for 0).
template <class Fn>
void run_untimed_for(Fn&& fn, cudaStream_t stream, const L2Flush* flush, int ms) {
  if (ms <= 0) return;
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(ms); ++r) {
    if (flush) flush->run(stream, r);
    fn();
    // A few runs in flight at most: the loop's clock then follows the GPU's.
    if (r % 4 == 3) check_cuda(cudaStreamSynchronize(stream), "warm-up");
  }
  check_cuda(cudaStreamSynchronize(stream), "warm-up");
}

// Median time in µs of `fn` (which enqueues work on `stream`) over `reps` runs after `warmup`
// untimed ones, with CUDA events. With `flush`, the L2 is emptied before each run (l2_flush.h),
// as when other layers run in between. With warm_ms > 0, flush + fn run untimed for that long
// first (BenchOptions::warm_ms).
template <class Fn>
double event_median_us(Fn&& fn, int reps, int warmup, cudaStream_t stream, const L2Flush* flush, int warm_ms) {
  run_untimed_for(fn, stream, flush, warm_ms);
  cudaEvent_t a, b;
  check_cuda(cudaEventCreate(&a), "cudaEventCreate");
  check_cuda(cudaEventCreate(&b), "cudaEventCreate");
  std::vector<double> us;
  for (int r = 0; r < warmup + reps; ++r) {
    if (flush) flush->run(stream, r);
    check_cuda(cudaEventRecord(a, stream), "cudaEventRecord");
    fn();
    check_cuda(cudaEventRecord(b, stream), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    if (r >= warmup) us.push_back(1000.0 * ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(us);
}

// A captured CUDA graph of whatever `enqueue` puts on the stream.
struct Graph {
  cudaGraphExec_t exec = nullptr;
  // `mode`: relaxed where the captured work includes NCCL calls, which may touch CUDA APIs that
  // the stricter modes forbid during a capture.
  template <class Fn>
  Graph(cudaStream_t stream, Fn&& enqueue, cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal) {
    cudaGraph_t g;
    check_cuda(cudaStreamBeginCapture(stream, mode), "begin capture");
    enqueue();
    check_cuda(cudaStreamEndCapture(stream, &g), "end capture");
    check_cuda(cudaGraphInstantiate(&exec, g, 0), "cudaGraphInstantiate");
    cudaGraphDestroy(g);
  }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph() { if (exec) cudaGraphExecDestroy(exec); }
  void launch(cudaStream_t s) const { check_cuda(cudaGraphLaunch(exec, s), "cudaGraphLaunch"); }
};

// The device's copy rate (device-to-device cudaMemcpy of 2 GiB, read + write bytes), TB/s, and its
// dense bf16 GEMM rate (cuBLAS, 8192^3), TFLOP/s: the ceilings of the floors.
double measure_copy_tbps(cudaStream_t stream, int warm_ms);
double measure_bf16_tflops(cudaStream_t stream, int warm_ms);
// The dense fp8 GEMM rate (cuBLASLt, e4m3 x e4m3 -> bf16 with fp32 accumulation, 8192^3, TN),
// TFLOP/s: the MMA ceiling of W4A8's floor.
double measure_fp8_tflops(cudaStream_t stream, int warm_ms);

uint64_t splitmix64(uint64_t x);

// FNV-1a over a point's inputs (hidden bits, expert ids, routing weight bits): recorded in the
// JSON so that two runs can be checked to have timed the same inputs.
uint64_t inputs_fingerprint(const std::vector<uint16_t>& x, const reference::TopK& topk);
std::string hex64(uint64_t v);

// Uniform random distinct experts per token, weights positive and normalised.
reference::TopK uniform_topk(std::mt19937_64& rng, int64_t T, int64_t E, int k);
// T x H normal bf16 values.
std::vector<uint16_t> random_hidden(std::mt19937_64& rng, int64_t T, int64_t H);

// Relative L2 error of bf16 `got` against `ref`; *nonfinite counts got's non-finite values (left
// out of the sums).
double rel_l2(const std::vector<uint16_t>& got, const std::vector<float>& ref, int64_t* nonfinite);

// `count` token rows spread evenly over [0, T) (the first and the last among them): a timed point
// is checked where its first and its last tiles write.
std::vector<int64_t> spread_rows(int64_t T, int64_t count);

// The rows `rows` of a layer's GPU output `got` ([T, H] bf16) against the CPU reference run on
// those tokens alone (tokens are independent), as a relative L2 error; *nonfinite counts the
// non-finite values among them. w4a8: against the W4A8 emulation (reference::moe_forward_w4a8).
double reference_rel_l2(const MoeLayer& layer, const std::vector<uint16_t>& x, const reference::TopK& topk,
                        const std::vector<uint16_t>& got, const std::vector<int64_t>& rows, int64_t* nonfinite,
                        bool w4a8 = false);

int64_t count_nonfinite(const std::vector<uint16_t>& v);

// Synthesizes preset `preset_name` into `work_dir` (empty: a temporary directory named after the
// preset) with `options`; returns the directory.
std::string synthesize_bench_checkpoint(const std::string& preset_name, const std::string& work_dir,
                                        const SynthOptions& options);
// The MoE layer a benchmark times: `layer` where it is >= 0, else the checkpoint's first MoE layer.
int64_t bench_layer_index(const ModelConfig& config, int64_t layer);

}  // namespace megamoe::bench
