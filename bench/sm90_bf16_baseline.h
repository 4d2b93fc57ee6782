// The bf16 baseline the benchmark compares against: the same MoE layer with its weights as
// dense bf16 (dequantized from NVFP4, or the unquantized originals), run as gather -> cuBLAS
// GEMM per active expert -> SwiGLU -> cuBLAS GEMM -> weighted combine. Benchmark-only: the
// MoE product path never holds bf16 weights.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "megamoe/reference.h"

namespace megamoe::bench {

class Bf16BaselineMoe {
 public:
  // Allocates bf16 W13 [E', 2I, H] and W2 [E', H, I] for E routed experts plus an optional
  // shared expert of intermediate size shared_I (as E' = E + 1 with its own I).
  Bf16BaselineMoe(int64_t hidden, int64_t inter, int64_t experts, int64_t shared_inter,
                  std::optional<float> swiglu_limit);
  ~Bf16BaselineMoe();
  Bf16BaselineMoe(const Bf16BaselineMoe&) = delete;
  Bf16BaselineMoe& operator=(const Bf16BaselineMoe&) = delete;

  // Device pointers to expert e's weights (e == E: the shared expert), row-major bf16:
  // W13 rows [0, I) gate, [I, 2I) up; W2 [H, I].
  uint16_t* w13(int64_t e) const;
  uint16_t* w2(int64_t e) const;
  int64_t expert_intermediate(int64_t e) const;

  // Sets the routing (host-known: the baseline plans per-expert GEMM sizes on the host) and
  // sizes the activations. Must be called before run() and outside graph capture.
  void set_routing(const reference::TopK& topk);
  // hidden [T, H] bf16 device -> out [T, H] bf16 device. Capturable once set_routing ran.
  void run(const uint16_t* hidden, uint16_t* out, cudaStream_t stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace megamoe::bench
