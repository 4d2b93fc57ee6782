// The tensor-name patterns of `quantize --include/--exclude` (src/checkpoint/name_pattern.h):
// the same answers as std::regex_search (ECMAScript) on the language they share, linear work on
// inputs that make std::regex recurse or backtrack, and clear errors for what is not supported.

#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "checkpoint/name_pattern.h"
#include "tests/common/error_matchers.h"
#include "megamoe/status.h"
#include "tests/common/test_util.h"

namespace {

using megamoe::NamePattern;

bool matches(const std::string& pattern, const std::string& name) {
  return NamePattern::compile(pattern, "--include").search(name);
}

TEST(NamePattern, HandPickedCases) {
  struct Case {
    const char* pattern;
    const char* name;
    bool want;
  };
  const Case cases[] = {
      {"experts", "model.layers.3.mlp.experts.7.up_proj.weight", true},
      {"^model\\.layers\\.\\d+\\.mlp\\.experts\\.", "model.layers.3.mlp.experts.7.w", true},
      {"^mlp", "model.mlp", false},
      {"weight$", "a.weight", true},
      {"weight$", "a.weight_scale", false},
      {"(gate|up)_proj", "x.up_proj.weight", true},
      {"(gate|up)_proj", "x.down_proj.weight", false},
      {"(?:gate|up)_proj", "x.gate_proj", true},
      {"lm_head|embed", "model.embed_tokens.weight", true},
      {"layers\\.[0-2]\\.", "model.layers.2.x", true},
      {"layers\\.[0-2]\\.", "model.layers.3.x", false},
      {"layers\\.[^0-2]\\.", "model.layers.3.x", true},
      {"\\d{2,3}\\.", "layers.7.x", false},
      {"\\d{2,3}\\.", "layers.17.x", true},
      {"^a{2}$", "aa", true},
      {"^a{2}$", "aaa", false},
      {"^a{2,}$", "aaaa", true},
      {"^(ab)+$", "ababab", true},
      {"^(ab)+$", "abba", false},
      {"^x?y*z+$", "zz", true},
      {"^.*$", "", true},
      {"", "anything", true},
      {"a.c", "a\nc", false},
      {"\\w+\\s\\S", "ab c", true},
      {"[\\d_]+$", "x_12", true},
      {"[a-]$", "x-", true},
      {"a.*?b", "aXXb", true},
      {"\\.", "ab", false},
      // std::regex takes exponential time on this one (not compared with it below).
      {"(a*)*b", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.pattern) + " on " + c.name);
    EXPECT_EQ(matches(c.pattern, c.name), c.want);
    if (std::string(c.name).size() < 20) {
      EXPECT_EQ(std::regex_search(std::string(c.name), std::regex(c.pattern)), c.want);
    }
  }
}

// Random patterns over a small alphabet, compared with std::regex_search on random names.
std::string random_pattern(std::mt19937_64& rng, int depth) {
  const auto pick = [&](int n) { return int(rng() % uint64_t(n)); };
  std::string p;
  const int atoms = 1 + pick(4);
  for (int i = 0; i < atoms; ++i) {
    switch (pick(depth > 1 ? 6 : 8)) {
      case 0: case 1: p += "ab."[pick(3)]; break;
      case 2: p += "[ab]"; break;
      case 3: p += "[^a]"; break;
      case 4: p += "\\d"; break;
      case 5: p += (pick(2) ? "^" : "$"); continue;  // anchors take no quantifier
      default:
        // Groups get at most `?` or `{2}`: std::regex, the oracle here, backtracks exponentially
        // on nested unbounded quantifiers (the matcher's own handling of those is tested above).
        p += "(" + random_pattern(rng, depth + 1) + "|" + random_pattern(rng, depth + 1) + ")";
        p += std::array{"", "?", "{2}"}[size_t(pick(3))];
        continue;
    }
    static const char* const kQuant[] = {"", "", "*", "+", "?", "{2}", "{1,2}", "{0,}"};
    p += kQuant[pick(8)];
  }
  return p;
}

TEST(NamePattern, AgreesWithStdRegexOnRandomPatterns) {
  const megamoe::testing::SeedTrace seed;
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 400; ++i) {
    const std::string pattern = random_pattern(rng, 0);
    const std::regex re(pattern, std::regex::ECMAScript);
    const NamePattern np = NamePattern::compile(pattern, "--include");
    for (int j = 0; j < 20; ++j) {
      std::string name;
      const int n = int(rng() % 9);
      for (int k = 0; k < n; ++k) name += "ab1."[rng() % 4];
      ASSERT_EQ(np.search(name), std::regex_search(name, re)) << pattern << " on '" << name << "'";
    }
  }
}

// What made std::regex crash or hang: a 200,000-character name (one recursion per character)
// and patterns that backtrack exponentially. Here both are linear: well under a second.
TEST(NamePattern, LongNamesAndPathologicalPatternsAreLinear) {
  const std::string long_name(200000, 'a');
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(matches("a+$", long_name));
  EXPECT_FALSE(matches("(a*)*b", long_name));
  EXPECT_FALSE(matches("(a|aa)+c", long_name));
  EXPECT_FALSE(matches("^(a|a?)+$x", std::string(5000, 'a')));
  EXPECT_TRUE(matches("(.*a){20}", long_name));
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(secs, 20.0) << "the matcher is not linear";
}

TEST(NamePattern, RejectsUnsupportedAndMalformedPatterns) {
  struct Bad {
    std::string pattern;
    std::string part;
  };
  const Bad bad[] = {
      {"(", "unclosed '('"},
      {"a)", "unmatched ')'"},
      {"[ab", "unterminated [ class"},
      {"*a", "nothing to repeat"},
      {"a**", "quantifier on a quantifier"},
      {"^*", "quantifier after an anchor"},
      {"a{3,1}", "m < n"},
      {"a{1001}", "above 1000"},
      {"a{2", "expected '}'"},
      {"(a)\\1", "backreferences are not supported"},
      {"(?=a)", "lookaround"},
      {"\\bword", "word boundaries"},
      {"\\q", "unknown escape \\q"},
      {"a\\", "trailing backslash"},
      {"[z-a]", "range out of order"},
      {std::string(60, '(') + std::string(60, ')'), "nested deeper than 50"},
      {"(a{1000}){1000}", "instructions"},
      {std::string(1001, 'a'), "at most 1000"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.pattern);
    EXPECT_MEGAMOE_ERROR(NamePattern::compile(b.pattern, "--exclude"), kInvalidArgument,
                         "--exclude", b.part);
  }
}

}  // namespace
