// The layers prepared by megamoe.moe_prepare, each held under an integer handle with what identifies
// the tensors it was prepared from.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "megamoe/runtime.h"

namespace megamoe::torch_ext {

// What identifies a source tensor: its data, shape, dtype and (when it tracks one) the version
// counter that every in-place write (copy_, load_state_dict) bumps.
struct Fingerprint {
  std::string name;
  const void* data = nullptr;
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kByte;
  std::optional<int64_t> version;  // none for inference-mode tensors, which track no version

  static Fingerprint of(const char* name, const at::Tensor& t) {
    Fingerprint f;
    f.name = name;
    f.data = t.const_data_ptr();
    f.sizes = t.sizes().vec();
    f.dtype = t.scalar_type();
    if (!t.is_inference()) f.version = t._version();
    return f;
  }
};

// One prepared layer on one device.
struct PreparedMoe {
  PreparedMoe(at::Device dev, MoePlan p, MoeDeviceWeights w, at::Tensor ws,
              std::vector<Fingerprint> src)
      : device(dev), plan(std::move(p)), weights(std::move(w)), workspace(std::move(ws)),
        sources(std::move(src)) {}
  at::Device device;
  MoePlan plan;
  MoeDeviceWeights weights;
  at::Tensor workspace;  // uint8, MoePlan::workspace_bytes() (the caching allocator aligns to 512)
  std::vector<Fingerprint> sources;
};

// The live prepared layers by handle; safe to use from several threads.
class Registry {
 public:
  // Registers `p` under a new handle, which it returns.
  int64_t add(std::shared_ptr<PreparedMoe> p);
  // The layer of handle `id`; raises ValueError, naming `op`, where no such layer is live.
  std::shared_ptr<PreparedMoe> get(int64_t id, const char* op) const;
  // Unregisters the layer of handle `id` and returns it; raises as get() does.
  std::shared_ptr<PreparedMoe> remove(int64_t id, const char* op);

 private:
  mutable std::mutex mu_;
  int64_t next_ = 1;
  std::unordered_map<int64_t, std::shared_ptr<PreparedMoe>> live_;
};

// Never destroyed: layers still registered at exit must not be freed after the CUDA runtime has
// shut down (static destruction order across libraries is unspecified).
Registry& registry();

}  // namespace megamoe::torch_ext
