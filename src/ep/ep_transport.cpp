// make_transport (ep_transport.h): the one place that chooses a transport for a layer.
#include "ep/ep_transport.h"

#include "ep/ep_transport_nccl.h"

namespace megamoe::ep {

std::unique_ptr<EpTransport> make_transport(const EpConfig& config, const EpUniqueId& id) {
  return make_nccl_transport(config, id);
}

}  // namespace megamoe::ep
