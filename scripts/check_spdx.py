# SPDX-License-Identifier: Apache-2.0
"""Exit 1, naming them, when any of the given files lacks an SPDX license identifier in its
first three lines (the pre-commit hook `spdx-header`; `tests/unit/test_repository.py` checks
every tracked source)."""

from __future__ import annotations

import sys
from pathlib import Path

TAG = "SPDX-License-Identifier: Apache-2.0"


def missing(paths: list[str]) -> list[str]:
    out = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            head = "".join(f.readline() for _ in range(3))
        if TAG not in head:
            out.append(path)
    return out


def main(argv: list[str]) -> int:
    bad = missing([p for p in argv if Path(p).is_file()])
    for path in bad:
        print(f"{path}: no '{TAG}' in its first three lines", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
