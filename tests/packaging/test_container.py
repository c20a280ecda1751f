# SPDX-License-Identifier: Apache-2.0
"""The Dockerfile: lint-clean, based on the pinned upstream image, copying make wheel's output."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def resolve(text: str, args: dict[str, str]) -> str:
    """Docker's ARG substitution: ${X}, $X and ${X:+word} (word when X is set and not empty)."""
    text = re.sub(r"\$\{(\w+):\+((?:[^{}]|\{[^{}]*\})*)\}",
                  lambda m: m.group(2) if args.get(m.group(1)) else "", text)  # fmt: skip
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], text)


def build_args() -> dict[str, str]:
    """Each ARG's default (a redeclaration without one keeps the earlier default)."""
    args = {}
    for keyword, rest in instructions():
        if keyword == "ARG":
            name, eq, default = rest.partition("=")
            if eq or name not in args:
                args[name] = default
    return args


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=str(REPO / ".venv" / "bin"))
    assert hadolint, "hadolint is installed by make setup (tests/requirements.txt)"
    done = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_base_image_is_the_pinned_upstream_image_pinned_by_digest_when_given(pin):
    froms = [rest for keyword, rest in instructions() if keyword == "FROM"]
    assert len(froms) == 1
    assert resolve(froms[0], build_args()) == pin.base_image
    digest = "sha256:" + "0" * 64
    assert resolve(froms[0], {**build_args(), "BASE_DIGEST": digest}) == f"{pin.base_image}@{digest}"


def test_image_labels_name_the_distribution_its_version_and_license(pin):
    args = build_args()
    labels = " ".join(resolve(rest, args) for keyword, rest in instructions() if keyword == "LABEL")
    assert f'org.opencontainers.image.version="{pin.distribution_version("cuda")}"' in labels
    assert 'org.opencontainers.image.licenses="Apache-2.0"' in labels
    assert f'org.opencontainers.image.base.name="docker.io/{pin.base_image}"' in labels


def test_the_repository_carries_the_apache_license_and_a_notice():
    assert (REPO / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    notice = (REPO / "NOTICE").read_text()
    assert "vLLM" in notice and "Apache License, Version 2.0" in notice


def test_the_build_context_holds_what_the_image_copies_and_nothing_else():
    """.dockerignore excludes everything but what COPY needs: each source is let in."""
    lines = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in lines, "everything is excluded unless let in"
    allowed = [line[1:].rstrip("/") for line in lines if line.startswith("!")]
    args = build_args()
    for keyword, rest in instructions():
        if keyword != "COPY":
            continue
        for source in resolve(rest, args).split()[:-1]:
            source = source.rstrip("/")
            assert any(
                source == a or source.startswith(a + "/") or (a.endswith("*.whl") and source.endswith(".whl"))
                for a in allowed
            ), f"COPY {source} is kept out of the build context by .dockerignore"


def test_the_image_ships_the_pd_proxy_and_the_gpu_check():
    copied = " ".join(rest for keyword, rest in instructions() if keyword == "COPY")
    for needed in ("scripts/", "csrc/", "tests/support/", "tests/kernels/", "setup.py"):
        assert needed in copied, needed


def test_copied_wheel_is_what_make_wheel_builds_for_cuda(pin):
    args = build_args()
    copies = [rest.split() for keyword, rest in instructions() if keyword == "COPY" and "dist/" in rest]
    assert len(copies) == 1
    source = resolve(copies[0][0], args)
    assert source == f"dist/{pin.wheel_name('cuda')}"
    runs = " ".join(rest for keyword, rest in instructions() if keyword == "RUN")
    assert "--no-deps" in runs and resolve("${HISPARSE_WHEEL}", args) in resolve(runs, args)


def test_entrypoint_stays_vllm_serve():
    entry = [rest for keyword, rest in instructions() if keyword == "ENTRYPOINT"]
    assert [json.loads(e) for e in entry] == [["vllm", "serve"]]


@pytest.mark.parametrize(
    "needle",
    [
        '--attention-config \'{"hisparse_config":{"host_pool_gib":384}}\'',
        '"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":137438953472',
        "--max-model-len 1048576",
        "--tensor-parallel-size 8",
    ],
)
def test_deploy_doc_shows_the_announced_flags(needle, pin):
    doc = (REPO / "docs" / "deploy.md").read_text()
    assert needle in doc
    assert f"vllm-hisparse:{pin.distribution_version('cuda').replace('+', '-')}" in doc
