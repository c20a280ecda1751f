# SPDX-License-Identifier: Apache-2.0
"""The repository's own files: every source file carries its license identifier."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("*.py", "*.cpp", "*.h", "*.cu", "*.cuh", "*.sh", ".ci/*")


def test_every_source_file_starts_with_an_spdx_license_identifier():
    files = subprocess.run(["git", "ls-files", *SOURCES], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()  # fmt: skip
    assert files, "git lists the sources"
    missing = [f for f in files if "SPDX-License-Identifier: Apache-2.0" not in
               "".join((REPO / f).read_text().splitlines(keepends=True)[:3])]  # fmt: skip
    assert not missing, f"without an SPDX header in their first lines: {missing}"
