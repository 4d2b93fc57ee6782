// The C API's entry points (include/megamoe/megamoe.h): each turns its C arguments into the C++
// API's, checks them on the host, and maps megamoe::Error (and anything else thrown) to a status
// and this thread's last-error message. No exception crosses the C boundary.
#include "megamoe/megamoe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "capi/capi_internal.h"
#include "megamoe/checkpoint.h"
#include "megamoe/reference.h"
#include "megamoe/status.h"

struct megamoe_checkpoint {
  megamoe::ModelConfig config;
  megamoe::Checkpoint files;
};

namespace megamoe::capi {
namespace {

thread_local std::string t_last_error;

megamoe_status status_of(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return MEGAMOE_ERROR_INVALID_ARGUMENT;
    case ErrorCode::kInvalidCheckpoint: return MEGAMOE_ERROR_INVALID_CHECKPOINT;
    case ErrorCode::kNotFound: return MEGAMOE_ERROR_NOT_FOUND;
    case ErrorCode::kIo: return MEGAMOE_ERROR_IO;
    case ErrorCode::kUnsupported: return MEGAMOE_ERROR_UNSUPPORTED;
    case ErrorCode::kCuda: return MEGAMOE_ERROR_CUDA;
    case ErrorCode::kInternal: return MEGAMOE_ERROR_INTERNAL;
  }
  return MEGAMOE_ERROR_INTERNAL;
}

// Runs `body` for the C function `fn`: clears the last error, and turns whatever it throws into a
// status and a message that starts with the function's name.
template <typename Body>
megamoe_status guarded(const char* fn, Body&& body) noexcept {
  try {
    t_last_error.clear();
  } catch (...) {
  }
  megamoe_status status = MEGAMOE_OK;
  std::string message;
  try {
    body();
    return MEGAMOE_OK;
  } catch (const Error& e) {
    status = status_of(e.code());
    message = e.what();
  } catch (const std::bad_alloc&) {
    status = MEGAMOE_ERROR_OUT_OF_MEMORY;
    message = "out of host memory";
  } catch (const std::exception& e) {
    status = MEGAMOE_ERROR_INTERNAL;
    message = std::string("unexpected exception: ") + e.what();
  } catch (...) {
    status = MEGAMOE_ERROR_INTERNAL;
    message = "unexpected exception of unknown type";
  }
  try {
    t_last_error = std::string(fn) + ": " + message;
  } catch (...) {
    // Out of memory while building the message: the status alone must do.
  }
  return status;
}

template <typename T>
void check_not_null(const T* p, const char* what) {
  MEGAMOE_CHECK(p != nullptr, kInvalidArgument, what, " is NULL.");
}

// Reads a caller's struct of `struct_size` bytes into a struct of this library's version. Fields
// are only appended (after the current sizeof, padding included) and take zero to mean their
// default, so a shorter struct gets zeros for what it lacks, and the bytes of a longer one past
// what this library knows must be zero: a field set there would otherwise be silently ignored.
// A struct_size past this is garbage (an uninitialised struct), not a newer version: refusing it
// keeps the check below from reading past the caller's struct.
constexpr uint32_t kMaxStructSize = 16384;

template <typename S>
S read_versioned(const S* in, const char* type) {
  const uint32_t size = in->struct_size;
  MEGAMOE_CHECK(size != 0, kInvalidArgument, type, ".struct_size is 0: initialise the struct with ",
                type, "_init (or set struct_size to sizeof(", type, ")).");
  MEGAMOE_CHECK(size <= kMaxStructSize, kInvalidArgument, type, ".struct_size is ", size,
                ", more than any version of it can have (", kMaxStructSize, "): initialise it with ",
                type, "_init.");
  MEGAMOE_CHECK(size >= sizeof(S), kInvalidArgument, type, ".struct_size is ", size,
                ", smaller than the ", sizeof(S), " bytes of its first version: initialise it with ",
                type, "_init.");
  S out;
  std::memcpy(&out, in, sizeof(S));
  const auto* bytes = reinterpret_cast<const unsigned char*>(in);
  for (size_t i = sizeof(S); i < size; ++i) {
    MEGAMOE_CHECK(bytes[i] == 0, kUnsupported, type, " sets byte ", i, " (struct_size ", size,
                  "), a field this library (version ", megamoe_version_string(),
                  ", which knows ", sizeof(S), " bytes) does not have: the header the caller was "
                  "built with is newer than the library.");
  }
  return out;
}

// Writes an output struct into the caller's, no more than its struct_size bytes.
template <typename S>
void write_versioned(S* out, const S& value, const char* type) {
  const uint32_t size = out->struct_size;
  MEGAMOE_CHECK(size >= sizeof(S), kInvalidArgument, type, ".struct_size is ", size,
                "; it must be at least sizeof(", type, ") = ", sizeof(S),
                " (set it before the call).");
  S copy = value;
  copy.struct_size = static_cast<uint32_t>(sizeof(S));
  std::memcpy(out, &copy, sizeof(S));
}

LayerOptions read_options(const megamoe_layer_options* in) {
  check_not_null(in, "options");
  const megamoe_layer_options o = read_versioned(in, "megamoe_layer_options");
  LayerOptions out;
  MEGAMOE_CHECK(o.device >= 0, kInvalidArgument, "options.device is ", o.device,
                "; it must be a CUDA device ordinal (>= 0).");
  MEGAMOE_CHECK(o.max_tokens >= 1 && o.max_tokens <= (int64_t{1} << 20), kInvalidArgument,
                "options.max_tokens is ", o.max_tokens,
                "; it must be the largest token count any run passes, 1..1048576.");
  MEGAMOE_CHECK(o.precision >= MEGAMOE_PRECISION_W4A16 && o.precision <= MEGAMOE_PRECISION_AUTO,
                kInvalidArgument, "options.precision is ", o.precision,
                "; allowed: MEGAMOE_PRECISION_W4A16 (0), MEGAMOE_PRECISION_W4A8 (1), "
                "MEGAMOE_PRECISION_AUTO (2).");
  MEGAMOE_CHECK(o.deterministic == 0 || o.deterministic == 1, kInvalidArgument,
                "options.deterministic is ", o.deterministic, "; it must be 0 or 1.");
  MEGAMOE_CHECK(o.external_workspace == 0 || o.external_workspace == 1, kInvalidArgument,
                "options.external_workspace is ", o.external_workspace, "; it must be 0 or 1.");
  out.device = o.device;
  out.max_tokens = o.max_tokens;
  out.precision = kPrecisions[o.precision];
  out.deterministic = o.deterministic != 0;
  out.external_workspace = o.external_workspace != 0;
  return out;
}

// ---- stacked tensors -------------------------------------------------------------------------

const char* dtype_label(int32_t dtype) {
  switch (dtype) {
    case MEGAMOE_DTYPE_U8: return "U8";
    case MEGAMOE_DTYPE_F8_E4M3: return "F8_E4M3";
    case MEGAMOE_DTYPE_F32: return "F32";
    case MEGAMOE_DTYPE_BF16: return "BF16";
    case MEGAMOE_DTYPE_I32: return "I32";
  }
  return "an unknown dtype";
}

std::string shape_text(const int64_t* dims, int ndim) {
  std::ostringstream os;
  os << '[';
  for (int d = 0; d < ndim; ++d) os << (d ? ", " : "") << dims[d];
  os << ']';
  return os.str();
}

enum class Kind { kCodes, kScales, kGlobalScales, kBias };

// Checks one tensor descriptor against the shape the layer's sizes imply (`rule` spells it, e.g.
// "[E, 2I, H/2]"), its dtype and its strides (contiguous only).
void check_tensor(const megamoe_tensor& t, const char* name, Kind kind,
                  const std::vector<int64_t>& expected, const char* rule) {
  MEGAMOE_CHECK(t.data != nullptr, kInvalidArgument, name, ".data is NULL; expected a device "
                "pointer to ", rule, ".");
  const bool dtype_ok = kind == Kind::kCodes    ? t.dtype == MEGAMOE_DTYPE_U8
                        : kind == Kind::kScales ? t.dtype == MEGAMOE_DTYPE_U8 || t.dtype == MEGAMOE_DTYPE_F8_E4M3
                                                : t.dtype == MEGAMOE_DTYPE_F32;
  const char* allowed = kind == Kind::kCodes    ? "MEGAMOE_DTYPE_U8 (packed e2m1 pairs)"
                        : kind == Kind::kScales ? "MEGAMOE_DTYPE_F8_E4M3 or MEGAMOE_DTYPE_U8 (ue4m3 bytes)"
                                                : "MEGAMOE_DTYPE_F32";
  MEGAMOE_CHECK(dtype_ok, kInvalidArgument, name, ".dtype is ", t.dtype, " (", dtype_label(t.dtype),
                "); expected ", allowed, ".");
  const int ndim = static_cast<int>(expected.size());
  MEGAMOE_CHECK(t.ndim == ndim, kInvalidArgument, name, ".ndim is ", t.ndim, "; expected ", ndim,
                " (", rule, ").");
  MEGAMOE_CHECK(std::equal(expected.begin(), expected.end(), t.shape), kInvalidArgument, name,
                " has shape ", shape_text(t.shape, ndim), "; expected ", rule, " = ",
                shape_text(expected.data(), ndim), ".");
  bool all_zero = true, contiguous = true;
  int64_t stride = 1;
  std::vector<int64_t> row_major(static_cast<size_t>(ndim));
  for (int d = ndim - 1; d >= 0; --d) {
    row_major[static_cast<size_t>(d)] = stride;
    all_zero = all_zero && t.strides[d] == 0;
    // A dimension of extent 1 is contiguous whatever its stride says.
    contiguous = contiguous && (t.strides[d] == stride || t.shape[d] == 1);
    stride *= t.shape[d];
  }
  MEGAMOE_CHECK(all_zero || contiguous, kUnsupported, name, " has strides ",
                shape_text(t.strides, ndim), " (elements); this version takes contiguous row-major "
                "tensors only: strides ", shape_text(row_major.data(), ndim), ", or all zero.");
}

bool absent(const megamoe_tensor& t) { return t.data == nullptr; }

// The loader's bound on H and I (README "Malformed input"): every size derived from them then
// fits int64.
constexpr int64_t kMaxSize = int64_t{1} << 24;

StackedLayer read_stacked(const megamoe_stacked_layer* in) {
  check_not_null(in, "weights");
  const megamoe_stacked_layer w = read_versioned(in, "megamoe_stacked_layer");
  // The sizes come from w13 [E, 2I, H/2] and w2 [E, H, I/2]; every tensor is then checked
  // against them, so a wrong shape is reported on the tensor that has it.
  MEGAMOE_CHECK(w.w13.ndim == 3 && w.w2.ndim == 3, kInvalidArgument, "w13.ndim is ", w.w13.ndim,
                " and w2.ndim is ", w.w2.ndim, "; expected 3 for both (w13 [E, 2I, H/2], w2 [E, H, I/2]).");
  StackedLayer s;
  s.num_experts = w.w13.shape[0];
  s.hidden_size = w.w2.shape[1];
  MEGAMOE_CHECK(w.w13.shape[1] % 2 == 0, kInvalidArgument, "w13 has shape ", shape_text(w.w13.shape, 3),
                "; its rows (gate then up) must be 2I, an even number.");
  s.intermediate_size = w.w13.shape[1] / 2;
  const int64_t E = s.num_experts, H = s.hidden_size, I = s.intermediate_size;
  MEGAMOE_CHECK(E >= 1 && E <= 1024, kInvalidArgument, "w13.shape[0] = ", E,
                " routed experts; allowed: 1..1024.");
  MEGAMOE_CHECK(H >= 16 && H % 16 == 0 && H <= kMaxSize, kInvalidArgument, "the hidden size H = w2.shape[1] = ",
                H, " must be a positive multiple of 16 (one ue4m3 block scale per 16 elements), at most 2^24.");
  MEGAMOE_CHECK(I >= 16 && I % 16 == 0 && I <= kMaxSize, kInvalidArgument,
                "the intermediate size I = w13.shape[1] / 2 = ", I,
                " must be a positive multiple of 16 (one ue4m3 block scale per 16 elements), at most 2^24.");
  check_tensor(w.w13, "w13", Kind::kCodes, {E, 2 * I, H / 2}, "[E, 2I, H/2]");
  check_tensor(w.w13_scale, "w13_scale", Kind::kScales, {E, 2 * I, H / 16}, "[E, 2I, H/16]");
  check_tensor(w.w13_scale_2, "w13_scale_2", Kind::kGlobalScales, {E, 2}, "[E, 2]");
  check_tensor(w.w2, "w2", Kind::kCodes, {E, H, I / 2}, "[E, H, I/2]");
  check_tensor(w.w2_scale, "w2_scale", Kind::kScales, {E, H, I / 16}, "[E, H, I/16]");
  check_tensor(w.w2_scale_2, "w2_scale_2", Kind::kGlobalScales, {E}, "[E]");
  s.w13 = static_cast<const uint8_t*>(w.w13.data);
  s.w13_scale = static_cast<const uint8_t*>(w.w13_scale.data);
  s.w13_scale_2 = static_cast<const float*>(w.w13_scale_2.data);
  s.w2 = static_cast<const uint8_t*>(w.w2.data);
  s.w2_scale = static_cast<const uint8_t*>(w.w2_scale.data);
  s.w2_scale_2 = static_cast<const float*>(w.w2_scale_2.data);

  const std::pair<const megamoe_tensor*, const char*> shared[] = {
      {&w.shared_w13_scale, "shared_w13_scale"}, {&w.shared_w13_scale_2, "shared_w13_scale_2"},
      {&w.shared_w2, "shared_w2"}, {&w.shared_w2_scale, "shared_w2_scale"},
      {&w.shared_w2_scale_2, "shared_w2_scale_2"}};
  if (absent(w.shared_w13)) {
    for (const auto& [t, name] : shared) {
      MEGAMOE_CHECK(absent(*t), kInvalidArgument, name, " is given but shared_w13 is not: give all "
                    "six shared-expert tensors, or none (shared_w13.data NULL: no shared expert).");
    }
  } else {
    MEGAMOE_CHECK(w.shared_w13.ndim == 2 && w.shared_w13.shape[0] % 2 == 0, kInvalidArgument,
                  "shared_w13 has ndim ", w.shared_w13.ndim, " and shape ",
                  shape_text(w.shared_w13.shape, std::clamp(w.shared_w13.ndim, 0, MEGAMOE_MAX_DIMS)),
                  "; expected [2Is, H/2] (rows: gate then up).");
    const int64_t Is = w.shared_w13.shape[0] / 2;
    MEGAMOE_CHECK(Is >= 16 && Is % 16 == 0 && Is <= kMaxSize, kInvalidArgument, "the shared expert's "
                  "intermediate size Is = shared_w13.shape[0] / 2 = ", Is,
                  " must be a positive multiple of 16, at most 2^24.");
    s.shared_intermediate_size = Is;
    check_tensor(w.shared_w13, "shared_w13", Kind::kCodes, {2 * Is, H / 2}, "[2Is, H/2]");
    check_tensor(w.shared_w13_scale, "shared_w13_scale", Kind::kScales, {2 * Is, H / 16}, "[2Is, H/16]");
    check_tensor(w.shared_w13_scale_2, "shared_w13_scale_2", Kind::kGlobalScales, {2}, "[2]");
    check_tensor(w.shared_w2, "shared_w2", Kind::kCodes, {H, Is / 2}, "[H, Is/2]");
    check_tensor(w.shared_w2_scale, "shared_w2_scale", Kind::kScales, {H, Is / 16}, "[H, Is/16]");
    check_tensor(w.shared_w2_scale_2, "shared_w2_scale_2", Kind::kGlobalScales, {1}, "[1]");
    s.shared_w13 = static_cast<const uint8_t*>(w.shared_w13.data);
    s.shared_w13_scale = static_cast<const uint8_t*>(w.shared_w13_scale.data);
    s.shared_w13_scale_2 = static_cast<const float*>(w.shared_w13_scale_2.data);
    s.shared_w2 = static_cast<const uint8_t*>(w.shared_w2.data);
    s.shared_w2_scale = static_cast<const uint8_t*>(w.shared_w2_scale.data);
    s.shared_w2_scale_2 = static_cast<const float*>(w.shared_w2_scale_2.data);
  }

  MEGAMOE_CHECK(w.top_k >= 1 && w.top_k <= std::min<int64_t>(E, 16), kInvalidArgument, "top_k is ",
                w.top_k, "; it must be in 1..min(E, 16) = 1..", std::min<int64_t>(E, 16), ".");
  s.top_k = w.top_k;
  MEGAMOE_CHECK(w.has_swiglu_limit == 0 || w.has_swiglu_limit == 1, kInvalidArgument,
                "has_swiglu_limit is ", w.has_swiglu_limit, "; it must be 0 or 1.");
  MEGAMOE_CHECK(w.in_place == 0 || w.in_place == 1, kInvalidArgument, "in_place is ", w.in_place,
                "; it must be 0 or 1.");
  s.in_place = w.in_place == 1;
  if (w.has_swiglu_limit) {
    MEGAMOE_CHECK(std::isfinite(w.swiglu_limit) && w.swiglu_limit > 0, kInvalidArgument,
                  "swiglu_limit is ", w.swiglu_limit, "; it must be finite and > 0.");
    s.swiglu_limit = w.swiglu_limit;
  }

  const megamoe_routing& r = w.routing;
  MEGAMOE_CHECK(r.kind >= MEGAMOE_ROUTING_NONE && r.kind <= MEGAMOE_ROUTING_NOAUX_TC, kInvalidArgument,
                "routing.kind is ", r.kind, "; allowed: MEGAMOE_ROUTING_NONE (0), "
                "MEGAMOE_ROUTING_SOFTMAX_TOPK (1), MEGAMOE_ROUTING_NOAUX_TC (2).");
  if (r.kind == MEGAMOE_ROUTING_NOAUX_TC && !absent(r.correction_bias)) {
    check_tensor(r.correction_bias, "routing.correction_bias", Kind::kBias, {E}, "[E]");
    s.correction_bias = static_cast<const float*>(r.correction_bias.data);
  } else {
    MEGAMOE_CHECK(absent(r.correction_bias), kInvalidArgument, "routing.correction_bias is given "
                  "for routing kind ", r.kind, "; only MEGAMOE_ROUTING_NOAUX_TC takes one.");
  }
  if (r.kind != MEGAMOE_ROUTING_NONE) {
    MEGAMOE_CHECK(r.renormalize == 0 || r.renormalize == 1, kInvalidArgument,
                  "routing.renormalize is ", r.renormalize, "; it must be 0 or 1.");
    RoutingConfig cfg;
    cfg.kind = r.kind == MEGAMOE_ROUTING_NOAUX_TC ? RoutingKind::kNoauxTc : RoutingKind::kSoftmaxTopK;
    cfg.top_k = w.top_k;
    cfg.renormalize = r.renormalize != 0;
    cfg.n_group = r.n_group;
    cfg.topk_group = r.topk_group;
    cfg.routed_scaling_factor = r.routed_scaling_factor;
    // The reference router checks a configuration before it reads any logits: with none, that
    // is all it does.
    reference::route(cfg, {}, 0, E);
    s.routing = cfg;
  }
  return s;
}

}  // namespace
}  // namespace megamoe::capi

using namespace megamoe;
using namespace megamoe::capi;

extern "C" {

uint32_t megamoe_version(void) { return MEGAMOE_VERSION; }

const char* megamoe_version_string(void) {
#define MEGAMOE_STR2(x) #x
#define MEGAMOE_STR(x) MEGAMOE_STR2(x)
  return MEGAMOE_STR(MEGAMOE_VERSION_MAJOR) "." MEGAMOE_STR(MEGAMOE_VERSION_MINOR) "." MEGAMOE_STR(
      MEGAMOE_VERSION_PATCH);
#undef MEGAMOE_STR
#undef MEGAMOE_STR2
}

const char* megamoe_status_name(megamoe_status status) {
  switch (status) {
    case MEGAMOE_OK: return "MEGAMOE_OK";
    case MEGAMOE_ERROR_INVALID_ARGUMENT: return "MEGAMOE_ERROR_INVALID_ARGUMENT";
    case MEGAMOE_ERROR_INVALID_CHECKPOINT: return "MEGAMOE_ERROR_INVALID_CHECKPOINT";
    case MEGAMOE_ERROR_NOT_FOUND: return "MEGAMOE_ERROR_NOT_FOUND";
    case MEGAMOE_ERROR_IO: return "MEGAMOE_ERROR_IO";
    case MEGAMOE_ERROR_UNSUPPORTED: return "MEGAMOE_ERROR_UNSUPPORTED";
    case MEGAMOE_ERROR_CUDA: return "MEGAMOE_ERROR_CUDA";
    case MEGAMOE_ERROR_INTERNAL: return "MEGAMOE_ERROR_INTERNAL";
    case MEGAMOE_ERROR_OUT_OF_MEMORY: return "MEGAMOE_ERROR_OUT_OF_MEMORY";
  }
  return "MEGAMOE_ERROR_UNKNOWN";
}

const char* megamoe_last_error(void) { return t_last_error.c_str(); }

int megamoe_has_cuda(void) {
#if MEGAMOE_CAPI_HAS_CUDA
  return 1;
#else
  return 0;
#endif
}

megamoe_status megamoe_device_count(int* count) {
  return guarded(__func__, [&] {
    check_not_null(count, "count");
    *count = capi::device_count();
  });
}

// ---- checkpoints -------------------------------------------------------------------------------

megamoe_status megamoe_checkpoint_open(const char* dir, megamoe_checkpoint** out) {
  return guarded(__func__, [&] {
    check_not_null(out, "out");
    *out = nullptr;
    check_not_null(dir, "dir");
    MEGAMOE_CHECK(*dir != '\0', kInvalidArgument, "dir is empty; expected a checkpoint directory.");
    ModelConfig config = load_model_config(dir);
    Checkpoint files = Checkpoint::open(dir);
    *out = new megamoe_checkpoint{std::move(config), std::move(files)};
  });
}

megamoe_status megamoe_checkpoint_close(megamoe_checkpoint* checkpoint) {
  return guarded(__func__, [&] { delete checkpoint; });
}

megamoe_status megamoe_checkpoint_describe(const megamoe_checkpoint* checkpoint,
                                           megamoe_checkpoint_info* info) {
  return guarded(__func__, [&] {
    check_not_null(checkpoint, "checkpoint");
    check_not_null(info, "info");
    const ModelConfig& c = checkpoint->config;
    megamoe_checkpoint_info v{};
    v.quant_format = c.quant_format == QuantFormat::kModelOptNvfp4            ? MEGAMOE_QUANT_MODELOPT_NVFP4
                     : c.quant_format == QuantFormat::kCompressedTensorsNvfp4 ? MEGAMOE_QUANT_COMPRESSED_TENSORS_NVFP4
                                                                              : MEGAMOE_QUANT_UNQUANTIZED;
    v.num_layers = c.num_hidden_layers;
    v.first_moe_layer = -1;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      if (c.is_moe_layer(l)) {
        v.first_moe_layer = l;
        break;
      }
    }
    v.hidden_size = c.hidden_size;
    v.moe_intermediate_size = c.moe_intermediate_size;
    v.num_experts = c.num_experts;
    v.top_k = c.num_experts_per_tok;
    v.n_shared_experts = c.n_shared_experts;
    write_versioned(info, v, "megamoe_checkpoint_info");
  });
}

megamoe_status megamoe_checkpoint_is_moe_layer(const megamoe_checkpoint* checkpoint, int64_t layer,
                                               int* is_moe) {
  return guarded(__func__, [&] {
    check_not_null(checkpoint, "checkpoint");
    check_not_null(is_moe, "is_moe");
    const int64_t n = checkpoint->config.num_hidden_layers;
    MEGAMOE_CHECK(layer >= 0 && layer < n, kInvalidArgument, "layer ", layer, " is out of range: '",
                  checkpoint->files.path(), "' has layers 0..", n - 1, ".");
    *is_moe = checkpoint->config.is_moe_layer(layer) ? 1 : 0;
  });
}

// ---- layers ------------------------------------------------------------------------------------

megamoe_status megamoe_layer_options_init(megamoe_layer_options* options) {
  return guarded(__func__, [&] {
    check_not_null(options, "options");
    *options = megamoe_layer_options{};
    options->struct_size = sizeof(megamoe_layer_options);
  });
}

megamoe_status megamoe_stacked_layer_init(megamoe_stacked_layer* layer) {
  return guarded(__func__, [&] {
    check_not_null(layer, "layer");
    *layer = megamoe_stacked_layer{};
    layer->struct_size = sizeof(megamoe_stacked_layer);
    layer->routing.kind = MEGAMOE_ROUTING_NONE;
    layer->routing.renormalize = 1;
    layer->routing.n_group = 1;
    layer->routing.topk_group = 1;
    layer->routing.routed_scaling_factor = 1.0f;
  });
}

megamoe_status megamoe_run_args_init(megamoe_run_args* args) {
  return guarded(__func__, [&] {
    check_not_null(args, "args");
    *args = megamoe_run_args{};
    args->struct_size = sizeof(megamoe_run_args);
  });
}

namespace {

// The layer of an open checkpoint, checked; the device work is create_layer's.
megamoe_layer* create_from_checkpoint(const megamoe_checkpoint& checkpoint, int64_t layer_index,
                                      const LayerOptions& options) {
  const ModelConfig& c = checkpoint.config;
  MEGAMOE_CHECK(layer_index >= 0 && layer_index < c.num_hidden_layers, kInvalidArgument, "layer_index ",
                layer_index, " is out of range: '", checkpoint.files.path(), "' has layers 0..",
                c.num_hidden_layers - 1, ".");
  const MoeLayer layer = load_moe_layer(checkpoint.files, c, layer_index);
  return create_layer(layer, options);
}

}  // namespace

megamoe_status megamoe_layer_create(const megamoe_checkpoint* checkpoint, int64_t layer_index,
                                    const megamoe_layer_options* options, megamoe_layer** out) {
  return guarded(__func__, [&] {
    check_not_null(out, "out");
    *out = nullptr;
    check_not_null(checkpoint, "checkpoint");
    *out = create_from_checkpoint(*checkpoint, layer_index, read_options(options));
  });
}

megamoe_status megamoe_layer_create_from_path(const char* checkpoint_dir, int64_t layer_index,
                                              const megamoe_layer_options* options, megamoe_layer** out) {
  return guarded(__func__, [&] {
    check_not_null(out, "out");
    *out = nullptr;
    const LayerOptions checked = read_options(options);
    check_not_null(checkpoint_dir, "checkpoint_dir");
    MEGAMOE_CHECK(*checkpoint_dir != '\0', kInvalidArgument,
                  "checkpoint_dir is empty; expected a checkpoint directory.");
    const megamoe_checkpoint checkpoint{load_model_config(checkpoint_dir), Checkpoint::open(checkpoint_dir)};
    *out = create_from_checkpoint(checkpoint, layer_index, checked);
  });
}

megamoe_status megamoe_layer_create_stacked(const megamoe_stacked_layer* weights,
                                            const megamoe_layer_options* options, megamoe_stream stream,
                                            megamoe_layer** out) {
  return guarded(__func__, [&] {
    check_not_null(out, "out");
    *out = nullptr;
    const StackedLayer stacked = read_stacked(weights);
    *out = create_layer_stacked(stacked, read_options(options), stream);
  });
}

megamoe_status megamoe_layer_destroy(megamoe_layer* layer) {
  return guarded(__func__, [&] { destroy_layer(layer); });
}

megamoe_status megamoe_layer_get_info(const megamoe_layer* layer, megamoe_layer_info* info) {
  return guarded(__func__, [&] {
    check_not_null(layer, "layer");
    check_not_null(info, "info");
    megamoe_layer_info v{};
    layer_info(*layer, v);
    write_versioned(info, v, "megamoe_layer_info");
  });
}

megamoe_status megamoe_layer_describe(const megamoe_layer* layer, int64_t tokens, char* buffer,
                                      size_t size, size_t* length) {
  return guarded(__func__, [&] {
    check_not_null(layer, "layer");
    MEGAMOE_CHECK(buffer != nullptr || size == 0, kInvalidArgument, "buffer is NULL but size is ",
                  size, "; pass size 0 to ask for the length only.");
    const std::string text = describe_layer(*layer, tokens);
    if (length) *length = text.size();
    if (size > 0) {
      const size_t n = std::min(size - 1, text.size());
      std::memcpy(buffer, text.data(), n);
      buffer[n] = '\0';
    }
  });
}

megamoe_status megamoe_layer_workspace_size(const megamoe_layer* layer, size_t* bytes) {
  return guarded(__func__, [&] {
    check_not_null(layer, "layer");
    check_not_null(bytes, "bytes");
    megamoe_layer_info v{};
    layer_info(*layer, v);
    *bytes = v.workspace_size;
  });
}

megamoe_status megamoe_layer_run(megamoe_layer* layer, const megamoe_run_args* args, megamoe_stream stream) {
  return guarded(__func__, [&] {
    check_not_null(layer, "layer");
    check_not_null(args, "args");
    const megamoe_run_args a = read_versioned(args, "megamoe_run_args");
    RunArgs r;
    r.tokens = a.tokens;
    r.hidden = a.hidden;
    r.topk_ids = a.topk_ids;
    r.topk_weights = a.topk_weights;
    r.router_logits = a.router_logits;
    r.output = a.output;
    r.output_f32 = a.output_f32;
    r.workspace = a.workspace;
    r.workspace_size = a.workspace_size;
    run_layer(*layer, r, stream);
  });
}

megamoe_status megamoe_layer_invalid_id_count(const megamoe_layer* layer, const void* workspace,
                                              megamoe_stream stream, int64_t* count) {
  return guarded(__func__, [&] {
    check_not_null(layer, "layer");
    check_not_null(count, "count");
    *count = invalid_id_count(*layer, workspace, stream);
  });
}

}  // extern "C"
