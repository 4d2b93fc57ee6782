// The backend table (backend.h). A row is compiled for its own architecture (CMakeLists.txt:
// megamoe_add_backend) and listed here under the definition its library sets.
#include "runtime/backend.h"

#include <array>
#include <vector>

#include "megamoe/gpu.h"
#include "megamoe/status.h"

namespace megamoe::runtime {

#if MEGAMOE_BACKEND_SM90_W4A8
const MoeBackend& sm90_w4a8_backend();
#endif
#if MEGAMOE_BACKEND_SM90_W4A16
const MoeBackend& sm90_w4a16_backend();
#endif

namespace {

// kAuto asks rows in this order: per architecture, lossy rows before the exact one.
std::vector<const MoeBackend*> make_table() {
  std::vector<const MoeBackend*> rows;
#if MEGAMOE_BACKEND_SM90_W4A8
  rows.push_back(&sm90_w4a8_backend());
#endif
#if MEGAMOE_BACKEND_SM90_W4A16
  rows.push_back(&sm90_w4a16_backend());
#endif
  return rows;
}

const std::vector<const MoeBackend*>& table() {
  static const std::vector<const MoeBackend*> rows = make_table();
  return rows;
}

}  // namespace

std::string arch_name(Arch arch) { return "sm_" + std::to_string(arch); }

std::string MoeBackend::name() const { return std::string(precision_name(precision())) + "/" + arch_name(arch()); }

DeviceInfo current_device() {
  DeviceInfo info;
  gpu::check_cuda(cudaGetDevice(&info.device), "cudaGetDevice");
  cudaDeviceProp prop{};
  gpu::check_cuda(cudaGetDeviceProperties(&prop, info.device), "cudaGetDeviceProperties");
  info.arch = prop.major * 10 + prop.minor;
  info.num_sms = prop.multiProcessorCount;
  info.name = prop.name;
  return info;
}

std::span<const MoeBackend* const> backend_table() { return table(); }

const MoeBackend* find_backend(Arch arch, Precision precision) {
  for (const MoeBackend* row : table()) {
    if (row->arch() == arch && row->precision() == precision) return row;
  }
  return nullptr;
}

std::string built_backends() {
  std::string names;
  for (const MoeBackend* row : table()) names += (names.empty() ? "" : ", ") + row->name();
  return names.empty() ? std::string("none") : names;
}

const MoeBackend& weights_backend(Arch arch) {
  const MoeBackend* exact = find_backend(arch, Precision::kW4a16);
  MEGAMOE_CHECK(exact != nullptr, kUnsupported, "MoeDeviceWeights: no backend of this build runs on ",
                arch_name(arch), "; built: ", built_backends());
  return *exact;
}

const MoeBackend& layout_backend(const std::string& layout) {
  // The exact row of the layout where there is one: every row reading it can unprepack it, and
  // the exact row validates every shape the layout holds (a lossy row may allow fewer).
  const MoeBackend* found = nullptr;
  std::string built;
  for (const MoeBackend* row : table()) {
    if (row->weight_layout() == layout && (found == nullptr || row->precision() == Precision::kW4a16)) found = row;
    const std::string name = row->weight_layout();
    if (built.find(name) == std::string::npos) built += (built.empty() ? "" : ", ") + name;
  }
  if (found != nullptr) return *found;
  MEGAMOE_FAIL(kInvalidArgument, "weight layout \"", layout, "\" is not one of this build's (",
               built.empty() ? std::string("none") : built, ").");
}

}  // namespace megamoe::runtime
