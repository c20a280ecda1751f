# SPDX-License-Identifier: Apache-2.0
"""The distribution wheel: built from the pinned upstream wheel, installable, verifiable."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import subprocess
import sys
import zipfile
from pathlib import Path

import build_wheel
import pytest
import setup_env

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow_test


@pytest.fixture(scope="module")
def cpu_wheel(tmp_path_factory) -> Path:
    return build_wheel.build("cpu", tmp_path_factory.mktemp("dist"), sys.executable)


def metadata_headers(wheel: Path) -> list[tuple[str, str]]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        headers = zf.read(name).decode().split("\n\n", 1)[0]
    return [tuple(line.split(": ", 1)) for line in headers.splitlines() if ": " in line]


def test_wheel_is_named_and_versioned_as_the_distribution(cpu_wheel, pin):
    assert cpu_wheel.name == pin.wheel_name("cpu")
    assert cpu_wheel.name.startswith(f"vllm-{pin.version}+hisparse.{pin.build}.cpu-")
    headers = dict(metadata_headers(cpu_wheel))
    assert headers["Name"] == "vllm"
    assert headers["Version"] == pin.distribution_version("cpu")


def test_cpu_wheel_drops_the_media_packages_that_break_beside_cpu_torch(cpu_wheel, pin):
    requires = [value for key, value in metadata_headers(cpu_wheel) if key == "Requires-Dist"]
    names = {r.split(";")[0].split("=")[0].split("<")[0].split(">")[0].strip().lower() for r in requires}
    assert not names & {"torchvision", "torchaudio", "torchcodec"}
    assert any(r.startswith(f"torch=={pin.cpu_torch}") for r in requires)


def test_every_record_row_matches_the_wheel_content(cpu_wheel):
    assert build_wheel.verify_record(cpu_wheel) > 2000


def test_a_tampered_wheel_fails_record_verification(cpu_wheel, tmp_path):
    tampered = tmp_path / cpu_wheel.name
    with zipfile.ZipFile(cpu_wheel) as src, zipfile.ZipFile(tampered, "w") as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename == "vllm/config/hisparse.py":
                data += b"# tampered\n"
            dst.writestr(info, data)
    with pytest.raises(build_wheel.PatchError, match="RECORD entry for vllm/config/hisparse.py"):
        build_wheel.verify_record(tampered)


def test_wheel_build_is_reproducible(cpu_wheel, tmp_path):
    again = build_wheel.build("cpu", tmp_path, sys.executable)
    assert hashlib.sha256(again.read_bytes()).digest() == hashlib.sha256(cpu_wheel.read_bytes()).digest()


def test_installed_wheel_reports_its_version_and_imports_the_overlay(cpu_wheel, venv_factory, pin):
    python, site = venv_factory("wheel-venv", cpu_wheel)
    version = subprocess.run(
        [str(python.parent / "vllm"), "--version"], capture_output=True, text=True, check=True, timeout=300
    )
    assert version.stdout.strip().splitlines()[-1] == pin.distribution_version("cpu")
    probe = subprocess.run(
        [
            str(python),
            "-c",
            "import vllm, vllm.config.hisparse as h; print(vllm.__file__); print(h.HiSparseConfig.__name__)",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    lines = probe.stdout.strip().splitlines()
    assert lines[-2].startswith(str(site)), "the wheel's vllm must shadow the development venv's"
    assert lines[-1] == "HiSparseConfig"
    check = subprocess.run(
        [str(python), str(REPO / "scripts" / "patches.py"), "check"], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr

    record = next(site.glob("vllm-*.dist-info/RECORD"))
    rows = list(csv.reader(io.StringIO(record.read_text())))
    verified = 0
    for path, digest, _size in rows:
        if not digest:
            continue
        data = (site / path).read_bytes()
        expected = digest.removeprefix("sha256=")
        actual = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert actual == expected, f"installed {path} does not match RECORD"
        verified += 1
    assert verified > 2000


def test_setup_venv_runs_the_wheel_this_checkout_builds(pin):
    site = setup_env.site_packages()
    assert site is not None
    infos = sorted(p.name for p in site.glob("vllm*.dist-info"))
    assert infos == [f"vllm-{pin.distribution_version('cpu')}.dist-info"]
    assert not list(site.glob("torchvision*")) and not list(site.glob("torchaudio*"))


def test_a_second_setup_is_a_no_op():
    stamp_before = setup_env.STAMP.read_text() if setup_env.STAMP.exists() else None
    assert stamp_before is not None, ".venv has no setup stamp: run make setup"
    assert stamp_before.strip() == setup_env.fingerprint(setup_env.machine_flavour()), (
        "the repository changed since the last make setup: run make setup before the tests"
    )
    site = setup_env.site_packages()
    record = next(site.glob("vllm-*.dist-info/RECORD"))
    mtime = record.stat().st_mtime_ns
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "setup_env.py")],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        timeout=120,
    )
    assert "up to date" in done.stdout
    assert record.stat().st_mtime_ns == mtime


def test_wheel_metadata_names_this_distribution_not_the_upstream_packager(cpu_wheel, pin):
    headers = metadata_headers(cpu_wheel)
    named = dict(headers)
    assert "Hybrid HiSparse" in named["Summary"]
    assert named["Author"] == "The vLLM Hybrid HiSparse distribution"
    assert not [k for k, _ in headers if k in ("Author-email", "Maintainer-email", "Maintainer")]
    urls = [v for k, v in headers if k == "Project-URL"]
    assert urls and all(u.startswith(("Upstream, ", "Upstream documentation, ")) for u in urls), urls
    assert named["License-Expression"] == "Apache-2.0"
    with zipfile.ZipFile(cpu_wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        description = zf.read(name).decode().split("\n\n", 1)[1]
    assert f"{pin.cpu_distribution}=={pin.version}" in description
    assert "not a release of the vLLM project" in description


def test_setup_refuses_to_start_an_install_the_disk_cannot_hold(tmp_path, monkeypatch):
    """A fresh install on a nearly full disk stops before pip, saying what it needs."""
    free = setup_env.shutil.disk_usage(tmp_path).free
    assert setup_env.disk_shortfall(tmp_path, free // 2) is None
    message = setup_env.disk_shortfall(tmp_path, free + (8 << 30))
    assert message is not None and "GiB free" in message and "make setup" in message
    # setup() itself stops there: no pip runs, and the stamp of the .venv it would have
    # replaced stays as it was.
    ran: list[tuple] = []
    stamp = tmp_path / "stamp"
    stamp.write_text("an older fingerprint\n")
    monkeypatch.setattr(setup_env, "run", lambda *cmd: ran.append(cmd))
    monkeypatch.setattr(setup_env, "STAMP", stamp)
    monkeypatch.setattr(setup_env, "SETUP_DISK_BYTES", free + (8 << 30))
    monkeypatch.setattr(setup_env, "hand_edited_files", lambda: [])
    assert setup_env.setup(force=False) == 1
    assert ran == []
    assert stamp.read_text() == "an older fingerprint\n"
