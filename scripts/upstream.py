# SPDX-License-Identifier: Apache-2.0
"""The upstream pin and the upstream wheels it names.

Owns: reading `upstream.toml` (the only place the pin is written), naming the
distribution's versions and wheel files, deciding this machine's flavour, and
fetching the pinned upstream wheel into the local cache. It never modifies an
installed vLLM tree; `patches.py` and `build_wheel.py` do that.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parent.parent
PIN_FILE = REPO / "upstream.toml"
CACHE_DIR = REPO / ".cache" / "upstream"
# Upstream wheels are tagged for every CPython >= 3.8 on manylinux_2_28 x86_64.
UPSTREAM_WHEEL_TAG = "cp38-abi3-manylinux_2_28_x86_64"

Flavour = Literal["cpu", "cuda"]
FLAVOURS: tuple[Flavour, ...] = ("cpu", "cuda")


@dataclass(frozen=True)
class Pin:
    version: str
    cuda_distribution: str
    cpu_distribution: str
    cpu_torch: str
    image: str
    name: str
    build: int
    cuda_platform: str

    def upstream_distribution(self, flavour: Flavour) -> str:
        return self.cpu_distribution if flavour == "cpu" else self.cuda_distribution

    def distribution_version(self, flavour: Flavour) -> str:
        local = f"hisparse.{self.build}"
        if flavour == "cpu":
            local += ".cpu"
        return f"{self.version}+{local}"

    def upstream_wheel_name(self, flavour: Flavour) -> str:
        dist = self.upstream_distribution(flavour).replace("-", "_")
        return f"{dist}-{self.version}-{UPSTREAM_WHEEL_TAG}.whl"

    def wheel_tag(self, flavour: Flavour) -> str:
        """The CPU wheel keeps upstream's tag; the CUDA wheel's compiled extension needs
        the glibc its platform tag names."""
        return UPSTREAM_WHEEL_TAG if flavour == "cpu" else f"cp38-abi3-{self.cuda_platform}"

    def glibc(self, flavour: Flavour) -> tuple[int, int]:
        """The glibc (major, minor) the flavour's wheel tag promises is enough."""
        major, minor = re.search(r"manylinux_(\d+)_(\d+)_", self.wheel_tag(flavour)).groups()
        return int(major), int(minor)

    def wheel_name(self, flavour: Flavour) -> str:
        return f"{self.name}-{self.distribution_version(flavour)}-{self.wheel_tag(flavour)}.whl"

    @property
    def base_image(self) -> str:
        return f"{self.image}:v{self.version}"


def load_pin(path: Path = PIN_FILE) -> Pin:
    with path.open("rb") as f:
        data = tomllib.load(f)
    up, dist = data["upstream"], data["distribution"]
    return Pin(
        version=up["version"],
        cuda_distribution=up["cuda_distribution"],
        cpu_distribution=up["cpu_distribution"],
        cpu_torch=up["cpu_torch"],
        image=up["image"],
        name=dist["name"],
        build=int(dist["build"]),
        cuda_platform=dist["cuda_platform"],
    )


def machine_flavour() -> Flavour:
    """The flavour this machine should run: CUDA when an NVIDIA driver answers.

    `HISPARSE_FLAVOUR=cpu|cuda` overrides the detection (e.g. to build the CUDA
    wheel for an image on a machine without a GPU).
    """
    forced = os.environ.get("HISPARSE_FLAVOUR", "").strip().lower()
    if forced:
        if forced not in FLAVOURS:
            raise SystemExit(
                f"HISPARSE_FLAVOUR={forced!r} is not a flavour; use one of {', '.join(FLAVOURS)}"
            )
        return forced  # type: ignore[return-value]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "cpu"
    probe = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False)
    return "cuda" if probe.returncode == 0 and "GPU" in probe.stdout else "cpu"


def fetch_upstream_wheel(flavour: Flavour, pin: Pin | None = None) -> Path:
    """Return the pinned upstream wheel, downloading it into the cache once."""
    pin = pin or load_pin()
    target = CACHE_DIR / pin.upstream_wheel_name(flavour)
    if target.is_file():
        return target
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    requirement = f"{pin.upstream_distribution(flavour)}=={pin.version}"
    print(f"fetching upstream wheel {requirement} into {CACHE_DIR}", flush=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--platform",
        "manylinux_2_28_x86_64",
        "--dest",
        str(CACHE_DIR),
        requirement,
    ]
    done = subprocess.run(cmd, check=False)
    if done.returncode != 0 or not target.is_file():
        raise SystemExit(
            f"could not fetch {requirement} (expected {target.name}); "
            "check that the package index is reachable and the pin in upstream.toml is right"
        )
    return target


def main(argv: list[str] | None = None) -> int:
    """Print one fact of the pin, for the Makefile and shell use."""
    import argparse

    parser = argparse.ArgumentParser(description="print one fact of the upstream pin")
    parser.add_argument("fact", choices=("version", "base-image", "image-tag", "wheel-name", "flavour"))
    parser.add_argument("--flavour", choices=FLAVOURS, help="default: this machine's")
    args = parser.parse_args(argv)
    pin = load_pin()
    flavour = args.flavour or machine_flavour()
    print(
        {
            "version": pin.version,
            "base-image": pin.base_image,
            "image-tag": pin.distribution_version("cuda").replace("+", "-"),
            "wheel-name": pin.wheel_name(flavour),
            "flavour": flavour,
        }[args.fact]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
