// The stacked MoE layer tensors of the megamoe torch ops (moe_stacked.h).
#include "moe_stacked.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "megamoe/runtime.h"
#include "torch_utils.h"

namespace megamoe::torch_ext {
LayerShape check_stacked(const char* op, const Stacked& s, bool any_device) {
  if (!any_device) arg(op, "w13", s.w13).cuda();
  arg(op, "w13", s.w13)
      .dtype({at::kByte})
      .dims(3, "[E, 2I, H/2] packed e2m1, rows gate then up")
      .contiguous();
  LayerShape L;
  L.device = s.w13.device();
  L.experts = s.w13.size(0);
  L.hidden = 2 * s.w13.size(2);
  L.inter = s.w13.size(1) / 2;
  TORCH_CHECK_VALUE(L.experts >= 1 && s.w13.size(1) % 2 == 0 && L.inter % 16 == 0 &&
                        L.inter >= 16 && L.hidden % 16 == 0 && L.hidden >= 16,
                    "megamoe.", op, ": w13 has shape ", sizes_string(s.w13.sizes()),
                    ", which gives E = ", L.experts, ", 2I = ", s.w13.size(1), ", H = ", L.hidden,
                    "; E must be >= 1, and H and I positive multiples of 16 (one ue4m3 scale per "
                    "16 elements).");
  const int64_t E = L.experts, H = L.hidden, I = L.inter;
  arg(op, "w13_scale", s.w13_scale).on(L.device).scale_dtype()
      .shape({E, 2 * I, H / 16}, "[E, 2I, H/16] ue4m3 block scales").contiguous();
  arg(op, "w13_scale_2", s.w13_scale_2).on(L.device).dtype({at::kFloat})
      .shape({E, 2}, "[E, 2] fp32 global scales of gate and up").contiguous();
  arg(op, "w2", s.w2).on(L.device).dtype({at::kByte})
      .shape({E, H, I / 2}, "[E, H, I/2] packed e2m1").contiguous();
  arg(op, "w2_scale", s.w2_scale).on(L.device).scale_dtype()
      .shape({E, H, I / 16}, "[E, H, I/16] ue4m3 block scales").contiguous();
  arg(op, "w2_scale_2", s.w2_scale_2).on(L.device).dtype({at::kFloat})
      .shape({E}, "[E] fp32 global scales of down").contiguous();

  std::string given, missing;
  for (const auto& [name, t] : s.shared()) {
    std::string& list = t->has_value() ? given : missing;
    list += (list.empty() ? "" : ", ") + std::string(name);
  }
  TORCH_CHECK_VALUE(given.empty() || missing.empty(), "megamoe.", op,
                    ": a shared expert needs all six shared_* tensors; given ", given,
                    ", missing ", missing, ".");
  if (!given.empty()) {
    const at::Tensor& sw13 = *s.shared_w13;
    arg(op, "shared_w13", sw13).on(L.device).dtype({at::kByte})
        .shape({-1, H / 2}, "[2Is, H/2] packed e2m1, rows gate then up").contiguous();
    L.shared_inter = sw13.size(0) / 2;
    TORCH_CHECK_VALUE(sw13.size(0) % 2 == 0 && L.shared_inter >= 16 && L.shared_inter % 16 == 0,
                      "megamoe.", op, ": shared_w13 has ", sw13.size(0),
                      " rows; expected 2Is with Is a positive multiple of 16.");
    const int64_t Is = L.shared_inter;
    arg(op, "shared_w13_scale", *s.shared_w13_scale).on(L.device).scale_dtype()
        .shape({2 * Is, H / 16}, "[2Is, H/16] ue4m3 block scales").contiguous();
    arg(op, "shared_w13_scale_2", *s.shared_w13_scale_2).on(L.device).dtype({at::kFloat})
        .shape({2}, "[2] fp32 global scales of gate and up").contiguous();
    arg(op, "shared_w2", *s.shared_w2).on(L.device).dtype({at::kByte})
        .shape({H, Is / 2}, "[H, Is/2] packed e2m1").contiguous();
    arg(op, "shared_w2_scale", *s.shared_w2_scale).on(L.device).scale_dtype()
        .shape({H, Is / 16}, "[H, Is/16] ue4m3 block scales").contiguous();
    const at::Tensor& s2 = *s.shared_w2_scale_2;
    arg(op, "shared_w2_scale_2", s2).on(L.device).dtype({at::kFloat});
    TORCH_CHECK_VALUE(s2.numel() == 1 && s2.dim() <= 1, "megamoe.", op,
                      ": shared_w2_scale_2 has shape ", sizes_string(s2.sizes()),
                      "; expected one fp32 global scale, shape [] or [1].");
  }
  return L;
}

StackedNvfp4Buffers writable_view(const Stacked& s, const LayerShape& L) {
  auto bytes = [](const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); };
  auto floats = [](const at::Tensor& t) { return t.data_ptr<float>(); };
  StackedNvfp4Buffers b;
  b.hidden_size = L.hidden;
  b.intermediate_size = L.inter;
  b.num_experts = L.experts;
  b.w13 = bytes(s.w13);
  b.w13_scale = bytes(s.w13_scale);
  b.w13_scale_2 = floats(s.w13_scale_2);
  b.w2 = bytes(s.w2);
  b.w2_scale = bytes(s.w2_scale);
  b.w2_scale_2 = floats(s.w2_scale_2);
  b.shared_intermediate_size = L.shared_inter;
  if (L.shared_inter > 0) {
    b.shared_w13 = bytes(*s.shared_w13);
    b.shared_w13_scale = bytes(*s.shared_w13_scale);
    b.shared_w13_scale_2 = floats(*s.shared_w13_scale_2);
    b.shared_w2 = bytes(*s.shared_w2);
    b.shared_w2_scale = bytes(*s.shared_w2_scale);
    b.shared_w2_scale_2 = floats(*s.shared_w2_scale_2);
  }
  return b;
}

StackedNvfp4Weights device_view(const Stacked& s, const LayerShape& L) { return writable_view(s, L).as_const(); }

}  // namespace megamoe::torch_ext
