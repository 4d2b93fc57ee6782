// The layers prepared by megamoe.moe_prepare, each held under an integer handle with what identifies
// the tensors it was prepared from.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

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

// Raises ValueError, naming `op` and `handle`, unless `given` are the tensors of `sources`,
// unchanged (same data, shape, dtype and version): a prepared layer reads them, or was made from
// them, so a change would leave it stale.
void check_fingerprints(const char* op, int64_t handle, const std::vector<Fingerprint>& sources,
                        const std::vector<std::pair<const char*, at::Tensor>>& given);

// Bumps the version counters of tensors an op rewrote through raw pointers (the dispatcher does
// not for custom ops), so that fingerprints taken before the write no longer match.
void mark_written(const std::vector<std::pair<const char*, at::Tensor>>& tensors);

// One prepared layer on one device.
struct PreparedMoe {
  PreparedMoe(at::Device dev, MoePlan p, MoeDeviceWeights w, at::Tensor ws,
              std::vector<Fingerprint> src)
      : device(dev), plan(std::move(p)), weights(std::move(w)), sources(std::move(src)),
        workspace_(std::move(ws)) {}
  at::Device device;
  MoePlan plan;
  MoeDeviceWeights weights;
  std::vector<Fingerprint> sources;

  // uint8, at least MoePlan::workspace_bytes(), 256-byte aligned: the layer's own, or one that
  // layers which never run at the same time share (megamoe.share_workspace).
  at::Tensor workspace() const {
    const std::lock_guard<std::mutex> lock(mu_);
    return workspace_;
  }
  void set_workspace(at::Tensor ws) {
    const std::lock_guard<std::mutex> lock(mu_);
    workspace_ = std::move(ws);
  }

 private:
  mutable std::mutex mu_;
  at::Tensor workspace_;
};

// Live objects by integer handle (what a torch op can take, and torch.compile carry as a
// constant); safe to use from several threads. `what` and `maker` name them in errors ("prepared
// layer", "megamoe.moe_prepare").
template <typename T>
class HandleRegistry {
 public:
  HandleRegistry(const char* what, const char* maker) : what_(what), maker_(maker) {}
  // Registers `p` under a new handle, which it returns.
  int64_t add(std::shared_ptr<T> p) {
    const std::lock_guard<std::mutex> lock(mu_);
    const int64_t id = next_++;
    live_.emplace(id, std::move(p));
    return id;
  }
  // The object of handle `id`; raises ValueError, naming `op`, where none is live.
  std::shared_ptr<T> get(int64_t id, const char* op) const {
    const std::lock_guard<std::mutex> lock(mu_);
    return find(id, op)->second;
  }
  // Unregisters the object of handle `id` and returns it; raises as get() does.
  std::shared_ptr<T> remove(int64_t id, const char* op) {
    const std::lock_guard<std::mutex> lock(mu_);
    const auto it = find(id, op);
    std::shared_ptr<T> p = std::move(it->second);
    live_.erase(it);
    return p;
  }

 private:
  typename std::unordered_map<int64_t, std::shared_ptr<T>>::const_iterator find(int64_t id, const char* op) const {
    const auto it = live_.find(id);
    TORCH_CHECK_VALUE(it != live_.end(), "megamoe.", op, ": handle ", id, " is not a live ", what_,
                      " (never returned by ", maker_, ", or already released).");
    return it;
  }
  const char* what_;
  const char* maker_;
  mutable std::mutex mu_;
  int64_t next_ = 1;
  std::unordered_map<int64_t, std::shared_ptr<T>> live_;
};

using Registry = HandleRegistry<PreparedMoe>;

// Never destroyed: layers still registered at exit must not be freed after the CUDA runtime has
// shut down (static destruction order across libraries is unspecified).
Registry& registry();

}  // namespace megamoe::torch_ext
