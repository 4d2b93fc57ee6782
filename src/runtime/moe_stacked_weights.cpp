// MoeDeviceWeights::from_stacked: prepacked device weights from the stacked layout engines keep
// on the GPU (w13 [E, 2I, H/2] gate-then-up rows, w2 [E, H, I/2], scales and global scales).
//
// The prepack (backends/sm90_w4a16/sm90_w4a16_prepack.h) is a host-side reshuffle, so the simplest correct
// path is: copy the stacked tensors to the host once, view them as the per-expert Nvfp4Linear
// matrices of a MoeLayer (no byte changes: gate is rows [0, I) of an expert's w13, up rows
// [I, 2I)), and reuse upload(). This is a one-time load cost, never part of a forward pass.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "megamoe/format.h"
#include "megamoe/gpu.h"
#include "megamoe/runtime.h"
#include "megamoe/status.h"
#include "runtime/backend.h"
#include "runtime/moe_device_weights.h"

namespace megamoe {
namespace {

using gpu::check_cuda;

constexpr const char* kFromStacked = "MoeDeviceWeights::from_stacked";
constexpr const char* kInPlace = "MoeDeviceWeights::prepack_in_place";
constexpr const char* kView = "MoeDeviceWeights::view_prepacked";
constexpr const char* kUnprepack = "unprepack_stacked";

// Host copies of the stacked tensors; the MoeLayer's Nvfp4Linear views point into them.
struct HostStacked {
  std::vector<uint8_t> w13, w13_scale, w2, w2_scale;
  std::vector<float> w13_scale_2, w2_scale_2;
  std::vector<uint8_t> shared_w13, shared_w13_scale, shared_w2, shared_w2_scale;
  std::vector<float> shared_w13_scale_2, shared_w2_scale_2;
};

// `src` may be device or host memory (unprepack_stacked reads either).
template <typename T>
void download(std::vector<T>& dst, const T* src, int64_t count, const char* name,
              cudaStream_t stream, const char* fn = kFromStacked) {
  MEGAMOE_CHECK(src != nullptr, kInvalidArgument, fn, ": ", name, " is a null pointer.");
  dst.resize(static_cast<size_t>(count));
  check_cuda(cudaMemcpyAsync(dst.data(), src, static_cast<size_t>(count) * sizeof(T),
                             cudaMemcpyDefault, stream),
             "cudaMemcpyAsync(stacked weights to host)");
}

// Every ue4m3 block scale must be finite and non-negative: a bad byte would silently poison a
// 16-element block in the kernels. `dims` is the tensor's shape, for the index in the message.
void check_block_scales(const std::vector<uint8_t>& scales, const std::vector<int64_t>& dims,
                        const char* name, const char* fn) {
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
    MEGAMOE_FAIL(kInvalidArgument, fn, ": ", name, "[", index,
                 "] is the block scale ", hex, ", which is ",
                 nan ? std::string("NaN") : detail::concat("negative (", format::e4m3_to_f32(scales[i]), ")"),
                 "; ue4m3 block scales must be finite and non-negative.");
  }
}

void check_global_scale(float v, const std::string& what, const char* fn) {
  MEGAMOE_CHECK(std::isfinite(v) && v > 0.0f, kInvalidArgument, fn, ": ", what, " is ", v,
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

// The layer's shape, checked as upload() checks it (no routing: top_k 1 is valid for every E).
MoeProblem stacked_shape(int64_t H, int64_t I, int64_t E, int64_t Is, const char* fn) {
  constexpr int64_t kBlock = format::kNvfp4BlockSize;
  MEGAMOE_CHECK(H >= kBlock && H % kBlock == 0 && I >= kBlock && I % kBlock == 0 && E >= 1 &&
                    Is >= 0 && Is % kBlock == 0,
                kInvalidArgument, fn, ": hidden_size ", H, ", intermediate_size ", I,
                ", num_experts ", E, ", shared_intermediate_size ", Is,
                " are invalid; H and I must be positive multiples of ", kBlock,
                ", E >= 1, and the shared size 0 or a positive multiple of ", kBlock, ".");
  MoeProblem p;
  p.hidden_size = H;
  p.intermediate_size = I;
  p.num_experts = E;
  p.top_k = 1;
  p.shared_intermediate_size = Is;
  return p;
}

// The stacked tensors copied to the host (after the work queued on `stream`), ModelOpt's all-zero
// weights made decodable, every block and global scale checked.
std::shared_ptr<HostStacked> load_checked(const StackedNvfp4Weights& w, cudaStream_t stream, const char* fn) {
  const int64_t H = w.hidden_size, I = w.intermediate_size, E = w.num_experts;
  const int64_t Is = w.shared_intermediate_size;
  constexpr int64_t kBlock = format::kNvfp4BlockSize;
  auto host = std::make_shared<HostStacked>();
  download(host->w13, w.w13, E * 2 * I * (H / 2), "w13", stream, fn);
  download(host->w13_scale, w.w13_scale, E * 2 * I * (H / kBlock), "w13_scale", stream, fn);
  download(host->w13_scale_2, w.w13_scale_2, E * 2, "w13_scale_2", stream, fn);
  download(host->w2, w.w2, E * H * (I / 2), "w2", stream, fn);
  download(host->w2_scale, w.w2_scale, E * H * (I / kBlock), "w2_scale", stream, fn);
  download(host->w2_scale_2, w.w2_scale_2, E, "w2_scale_2", stream, fn);
  if (Is > 0) {
    download(host->shared_w13, w.shared_w13, 2 * Is * (H / 2), "shared_w13", stream, fn);
    download(host->shared_w13_scale, w.shared_w13_scale, 2 * Is * (H / kBlock), "shared_w13_scale",
             stream, fn);
    download(host->shared_w13_scale_2, w.shared_w13_scale_2, 2, "shared_w13_scale_2", stream, fn);
    download(host->shared_w2, w.shared_w2, H * (Is / 2), "shared_w2", stream, fn);
    download(host->shared_w2_scale, w.shared_w2_scale, H * (Is / kBlock), "shared_w2_scale", stream, fn);
    download(host->shared_w2_scale_2, w.shared_w2_scale_2, 1, "shared_w2_scale_2", stream, fn);
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

  check_block_scales(host->w13_scale, {E, 2 * I, H / kBlock}, "w13_scale", fn);
  check_block_scales(host->w2_scale, {E, H, I / kBlock}, "w2_scale", fn);
  for (int64_t e = 0; e < E; ++e) {
    const std::string ex = " of expert " + std::to_string(e);
    check_global_scale(host->w13_scale_2[2 * e], "w13_scale_2[" + std::to_string(e) + ", 0] (gate" + ex + ")", fn);
    check_global_scale(host->w13_scale_2[2 * e + 1], "w13_scale_2[" + std::to_string(e) + ", 1] (up" + ex + ")", fn);
    check_global_scale(host->w2_scale_2[e], "w2_scale_2[" + std::to_string(e) + "] (down" + ex + ")", fn);
  }
  if (Is > 0) {
    check_block_scales(host->shared_w13_scale, {2 * Is, H / kBlock}, "shared_w13_scale", fn);
    check_block_scales(host->shared_w2_scale, {H, Is / kBlock}, "shared_w2_scale", fn);
    check_global_scale(host->shared_w13_scale_2[0], "shared_w13_scale_2[0] (shared gate)", fn);
    check_global_scale(host->shared_w13_scale_2[1], "shared_w13_scale_2[1] (shared up)", fn);
    check_global_scale(host->shared_w2_scale_2[0], "shared_w2_scale_2 (shared down)", fn);
  }
  return host;
}

// The host copy viewed as the per-expert matrices of a MoeLayer (no byte changes: gate is rows
// [0, I) of an expert's w13, up rows [I, 2I)).
MoeLayer host_layer(const std::shared_ptr<HostStacked>& host, int64_t H, int64_t I, int64_t E, int64_t Is) {
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
  return layer;
}

// Where the kernels will read a layer the caller holds: device memory, 16-byte aligned (the
// kernels' 16-byte loads), and with a shared expert one allocation per kind (its slices are
// virtual experts E.. of one base).
runtime::WeightStorage caller_storage(const StackedNvfp4Weights& w, const char* fn) {
  const int64_t H = w.hidden_size, I = w.intermediate_size, E = w.num_experts;
  const int64_t Is = w.shared_intermediate_size;
  constexpr int64_t kBlock = format::kNvfp4BlockSize;
  struct Kind {
    const char* name;
    const uint8_t* routed;
    const char* shared_name;
    const uint8_t* shared;
    int64_t routed_bytes;
  };
  const Kind kinds[] = {{"w13", w.w13, "shared_w13", w.shared_w13, E * 2 * I * (H / 2)},
                        {"w13_scale", w.w13_scale, "shared_w13_scale", w.shared_w13_scale, E * 2 * I * (H / kBlock)},
                        {"w2", w.w2, "shared_w2", w.shared_w2, E * H * (I / 2)},
                        {"w2_scale", w.w2_scale, "shared_w2_scale", w.shared_w2_scale, E * H * (I / kBlock)}};
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  for (const Kind& k : kinds) {
    MEGAMOE_CHECK(k.routed != nullptr, kInvalidArgument, fn, ": ", k.name, " is a null pointer.");
    MEGAMOE_CHECK(reinterpret_cast<uintptr_t>(k.routed) % 16 == 0, kInvalidArgument, fn, ": ", k.name,
                  " is not 16-byte aligned; the kernels read it in 16-byte loads.");
    cudaPointerAttributes attr{};
    check_cuda(cudaPointerGetAttributes(&attr, k.routed), "cudaPointerGetAttributes(weights)");
    MEGAMOE_CHECK(attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged, kInvalidArgument, fn,
                  ": ", k.name, " is not device memory; the kernels read the caller's tensors in place.");
    MEGAMOE_CHECK(attr.type == cudaMemoryTypeManaged || attr.device == device, kInvalidArgument, fn, ": ", k.name,
                  " is on device ", attr.device, ", not the current device ", device, ".");
    MEGAMOE_CHECK(Is == 0 || k.shared == k.routed + k.routed_bytes, kInvalidArgument, fn, ": ", k.shared_name,
                  " must start where ", k.name, " ends (", k.routed_bytes, " bytes after it): the kernels read "
                  "the routed and the shared expert's ", k.name, " from one allocation.");
  }
  return {const_cast<uint8_t*>(w.w13), const_cast<uint8_t*>(w.w13_scale), const_cast<uint8_t*>(w.w2),
          const_cast<uint8_t*>(w.w2_scale)};
}

template <typename T>
void upload_to(T* dst, const std::vector<T>& src, cudaStream_t stream) {
  check_cuda(cudaMemcpyAsync(dst, src.data(), src.size() * sizeof(T), cudaMemcpyDefault, stream),
             "cudaMemcpyAsync(stacked weights from host)");
}

}  // namespace

StackedNvfp4Weights StackedNvfp4Buffers::as_const() const {
  StackedNvfp4Weights w;
  w.hidden_size = hidden_size;
  w.intermediate_size = intermediate_size;
  w.num_experts = num_experts;
  w.w13 = w13;
  w.w13_scale = w13_scale;
  w.w13_scale_2 = w13_scale_2;
  w.w2 = w2;
  w.w2_scale = w2_scale;
  w.w2_scale_2 = w2_scale_2;
  w.shared_intermediate_size = shared_intermediate_size;
  w.shared_w13 = shared_w13;
  w.shared_w13_scale = shared_w13_scale;
  w.shared_w13_scale_2 = shared_w13_scale_2;
  w.shared_w2 = shared_w2;
  w.shared_w2_scale = shared_w2_scale;
  w.shared_w2_scale_2 = shared_w2_scale_2;
  return w;
}

MoeDeviceWeights MoeDeviceWeights::from_stacked(const StackedNvfp4Weights& w, cudaStream_t stream) {
  const int64_t H = w.hidden_size, I = w.intermediate_size, E = w.num_experts;
  const int64_t Is = w.shared_intermediate_size;
  stacked_shape(H, I, E, Is, kFromStacked);
  const std::shared_ptr<HostStacked> host = load_checked(w, stream, kFromStacked);
  MoeDeviceWeights out = upload(host_layer(host, H, I, E, Is), stream);
  // upload() copies from pageable host memory with cudaMemcpy, which may return before the DMA
  // has landed; a stream the caller uses next need not be ordered after it. Wait for the device
  // so the weights are complete on every stream when this returns.
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize(after uploading stacked weights)");
  return out;
}

MoeDeviceWeights MoeDeviceWeights::prepack_in_place(const StackedNvfp4Buffers& b, cudaStream_t stream) {
  const int64_t H = b.hidden_size, I = b.intermediate_size, E = b.num_experts;
  const int64_t Is = b.shared_intermediate_size;
  const StackedNvfp4Weights w = b.as_const();
  MoeProblem shape = stacked_shape(H, I, E, Is, kInPlace);
  runtime::validate_problem_common(shape);
  const runtime::Arch arch = runtime::current_device().arch;
  const runtime::MoeBackend& row = runtime::weights_backend(arch);
  row.validate(shape);
  const runtime::WeightStorage storage = caller_storage(w, kInPlace);
  const std::shared_ptr<HostStacked> host = load_checked(w, stream, kInPlace);
  const MoeLayer layer = host_layer(host, H, I, E, Is);
  layer.validate();

  MoeDeviceWeights out;
  Impl& impl = *out.impl_;
  impl.shape = shape;
  impl.arch = arch;
  impl.data = row.upload_into(layer, storage, stream);
  // The global scales stay in the caller's tensors (view_prepacked and unprepack_stacked read
  // them): write back the all-zero weights' canonical 1.
  upload_to(b.w13_scale_2, host->w13_scale_2, stream);
  upload_to(b.w2_scale_2, host->w2_scale_2, stream);
  if (Is > 0) {
    upload_to(b.shared_w13_scale_2, host->shared_w13_scale_2, stream);
    upload_to(b.shared_w2_scale_2, host->shared_w2_scale_2, stream);
  }
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize(after prepacking in place)");
  return out;
}

MoeDeviceWeights MoeDeviceWeights::view_prepacked(const StackedNvfp4Weights& w, cudaStream_t stream) {
  const int64_t H = w.hidden_size, I = w.intermediate_size, E = w.num_experts;
  const int64_t Is = w.shared_intermediate_size;
  MoeProblem shape = stacked_shape(H, I, E, Is, kView);
  runtime::validate_problem_common(shape);
  const runtime::Arch arch = runtime::current_device().arch;
  const runtime::MoeBackend& row = runtime::weights_backend(arch);
  row.validate(shape);
  const runtime::WeightStorage storage = caller_storage(w, kView);
  std::vector<float> s13, s2, shared13, shared2;
  download(s13, w.w13_scale_2, 2 * E, "w13_scale_2", stream, kView);
  download(s2, w.w2_scale_2, E, "w2_scale_2", stream, kView);
  if (Is > 0) {
    download(shared13, w.shared_w13_scale_2, 2, "shared_w13_scale_2", stream, kView);
    download(shared2, w.shared_w2_scale_2, 1, "shared_w2_scale_2", stream, kView);
  }
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize(global scales to host)");
  runtime::GlobalScales scales;
  for (int64_t e = 0; e < E; ++e) {
    const std::string ex = std::to_string(e);
    check_global_scale(s13[2 * e], "w13_scale_2[" + ex + ", 0] (gate of expert " + ex + ")", kView);
    check_global_scale(s13[2 * e + 1], "w13_scale_2[" + ex + ", 1] (up of expert " + ex + ")", kView);
    check_global_scale(s2[e], "w2_scale_2[" + ex + "] (down of expert " + ex + ")", kView);
    scales.routed.push_back({s13[2 * e], s13[2 * e + 1], s2[e]});
  }
  if (Is > 0) {
    check_global_scale(shared13[0], "shared_w13_scale_2[0] (shared gate)", kView);
    check_global_scale(shared13[1], "shared_w13_scale_2[1] (shared up)", kView);
    check_global_scale(shared2[0], "shared_w2_scale_2 (shared down)", kView);
    scales.shared = {shared13[0], shared13[1], shared2[0]};
  }

  MoeDeviceWeights out;
  Impl& impl = *out.impl_;
  impl.shape = shape;
  impl.arch = arch;
  impl.data = row.view(shape, storage, scales, stream);
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize(after viewing prepacked weights)");
  return out;
}

std::string prepacked_layout() {
  return runtime::weights_backend(runtime::current_device().arch).weight_layout();
}

void unprepack_stacked(const std::string& layout, const StackedNvfp4Weights& in, const StackedNvfp4Buffers& out,
                       cudaStream_t stream) {
  const runtime::MoeBackend& row = runtime::layout_backend(layout);
  const int64_t H = in.hidden_size, I = in.intermediate_size, E = in.num_experts;
  const int64_t Is = in.shared_intermediate_size;
  const MoeProblem shape = stacked_shape(H, I, E, Is, kUnprepack);
  row.validate(shape);
  MEGAMOE_CHECK(out.hidden_size == H && out.intermediate_size == I && out.num_experts == E &&
                    out.shared_intermediate_size == Is,
                kInvalidArgument, kUnprepack, ": out has hidden_size ", out.hidden_size, ", intermediate_size ",
                out.intermediate_size, ", num_experts ", out.num_experts, ", shared_intermediate_size ",
                out.shared_intermediate_size, "; the prepacked layer has ", H, ", ", I, ", ", E, ", ", Is, ".");
  constexpr int64_t kBlock = format::kNvfp4BlockSize;
  const int64_t c13 = E * 2 * I * (H / 2), s13 = E * 2 * I * (H / kBlock);
  const int64_t c2 = E * H * (I / 2), sc2 = E * H * (I / kBlock);
  const int64_t sc13 = 2 * Is * (H / 2), ss13 = 2 * Is * (H / kBlock), sc2s = H * (Is / 2), ss2 = H * (Is / kBlock);
  // The prepacked kinds hold the shared expert's slices after the routed experts (one allocation
  // each); read each kind whole.
  auto read_kind = [&](std::vector<uint8_t>& dst, const uint8_t* routed, int64_t routed_bytes, const uint8_t* shared,
                       int64_t shared_bytes, const char* name) {
    MEGAMOE_CHECK(Is == 0 || (routed != nullptr && shared == routed + routed_bytes), kInvalidArgument, kUnprepack,
                  ": the shared expert's ", name, " must follow the routed experts' in one allocation, as "
                  "prepack_in_place wrote it.");
    download(dst, routed, routed_bytes + shared_bytes, name, stream, kUnprepack);
  };
  std::vector<uint8_t> p13, ps13, p2, ps2;
  read_kind(p13, in.w13, c13, in.shared_w13, sc13, "w13");
  read_kind(ps13, in.w13_scale, s13, in.shared_w13_scale, ss13, "w13_scale");
  read_kind(p2, in.w2, c2, in.shared_w2, sc2s, "w2");
  read_kind(ps2, in.w2_scale, sc2, in.shared_w2_scale, ss2, "w2_scale");
  std::vector<float> g13, g2, gs13, gs2;
  download(g13, in.w13_scale_2, 2 * E, "w13_scale_2", stream, kUnprepack);
  download(g2, in.w2_scale_2, E, "w2_scale_2", stream, kUnprepack);
  if (Is > 0) {
    download(gs13, in.shared_w13_scale_2, 2, "shared_w13_scale_2", stream, kUnprepack);
    download(gs2, in.shared_w2_scale_2, 1, "shared_w2_scale_2", stream, kUnprepack);
  }
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize(prepacked weights to host)");

  HostStacked h;
  h.w13.resize(static_cast<size_t>(c13));
  h.w13_scale.resize(static_cast<size_t>(s13));
  h.w2.resize(static_cast<size_t>(c2));
  h.w2_scale.resize(static_cast<size_t>(sc2));
  h.shared_w13.resize(static_cast<size_t>(sc13));
  h.shared_w13_scale.resize(static_cast<size_t>(ss13));
  h.shared_w2.resize(static_cast<size_t>(sc2s));
  h.shared_w2_scale.resize(static_cast<size_t>(ss2));
  StackedNvfp4Buffers host_out;
  host_out.hidden_size = H;
  host_out.intermediate_size = I;
  host_out.num_experts = E;
  host_out.shared_intermediate_size = Is;
  host_out.w13 = h.w13.data();
  host_out.w13_scale = h.w13_scale.data();
  host_out.w2 = h.w2.data();
  host_out.w2_scale = h.w2_scale.data();
  host_out.shared_w13 = h.shared_w13.data();
  host_out.shared_w13_scale = h.shared_w13_scale.data();
  host_out.shared_w2 = h.shared_w2.data();
  host_out.shared_w2_scale = h.shared_w2_scale.data();
  row.unprepack(shape, {p13, ps13, p2, ps2}, host_out);

  auto write = [&](auto* dst, const auto& src, const char* name) {
    MEGAMOE_CHECK(dst != nullptr, kInvalidArgument, kUnprepack, ": out.", name, " is a null pointer.");
    upload_to(dst, src, stream);
  };
  // The global scales are not rewritten by a prepack: where `out` is `in`'s memory they are left
  // alone (a caller may hold them read-only).
  auto write_scales = [&](float* dst, const float* src, const std::vector<float>& values, const char* name) {
    if (dst != src) write(dst, values, name);
  };
  write(out.w13, h.w13, "w13");
  write(out.w13_scale, h.w13_scale, "w13_scale");
  write_scales(out.w13_scale_2, in.w13_scale_2, g13, "w13_scale_2");
  write(out.w2, h.w2, "w2");
  write(out.w2_scale, h.w2_scale, "w2_scale");
  write_scales(out.w2_scale_2, in.w2_scale_2, g2, "w2_scale_2");
  if (Is > 0) {
    write(out.shared_w13, h.shared_w13, "shared_w13");
    write(out.shared_w13_scale, h.shared_w13_scale, "shared_w13_scale");
    write_scales(out.shared_w13_scale_2, in.shared_w13_scale_2, gs13, "shared_w13_scale_2");
    write(out.shared_w2, h.shared_w2, "shared_w2");
    write(out.shared_w2_scale, h.shared_w2_scale, "shared_w2_scale");
    write_scales(out.shared_w2_scale_2, in.shared_w2_scale_2, gs2, "shared_w2_scale_2");
  }
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize(after unprepacking)");
}

}  // namespace megamoe
