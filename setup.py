# SPDX-License-Identifier: Apache-2.0
"""Build the csrc/ CUDA extension, `vllm._hisparse_C`.

This is not how the distribution is packaged: `scripts/build_wheel.py` builds the
wheel from the pinned upstream wheel and calls `setup.py build_ext` only to
compile csrc/ when CUDA torch and nvcc are present. Kernels register their ops
with TORCH_LIBRARY (no pybind11) and the library is loaded with
torch.ops.load_library, so it is built against the limited Python API and
loads on every CPython the upstream abi3 wheel supports.
"""

import os
from pathlib import Path

from setuptools import setup

CSRC = Path(__file__).resolve().parent / "csrc"
# The GPUs whose sparse-MLA backends resolve through HiSparse (RESOLVING_CUDA_MAJORS in
# vllm/config/hisparse.py): Hopper (sm_90a) and Blackwell data-centre parts (sm_100a).
CUDA_ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_100a,code=sm_100a"]


def extensions():
    from torch.utils.cpp_extension import CUDAExtension

    # The C++ runtime torch loads, named after the objects where the compiler would link a
    # private copy of it (scripts/cuda_build.py, compile_extension).
    cxx_runtime = os.environ.get("HISPARSE_CXX_RUNTIME")

    sources = sorted(str(p) for p in CSRC.rglob("*") if p.suffix in (".cu", ".cpp"))
    if not sources:
        raise SystemExit("csrc/ holds no kernel sources: there is no extension to build")
    return [
        CUDAExtension(
            name="vllm._hisparse_C",
            sources=sources,
            include_dirs=[str(CSRC)],
            py_limited_api=True,
            # -g0 after Python's own CFLAGS (which carry -g): no debug information.
            extra_compile_args={"cxx": ["-O3", "-g0"], "nvcc": ["-O3", *CUDA_ARCH_FLAGS]},
            extra_link_args=[cxx_runtime] if cxx_runtime else [],
        )
    ]


if __name__ == "__main__":
    from torch.utils.cpp_extension import BuildExtension

    setup(
        name="vllm-hisparse-kernels",
        ext_modules=extensions(),
        cmdclass={"build_ext": BuildExtension},
        options={"bdist_wheel": {"py_limited_api": "cp38"}},
    )
