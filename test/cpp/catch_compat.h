#pragma once
// Catch2 2.x (Debian 12's catch2) or 3.x (Debian 13's): the tests include this, never Catch2
// directly. Under 3.x the 2.x names the tests use are provided: Approx at global scope, the
// string matchers Catch::Contains / Catch::StartsWith (3.x's Matchers::Contains matches range
// elements, not substrings). A file that defines main (MONARCH_CATCH_RUNNER) gets 2.x's runner.
#include <string>

#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>

namespace Catch {
inline Matchers::StringContainsMatcher Contains(const std::string& text,
                                                CaseSensitive sensitivity = CaseSensitive::Yes) {
  return Matchers::ContainsSubstring(text, sensitivity);
}
inline Matchers::StartsWithMatcher StartsWith(const std::string& text, CaseSensitive sensitivity = CaseSensitive::Yes) {
  return Matchers::StartsWith(text, sensitivity);
}
}  // namespace Catch
using Catch::Approx;

#else
#ifdef MONARCH_CATCH_RUNNER
#define CATCH_CONFIG_RUNNER
#endif
#include <catch2/catch.hpp>
#endif
