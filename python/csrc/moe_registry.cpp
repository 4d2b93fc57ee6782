// The layers prepared by megamoe.moe_prepare (moe_registry.h).
#include "moe_registry.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>

namespace megamoe::torch_ext {

int64_t Registry::add(std::shared_ptr<PreparedMoe> p) {
  const std::lock_guard<std::mutex> lock(mu_);
  const int64_t id = next_++;
  live_.emplace(id, std::move(p));
  return id;
}

std::shared_ptr<PreparedMoe> Registry::get(int64_t id, const char* op) const {
  const std::lock_guard<std::mutex> lock(mu_);
  const auto it = live_.find(id);
  TORCH_CHECK_VALUE(it != live_.end(), "megamoe.", op, ": handle ", id,
                    " is not a live prepared layer (never returned by megamoe.moe_prepare, or "
                    "already released).");
  return it->second;
}

std::shared_ptr<PreparedMoe> Registry::remove(int64_t id, const char* op) {
  const std::lock_guard<std::mutex> lock(mu_);
  const auto it = live_.find(id);
  TORCH_CHECK_VALUE(it != live_.end(), "megamoe.", op, ": handle ", id,
                    " is not a live prepared layer (never returned by megamoe.moe_prepare, or "
                    "already released).");
  std::shared_ptr<PreparedMoe> p = std::move(it->second);
  live_.erase(it);
  return p;
}

Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

}  // namespace megamoe::torch_ext
