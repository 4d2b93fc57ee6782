// Helpers for GPU tests: skip visibly where there is no GPU, RAII device buffers.
#pragma once

#include <gtest/gtest.h>

#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "megamoe/gpu.h"

#define MEGAMOE_REQUIRE_GPU()                                                       \
  do {                                                                              \
    if (::megamoe::gpu::device_count() == 0) {                                      \
      GTEST_SKIP() << "no CUDA device: GPU test skipped (run it on the GPU machine)"; \
    }                                                                               \
  } while (0)

namespace megamoe::testing {

template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (count_) gpu::check_cuda(cudaMalloc(&ptr_, count_ * sizeof(T)), "cudaMalloc");
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { if (ptr_) cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return static_cast<T*>(ptr_); }
  size_t size() const { return count_; }
  void upload(const std::vector<T>& host) {
    gpu::check_cuda(cudaMemcpy(ptr_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice),
                    "cudaMemcpy H2D");
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    gpu::check_cuda(cudaMemcpy(host.data(), ptr_, count_ * sizeof(T), cudaMemcpyDeviceToHost),
                    "cudaMemcpy D2H");
    return host;
  }
  // Fills every byte with `byte` (poison before a kernel writes the buffer).
  void poison(uint8_t byte = 0xFF) {
    gpu::check_cuda(cudaMemset(ptr_, byte, count_ * sizeof(T)), "cudaMemset");
  }

 private:
  void* ptr_ = nullptr;
  size_t count_ = 0;
};

}  // namespace megamoe::testing
