// Tensor-parallel shards (include/megamoe/tp.h) on one GPU: each rank's slice runs on the
// single-GPU pipeline with fp32 output (MoeRunArgs::output_f32, the partial sum before rounding),
// one rank after the other; the partials are summed as an all-reduce would (rank order, then one
// bf16 rounding: reference::tp_combine) and checked against the CPU reference of the whole layer,
// and each rank's partial against the reference of its slice. Fresh random data each run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <random>
#include <vector>

#include "gpu_test_util.h"
#include "megamoe/reference.h"
#include "megamoe/runtime.h"
#include "megamoe/tp.h"
#include "moe_test_util.h"
#include "megamoe/gpu.h"

namespace megamoe {
namespace {

using testing::DeviceBuffer;

// As the single-GPU tests (test_gpu_moe.cpp): what the kernels' fp32 arithmetic and SFU silu add
// beyond the reference's rounding.
constexpr double kMaxRelL2 = 2e-3;

double rel_l2(const std::vector<float>& got, const std::vector<float>& ref, int64_t* nonfinite) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ++*nonfinite;
      continue;
    }
    num += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// One rank's partial output [T, H] fp32 on this GPU.
std::vector<float> run_rank(const MoeLayer& local, const std::vector<uint16_t>& hidden,
                            const reference::TopK& topk, bool deterministic) {
  const int64_t T = topk.tokens;
  MoeProblem p = MoeProblem::from_layer(local, T);
  p.deterministic = deterministic;
  const MoePlan plan = MoePlan::create(p);
  const MoeDeviceWeights weights = MoeDeviceWeights::upload(local);
  DeviceBuffer<uint8_t> workspace(plan.workspace_bytes());
  DeviceBuffer<uint16_t> d_hidden(hidden);
  DeviceBuffer<int32_t> d_ids(topk.ids);
  DeviceBuffer<float> d_w(topk.weights);
  DeviceBuffer<float> d_out(static_cast<size_t>(T * local.hidden_size));
  d_out.poison();  // fp32 NaN: an unwritten element fails the finiteness check
  workspace.poison();
  MoeRunArgs args{};
  args.hidden = d_hidden.get();
  args.topk_ids = d_ids.get();
  args.topk_weights = d_w.get();
  args.tokens = T;
  args.workspace = workspace.get();
  args.output_f32 = d_out.get();
  run(plan, weights, args, nullptr);
  gpu::check_cuda(cudaStreamSynchronize(nullptr), "run (TP rank)");
  return d_out.download();
}

struct TpCase {
  const char* name;
  int64_t H, I, E;
  int k;
  int64_t T, shared_I;
  std::optional<float> limit;
};

TEST(GpuTp, RanksPartialsSumToTheWholeLayer) {
  MEGAMOE_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  const std::vector<TpCase> cases = {
      {"decode", 256, 512, 8, 4, 3, 0, std::nullopt},
      {"shared_clamp", 256, 512, 8, 8, 40, 512, 1.0f},
      {"k1_shared2x", 512, 256, 16, 1, 17, 512, std::nullopt},
  };
  for (const TpCase& c : cases) {
    for (int R : {2, 4}) {
      if ((c.I / R) % kTpSliceMultiple != 0) continue;
      for (bool deterministic : {false, true}) {
        SCOPED_TRACE(::testing::Message() << c.name << " R=" << R << " det=" << deterministic
                                          << " seed=" << seed);
        const MoeLayer layer =
            testing::random_layer(rng, c.H, c.I, c.E, c.k, c.shared_I, c.limit);
        const auto hidden = testing::random_hidden(rng, c.T, c.H);
        const auto topk = testing::random_topk(rng, c.T, c.E, c.k);
        std::vector<std::vector<float>> partials;
        double worst_partial = 0;
        for (int r = 0; r < R; ++r) {
          const MoeLayer local = tp_local_layer(layer, TpConfig{R, r});
          partials.push_back(run_rank(local, hidden, topk, deterministic));
          int64_t nonfinite = 0;
          const double e = rel_l2(partials.back(),
                                  reference::moe_forward_f32(local, hidden, c.T, topk), &nonfinite);
          EXPECT_EQ(nonfinite, 0) << "rank " << r << ": non-finite or unwritten outputs";
          EXPECT_LE(e, kMaxRelL2) << "rank " << r << "'s partial vs the reference of its slice";
          worst_partial = std::max(worst_partial, e);
        }
        const auto got = testing::widen(reference::tp_combine(partials));
        const auto ref = testing::widen(reference::moe_forward(layer, hidden, c.T, topk));
        int64_t nonfinite = 0;
        const double e = rel_l2(got, ref, &nonfinite);
        EXPECT_EQ(nonfinite, 0);
        EXPECT_LE(e, kMaxRelL2) << "Σ of the GPU partials vs the whole layer's reference";
        std::printf("[ %-14s] R=%d %s rel_l2=%.3g (worst partial %.3g)\n", c.name, R,
                    deterministic ? "deterministic " : "atomic-combine", e, worst_partial);
      }
    }
  }
}

}  // namespace
}  // namespace megamoe
