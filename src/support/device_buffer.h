// An owned device buffer with blocking host copies, for the tool, the benchmark and the tests: a
// support header of theirs, not part of the library (run() takes caller-owned pointers, never allocates).
#pragma once

#include <cuda_runtime.h>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "megamoe/status.h"
#include "megamoe/gpu.h"

namespace megamoe::support {

// An owned device allocation of `count` elements of T (none when count is 0), with blocking
// copies to and from host vectors of exactly that size.
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
    MEGAMOE_CHECK(host.size() == count_, kInvalidArgument, "DeviceBuffer::upload: ", host.size(),
                  " elements for a buffer of ", count_);
    if (count_) {
      gpu::check_cuda(cudaMemcpy(ptr_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice),
                 "cudaMemcpy(host to device)");
    }
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    if (count_) {
      gpu::check_cuda(cudaMemcpy(host.data(), ptr_, count_ * sizeof(T), cudaMemcpyDeviceToHost),
                 "cudaMemcpy(device to host)");
    }
    return host;
  }
  // Fills every byte with `byte` (poison before a kernel writes the buffer).
  void poison(uint8_t byte = 0xFF) {
    if (count_) gpu::check_cuda(cudaMemset(ptr_, byte, count_ * sizeof(T)), "cudaMemset");
  }

 private:
  void* ptr_ = nullptr;
  size_t count_ = 0;
};

}  // namespace megamoe::support
