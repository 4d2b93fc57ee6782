// The C API's layer in a CPU-only build (MEGAMOE_CUDA=OFF): every argument has been checked by the
// entry points by the time these are called, so what is left to say is that there is no GPU
// runtime. No layer can be created, so the functions that take one are never reached with one.
#include "capi/capi_internal.h"
#include "megamoe/status.h"

namespace megamoe::capi {

int device_count() { return 0; }

megamoe_layer* create_layer(const MoeLayer&, const LayerOptions&) { MEGAMOE_FAIL(kUnsupported, kNoCudaMessage, "."); }

megamoe_layer* create_layer_stacked(const StackedLayer&, const LayerOptions&, megamoe_stream) {
  MEGAMOE_FAIL(kUnsupported, kNoCudaMessage, ".");
}

void destroy_layer(megamoe_layer*) noexcept {}

void layer_info(const megamoe_layer&, megamoe_layer_info&) { MEGAMOE_FAIL(kUnsupported, kNoCudaMessage, "."); }

std::string describe_layer(const megamoe_layer&, int64_t) { MEGAMOE_FAIL(kUnsupported, kNoCudaMessage, "."); }

void run_layer(megamoe_layer&, const RunArgs&, megamoe_stream) { MEGAMOE_FAIL(kUnsupported, kNoCudaMessage, "."); }

int64_t invalid_id_count(const megamoe_layer&, const void*, megamoe_stream) {
  MEGAMOE_FAIL(kUnsupported, kNoCudaMessage, ".");
}

}  // namespace megamoe::capi
