# SPDX-License-Identifier: Apache-2.0
"""Finding the CUDA toolkit for the CUDA wheel, and stopping clearly without one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import cuda_build
import pytest

REPO = Path(__file__).resolve().parents[2]


def test_without_nvcc_the_cuda_wheel_stops_naming_what_is_missing_and_writes_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + "/usr/bin" + os.pathsep + "/bin"
    if shutil.which("nvcc", path=env["PATH"]):
        pytest.skip("nvcc is on the system path of this machine")
    dist = tmp_path / "dist"
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "build_wheel.py"), "--flavour", "cuda", "--dist", str(dist)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1
    assert "needs nvcc to build its extension" in done.stderr and "CUDA_HOME" in done.stderr
    assert not dist.exists() or not list(dist.iterdir()), "no wheel, not even a partial one"


def test_a_cuda_home_without_nvcc_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    with pytest.raises(cuda_build.CudaBuildError, match=f"CUDA_HOME={tmp_path} has no bin/nvcc"):
        cuda_build.find_cuda_home()


def test_nvcc_behind_a_wrapper_script_resolves_to_its_real_toolkit(tmp_path, monkeypatch):
    real = shutil.which("nvcc")
    if real is None:
        pytest.skip("needs nvcc (a CUDA toolkit)")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec "{Path(real).resolve()}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    home = cuda_build.find_cuda_home()
    assert home != tmp_path, "not the wrapper's own folder"
    assert (home / "include" / "cuda_runtime_api.h").is_file()
    assert (home / "bin" / "nvcc").is_file()
