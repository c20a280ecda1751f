# SPDX-License-Identifier: Apache-2.0
"""Building csrc/ into `vllm/_hisparse_C.abi3.so` on any Linux machine with nvcc.

Owns what the CUDA wheel needs to compile the extension, GPU or not:
- the CUDA toolkit: `CUDA_HOME` when it names one, else the toolkit of the
  `nvcc` on PATH, found by asking nvcc where it really lives (an `nvcc` on PATH
  may be a wrapper script elsewhere);
- a cached build environment, `.cache/cuda-build-env`, holding the CUDA build of
  the torch the upstream CUDA wheel pins (read from that wheel's metadata, so
  the pin stays in one place), created by the build itself from the package
  index and reused while the version matches;
- compiling with `setup.py` for every architecture in `CUDA_ARCHS`, linked to the
  shared C++ runtime torch loads (never a private copy of it), stripping debug
  information, and checking the glibc the library needs against the platform
  tag the wheel will carry.

It fails with a message saying what is missing; it never returns a build
without the extension. It never touches .venv or an installed vLLM.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILD_ENV = REPO / ".cache" / "cuda-build-env"
BUILD_ENV_STAMP = BUILD_ENV / ".hisparse-build-env"
EXTENSION = "vllm/_hisparse_C.abi3.so"


class CudaBuildError(RuntimeError):
    """The CUDA extension cannot be built here; the message says what is missing."""


def find_cuda_home() -> Path:
    """The CUDA toolkit to build with: `CUDA_HOME` if set, else the toolkit of nvcc on PATH."""
    configured = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if configured:
        home = Path(configured)
        if not (home / "bin" / "nvcc").is_file():
            raise CudaBuildError(f"CUDA_HOME={configured} has no bin/nvcc; point it at a CUDA toolkit")
        return home
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise CudaBuildError(
            "the CUDA wheel needs nvcc to build its extension (vllm/_hisparse_C) and none is on "
            "PATH; install a CUDA toolkit or set CUDA_HOME"
        )
    # nvcc on PATH may be a wrapper; its dry run names the directory the real one runs from.
    probe = subprocess.run(
        [nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
        capture_output=True,
        text=True,
        check=False,
    )
    match = re.search(r"^#\$ _HERE_=(.+)$", probe.stdout + probe.stderr, flags=re.M)
    home = Path(match[1]).parent if match else Path(nvcc).resolve().parent.parent
    if not (home / "include" / "cuda_runtime_api.h").is_file():
        raise CudaBuildError(
            f"found nvcc at {nvcc} but no CUDA headers under {home}; set CUDA_HOME to the toolkit"
        )
    return home


def upstream_torch_requirement(upstream_wheel: Path) -> str:
    """The `torch==X` the upstream CUDA wheel requires (its METADATA is the pin)."""
    with zipfile.ZipFile(upstream_wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(name).decode()
    match = re.search(r"^Requires-Dist: torch\s*==\s*([0-9][^\s;,]*)", metadata, flags=re.M)
    if match is None:
        raise CudaBuildError(f"{upstream_wheel.name} does not pin torch; cannot choose the build torch")
    return f"torch=={match[1]}"


def ensure_build_env(torch_requirement: str) -> Path:
    """The cached build environment's python, created or refreshed for `torch_requirement`."""
    python = BUILD_ENV / "bin" / "python"
    if python.is_file() and BUILD_ENV_STAMP.is_file() and BUILD_ENV_STAMP.read_text() == torch_requirement:
        return python
    print(
        f"cuda build env: creating {BUILD_ENV} with the CUDA build of {torch_requirement} "
        "(about 3 GB from the package index, once)",
        flush=True,
    )
    shutil.rmtree(BUILD_ENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(BUILD_ENV)], check=True)
    # The machine's pip configuration may point at a CPU torch; the CUDA build comes from the index.
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": ""}
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", torch_requirement, "setuptools", "wheel", "ninja"],
        env=env,
        check=False,
    )
    cuda = subprocess.run(
        [str(python), "-c", "import torch; print(torch.version.cuda or '')"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0 or not cuda.stdout.strip():
        raise CudaBuildError(
            f"could not install the CUDA build of {torch_requirement} into {BUILD_ENV}; check that "
            "the package index is reachable"
        )
    BUILD_ENV_STAMP.write_text(torch_requirement)
    return python


def required_glibc(library: Path) -> tuple[int, int]:
    """The newest GLIBC_x.y symbol version a shared library needs."""
    dump = subprocess.run(["objdump", "-T", str(library)], capture_output=True, text=True, check=True)
    versions = [tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_(\d+\.\d+)", dump.stdout)]
    return max(versions, default=(2, 17))[:2]  # type: ignore[return-value]


# setup.py links this C++ runtime, when set, after the objects (see compile_extension).
CXX_RUNTIME_ENV = "HISPARSE_CXX_RUNTIME"
CXX_RUNTIME = "libstdc++.so.6"


def needed_libraries(library: Path) -> list[str]:
    """The shared libraries a shared object names as NEEDED (its dynamic section)."""
    dump = subprocess.run(["objdump", "-p", str(library)], capture_output=True, text=True, check=True)
    return re.findall(r"^\s*NEEDED\s+(\S+)", dump.stdout, flags=re.M)


def loaded_cxx_runtime(interpreter: str) -> Path | None:
    """The C++ runtime (libstdc++.so.6) `interpreter` has mapped once torch is imported:
    the one the extension shares at run time."""
    probe = subprocess.run(
        [
            interpreter,
            "-c",
            "import torch\n"
            "for line in open('/proc/self/maps'):\n"
            f"    if line.rstrip().endswith('/{CXX_RUNTIME}') or '/{CXX_RUNTIME}.' in line:\n"
            "        print(line.split()[-1]); break",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    found = probe.stdout.strip()
    return Path(found) if probe.returncode == 0 and found else None


def compile_extension(interpreter: str, build_lib: Path, build_temp: Path) -> Path:
    """`setup.py build_ext` with `interpreter` and the toolkit `find_cuda_home` finds; the
    library, which links the shared C++ runtime.

    Some toolchains (a compiler whose specs carry -static-libstdc++, or that has only
    libstdc++.a) would put a private copy of the C++ runtime into the library. torch has
    its own, and the private copy's stream machinery is never initialised in a library
    loaded this way: the first formatted message (a warning, a failed check) crashes the
    process. When the first link comes out so, the library is linked again with the
    runtime torch itself loads named after the objects, which the linker then prefers."""
    cuda_home = find_cuda_home()
    env = {
        **os.environ,
        "CUDA_HOME": str(cuda_home),
        "PATH": f"{cuda_home / 'bin'}{os.pathsep}{os.environ['PATH']}",
    }

    def run(extra_env: dict[str, str], force: bool) -> Path:
        done = subprocess.run(
            [
                interpreter,
                str(REPO / "setup.py"),
                "build_ext",
                "--build-lib",
                str(build_lib),
                "--build-temp",
                str(build_temp),
                *(["--force"] if force else []),
            ],
            cwd=REPO,
            env={**env, **extra_env},
            check=False,
        )
        library = build_lib / EXTENSION
        if done.returncode != 0 or not library.is_file():
            raise CudaBuildError(f"compiling csrc/ failed (setup.py build_ext exited {done.returncode})")
        return library

    library = run({}, force=False)
    if CXX_RUNTIME in needed_libraries(library):
        return library
    runtime = loaded_cxx_runtime(interpreter)
    compiler = env.get("CXX") or "c++"
    if runtime is None:
        raise CudaBuildError(
            f"the extension was linked with a private copy of the C++ runtime ({compiler} links "
            f"libstdc++ statically) and torch's own {CXX_RUNTIME} could not be found to link "
            "instead; set CXX and CC to a compiler that links libstdc++ as a shared library"
        )
    print(
        f"extension: {compiler} linked libstdc++ statically; linking {runtime} (torch's own) instead",
        flush=True,
    )
    library = run({CXX_RUNTIME_ENV: str(runtime)}, force=True)
    if CXX_RUNTIME not in needed_libraries(library):
        raise CudaBuildError(
            f"the extension still carries a private copy of the C++ runtime after linking {runtime}; "
            f"set CXX and CC to a compiler that links libstdc++ as a shared library (now {compiler})"
        )
    return library


def build_extension(
    torch_requirement: str, workdir: Path, glibc_limit: tuple[int, int], python: str | None = None
) -> dict[str, bytes]:
    """Compile csrc/ into {wheel path: bytes}; raises CudaBuildError when it cannot."""
    sources = sorted((REPO / "csrc").glob("*.cu")) + sorted((REPO / "csrc").glob("*.cpp"))
    if not sources:
        raise CudaBuildError("csrc/ holds no kernel sources")
    cuda_home = find_cuda_home()
    interpreter = python or str(ensure_build_env(torch_requirement))
    print(f"extension: compiling csrc/ with {cuda_home / 'bin' / 'nvcc'} and {interpreter}", flush=True)
    library = compile_extension(interpreter, workdir / "build-lib", workdir / "build-temp")
    subprocess.run(["strip", "--strip-debug", str(library)], check=True)
    needs = required_glibc(library)
    if needs > glibc_limit:
        raise CudaBuildError(
            f"{EXTENSION} needs glibc {needs[0]}.{needs[1]} but the wheel is tagged for "
            f"{glibc_limit[0]}.{glibc_limit[1]}; build on an older system or raise cuda_platform "
            "in upstream.toml"
        )
    print(f"extension: {EXTENSION}, {library.stat().st_size} bytes, needs glibc {needs[0]}.{needs[1]}")
    return {EXTENSION: library.read_bytes()}
