#!/usr/bin/env python3
"""Fail when a tracked Rust file outside an `ffi` module is over the line cap.

A file past the cap is split by concern (STYLE.md); `ffi` modules, which
mirror a C header, are exempt.
"""
import subprocess
import sys

CAP = 1200


def main() -> int:
    files = subprocess.run(
        ["git", "ls-files", "*.rs"], check=True, capture_output=True, text=True
    ).stdout.split()
    over = []
    for path in files:
        parts = path.split("/")
        if "ffi" in parts or parts[-1] == "ffi.rs":
            continue
        with open(path, encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > CAP:
            over.append((n, path))
    for n, path in sorted(over, reverse=True):
        print(f"{path}: {n} lines, over the {CAP}-line cap: split it by concern "
              f"(a folder module, one file per concern)")
    print(f"line cap: {len(files)} files checked, {len(over)} over {CAP} lines")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
