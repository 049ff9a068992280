// The C++ tests' one check: counts passes and failures and names each failure on stderr; report()
// prints "<name>: N passed, M failed" and gives the exit status (0 iff nothing failed).
#pragma once

#include <cstdio>

namespace checks {
inline int passed = 0, failed = 0;
}  // namespace checks

inline void check(bool ok, const char* what) {
  if (ok) {
    ++checks::passed;
  } else {
    ++checks::failed;
    std::fprintf(stderr, "FAIL: %s\n", what);
  }
}

inline int report(const char* name) {
  std::printf("%s: %d passed, %d failed\n", name, checks::passed, checks::failed);
  return checks::failed == 0 ? 0 : 1;
}
