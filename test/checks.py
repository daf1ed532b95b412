"""checks.py: how a test program reports, in the lines test/run_tests.py counts.

Each check prints one line: `PASS: name` (with what it measured in parentheses, where that says
something), `FAIL: name: why`, or `SKIP: name (why)` (printed directly: a skip is not a result), and
the program exits non-zero if any check failed. This module is that protocol, written once.
"""
failed = 0


def report(ok, name, why="", measured=""):
    global failed
    if ok:
        print(f"PASS: {name}" + (f" ({measured})" if measured else ""), flush=True)
    else:
        failed += 1
        print(f"FAIL: {name}: {why or 'failed'}", flush=True)


def exit_code():
    return 1 if failed else 0
