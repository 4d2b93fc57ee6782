// Regular expressions over tensor names (`quantize --include/--exclude`), matched by a Thompson
// NFA simulation: time O(name length x pattern size) and no recursion over the name, whatever the
// pattern or the name (std::regex backtracks exponentially on some patterns and recurses once
// per character, so a long name overflows the stack).
//
// The language is the common subset of ECMAScript regular expressions, with the same meaning:
//   literal characters; `.` (any character but a line break); `[abc]`, `[^a-z0-9_]` classes;
//   `\d \D \w \W \s \S`, `\t \n \r \f \v`, and `\` before any punctuation for that character;
//   `^` and `$` (start and end of the name); groups `( )` and `(?: )`; alternation `|`;
//   quantifiers `*`, `+`, `?`, `{n}`, `{n,}`, `{n,m}` (n, m <= 1000; a lazy `?` suffix is
//   accepted and means the same here: only whether a name matches is asked).
// Not supported (rejected with a message): backreferences, lookaround `(?=` `(?!` `(?<`, word
// boundaries `\b \B`, other escapes. Limits: 1000 characters, groups nested 50 deep, 10000
// instructions once quantifiers are expanded.
#pragma once

#include <bitset>
#include <string_view>
#include <vector>

namespace megamoe {

class NamePattern {
 public:
  // Throws megamoe::Error(kInvalidArgument) naming `option` (e.g. "--include"), the pattern and
  // what is wrong in it.
  static NamePattern compile(std::string_view pattern, std::string_view option);

  // True when some substring of `name` matches (std::regex_search semantics).
  bool search(std::string_view name) const;

  struct Inst {
    enum Op { kChar, kSplit, kJump, kBol, kEol, kMatch };
    Inst(Op o, int x_ = 0, int y_ = 0) : op(o), x(x_), y(y_) {}
    Op op;
    int x, y;  // kChar: index into sets_; kSplit: both targets; kJump: x
  };

 private:
  std::vector<Inst> prog_;
  std::vector<std::bitset<256>> sets_;
};

}  // namespace megamoe
