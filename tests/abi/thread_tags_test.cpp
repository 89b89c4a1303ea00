// Rule 6 of dtk/abi.h (CLAP style): every function pointer in an ABI struct carries its own
// thread tag, [main-thread], [loader-thread], [any-thread] or [thread-safe], in the comment that
// belongs to it: a comment on its own lines (trailing, or inside the declaration), or the comment
// directly above it (no blank line between, not past the previous member). A tag inherited from
// a group comment further up ("Every function is [main-thread]") does not count.
//
// The test reads the header's text (DTK_ABI_HEADER, set by tests/abi/CMakeLists.txt).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <fstream>
#include <iostream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#ifndef DTK_ABI_HEADER
#error "DTK_ABI_HEADER must be defined to the path of sdk/include/dtk/abi.h"
#endif

namespace {

struct Comment {
  size_t begin = 0;  // offset of "/*" or "//"
  size_t end = 0;    // one past the last character
  std::string text;
};

struct Member {
  std::string owner;  // struct name
  std::string name;
  size_t line = 0;  // 1-based line of the member's name
  bool tagged = false;
};

struct Scan {
  std::vector<Member> members;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Splits `src` into code (comments and string/char literals blanked, offsets and newlines kept)
// and the list of comments. Consecutive // lines form one comment.
void split_comments(const std::string& src, std::string& code, std::vector<Comment>& comments) {
  code = src;
  size_t i = 0;
  const size_t n = src.size();
  auto blank = [&](size_t from, size_t to) {
    for (size_t k = from; k < to && k < n; ++k)
      if (code[k] != '\n') code[k] = ' ';
  };
  while (i < n) {
    if (src.compare(i, 2, "/*") == 0) {
      size_t close = src.find("*/", i + 2);
      size_t end = close == std::string::npos ? n : close + 2;
      comments.push_back({i, end, src.substr(i, end - i)});
      blank(i, end);
      i = end;
    } else if (src.compare(i, 2, "//") == 0) {
      size_t end = src.find('\n', i);
      if (end == std::string::npos) end = n;
      bool merged = false;
      if (!comments.empty() && comments.back().text.compare(0, 2, "//") == 0) {
        // Merge with the previous // comment when only whitespace with one newline separates them.
        const Comment& prev = comments.back();
        std::string gap = src.substr(prev.end, i - prev.end);
        if (gap.find_first_not_of(" \t\r\n") == std::string::npos && std::count(gap.begin(), gap.end(), '\n') == 1) {
          comments.back().end = end;
          comments.back().text = src.substr(prev.begin, end - prev.begin);
          merged = true;
        }
      }
      if (!merged) comments.push_back({i, end, src.substr(i, end - i)});
      blank(i, end);
      i = end;
    } else if (src[i] == '"' || src[i] == '\'') {
      const char quote = src[i];
      size_t k = i + 1;
      while (k < n && src[k] != quote && src[k] != '\n') k += (src[k] == '\\') ? 2 : 1;
      blank(i + 1, k);
      i = k + 1;
    } else {
      ++i;
    }
  }
}

size_t line_of(const std::string& s, size_t pos) {
  return 1 + static_cast<size_t>(std::count(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(pos), '\n'));
}

size_t line_end(const std::string& s, size_t pos) {
  size_t e = s.find('\n', pos);
  return e == std::string::npos ? s.size() : e;
}

const std::regex& tag_regex() {
  static const std::regex re(R"(\[(main-thread|loader-thread|any-thread|thread-safe)\])");
  return re;
}

// Is the member declared in code[decl_begin, decl_end) (decl_end = its ';') tagged? `prev_term`
// is the offset of the ';' or '{' that ends the previous member or opens the struct.
bool is_tagged(const std::string& src, const std::string& code, const std::vector<Comment>& comments, size_t prev_term,
               size_t decl_begin, size_t decl_end) {
  const size_t own_end = line_end(src, decl_end);  // through the end of the ';' line
  const Comment* above = nullptr;
  for (const Comment& c : comments) {
    if (c.begin >= decl_begin && c.begin < own_end) {  // on the member's own lines
      if (std::regex_search(c.text, tag_regex())) return true;
    } else if (c.begin > prev_term && c.end <= decl_begin) {
      above = &c;  // keeps the nearest one above
    }
  }
  if (above == nullptr) return false;
  // The comment above must not be the previous member's trailing comment...
  if (line_of(src, above->begin) == line_of(src, prev_term) && src[prev_term] == ';') return false;
  // ...and must sit right above the declaration: only whitespace and at most one newline between.
  std::string gap = code.substr(above->end, decl_begin - above->end);
  if (gap.find_first_not_of(" \t\r\n") != std::string::npos) return false;
  if (std::count(gap.begin(), gap.end(), '\n') > 1) return false;
  return std::regex_search(above->text, tag_regex());
}

Scan scan_header(const std::string& src) {
  Scan scan;
  std::string code;
  std::vector<Comment> comments;
  split_comments(src, code, comments);

  // Blank preprocessor lines (with their continuations): macros are not declarations.
  for (size_t i = 0; i < code.size();) {
    size_t eol = line_end(code, i);
    size_t first = code.find_first_not_of(" \t", i);
    if (first != std::string::npos && first < eol && code[first] == '#') {
      size_t k = i;
      for (;;) {
        eol = line_end(code, k);
        bool cont = eol > k && code.find_last_not_of(" \t\r", eol - 1) != std::string::npos &&
                    code[code.find_last_not_of(" \t\r", eol - 1)] == '\\';
        for (size_t j = k; j < eol; ++j) code[j] = ' ';
        if (!cont || eol >= code.size()) break;
        k = eol + 1;
      }
      i = eol + 1;
    } else {
      i = eol + 1;
    }
  }

  static const std::regex struct_open(R"(\bstruct(\s+(\w+))?\s*\{)");
  static const std::regex fn_ptr(R"(^[^()]*\(\s*\*\s*(\w+)\s*\)\s*\()");
  for (auto it = std::sregex_iterator(code.begin(), code.end(), struct_open); it != std::sregex_iterator(); ++it) {
    const std::smatch& m = *it;
    const size_t open = static_cast<size_t>(m.position(0) + m.length(0)) - 1;  // the '{'
    std::string owner = m[2].matched ? m[2].str() : std::string("<anonymous>");
    // Walk the body; members end at ';' at depth 1 (nested struct bodies are scanned on their own).
    int depth = 0;
    size_t prev_term = open;
    for (size_t i = open; i < code.size(); ++i) {
      const char ch = code[i];
      if (ch == '{') {
        ++depth;
      } else if (ch == '}') {
        if (--depth == 0) break;
      } else if (ch == ';' && depth == 1) {
        const size_t decl_begin = code.find_first_not_of(" \t\r\n", prev_term + 1);
        const std::string decl = code.substr(decl_begin, i - decl_begin);
        std::smatch fm;
        if (decl.find('{') == std::string::npos && std::regex_search(decl, fm, fn_ptr)) {
          Member mem;
          mem.owner = owner;
          mem.name = fm[1].str();
          mem.line = line_of(src, decl_begin + static_cast<size_t>(fm.position(1)));
          mem.tagged = is_tagged(src, code, comments, prev_term, decl_begin, i);
          scan.members.push_back(mem);
        }
        prev_term = i;
      }
    }
  }
  return scan;
}

const Member* find_member(const Scan& s, const std::string& owner, const std::string& name) {
  for (const Member& m : s.members)
    if (m.owner == owner && m.name == name) return &m;
  return nullptr;
}

}  // namespace

// The scanner itself, on a small header: trailing, inline and directly-above comments count; a
// group comment, a comment behind a blank line and the previous member's trailing comment don't.
TEST(AbiThreadTags, ScannerAttachesCommentsToTheirMember) {
  const std::string header = R"(
/* A header comment that names struct x { and [main-thread] is not a member. */
#define MACRO(type) ((type*)0)
typedef struct a {
  size_t struct_size;
  void (*trailing)(void* ctx); /* [thread-safe] */
  /* [any-thread] above */
  int (*above)(void* ctx,
               int x);
  /* Every function is [main-thread]. */
  /* A group comment above does not count. */
  void (*grouped)(void);
  void (*inline_comment)(int x /* [loader-thread] */);
  int value; /* [main-thread] belongs to value */
  void (*after_trailing)(void);
  /* [main-thread] behind a blank line */

  void (*blank_line)(void);
  // [any-thread] a C++ comment
  // on two lines
  void (*cpp_comment)(void);
  void (*untagged)(void); /* main-thread without brackets */
} a;
typedef void (*not_a_member)(void);
struct b { void (*solo)(void); };
)";
  const Scan s = scan_header(header);
  ASSERT_EQ(s.members.size(), 9u);
  struct Expect {
    const char* owner;
    const char* name;
    bool tagged;
  };
  const Expect expected[] = {
      {"a", "trailing", true},       {"a", "above", true},           {"a", "grouped", false},
      {"a", "inline_comment", true}, {"a", "after_trailing", false}, {"a", "blank_line", false},
      {"a", "cpp_comment", true},    {"a", "untagged", false},       {"b", "solo", false},
  };
  for (const Expect& e : expected) {
    const Member* m = find_member(s, e.owner, e.name);
    ASSERT_NE(m, nullptr) << e.owner << "::" << e.name << " not found";
    EXPECT_EQ(m->tagged, e.tagged) << e.owner << "::" << e.name;
  }
  EXPECT_EQ(find_member(s, "a", "not_a_member"), nullptr);
  EXPECT_EQ(find_member(s, "x", "not_a_member"), nullptr);
}

TEST(AbiThreadTags, EveryFunctionPointerHasItsOwnTag) {
  const std::string src = read_file(DTK_ABI_HEADER);
  ASSERT_FALSE(src.empty()) << "cannot read " << DTK_ABI_HEADER;
  const Scan s = scan_header(src);

  // Spot checks: the scanner finds members of the tables that matter.
  EXPECT_NE(find_member(s, "dtk_dataset_api", "get_sample"), nullptr);
  EXPECT_NE(find_member(s, "dtk_plugin_entry", "init"), nullptr);
  EXPECT_NE(find_member(s, "dtk_strategy_api", "memory_usage"), nullptr);

  std::vector<const Member*> untagged;
  for (const Member& m : s.members)
    if (!m.tagged) untagged.push_back(&m);
  std::cout << "checked " << s.members.size() << " function pointers in " << DTK_ABI_HEADER << ", " << untagged.size()
            << " without a thread tag\n";
  ::testing::Test::RecordProperty("function_pointers_checked", static_cast<int>(s.members.size()));

  // Guards against a scanner that finds nothing and passes vacuously.
  EXPECT_GT(s.members.size(), 80u);

  std::ostringstream names;
  for (const Member* m : untagged) names << "  " << m->owner << "::" << m->name << " (line " << m->line << ")\n";
  EXPECT_TRUE(untagged.empty()) << untagged.size()
                                << " function pointer(s) without [main-thread], [loader-thread], [any-thread] or "
                                   "[thread-safe] in their own comment (abi.h rule 6):\n"
                                << names.str();
}
