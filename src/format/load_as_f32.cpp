// load_as_f32: one element of any float-like safetensors dtype as f32. In format/ (not core/)
// because the fp8 dtypes decode through the format codecs; core/ stays below format/.
#include <cstring>

#include "megamoe/dtype.h"
#include "megamoe/format.h"
#include "megamoe/status.h"

namespace megamoe {

float load_as_f32(DType t, const void* base, int64_t index) {
  MEGAMOE_CHECK(base != nullptr, kInvalidArgument, "load_as_f32: the base pointer is null.");
  MEGAMOE_CHECK(index >= 0, kInvalidArgument, "load_as_f32: index ", index,
                " is negative; element indices start at 0.");
  // memcpy: safetensors data is only byte-aligned in general.
  const auto* p = static_cast<const unsigned char*>(base);
  switch (t) {
    case DType::BF16: {
      uint16_t h;
      std::memcpy(&h, p + index * 2, 2);
      return bf16_to_f32(h);
    }
    case DType::F16: {
      uint16_t h;
      std::memcpy(&h, p + index * 2, 2);
      return f16_to_f32(h);
    }
    case DType::F32: {
      float f;
      std::memcpy(&f, p + index * 4, 4);
      return f;
    }
    case DType::F8_E4M3: return format::e4m3_to_f32(p[index]);
    case DType::F8_E5M2: return format::e5m2_to_f32(p[index]);
    case DType::U8:
    case DType::I8:
    case DType::I32:
    case DType::I64: break;
  }
  MEGAMOE_FAIL(kInvalidArgument, "load_as_f32: dtype ", dtype_name(t),
               " is not a floating-point type; allowed are BF16, F16, F32, F8_E4M3, F8_E5M2.");
}

}  // namespace megamoe
