# SPDX-License-Identifier: Apache-2.0
"""scripts/patches.py against real installed trees: check, apply, refusal, refresh."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

import patches
from patches import EXIT_OTHER, EXIT_PATCHED, EXIT_PRISTINE, PatchError, load_series

REPO = Path(__file__).resolve().parents[2]
PATCHES_PY = REPO / "scripts" / "patches.py"

pytestmark = pytest.mark.slow_test


def run_patches(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), str(PATCHES_PY), *args], capture_output=True, text=True, check=False, cwd="/"
    )


def tree_snapshot(site: Path) -> dict[str, str]:
    """Hashes of every file the series or the overlay could touch."""
    series = load_series()
    snap: dict[str, str] = {}
    for path in [*series.targets, *series.overlay]:
        file = site / path
        snap[path] = hashlib.sha256(file.read_bytes()).hexdigest() if file.exists() else "absent"
    return snap


def test_check_on_the_setup_venv_says_patched():
    done = run_patches(REPO / ".venv" / "bin" / "python", "check")
    assert done.returncode == EXIT_PATCHED, done.stdout + done.stderr
    assert "patched by this series" in done.stdout


def test_check_apply_check_on_a_fresh_upstream_install(fresh_upstream_venv):
    python, site = fresh_upstream_venv
    pristine = tree_snapshot(site)
    done = run_patches(python, "check")
    assert done.returncode == EXIT_PRISTINE, done.stdout + done.stderr
    assert "pristine vLLM" in done.stdout

    done = run_patches(python, "apply")
    assert done.returncode == 0, done.stderr
    assert ": applied;" in done.stdout
    patched = tree_snapshot(site)
    assert all(patched[p] != pristine[p] for p in patched)

    assert run_patches(python, "check").returncode == EXIT_PATCHED
    done = run_patches(python, "apply")
    assert done.returncode == 0 and "already patched" in done.stdout
    assert tree_snapshot(site) == patched


def test_apply_refuses_a_hand_altered_file_and_changes_nothing(fresh_upstream_venv):
    python, site = fresh_upstream_venv
    victim = load_series().targets[-1]
    with (site / victim).open("a") as f:
        f.write("# local change\n")
    before = tree_snapshot(site)
    done = run_patches(python, "apply")
    assert done.returncode == EXIT_OTHER
    assert victim in done.stderr and "refusing to patch" in done.stderr
    assert tree_snapshot(site) == before
    done = run_patches(python, "check")
    assert done.returncode == EXIT_OTHER and victim in done.stdout


def test_check_names_a_partially_patched_tree(fresh_upstream_venv):
    python, site = fresh_upstream_venv
    assert run_patches(python, "apply").returncode == 0
    overlay_file = next(iter(load_series().overlay))
    (site / overlay_file).unlink()
    done = run_patches(python, "check")
    assert done.returncode == EXIT_OTHER
    assert f"partially patched: {overlay_file} is pristine" in done.stdout
    assert run_patches(python, "apply").returncode == EXIT_OTHER


def test_apply_rolls_back_when_a_write_fails(fresh_upstream_venv, pin, monkeypatch):
    _, site = fresh_upstream_venv
    series = load_series()
    before = tree_snapshot(site)
    real_write = patches._write_atomically
    writes = []

    def failing_write(file: Path, content: bytes) -> None:
        writes.append(file)
        if len(writes) == len(series.targets) + 1:
            raise OSError(28, "No space left on device")
        real_write(file, content)

    monkeypatch.setattr(patches, "_write_atomically", failing_write)
    with pytest.raises(OSError, match="No space left"):
        patches.apply_to_tree(site, series, pin)
    monkeypatch.setattr(patches, "_write_atomically", real_write)
    assert tree_snapshot(site) == before
    assert patches.classify(site, series, pin).code == EXIT_PRISTINE
    assert not list((site / "vllm").rglob("*.hisparse-tmp"))


@pytest.fixture
def scratch_repo(tmp_path) -> Path:
    """A copy of the repository's series and overlay that refresh may rewrite."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "patches", repo / "patches")
    shutil.copytree(REPO / "vllm", repo / "vllm", ignore=shutil.ignore_patterns("__pycache__"))
    return repo


def test_refresh_of_the_applied_tree_regenerates_the_same_series(fresh_upstream_venv, pin, scratch_repo):
    _, site = fresh_upstream_venv
    patches.apply_to_tree(site, load_series(), pin)
    patches.refresh(site, None, pin, repo=scratch_repo)
    for file in sorted((REPO / "patches").iterdir()):
        assert (scratch_repo / "patches" / file.name).read_text() == file.read_text(), file.name


def test_refresh_captures_a_new_edit_as_a_new_patch(
    fresh_upstream_venv, pin, scratch_repo, upstream_cpu_wheel
):
    _, site = fresh_upstream_venv
    patches.apply_to_tree(site, load_series(), pin)
    edited = "vllm/config/cache.py"
    text = (site / edited).read_text()
    anchor = "class CacheConfig:\n"
    assert anchor in text
    (site / edited).write_text(text.replace(anchor, "# hooked here\n" + anchor, 1))

    with pytest.raises(PatchError, match=f"{edited} is edited but no patch owns it"):
        patches.refresh(site, None, pin, repo=scratch_repo)
    changed = patches.refresh(site, "0002-cache-hook.patch", pin, repo=scratch_repo)
    assert any("new patch 0002-cache-hook.patch" in line for line in changed)

    series = load_series(scratch_repo)
    assert [p.name for p in series.patches][-1] == "0002-cache-hook.patch"
    assert "What: <fill in>" in series.patches[-1].header
    with zipfile.ZipFile(upstream_cpu_wheel) as wheel:
        assert series.patched_content(edited, wheel.read(edited)).decode() == (site / edited).read_text()
    assert patches.classify(site, series, pin).code == EXIT_PATCHED
