// dtk/core/config/param_rule_regex.hpp — a user's regular expression (lr.param_rules' `match`)
// compiled so that matching it takes polynomial time.
//
// std::regex backtracks by default: a pattern with nested quantifiers such as "(.+)+x" takes time
// exponential in the length of a parameter name it fails to match (dtk hung at start). libstdc++'s
// __polynomial flag runs the same ECMAScript syntax on its breadth-first executor, which has no
// such case; it cannot run back-references, which it refuses at compile time (a regex_error the
// config check reports as an invalid expression). Another standard library (not one DTK's builds
// use) gets the ECMAScript default, which backtracks.
#pragma once

#include <regex>
#include <string>

namespace dtk::core {

inline std::regex param_rule_regex(const std::string& pattern) {
#ifdef __GLIBCXX__
  return std::regex(pattern, std::regex::ECMAScript | std::regex_constants::__polynomial);
#else
  return std::regex(pattern, std::regex::ECMAScript);
#endif
}

}  // namespace dtk::core
