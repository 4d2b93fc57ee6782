#include "checkpoint/name_pattern.h"

#include <cctype>
#include <cstdint>
#include <string>

#include "megamoe/status.h"

namespace megamoe {

namespace {

using Set = std::bitset<256>;

constexpr size_t kMaxPatternChars = 1000;
constexpr int kMaxNesting = 50;
constexpr int kMaxRepeat = 1000;
constexpr size_t kMaxInstructions = 10000;

constexpr const char* kSyntax =
    "supported: literals, '.', [classes], \\d \\w \\s (and \\D \\W \\S), escaped punctuation, "
    "'^', '$', groups ( ) and (?: ), '|', and the quantifiers * + ? {n} {n,} {n,m}";

// The parse tree. Concatenations and alternations keep their parts in one node, so the tree is
// only as deep as the groups and quantifiers are nested (bounded by kMaxNesting).
struct Node {
  enum Kind { kEmpty, kSet, kBol, kEol, kConcat, kAlt, kRepeat };
  explicit Node(Kind k) : kind(k) {}
  Kind kind;
  Set set;
  std::vector<int> kids;
  int min = 0, max = 0;  // kRepeat; max < 0: unbounded
};

class Parser {
 public:
  Parser(std::string_view pattern, std::string_view option) : p_(pattern), option_(option) {}

  std::vector<Node> nodes;

  int parse() {
    const int root = alternation(0);
    if (pos_ < p_.size()) fail("unmatched ')'");
    return root;
  }

  [[noreturn]] void fail(const std::string& what) const {
    MEGAMOE_FAIL(kInvalidArgument, option_, " '", std::string(p_), "' is not a supported pattern: ",
                 what, " at character ", pos_ + 1, "; ", kSyntax, ".");
  }

 private:
  int add(Node n) {
    nodes.push_back(std::move(n));
    return int(nodes.size() - 1);
  }
  bool at_end() const { return pos_ >= p_.size(); }
  char peek() const { return p_[pos_]; }

  int alternation(int depth) {
    Node alt{Node::kAlt};
    alt.kids.push_back(concatenation(depth));
    while (!at_end() && peek() == '|') {
      ++pos_;
      alt.kids.push_back(concatenation(depth));
    }
    return alt.kids.size() == 1 ? alt.kids[0] : add(std::move(alt));
  }

  int concatenation(int depth) {
    Node cat{Node::kConcat};
    while (!at_end() && peek() != '|' && peek() != ')') {
      int atom_index = atom(depth);
      if (!at_end() && (peek() == '*' || peek() == '+' || peek() == '?' || peek() == '{')) {
        atom_index = quantified(atom_index);
      }
      cat.kids.push_back(atom_index);
    }
    if (cat.kids.empty()) return add(Node{Node::kEmpty});
    return cat.kids.size() == 1 ? cat.kids[0] : add(std::move(cat));
  }

  int number() {
    if (at_end() || !std::isdigit(static_cast<unsigned char>(peek()))) fail("expected a number in {}");
    int v = 0;
    while (!at_end() && std::isdigit(static_cast<unsigned char>(peek()))) {
      v = v * 10 + (peek() - '0');
      if (v > kMaxRepeat) fail("a repeat count above " + std::to_string(kMaxRepeat));
      ++pos_;
    }
    return v;
  }

  int quantified(int atom_index) {
    const Node::Kind k = nodes[size_t(atom_index)].kind;
    if (k == Node::kBol || k == Node::kEol) fail("a quantifier after an anchor");
    Node rep{Node::kRepeat};
    rep.kids.push_back(atom_index);
    const char q = p_[pos_++];
    if (q == '*') {
      rep.min = 0, rep.max = -1;
    } else if (q == '+') {
      rep.min = 1, rep.max = -1;
    } else if (q == '?') {
      rep.min = 0, rep.max = 1;
    } else {  // {n}, {n,}, {n,m}
      rep.min = rep.max = number();
      if (!at_end() && peek() == ',') {
        ++pos_;
        rep.max = (!at_end() && peek() == '}') ? -1 : number();
      }
      if (at_end() || peek() != '}') fail("expected '}'");
      ++pos_;
      if (rep.max >= 0 && rep.max < rep.min) fail("a {n,m} with m < n");
    }
    if (!at_end() && peek() == '?') ++pos_;  // lazy: the same set of matching names
    if (!at_end() && (peek() == '*' || peek() == '+' || peek() == '?' || peek() == '{')) {
      fail("a quantifier on a quantifier (nothing to repeat)");
    }
    return add(std::move(rep));
  }

  static Set class_set(char c) {
    Set s;
    for (int b = 0; b < 256; ++b) {
      const unsigned char u = static_cast<unsigned char>(b);
      const bool digit = u >= '0' && u <= '9';
      const bool word = digit || (u >= 'a' && u <= 'z') || (u >= 'A' && u <= 'Z') || u == '_';
      const bool space = u == ' ' || (u >= '\t' && u <= '\r');
      switch (c) {
        case 'd': s[size_t(b)] = digit; break;
        case 'D': s[size_t(b)] = !digit; break;
        case 'w': s[size_t(b)] = word; break;
        case 'W': s[size_t(b)] = !word; break;
        case 's': s[size_t(b)] = space; break;
        case 'S': s[size_t(b)] = !space; break;
      }
    }
    return s;
  }

  // After a backslash: the set it stands for (one character, or a \d-style class).
  Set escape() {
    if (at_end()) fail("a trailing backslash");
    const char c = p_[pos_++];
    Set s;
    switch (c) {
      case 'd': case 'D': case 'w': case 'W': case 's': case 'S': return class_set(c);
      case 't': s.set('\t'); return s;
      case 'n': s.set('\n'); return s;
      case 'r': s.set('\r'); return s;
      case 'f': s.set('\f'); return s;
      case 'v': s.set('\v'); return s;
      case 'b': case 'B': --pos_; fail("word boundaries (\\b, \\B) are not supported");
      default: break;
    }
    if (std::isalnum(static_cast<unsigned char>(c))) {
      --pos_;
      fail(std::isdigit(static_cast<unsigned char>(c)) ? "backreferences are not supported"
                                                       : std::string("unknown escape \\") + c);
    }
    s.set(static_cast<unsigned char>(c));
    return s;
  }

  Set bracket() {  // after '['
    Set s;
    bool negate = false;
    if (!at_end() && peek() == '^') {
      negate = true;
      ++pos_;
    }
    while (true) {
      if (at_end()) fail("an unterminated [ class");
      if (peek() == ']') {
        ++pos_;
        break;
      }
      Set item;
      int lo = -1;  // a single character, which may start a range
      if (peek() == '\\') {
        ++pos_;
        item = escape();
        if (item.count() == 1) {
          for (int b = 0; b < 256; ++b) lo = item[size_t(b)] ? b : lo;
        }
      } else {
        lo = static_cast<unsigned char>(p_[pos_++]);
        item.set(size_t(lo));
      }
      if (lo >= 0 && pos_ + 1 < p_.size() && peek() == '-' && p_[pos_ + 1] != ']') {
        ++pos_;
        int hi;
        if (peek() == '\\') {
          ++pos_;
          const Set h = escape();
          if (h.count() != 1) fail("a class escape as the end of a range");
          hi = -1;
          for (int b = 0; b < 256; ++b) hi = h[size_t(b)] ? b : hi;
        } else {
          hi = static_cast<unsigned char>(p_[pos_++]);
        }
        if (hi < lo) fail("a range out of order");
        for (int b = lo; b <= hi; ++b) item.set(size_t(b));
      }
      s |= item;
    }
    return negate ? ~s : s;
  }

  int atom(int depth) {
    const char c = p_[pos_];
    Node n{Node::kSet};
    switch (c) {
      case '(': {
        ++pos_;
        if (!at_end() && peek() == '?') {
          if (pos_ + 1 < p_.size() && p_[pos_ + 1] == ':') {
            pos_ += 2;
          } else {
            fail("lookaround and named groups are not supported");
          }
        }
        if (depth + 1 > kMaxNesting) fail("groups nested deeper than " + std::to_string(kMaxNesting));
        const int inner = alternation(depth + 1);
        if (at_end() || peek() != ')') fail("an unclosed '('");
        ++pos_;
        return inner;
      }
      case '[':
        ++pos_;
        n.set = bracket();
        return add(std::move(n));
      case '.':
        ++pos_;
        n.set.set();
        n.set.reset('\n');
        n.set.reset('\r');
        return add(std::move(n));
      case '^':
        ++pos_;
        return add(Node{Node::kBol});
      case '$':
        ++pos_;
        return add(Node{Node::kEol});
      case '\\':
        ++pos_;
        n.set = escape();
        return add(std::move(n));
      case '*': case '+': case '?': case '{':
        fail("a quantifier with nothing to repeat");
      default:
        ++pos_;
        n.set.set(static_cast<unsigned char>(c));
        return add(std::move(n));
    }
  }

  std::string_view p_;
  std::string_view option_;
  size_t pos_ = 0;
};

class Compiler {
 public:
  Compiler(const std::vector<Node>& nodes, std::vector<NamePattern::Inst>& prog,
           std::vector<Set>& sets, const Parser& parser)
      : nodes_(nodes), prog_(prog), sets_(sets), parser_(parser) {}

  // Emits the code of node `i`; recursion is as deep as the tree (bounded by the nesting limit).
  void emit(int i) {
    const Node& n = nodes_[size_t(i)];
    switch (n.kind) {
      case Node::kEmpty: return;
      case Node::kSet:
        sets_.push_back(n.set);
        push({NamePattern::Inst::kChar, int(sets_.size() - 1), 0});
        return;
      case Node::kBol: push({NamePattern::Inst::kBol}); return;
      case Node::kEol: push({NamePattern::Inst::kEol}); return;
      case Node::kConcat:
        for (int k : n.kids) emit(k);
        return;
      case Node::kAlt: {
        // split L1, next; L1: kid0; jmp end; next: split L2, next2; ... last kid; end:
        std::vector<size_t> jumps;
        for (size_t k = 0; k + 1 < n.kids.size(); ++k) {
          const size_t split = push({NamePattern::Inst::kSplit});
          prog_[split].x = int(prog_.size());
          emit(n.kids[k]);
          jumps.push_back(push({NamePattern::Inst::kJump}));
          prog_[split].y = int(prog_.size());
        }
        emit(n.kids.back());
        for (size_t j : jumps) prog_[j].x = int(prog_.size());
        return;
      }
      case Node::kRepeat: {
        for (int r = 0; r < n.min; ++r) emit(n.kids[0]);
        if (n.max < 0) {  // L: split body, end; body; jmp L; end:
          const size_t split = push({NamePattern::Inst::kSplit});
          prog_[split].x = int(prog_.size());
          emit(n.kids[0]);
          push({NamePattern::Inst::kJump, int(split), 0});
          prog_[split].y = int(prog_.size());
          return;
        }
        std::vector<size_t> splits;  // each optional copy may be skipped to the end
        for (int r = n.min; r < n.max; ++r) {
          const size_t split = push({NamePattern::Inst::kSplit});
          prog_[split].x = int(prog_.size());
          splits.push_back(split);
          emit(n.kids[0]);
        }
        for (size_t s : splits) prog_[s].y = int(prog_.size());
        return;
      }
    }
  }

  size_t push(NamePattern::Inst inst) {
    if (prog_.size() >= kMaxInstructions) {
      parser_.fail("more than " + std::to_string(kMaxInstructions) +
                   " instructions once its quantifiers are expanded (the pattern is too large)");
    }
    prog_.push_back(inst);
    return prog_.size() - 1;
  }

 private:
  const std::vector<Node>& nodes_;
  std::vector<NamePattern::Inst>& prog_;
  std::vector<Set>& sets_;
  const Parser& parser_;
};

}  // namespace

NamePattern NamePattern::compile(std::string_view pattern, std::string_view option) {
  MEGAMOE_CHECK(pattern.size() <= kMaxPatternChars, kInvalidArgument, option, " is a pattern of ",
                pattern.size(), " characters; at most ", kMaxPatternChars, " are allowed.");
  Parser parser(pattern, option);
  const int root = parser.parse();
  NamePattern p;
  Compiler compiler(parser.nodes, p.prog_, p.sets_, parser);
  compiler.emit(root);
  compiler.push({Inst::kMatch});
  return p;
}

bool NamePattern::search(std::string_view name) const {
  // The Pike VM without captures: the set of program counters alive before each character, each
  // added once per step (epsilon loops end there), with an explicit stack instead of recursion.
  const size_t n = prog_.size();
  std::vector<int> current, next, stack;
  std::vector<size_t> mark(n, SIZE_MAX);  // the step that last added each pc
  current.reserve(n);
  next.reserve(n);
  bool matched = false;
  const auto add = [&](std::vector<int>& list, int start, size_t pos, size_t step) {
    stack.push_back(start);
    while (!stack.empty()) {
      const int pc = stack.back();
      stack.pop_back();
      if (mark[size_t(pc)] == step) continue;
      mark[size_t(pc)] = step;
      const Inst& in = prog_[size_t(pc)];
      switch (in.op) {
        case Inst::kChar: list.push_back(pc); break;
        case Inst::kMatch: matched = true; break;
        case Inst::kJump: stack.push_back(in.x); break;
        case Inst::kSplit:
          stack.push_back(in.y);
          stack.push_back(in.x);
          break;
        case Inst::kBol:
          if (pos == 0) stack.push_back(pc + 1);
          break;
        case Inst::kEol:
          if (pos == name.size()) stack.push_back(pc + 1);
          break;
      }
    }
  };
  for (size_t pos = 0;; ++pos) {
    add(current, 0, pos, pos);  // a match may start at every position (search, not match)
    if (matched) return true;
    if (pos == name.size()) return false;
    const unsigned char c = static_cast<unsigned char>(name[pos]);
    next.clear();
    for (int pc : current) {
      const Inst& in = prog_[size_t(pc)];
      if (sets_[size_t(in.x)][c]) add(next, pc + 1, pos + 1, pos + 1);
    }
    if (matched) return true;
    current.swap(next);
  }
}

}  // namespace megamoe
