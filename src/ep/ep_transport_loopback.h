// EpTransport for the virtual ranks of an EpLoopback (include/megamoe/ep.h): every rank's window
// is a plain device buffer of the one GPU, and each rank's kernels run on its own green context.
// Host code; nothing here runs per forward.
#pragma once

#include <memory>

#include "ep/ep_transport.h"
#include "megamoe/ep.h"

namespace megamoe {

// The layer's view of an EpLoopback's internals.
struct EpLoopbackAccess {
  static const std::shared_ptr<EpLoopback::Impl>& impl(const EpLoopback& loopback) { return loopback.impl_; }
};

namespace ep {

// Rank `rank`'s endpoint. allocate_window is collective in the loopback's sense: the k-th call of
// every rank gets the k-th set of windows, made (zeroed) by whichever rank asks first; the other
// ranks must ask for the same sizes. The windows live as long as the loopback and every endpoint
// made from it. Throws megamoe::Error(kInvalidArgument) for a bad rank.
std::unique_ptr<EpTransport> make_loopback_transport(const EpLoopback& loopback, int rank);

}  // namespace ep
}  // namespace megamoe
