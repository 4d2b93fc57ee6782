// Tensor-parallel shards (include/megamoe/tp.h) on one GPU: each rank's slice runs on the
// single-GPU pipeline with fp32 output (MoeRunArgs::output_f32, the partial sum before rounding),
// one rank after the other; the partials are summed as an all-reduce would (rank order, then one
// bf16 rounding: reference::tp_combine) and checked against the CPU reference of the whole layer,
// and each rank's partial against the reference of its slice. Fresh random data each run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <vector>

#include "gpu_test_util.h"
#include "megamoe/reference.h"
#include "megamoe/runtime.h"
#include "megamoe/tp.h"
#include "megamoe/gpu.h"
#include "tests/common/test_util.h"

namespace megamoe {
namespace {

using testing::kMaxRelL2;

struct TpCase {
  const char* name;
  int64_t H, I, E;
  int k;
  int64_t T, shared_I;
  std::optional<float> limit;
};

TEST(GpuTp, RanksPartialsSumToTheWholeLayer) {
  MEGAMOE_REQUIRE_GPU();
  const testing::SeedTrace seed;
  testing::Rng rng(seed);
  const std::vector<TpCase> cases = {
      {"decode", 256, 512, 8, 4, 3, 0, std::nullopt},
      {"shared_clamp", 256, 512, 8, 8, 40, 512, 1.0f},
      {"k1_shared2x", 512, 256, 16, 1, 17, 512, std::nullopt},
  };
  for (const TpCase& c : cases) {
    for (int R : {2, 4}) {
      if ((c.I / R) % kTpSliceMultiple != 0) continue;
      for (bool deterministic : {false, true}) {
        SCOPED_TRACE(::testing::Message() << c.name << " R=" << R << " det=" << deterministic);
        const MoeLayer layer =
            testing::random_layer(rng, c.H, c.I, c.E, c.k, c.shared_I, c.limit);
        const auto hidden = testing::random_hidden(rng, c.T, c.H);
        const auto topk = testing::random_topk(rng, c.T, c.E, c.k);
        std::vector<std::vector<float>> partials;
        double worst_partial = 0;
        for (int r = 0; r < R; ++r) {
          const MoeLayer local = tp_local_layer(layer, TpConfig{R, r});
          partials.push_back(testing::GpuMoe(local, c.T, deterministic).run_f32(hidden, topk));
          const testing::ErrorStats e =
              testing::compare(partials.back(), reference::moe_forward_f32(local, hidden, c.T, topk));
          EXPECT_EQ(e.nonfinite, 0) << "rank " << r << ": non-finite or unwritten outputs";
          EXPECT_LE(e.rel_l2, kMaxRelL2) << "rank " << r << "'s partial vs the reference of its slice";
          worst_partial = std::max(worst_partial, e.rel_l2);
        }
        const auto got = testing::widen(reference::tp_combine(partials));
        const auto ref = testing::widen(reference::moe_forward(layer, hidden, c.T, topk));
        const testing::ErrorStats e = testing::compare(got, ref);
        EXPECT_EQ(e.nonfinite, 0);
        EXPECT_LE(e.rel_l2, kMaxRelL2) << "Σ of the GPU partials vs the whole layer's reference";
        std::printf("[ %-14s] R=%d %s rel_l2=%.3g (worst partial %.3g)\n", c.name, R,
                    deterministic ? "deterministic " : "atomic-combine", e.rel_l2, worst_partial);
      }
    }
  }
}

}  // namespace
}  // namespace megamoe
