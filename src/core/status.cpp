#include "megamoe/status.h"

namespace megamoe {

// Used when printing an Error, so it must never throw: a value outside the enum (only reachable
// through a cast) gets a name that says so instead of an exception inside error handling.
const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid_argument";
    case ErrorCode::kInvalidCheckpoint: return "invalid_checkpoint";
    case ErrorCode::kNotFound: return "not_found";
    case ErrorCode::kIo: return "io";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kCuda: return "cuda";
    case ErrorCode::kInternal: return "internal";
  }
  return "unknown_error_code";
}

}  // namespace megamoe
