# SPDX-License-Identifier: Apache-2.0
"""Loading of HiSparse's compiled CUDA extension, `vllm._hisparse_C`.

Owns the one place the extension is found and loaded, so every op that has a
CUDA kernel (`resolver.py`, `page_copy.py`) agrees on whether it exists. The
CUDA wheel builds the extension from csrc/; the CPU wheel has none, and the
torch references run there.

On a CUDA host the kernels are required: `require_cuda_kernels` raises with
the cause (not installed, or the library failed to load, with the loader's own
message) and the worker calls it at start-up, so a GPU never silently runs a
torch fallback. It never chooses what to run; callers ask
`cuda_kernels_available()` and pick.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

OPS = ("apply_resolution", "copy_host_rows", "copy_pages", "plan_resolution")


def ops_registered() -> bool:
    """Whether `torch.ops._hisparse_C` has every op (loaded from the wheel, or a JIT build)."""
    try:
        namespace = torch.ops._hisparse_C
        return all(hasattr(namespace, op) for op in OPS)
    except (AttributeError, RuntimeError):
        return False


def _package_dir() -> Path:
    import vllm

    if vllm.__file__:
        return Path(vllm.__file__).parent
    return Path(next(iter(vllm.__path__)))  # a source tree on sys.path, without vLLM installed


def extension_problem(package_dir: Path | None = None) -> str | None:
    """None when the extension's ops are registered (loading the library if needed), else why not."""
    if ops_registered():
        return None
    return _load(package_dir or _package_dir())


@functools.cache
def _load(package_dir: Path) -> str | None:
    libraries = sorted(package_dir.glob("_hisparse_C*.so"))
    if not libraries:
        return (
            f"the extension vllm/_hisparse_C.abi3.so is not in this installation ({package_dir}); "
            "the CPU wheel has none: install the CUDA wheel (`make wheel FLAVOUR=cuda`)"
        )
    try:
        torch.ops.load_library(str(libraries[0]))
    except (OSError, RuntimeError) as e:
        reason = e.__cause__ or e  # torch wraps the dynamic loader's own message
        return (
            f"{libraries[0]} failed to load ({reason}); it must be built for this torch "
            f"({torch.__version__}) and a glibc at least as new as its wheel tag names"
        )
    if not ops_registered():
        return f"{libraries[0]} loaded but does not register torch.ops._hisparse_C.{{{', '.join(OPS)}}}"
    return None


def narrow_copy_launches() -> int:
    """Copy launches of this process that copied byte by byte because something was not
    16-byte aligned (the extension warns once per kind); 0 without the extension."""
    if not ops_registered():
        return 0
    return int(torch.ops._hisparse_C.narrow_copy_launches())


def cuda_kernels_available() -> bool:
    """Whether the compiled kernels can run here: a CUDA device and the extension loaded."""
    return torch.cuda.is_available() and extension_problem() is None


def require_cuda_kernels(package_dir: Path | None = None) -> None:
    """Raise, naming the cause, unless the extension's ops are registered."""
    problem = extension_problem(package_dir)
    if problem is not None:
        raise RuntimeError(f"Hybrid HiSparse on CUDA needs its compiled kernels: {problem}")
