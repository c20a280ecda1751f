# SPDX-License-Identifier: Apache-2.0
"""Building csrc/ for the kernel tests: an nvcc compile check and the just-in-time torch ops."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"
SM90A = "-gencode=arch=compute_90a,code=sm_90a"


def compile_for_sm90a(source: str, out_dir: Path) -> Path:
    """Compile one csrc/ kernel source with nvcc for sm_90a; fails the test on errors."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed on this machine")
    out = out_dir / (Path(source).stem + ".o")
    done = subprocess.run(
        [nvcc, "-std=c++17", "-O3", SM90A, f"-I{CSRC}", "-c", str(CSRC / source), "-o", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert out.stat().st_size > 0
    return out


def hisparse_ops(build_dir: Path):
    """torch.ops._hisparse_C: the library HISPARSE_EXTENSION_LIBRARY names (gpu_check's
    build, for its runs under compute-sanitizer), else the installed wheel's if it carries
    the extension, else every csrc/ source built just in time (needs CUDA torch and nvcc)."""
    import os

    import torch

    from vllm.v1.hisparse.ops import cuda_kernels_available, ops_registered

    library = os.environ.get("HISPARSE_EXTENSION_LIBRARY")
    if library and not ops_registered():
        torch.ops.load_library(library)
    if not cuda_kernels_available():
        from torch.utils.cpp_extension import load

        load(
            name="hisparse_ops_jit",
            sources=[str(p) for p in sorted(CSRC.glob("*.cu"))] + [str(CSRC / "hisparse_ops.cpp")],
            extra_include_paths=[str(CSRC)],
            extra_cuda_cflags=["-O3", SM90A],
            build_directory=str(build_dir),
            is_python_module=False,
        )
    return torch.ops._hisparse_C
