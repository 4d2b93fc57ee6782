// The transport under expert parallelism: one window per rank (data bytes and 64-bit signal
// words, the same size on every rank) that every rank's kernels can load from and store to.
// The layer talks only to EpTransport; the exchange kernels see only EpPeerWindows (plain device
// pointers), so a transport is added by implementing EpTransport and choosing it in
// make_transport, with no change to the layer or the kernels. Plain C++: device code includes it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace megamoe {
struct EpConfig;
struct EpUniqueId;
}  // namespace megamoe

namespace megamoe::ep {

// The GPUs of one host.
inline constexpr int kMaxRanks = 8;

// Every rank's window as this rank's kernels address it (index = rank, this rank's included).
// A plain struct, passed by value as a kernel parameter.
struct EpPeerWindows {
  char* base[kMaxRanks];       // the data bytes, 256-byte aligned
  uint64_t* flags[kMaxRanks];  // the signal words, zero after setup
  int32_t rank;
  int32_t world;
};

// One rank's endpoint. Creating it (a factory) and allocate_window are collective: every rank
// calls them, in the same order with the same arguments. Destroying it frees the window.
class EpTransport {
 public:
  virtual ~EpTransport() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // Collective, once: this rank's window of `data_bytes` and `flag_words` signal words, all zero.
  // Returns once every rank's window is zeroed and reachable, so peers may write at once.
  virtual void allocate_window(size_t data_bytes, size_t flag_words) = 0;
  // The window, after allocate_window (throws megamoe::Error(kInternal) before).
  virtual const EpPeerWindows& peers() const = 0;
  // Device bytes of this rank's window as requested: the signal words, rounded up to 256, and the
  // data bytes (0 before allocate_window).
  virtual size_t window_bytes() const = 0;

  char* local_base() const { return peers().base[rank()]; }
};

// The transport EpConfig asks for, over the GPUs of one host (today: NCCL, ep_transport_nccl.h).
// Collective. Throws megamoe::Error as the chosen factory does.
std::unique_ptr<EpTransport> make_transport(const EpConfig& config, const EpUniqueId& id);

// The signal words' area in a window: 256-byte aligned, so that the data that follows is too.
inline constexpr size_t flag_area_bytes(size_t flag_words) { return (flag_words * 8 + 255) / 256 * 256; }

}  // namespace megamoe::ep
