// checks.h — how the C++ tests report, the same way as test/checks.py does for the Python ones: one
// line per check, "PASS: name" or "FAIL: name: why", which test/run_tests.py counts; the process
// exits non-zero when any check failed (return check_exit_code() from main).
#pragma once

#include <cstdio>
#include <string>

inline int check_failures = 0;

inline void check(bool ok, const std::string& name, const std::string& why = "") {
    if (ok) printf("PASS: %s\n", name.c_str());
    else { printf("FAIL: %s: %s\n", name.c_str(), why.c_str()); check_failures++; }
    fflush(stdout);  // a test that crashes later still shows every check it made
}

inline int check_exit_code() { return check_failures ? 1 : 0; }
