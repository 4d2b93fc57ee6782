// Test helper: EXPECT_MEGAMOE_ERROR(statement, code, parts...) checks that the statement throws
// megamoe::Error with that ErrorCode and a message containing every part.
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <string_view>

#include "megamoe/status.h"

namespace megamoe::testing_util {

template <typename F>
::testing::AssertionResult throws_error(F&& f, ErrorCode code,
                                        std::initializer_list<std::string_view> parts) {
  try {
    f();
  } catch (const Error& e) {
    if (e.code() != code) {
      return ::testing::AssertionFailure() << "error code " << megamoe::error_code_name(e.code())
                                           << ", expected " << megamoe::error_code_name(code)
                                           << "; message: " << e.what();
    }
    for (std::string_view p : parts) {
      if (std::string_view(e.what()).find(p) == std::string_view::npos) {
        return ::testing::AssertionFailure() << "message lacks \"" << p << "\": " << e.what();
      }
    }
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-megamoe exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace megamoe::testing_util

#define EXPECT_MEGAMOE_ERROR(stmt, code, ...)                                              \
  EXPECT_TRUE(::megamoe::testing_util::throws_error([&] { stmt; }, ::megamoe::ErrorCode::code, \
                                                    {__VA_ARGS__}))
