// The C++ API from the same library: a call, and its megamoe::Error caught across the boundary.
#include <cstring>

#include "megamoe/precision.h"
#include "megamoe/status.h"

extern "C" int cxx_api_works(void) {
  if (megamoe::parse_precision("w4a16") != megamoe::Precision::kW4a16) return 0;
  try {
    megamoe::parse_precision("fp64");
  } catch (const megamoe::Error& e) {
    return e.code() == megamoe::ErrorCode::kInvalidArgument && std::strstr(e.what(), "fp64") != nullptr;
  }
  return 0;
}
