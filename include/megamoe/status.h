// Errors: every rejection says what was wrong and what is allowed.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace megamoe {

enum class ErrorCode {
  kInvalidArgument,   // a caller-supplied value is outside what is allowed
  kInvalidCheckpoint, // a file on disk is malformed, truncated or inconsistent
  kNotFound,          // a file or tensor that must exist does not
  kIo,                // the operating system refused a read or write
  kUnsupported,       // well-formed, but not something this build implements
  kCuda,              // a CUDA runtime or driver call failed
  kInternal,          // a broken invariant inside the library
};

const char* error_code_name(ErrorCode code);

// The one exception type the library throws. what() is a complete sentence for the user.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace megamoe

// MEGAMOE_CHECK(cond, code, parts...): throw megamoe::Error(code, concat(parts...)) unless cond.
#define MEGAMOE_CHECK(cond, code, ...)                                                  \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      throw ::megamoe::Error(::megamoe::ErrorCode::code, ::megamoe::detail::concat(__VA_ARGS__)); \
    }                                                                                   \
  } while (0)

#define MEGAMOE_FAIL(code, ...) \
  throw ::megamoe::Error(::megamoe::ErrorCode::code, ::megamoe::detail::concat(__VA_ARGS__))
