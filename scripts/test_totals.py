#!/usr/bin/env python3
"""make test's last lines: one total over every test binary and lane of a
log (libtest's `test result:` lines), then each skipped test with its reason
(the `SKIP name: why` lines accel_test_support::skips appended to the skip
log). A test that skipped part of its work counts as skipped.

    scripts/test_totals.py TEST_LOG SKIP_LOG
"""
import re
import sys

RESULT = re.compile(
    r"test result: \w+\. (\d+) passed; (\d+) failed; (\d+) ignored; (\d+) measured; (\d+) filtered out"
)


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    passed = failed = ignored = binaries = 0
    with open(sys.argv[1], errors="replace") as f:
        for line in f:
            m = RESULT.search(line)
            if m:
                binaries += 1
                passed += int(m[1])
                failed += int(m[2])
                ignored += int(m[3])
    skips = []
    try:
        with open(sys.argv[2], errors="replace") as f:
            skips = sorted({l.rstrip("\n") for l in f if l.startswith("SKIP ")})
    except FileNotFoundError:
        pass
    # A test that skipped all or part of its work passed for libtest; here
    # it counts as skipped, not passed.
    skipped = len({s.split(": ", 1)[0] for s in skips})
    print(
        f"make test: {passed - skipped} passed, {failed} failed, {ignored} ignored, "
        f"{skipped} skipped ({binaries} test binaries)"
    )
    for s in skips:
        print(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
