# SPDX-License-Identifier: Apache-2.0
"""`make demo`'s script: a real `vllm serve` under KV pressure, driven by the multi-turn client."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow_test

REPO = Path(__file__).resolve().parents[2]


def number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match is not None, f"{pattern!r} not in the demo's report:\n{text}"
    return float(match.group(1))


def test_the_demo_shows_pages_leaving_the_device_and_coming_back():
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo.py")],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "12 finished, 0 failed" in out
    assert number(r"demoted (\d+)", out) > 0
    assert number(r"copied to host (\d+)", out) > 0
    assert number(r"reused from host (\d+)", out) > 0, "later turns took prefix pages from the host pool"
    assert number(r"peak MIXED (\d+)", out) + number(r"peak NONE (\d+)", out) > 0
    assert number(r"rows loaded (\d+)", out) > 0
    assert number(r"(\d+) served from cache", out) > 0


def test_bad_arguments_are_refused_naming_the_flag():
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo.py"), "--kv-blocks", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "--kv-blocks must be at least 1 (got 0)" in done.stderr
