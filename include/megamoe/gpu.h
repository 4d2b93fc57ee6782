// Small GPU utilities over raw device pointers (no allocation, no host synchronisation).
#pragma once

#include <cuda_runtime.h>
#include <cstdint>
#include <vector>

#include "megamoe/status.h"

namespace megamoe::gpu {

// Throws megamoe::Error(kCuda) naming `what` when `err` is not cudaSuccess.
void check_cuda(cudaError_t err, const char* what);

// Number of usable CUDA devices (0 when there is no GPU or no driver; never throws).
int device_count();

// Dequantizes one NVFP4 weight [rows, cols] (ModelOpt layout, device pointers) to bf16:
// out[n,k] = bf16(e2m1 * ue4m3 * global_scale). cols % 16 == 0; pointers 16-byte aligned.
// Throws megamoe::Error(kInvalidArgument) on bad shapes or alignment; launches on `stream`.
void dequantize_nvfp4(const uint8_t* codes, const uint8_t* scales, float global_scale,
                      int64_t rows, int64_t cols, uint16_t* out_bf16, cudaStream_t stream);

// An owned device allocation of `count` elements of T (none when count is 0), with blocking
// copies to and from host vectors of exactly that size. For tools, tests and benchmarks; run()
// itself takes caller-owned pointers.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (count_) check_cuda(cudaMalloc(&ptr_, count_ * sizeof(T)), "cudaMalloc");
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
      check_cuda(cudaMemcpy(ptr_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice),
                 "cudaMemcpy(host to device)");
    }
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    if (count_) {
      check_cuda(cudaMemcpy(host.data(), ptr_, count_ * sizeof(T), cudaMemcpyDeviceToHost),
                 "cudaMemcpy(device to host)");
    }
    return host;
  }
  // Fills every byte with `byte` (poison before a kernel writes the buffer).
  void poison(uint8_t byte = 0xFF) {
    if (count_) check_cuda(cudaMemset(ptr_, byte, count_ * sizeof(T)), "cudaMemset");
  }

 private:
  void* ptr_ = nullptr;
  size_t count_ = 0;
};

}  // namespace megamoe::gpu
