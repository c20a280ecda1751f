# SPDX-License-Identifier: Apache-2.0
"""Loading the compiled extension: on a CUDA host a missing or broken library stops start-up,
naming its cause."""

from __future__ import annotations

import pytest

from vllm.v1.hisparse.ops import extension_problem, ops_registered, require_cuda_kernels


@pytest.fixture(autouse=True)
def _no_ops_registered():
    if ops_registered():
        pytest.skip("this process already has torch.ops._hisparse_C registered")


def test_a_missing_library_is_named_with_where_it_was_looked_for(tmp_path):
    missing = r"needs its compiled kernels: .*_hisparse_C\.abi3\.so is not in this installation"
    with pytest.raises(RuntimeError, match=missing) as raised:
        require_cuda_kernels(tmp_path)
    assert str(tmp_path) in str(raised.value)
    assert "FLAVOUR=cuda" in str(raised.value)


def test_a_library_that_fails_to_load_is_named_with_the_loaders_own_message(tmp_path):
    library = tmp_path / "_hisparse_C.abi3.so"
    library.write_bytes(b"not an ELF file")
    problem = extension_problem(tmp_path)
    assert problem is not None
    assert str(library) in problem and "failed to load" in problem
    assert "header" in problem or "too short" in problem, problem  # the dynamic loader's reason
    with pytest.raises(RuntimeError, match="failed to load"):
        require_cuda_kernels(tmp_path)


def test_the_cpu_wheel_reports_no_kernels_without_raising():
    import torch

    from vllm.v1.hisparse.ops import cuda_kernels_available

    if torch.cuda.is_available():
        pytest.skip("a CUDA host: the installed wheel decides")
    assert cuda_kernels_available() is False


def test_gpu_check_stops_with_a_reason_on_a_machine_without_cuda():
    import subprocess
    import sys
    from pathlib import Path

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA host: gpu_check would run for real")
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
    done = subprocess.run(
        [sys.executable, str(script), "--out", "/dev/null"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr


def test_gpu_check_sanitize_runs_the_kernel_tests_under_each_tool_and_reports_its_verdict(tmp_path):
    """`gpu_check --sanitize` without a GPU: the commands it runs, and how it reads their
    exit status (a stand-in sanitizer: the real one needs a device)."""
    import gpu_check

    library = tmp_path / "_hisparse_C.abi3.so"
    assert gpu_check.run_sanitizers(library, None) == {
        "memcheck": "not run: compute-sanitizer is not in this CUDA toolkit",
        "racecheck": "not run: compute-sanitizer is not in this CUDA toolkit",
    }
    commands = gpu_check.sanitizer_commands(tmp_path / "compute-sanitizer", library)
    assert [tool for tool, _, _ in commands] == ["memcheck", "racecheck"]
    for tool, command, env in commands:
        assert command[:5] == [str(tmp_path / "compute-sanitizer"), "--tool", tool, "--error-exitcode", "97"]
        assert command[6:8] == ["-m", "pytest"] and command[-2].endswith("tests/kernels")
        assert env[gpu_check.EXTENSION_LIBRARY_ENV] == str(library)
    stand_in = tmp_path / "compute-sanitizer"
    stand_in.write_text(
        '#!/bin/sh\n[ "$2" = racecheck ] && exit 97\n[ -n "$HISPARSE_EXTENSION_LIBRARY" ] || exit 3\nexit 0\n'
    )
    stand_in.chmod(0o755)
    assert gpu_check.run_sanitizers(library, stand_in) == {
        "memcheck": "passed",
        "racecheck": "FAILED (exit 97: its own finding)",
    }


def test_gpu_check_runs_the_kernel_tests_in_a_child_so_a_crash_is_reported_not_fatal(tmp_path, monkeypatch):
    """A test that crashes (here: a segfault, as a kernel test did on a GPU machine) fails
    the kernel tests' verdict; gpu_check itself goes on to its report."""
    import gpu_check

    crashing = tmp_path / "test_crash.py"
    crashing.write_text(
        "import os, signal\n\n\ndef test_ok():\n    pass\n\n\n"
        "def test_crash():\n    os.kill(os.getpid(), signal.SIGSEGV)\n"
    )
    monkeypatch.setattr(gpu_check, "PYTEST_ARGS", ("-q", "-p", "no:cacheprovider", str(crashing)))
    library = tmp_path / "_hisparse_C.abi3.so"
    verdict = gpu_check.run_pytest(library)
    assert verdict.startswith("FAILED (pytest exit "), verdict
    command = gpu_check.pytest_command()
    assert command is not None and command[1:5] == ["-X", "faulthandler", "-m", "pytest"]
