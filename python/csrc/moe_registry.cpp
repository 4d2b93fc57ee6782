// The layers prepared by megamoe.moe_prepare (moe_registry.h).
#include "moe_registry.h"

#include <torch/csrc/autograd/variable.h>

namespace megamoe::torch_ext {

void mark_written(const std::vector<std::pair<const char*, at::Tensor>>& tensors) {
  for (const auto& [name, t] : tensors) {
    if (!t.is_inference()) torch::autograd::impl::bump_version(t);
  }
}

void check_fingerprints(const char* op, int64_t handle, const std::vector<Fingerprint>& sources,
                        const std::vector<std::pair<const char*, at::Tensor>>& given) {
  TORCH_CHECK_VALUE(given.size() == sources.size(), "megamoe.", op, ": handle ", handle, " was prepared ",
                    sources.size() > 6 ? "with" : "without", " a shared expert, but the call passes ",
                    given.size() > 6 ? "one" : "none", ".");
  for (size_t i = 0; i < given.size(); ++i) {
    const Fingerprint now = Fingerprint::of(given[i].first, given[i].second);
    const Fingerprint& then = sources[i];
    const char* why = nullptr;
    if (now.data != then.data || now.dtype != then.dtype) {
      why = "is not the tensor the handle was prepared from";
    } else if (now.sizes != then.sizes) {
      why = "has changed shape since the handle was prepared";
    } else if (now.version != then.version) {
      why = "was modified in place since the handle was prepared";
    }
    TORCH_CHECK_VALUE(why == nullptr, "megamoe.", op, ": ", now.name, " ", why, " (handle ", handle,
                      "); the prepared layer would read stale or rewritten weights. After loading new "
                      "weights prepare again (NVFP4MoE does so after load_state_dict; change a prepared "
                      "module's buffers only after NVFP4MoE.unprepare()).");
  }
}

Registry& registry() {
  static Registry* r = new Registry("prepared layer", "megamoe.moe_prepare");
  return *r;
}

}  // namespace megamoe::torch_ext
