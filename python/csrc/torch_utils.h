// Shared helpers of the torch binding: argument checks that raise the Python exception class
// that fits (TypeError for dtypes, ValueError for shapes, devices, layouts and values), and the
// translation of megamoe::Error into those classes.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "megamoe/gpu.h"
#include "megamoe/status.h"

namespace megamoe::torch_ext {

inline std::string sizes_string(at::IntArrayRef sizes) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < sizes.size(); ++i) os << (i ? ", " : "") << sizes[i];
  os << "]";
  return os.str();
}

// Runs `fn`, rethrowing a megamoe::Error as the c10 error whose Python class fits its code
// (kInvalidArgument: ValueError; kUnsupported: NotImplementedError; others: RuntimeError), with
// the op's name in front of the library's message.
template <typename Fn>
decltype(auto) translate_errors(const char* op, Fn&& fn) {
  try {
    return fn();
  } catch (const Error& e) {
    const std::string msg = std::string("megamoe.") + op + ": " + e.what();
    if (e.code() == ErrorCode::kInvalidArgument) C10_THROW_ERROR(ValueError, msg);
    if (e.code() == ErrorCode::kUnsupported) C10_THROW_ERROR(NotImplementedError, msg);
    C10_THROW_ERROR(Error, msg + " [" + error_code_name(e.code()) + "]");
  }
}

// Checks of one tensor argument `name` of op `op`. Each raises with a message that says what
// was given and what is allowed.
class ArgCheck {
 public:
  ArgCheck(const char* op, const char* name, const at::Tensor& t) : op_(op), name_(name), t_(t) {}

  const ArgCheck& dtype(std::initializer_list<at::ScalarType> allowed) const {
    for (at::ScalarType s : allowed) {
      if (t_.scalar_type() == s) return *this;
    }
    std::string names;
    for (at::ScalarType s : allowed) names += (names.empty() ? "" : " or ") + std::string(c10::toString(s));
    TORCH_CHECK_TYPE(false, prefix(), " has dtype ", t_.scalar_type(), "; expected ", names, ".");
    return *this;
  }
  // NVFP4 block scales: float8_e4m3fn (the checkpoint dtype) or the same bytes as uint8.
  const ArgCheck& scale_dtype() const {
    return dtype({at::ScalarType::Float8_e4m3fn, at::ScalarType::Byte});
  }
  // `shape` with -1 entries that match any size.
  const ArgCheck& shape(std::vector<int64_t> expected, const char* meaning) const {
    bool ok = t_.dim() == static_cast<int64_t>(expected.size());
    for (size_t i = 0; ok && i < expected.size(); ++i) {
      ok = expected[i] < 0 || t_.size(static_cast<int64_t>(i)) == expected[i];
    }
    if (!ok) {
      std::string want = "[";
      for (size_t i = 0; i < expected.size(); ++i) {
        want += (i ? ", " : "") + (expected[i] < 0 ? std::string("*") : std::to_string(expected[i]));
      }
      want += "]";
      TORCH_CHECK_VALUE(false, prefix(), " has shape ", sizes_string(t_.sizes()), "; expected ",
                        want, " (", meaning, ").");
    }
    return *this;
  }
  const ArgCheck& dims(int64_t d, const char* meaning) const {
    TORCH_CHECK_VALUE(t_.dim() == d, prefix(), " has shape ", sizes_string(t_.sizes()),
                      "; expected ", d, " dimensions (", meaning, ").");
    return *this;
  }
  const ArgCheck& contiguous() const {
    TORCH_CHECK_VALUE(t_.is_contiguous(), prefix(), " is not contiguous (strides ",
                      sizes_string(t_.strides()), "); pass a contiguous tensor (.contiguous()).");
    return *this;
  }
  const ArgCheck& on(const at::Device& device) const {
    TORCH_CHECK_VALUE(t_.device() == device, prefix(), " is on ", t_.device(), "; expected ",
                      device, ".");
    return *this;
  }
  const ArgCheck& cuda() const {
    TORCH_CHECK_VALUE(t_.is_cuda(), prefix(), " is on ", t_.device(),
                      "; expected a CUDA tensor.");
    return *this;
  }
  const ArgCheck& cpu() const {
    TORCH_CHECK_VALUE(t_.is_cpu(), prefix(), " is on ", t_.device(), "; expected a CPU tensor.");
    return *this;
  }
  const ArgCheck& aligned(int64_t bytes) const {
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t_.data_ptr()) % bytes == 0, prefix(),
                      " is not ", bytes, "-byte aligned (its data starts at storage offset ",
                      t_.storage_offset(), "); pass an aligned tensor (.clone()).");
    return *this;
  }

 private:
  std::string prefix() const { return std::string("megamoe.") + op_ + ": " + name_; }
  const char* op_;
  const char* name_;
  const at::Tensor& t_;
};

inline ArgCheck arg(const char* op, const char* name, const at::Tensor& t) { return {op, name, t}; }

// Torch's current stream on `device`, where the ops launch their work.
inline cudaStream_t current_stream(const at::Device& device) {
  return at::cuda::getCurrentCUDAStream(device.index()).stream();
}

// Whether `stream` is capturing a CUDA graph (the ops skip their host synchronisations then).
inline bool is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  gpu::check_cuda(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace megamoe::torch_ext
