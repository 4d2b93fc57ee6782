// Precision names (megamoe/precision.h): the words every API takes (C++ enum, CLI --precision,
// the torch op and module), parsed exactly, with a message listing the allowed values otherwise.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "megamoe/precision.h"
#include "tests/common/error_matchers.h"

namespace megamoe {
namespace {

TEST(Precision, NamesRoundTrip) {
  EXPECT_STREQ(precision_name(Precision::kW4a16), "w4a16");
  EXPECT_STREQ(precision_name(Precision::kW4a8), "w4a8");
  EXPECT_STREQ(precision_name(Precision::kAuto), "auto");
  std::set<std::string> names;
  for (const Precision p : kPrecisions) {
    EXPECT_EQ(parse_precision(precision_name(p)), p) << precision_name(p);
    names.insert(precision_name(p));
  }
  EXPECT_EQ(names.size(), 3u) << "every value has its own name";
  // The default of every API is the exact path.
  EXPECT_EQ(kPrecisions[0], Precision::kW4a16);
}

TEST(Precision, BadNamesListTheAllowedValues) {
  // Exact lowercase names only: near misses are refused rather than guessed.
  for (const char* bad : {"", "bogus", "W4A16", "w4a16 ", " w4a8", "fp8", "w4a4", "Auto", "w4a8\n"}) {
    SCOPED_TRACE(bad);
    EXPECT_MEGAMOE_ERROR(parse_precision(bad), kInvalidArgument, "precision '", "w4a16", "w4a8", "auto",
                         "allowed");
  }
  EXPECT_MEGAMOE_ERROR(parse_precision("bogus"), kInvalidArgument, "'bogus'");
  // A long value is quoted cut, not whole.
  const std::string long_name(500, 'x');
  try {
    parse_precision(long_name);
    ADD_FAILURE() << "did not throw";
  } catch (const Error& e) {
    EXPECT_LT(std::string(e.what()).size(), 300u) << e.what();
  }
  // A value outside the enum (only through a cast) still has a printable name.
  EXPECT_STREQ(precision_name(static_cast<Precision>(42)), "invalid");
}

}  // namespace
}  // namespace megamoe
