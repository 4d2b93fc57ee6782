// The warp-level pieces of the tiny batch's schedule (src/kernels/sm90/sm90_moe_tiny_schedule.cuh)
// against a CPU oracle: tiny_compact, which moves a gated batch's valid ids into lanes in entry
// order (early start on the rows other ranks send: docs/design.md §7). Every lane of every case
// checked; fresh random ids each run, outputs poisoned first.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <vector>

#include "gpu_test_util.h"
#include "kernels/sm90/sm90_moe_tiny_schedule.cuh"
#include "megamoe/gpu.h"
#include "tests/common/test_util.h"

namespace megamoe {
namespace {

namespace k90 = kernels::sm90;

static_assert(k90::tiny_batch(k90::kTinyMaxEntries, k90::kTinyMaxSelections), "the limits are inclusive");
static_assert(!k90::tiny_batch(k90::kTinyMaxEntries + 1, 0), "past kTinyMaxEntries ids a batch is not tiny");
static_assert(!k90::tiny_batch(64, k90::kTinyMaxSelections + 1), "past 32 valid ids a batch is not tiny");

// One warp per case: ids[case * kTinyMaxEntries ...], entries[case] of them; lane L writes its
// (id, entry, valid) at out[(case * 32 + L) * 3].
__global__ void tiny_compact_kernel(const int32_t* ids, const int32_t* entries, int32_t num_experts, int32_t* out) {
  const int c = blockIdx.x;
  const k90::TinyEntry e = k90::tiny_compact(ids + c * k90::kTinyMaxEntries, entries[c], num_experts);
  int32_t* o = out + (c * 32 + threadIdx.x) * 3;
  o[0] = e.id;
  o[1] = e.entry;
  o[2] = e.valid;
}

TEST(GpuTinySchedule, CompactMovesTheValidIdsIntoLanesInOrder) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const int cases = 512, E = 40;
  std::vector<int32_t> ids(static_cast<size_t>(cases) * k90::kTinyMaxEntries), entries(cases);
  for (int c = 0; c < cases; ++c) {
    // Every length 0..256, then random; the share of valid ids from none to all.
    entries[c] = c <= k90::kTinyMaxEntries ? c : rng.uniform_int(0, k90::kTinyMaxEntries);
    const int valid_percent = rng.uniform_int(0, 100);
    for (int i = 0; i < k90::kTinyMaxEntries; ++i) {
      int32_t id;
      if (rng.uniform_int(0, 99) < valid_percent) {
        id = rng.uniform_int(0, E - 1);
      } else {
        const int kind = rng.uniform_int(0, 3);
        id = kind == 0 ? -1 : kind == 1 ? E + rng.uniform_int(0, 5) : kind == 2 ? -rng.uniform_int(2, 1000) : -1;
      }
      // Past `entries` the ids must not be read: valid-looking values there would show.
      ids[static_cast<size_t>(c) * k90::kTinyMaxEntries + i] = i < entries[c] ? id : rng.uniform_int(0, E - 1);
    }
  }
  support::DeviceBuffer<int32_t> d_ids(ids), d_entries(entries), d_out(static_cast<size_t>(cases) * 32 * 3);
  d_out.poison();
  tiny_compact_kernel<<<cases, 32>>>(d_ids.get(), d_entries.get(), E, d_out.get());
  gpu::check_cuda(cudaGetLastError(), "tiny_compact_kernel");
  const std::vector<int32_t> out = d_out.download();
  for (int c = 0; c < cases; ++c) {
    std::vector<int32_t> want_entry;
    for (int i = 0; i < entries[c]; ++i) {
      const int32_t id = ids[static_cast<size_t>(c) * k90::kTinyMaxEntries + i];
      if (id >= 0 && id < E) want_entry.push_back(i);
    }
    for (int lane = 0; lane < 32; ++lane) {
      const int32_t* o = &out[(static_cast<size_t>(c) * 32 + lane) * 3];
      ASSERT_EQ(o[2], static_cast<int32_t>(want_entry.size())) << "case " << c << " lane " << lane;
      if (lane < static_cast<int>(want_entry.size())) {
        ASSERT_EQ(o[1], want_entry[lane]) << "case " << c << " lane " << lane;
        ASSERT_EQ(o[0], ids[static_cast<size_t>(c) * k90::kTinyMaxEntries + want_entry[lane]])
            << "case " << c << " lane " << lane;
      } else {
        ASSERT_EQ(o[0], -1) << "case " << c << " lane " << lane << ": a lane past the valid ids holds an id";
      }
    }
  }
}

}  // namespace
}  // namespace megamoe
