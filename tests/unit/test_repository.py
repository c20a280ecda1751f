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


def test_the_architecture_doc_states_the_plan_version_the_code_uses():
    import re

    from vllm.v1.hisparse.plan import HISPARSE_PLAN_VERSION

    text = (REPO / "docs" / "architecture.md").read_text()
    stated = re.findall(r"`HISPARSE_PLAN_VERSION` (\d+)", text)
    assert stated and {int(v) for v in stated} == {HISPARSE_PLAN_VERSION}, stated


def test_documents_link_the_one_gpu_status_section_instead_of_repeating_it():
    kernels = (REPO / "docs" / "kernels.md").read_text()
    assert "## GPU status" in kernels
    for doc in ("README.md", "RELEASE_NOTES.md", "docs/deploy.md", "docs/architecture.md"):
        text = (REPO / doc).read_text()
        assert "kernels.md#gpu-status" in text, f"{doc} links docs/kernels.md's GPU status"
        assert "not run on a GPU in our test bed" not in text, f"{doc} repeats the GPU caveat"


def test_tests_use_upstream_vllms_marker_names():
    import re
    import tomllib

    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    names = {m.split(":")[0] for m in markers}
    assert {"cpu_test", "distributed", "slow_test"} <= names and "slow" not in names
    used = set()
    for path in (REPO / "tests").rglob("*.py"):
        used |= set(re.findall(r"pytest\.mark\.([a-z_]+)", path.read_text()))
    custom = used - {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings", "timeout"}
    assert custom <= names, f"markers not registered: {custom - names}"
