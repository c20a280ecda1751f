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
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], text)


def build_args() -> dict[str, str]:
    args = {}
    for keyword, rest in instructions():
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
    return args


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=str(REPO / ".venv" / "bin"))
    assert hadolint, "hadolint is installed by make setup (tests/requirements.txt)"
    done = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_base_image_is_the_pinned_upstream_image(pin):
    froms = [rest for keyword, rest in instructions() if keyword == "FROM"]
    assert len(froms) == 1
    assert resolve(froms[0], build_args()) == pin.base_image


def test_copied_wheel_is_what_make_wheel_builds_for_cuda(pin):
    args = build_args()
    copies = [rest.split() for keyword, rest in instructions() if keyword == "COPY"]
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
        "--attention-config '{\"hisparse_config\":{\"host_pool_gib\":384}}'",
        '"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":137438953472',
        "--max-model-len 1048576",
        "--tensor-parallel-size 8",
    ],
)
def test_deploy_doc_shows_the_announced_flags(needle, pin):
    doc = (REPO / "docs" / "deploy.md").read_text()
    assert needle in doc
    assert f"vllm-hisparse:{pin.distribution_version('cuda').replace('+', '-')}" in doc
