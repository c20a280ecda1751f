# SPDX-License-Identifier: Apache-2.0
"""Loading of HiSparse's compiled CUDA extension, `vllm._hisparse_C`.

Owns the one place the extension is found and loaded, so every op that has a
CUDA kernel (`resolver.py`, `page_copy.py`) agrees on whether it exists. The
CUDA wheel builds the extension from csrc/; the CPU wheel has none, and the
torch references run there.

It never chooses what to run; callers ask `cuda_kernels_available()` and pick.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.cache
def cuda_kernels_available() -> bool:
    """Load the compiled HiSparse extension once; False where it was not built or no CUDA device."""
    import vllm

    libraries = sorted(Path(vllm.__file__).parent.glob("_hisparse_C*.so"))
    if not libraries or not torch.cuda.is_available():
        return False
    torch.ops.load_library(str(libraries[0]))
    return True
