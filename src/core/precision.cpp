#include "megamoe/precision.h"

#include <string>

#include "megamoe/status.h"

namespace megamoe {

const char* precision_name(Precision precision) {
  switch (precision) {
    case Precision::kW4a16: return "w4a16";
    case Precision::kW4a8: return "w4a8";
    case Precision::kAuto: return "auto";
  }
  return "invalid";
}

Precision parse_precision(std::string_view name) {
  for (const Precision p : kPrecisions) {
    if (name == precision_name(p)) return p;
  }
  // Quoted and cut, as other messages quote user values: a precision is a short word.
  const std::string shown = name.size() > 40 ? std::string(name.substr(0, 40)) + "..." : std::string(name);
  MEGAMOE_FAIL(kInvalidArgument, "precision '", shown,
               "' is not one of the allowed values: w4a16 (exact, the default), w4a8 (fp8 "
               "activations), auto (w4a8 where it is faster)");
}

}  // namespace megamoe
