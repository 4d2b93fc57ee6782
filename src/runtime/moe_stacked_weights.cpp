// MoeDeviceWeights::from_stacked: prepacked device weights from the stacked layout engines keep
// on the GPU (w13 [E, 2I, H/2] gate-then-up rows, w2 [E, H, I/2], scales and global scales).
//
// The prepack (backends/sm90_w4a16/sm90_w4a16_prepack.h) is a host-side reshuffle, so the simplest correct
// path is: copy the stacked tensors to the host once, view them as the per-expert Nvfp4Linear
// matrices of a MoeLayer (no byte changes: gate is rows [0, I) of an expert's w13, up rows
// [I, 2I)), and reuse upload(). This is a one-time load cost, never part of a forward pass.
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "megamoe/format.h"
#include "megamoe/gpu.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"

namespace megamoe {
namespace {

using gpu::check_cuda;

// Host copies of the stacked tensors; the MoeLayer's Nvfp4Linear views point into them.
struct HostStacked {
  std::vector<uint8_t> w13, w13_scale, w2, w2_scale;
  std::vector<float> w13_scale_2, w2_scale_2;
  std::vector<uint8_t> shared_w13, shared_w13_scale, shared_w2, shared_w2_scale;
  std::vector<float> shared_w13_scale_2, shared_w2_scale_2;
};

template <typename T>
void download(std::vector<T>& dst, const T* src, int64_t count, const char* name,
              cudaStream_t stream) {
  MEGAMOE_CHECK(src != nullptr, kInvalidArgument, "MoeDeviceWeights::from_stacked: ", name,
                " is a null device pointer.");
  dst.resize(static_cast<size_t>(count));
  check_cuda(cudaMemcpyAsync(dst.data(), src, static_cast<size_t>(count) * sizeof(T),
                             cudaMemcpyDeviceToHost, stream),
             "cudaMemcpyAsync(stacked weights to host)");
}

// Every ue4m3 block scale must be finite and non-negative: a bad byte would silently poison a
// 16-element block in the kernels. `dims` is the tensor's shape, for the index in the message.
void check_block_scales(const std::vector<uint8_t>& scales, const std::vector<int64_t>& dims,
                        const char* name) {
  for (size_t i = 0; i < scales.size(); ++i) {
    if (format::ue4m3_is_valid(scales[i])) continue;
    std::string index;
    int64_t rest = static_cast<int64_t>(i);
    for (size_t d = dims.size(); d-- > 0;) {
      index = std::to_string(rest % dims[d]) + (index.empty() ? "" : ", ") + index;
      rest /= dims[d];
    }
    char hex[8];
    std::snprintf(hex, sizeof(hex), "0x%02X", scales[i]);
    const bool nan = (scales[i] & 0x7F) == 0x7F;
    MEGAMOE_FAIL(kInvalidArgument, "MoeDeviceWeights::from_stacked: ", name, "[", index,
                 "] is the block scale ", hex, ", which is ",
                 nan ? std::string("NaN") : detail::concat("negative (", format::e4m3_to_f32(scales[i]), ")"),
                 "; ue4m3 block scales must be finite and non-negative.");
  }
}

void check_global_scale(float v, const std::string& what) {
  MEGAMOE_CHECK(std::isfinite(v) && v > 0.0f, kInvalidArgument,
                "MoeDeviceWeights::from_stacked: ", what, " is ", v,
                "; global scales must be finite and > 0.");
}

// Views of rows [row0, row0 + rows) of one expert's matrix inside a stacked host buffer.
Nvfp4Linear view(const std::vector<uint8_t>& codes, const std::vector<uint8_t>& scales,
                 int64_t row0, int64_t rows, int64_t k, float global_scale,
                 const std::shared_ptr<const HostStacked>& owner) {
  Nvfp4Linear lin;
  lin.out_features = rows;
  lin.in_features = k;
  lin.weight = codes.data() + row0 * (k / 2);
  lin.weight_scale = scales.data() + row0 * (k / format::kNvfp4BlockSize);
  lin.weight_scale_2 = global_scale;
  lin.owner = owner;
  return lin;
}

}  // namespace

MoeDeviceWeights MoeDeviceWeights::from_stacked(const StackedNvfp4Weights& w, cudaStream_t stream) {
  const int64_t H = w.hidden_size, I = w.intermediate_size, E = w.num_experts;
  const int64_t Is = w.shared_intermediate_size;
  constexpr int64_t kBlock = format::kNvfp4BlockSize;
  MEGAMOE_CHECK(H >= kBlock && H % kBlock == 0 && I >= kBlock && I % kBlock == 0 && E >= 1 &&
                    Is >= 0 && Is % kBlock == 0,
                kInvalidArgument, "MoeDeviceWeights::from_stacked: hidden_size ", H,
                ", intermediate_size ", I, ", num_experts ", E, ", shared_intermediate_size ", Is,
                " are invalid; H and I must be positive multiples of ", kBlock,
                ", E >= 1, and the shared size 0 or a positive multiple of ", kBlock, ".");

  auto host = std::make_shared<HostStacked>();
  download(host->w13, w.w13, E * 2 * I * (H / 2), "w13", stream);
  download(host->w13_scale, w.w13_scale, E * 2 * I * (H / kBlock), "w13_scale", stream);
  download(host->w13_scale_2, w.w13_scale_2, E * 2, "w13_scale_2", stream);
  download(host->w2, w.w2, E * H * (I / 2), "w2", stream);
  download(host->w2_scale, w.w2_scale, E * H * (I / kBlock), "w2_scale", stream);
  download(host->w2_scale_2, w.w2_scale_2, E, "w2_scale_2", stream);
  if (Is > 0) {
    download(host->shared_w13, w.shared_w13, 2 * Is * (H / 2), "shared_w13", stream);
    download(host->shared_w13_scale, w.shared_w13_scale, 2 * Is * (H / kBlock),
             "shared_w13_scale", stream);
    download(host->shared_w13_scale_2, w.shared_w13_scale_2, 2, "shared_w13_scale_2", stream);
    download(host->shared_w2, w.shared_w2, H * (Is / 2), "shared_w2", stream);
    download(host->shared_w2_scale, w.shared_w2_scale, H * (Is / kBlock), "shared_w2_scale",
             stream);
    download(host->shared_w2_scale_2, w.shared_w2_scale_2, 1, "shared_w2_scale_2", stream);
  }
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize(stacked weights to host)");

  // ModelOpt's all-zero weight (global scale 0, NaN scales, codes 0x77) becomes zeros, as the
  // checkpoint loader maps it; every other NaN scale is refused below.
  auto zero_weight = [&](std::vector<uint8_t>& codes, std::vector<uint8_t>& scales, float& s2,
                         int64_t row0, int64_t rows, int64_t k, const std::string& what) {
    if (format::zero_weight_to_decodable(codes.data() + row0 * (k / 2),
                                         scales.data() + row0 * (k / kBlock), s2, rows, k)) {
      std::fprintf(stderr, "megamoe: warning: %s is ModelOpt's all-zero weight; it is loaded as "
                   "zeros.\n", what.c_str());
    }
  };
  for (int64_t e = 0; e < E; ++e) {
    const std::string ex = " of expert " + std::to_string(e);
    zero_weight(host->w13, host->w13_scale, host->w13_scale_2[2 * e], 2 * e * I, I, H, "gate" + ex);
    zero_weight(host->w13, host->w13_scale, host->w13_scale_2[2 * e + 1], (2 * e + 1) * I, I, H,
                "up" + ex);
    zero_weight(host->w2, host->w2_scale, host->w2_scale_2[e], e * H, H, I, "down" + ex);
  }
  if (Is > 0) {
    zero_weight(host->shared_w13, host->shared_w13_scale, host->shared_w13_scale_2[0], 0, Is, H,
                "the shared gate");
    zero_weight(host->shared_w13, host->shared_w13_scale, host->shared_w13_scale_2[1], Is, Is, H,
                "the shared up");
    zero_weight(host->shared_w2, host->shared_w2_scale, host->shared_w2_scale_2[0], 0, H, Is,
                "the shared down");
  }

  check_block_scales(host->w13_scale, {E, 2 * I, H / kBlock}, "w13_scale");
  check_block_scales(host->w2_scale, {E, H, I / kBlock}, "w2_scale");
  for (int64_t e = 0; e < E; ++e) {
    const std::string ex = " of expert " + std::to_string(e);
    check_global_scale(host->w13_scale_2[2 * e], "w13_scale_2[" + std::to_string(e) + ", 0] (gate" + ex + ")");
    check_global_scale(host->w13_scale_2[2 * e + 1], "w13_scale_2[" + std::to_string(e) + ", 1] (up" + ex + ")");
    check_global_scale(host->w2_scale_2[e], "w2_scale_2[" + std::to_string(e) + "] (down" + ex + ")");
  }
  if (Is > 0) {
    check_block_scales(host->shared_w13_scale, {2 * Is, H / kBlock}, "shared_w13_scale");
    check_block_scales(host->shared_w2_scale, {H, Is / kBlock}, "shared_w2_scale");
    check_global_scale(host->shared_w13_scale_2[0], "shared_w13_scale_2[0] (shared gate)");
    check_global_scale(host->shared_w13_scale_2[1], "shared_w13_scale_2[1] (shared up)");
    check_global_scale(host->shared_w2_scale_2[0], "shared_w2_scale_2 (shared down)");
  }

  MoeLayer layer;
  layer.hidden_size = H;
  layer.intermediate_size = I;
  layer.num_experts = E;
  // The prepacked weights do not depend on routing; upload() only checks top_k against E, and
  // 1 is valid for every E (the plan carries the real top_k).
  layer.routing.top_k = 1;
  const std::shared_ptr<const HostStacked> owner = host;
  layer.experts.reserve(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    layer.experts.push_back(
        {view(host->w13, host->w13_scale, e * 2 * I, I, H, host->w13_scale_2[2 * e], owner),
         view(host->w13, host->w13_scale, e * 2 * I + I, I, H, host->w13_scale_2[2 * e + 1], owner),
         view(host->w2, host->w2_scale, e * H, H, I, host->w2_scale_2[e], owner)});
  }
  if (Is > 0) {
    layer.shared_expert = ExpertWeights{
        view(host->shared_w13, host->shared_w13_scale, 0, Is, H, host->shared_w13_scale_2[0], owner),
        view(host->shared_w13, host->shared_w13_scale, Is, Is, H, host->shared_w13_scale_2[1], owner),
        view(host->shared_w2, host->shared_w2_scale, 0, H, Is, host->shared_w2_scale_2[0], owner)};
  }

  MoeDeviceWeights out = upload(layer, stream);
  // upload() copies from pageable host memory with cudaMemcpy, which may return before the DMA
  // has landed; a stream the caller uses next need not be ordered after it. Wait for the device
  // so the weights are complete on every stream when this returns.
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize(after uploading stacked weights)");
  return out;
}

}  // namespace megamoe
