# SPDX-License-Identifier: Apache-2.0
"""The CUDA wheel carries its compiled kernels: built with `make wheel FLAVOUR=cuda`'s own
script wherever nvcc exists (GPU or not), then loaded in the CUDA-torch build environment.

Needs nvcc; the first run creates the cached build environment (.cache/cuda-build-env,
the CUDA build of the torch the upstream wheel pins) from the package index.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import build_wheel
import cuda_build
import pytest

REPO = Path(__file__).resolve().parents[2]
EXTENSION = "vllm/_hisparse_C.abi3.so"

pytestmark = [
    pytest.mark.slow_test,
    pytest.mark.skipif(
        shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"),
        reason="needs nvcc (a CUDA toolkit) to build the CUDA wheel's extension",
    ),
]


@pytest.fixture(scope="module")
def cuda_wheel(tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "build_wheel.py"), "--flavour", "cuda", "--dist", str(dist)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    wheels = list(dist.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def extracted(cuda_wheel, tmp_path_factory) -> Path:
    """The extension and its loader, out of the wheel, in a tree without vLLM."""
    root = tmp_path_factory.mktemp("wheel-tree")
    with zipfile.ZipFile(cuda_wheel) as zf:
        for name in (
            EXTENSION,
            "vllm/v1/hisparse/ops.py",
            "vllm/v1/hisparse/__init__.py",
            "vllm/v1/hisparse/host_memory.py",
        ):
            zf.extract(name, root)
    return root


@pytest.fixture(scope="module")
def probe(extracted) -> dict:
    done = subprocess.run(
        [
            str(cuda_build.BUILD_ENV / "bin" / "python"),
            str(REPO / "tests" / "support" / "extension_probe.py"),
            str(extracted),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_wheel_is_named_and_tagged_for_the_glibc_its_extension_needs(cuda_wheel, extracted, pin):
    assert cuda_wheel.name == pin.wheel_name("cuda")
    with zipfile.ZipFile(cuda_wheel) as zf:
        wheel_file = next(n for n in zf.namelist() if n.endswith(".dist-info/WHEEL"))
        tags = [
            line.split(": ", 1)[1]
            for line in zf.read(wheel_file).decode().splitlines()
            if line.startswith("Tag: ")
        ]
    assert tags == [pin.wheel_tag("cuda")]
    assert cuda_build.required_glibc(extracted / EXTENSION) <= pin.glibc("cuda")


def test_the_extension_is_in_the_wheel_and_its_record(cuda_wheel):
    with zipfile.ZipFile(cuda_wheel) as zf:
        data = zf.read(EXTENSION)
        record_name = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        record = {row.split(",")[0]: row.split(",")[1:] for row in zf.read(record_name).decode().splitlines()}
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    assert record[EXTENSION] == [f"sha256={digest}", str(len(data))]
    assert build_wheel.verify_record(cuda_wheel) > 2000


def test_the_extension_is_stripped_and_built_for_hopper_and_blackwell(extracted):
    library = extracted / EXTENSION
    sections = subprocess.run(
        ["objdump", "-h", str(library)], capture_output=True, text=True, check=True
    ).stdout
    assert ".debug_info" not in sections
    # Each embedded cubin records the architecture it was assembled for.
    data = library.read_bytes()
    assert b"-arch sm_90a " in data and b"-arch sm_100a " in data


def test_it_loads_and_registers_the_ops_with_their_schemas(probe):
    assert probe["problem"] is None
    assert probe["torch_cuda"]
    # The op without tensor arguments answers without a device (no copy has run).
    assert probe["narrow_copy_launches"] == 0
    assert probe["schemas"] == {
        "apply_resolution": "_hisparse_C::apply_resolution(Tensor rows, Tensor on_host, "
        "Tensor entry_request, Tensor entry_slot, Tensor slot_rows, Tensor(a!) kv_rows, "
        "Tensor copy_rows, Tensor host_rows, "
        "Tensor load, Tensor load_request, Tensor load_slot, Tensor load_host_row, Tensor(b!) error, "
        "int block_stride_rows, int block_rows) -> Tensor",
        "copy_host_rows": "_hisparse_C::copy_host_rows(Tensor(a!) kv_rows, Tensor dst_rows, "
        "Tensor host_rows, Tensor src_rows, Tensor copy, Tensor(b!) error, int block_stride_rows, "
        "int block_rows) -> ()",
        "copy_pages": "_hisparse_C::copy_pages(Tensor(a!)[] kv_caches, Tensor(b!) host_pool, "
        "Tensor block_ids, Tensor host_pages, bool to_host, Tensor(c!) error) -> ()",
        "plan_resolution": "_hisparse_C::plan_resolution(Tensor positions, Tensor token_requests, "
        "Tensor host_page_table, Tensor table_rows, Tensor staging_slots, Tensor(a!) hot_positions, "
        "Tensor(b!) hot_stamps, int block_size, int step, int max_entries, int hot_pad, Tensor(c!) flags, "
        "Tensor(d!) ints) -> ()",
    }


def test_cpu_tensors_get_an_error_naming_the_reference_to_call(probe):
    assert probe["cpu_errors"] == {
        "apply_resolution": "RuntimeError: _hisparse_C::apply_resolution is the CUDA kernel and needs CUDA "
        "tensors; for CPU tensors call the torch reference, vllm.v1.hisparse.resolver.apply_resolution",
        "copy_host_rows": "RuntimeError: _hisparse_C::copy_host_rows is the CUDA kernel and needs CUDA "
        "tensors; for CPU tensors call the torch reference, vllm.v1.hisparse.resolver.copy_host_rows",
        "copy_pages": "RuntimeError: _hisparse_C::copy_pages is the CUDA kernel and needs CUDA "
        "tensors; for CPU tensors call the torch reference, vllm.v1.hisparse.page_copy.copy_pages",
        "plan_resolution": "RuntimeError: _hisparse_C::plan_resolution is the CUDA kernel and needs CUDA "
        "tensors; for CPU tensors call the torch reference, vllm.v1.hisparse.resolver.plan_resolution",
    }


def test_the_meta_implementations_check_shapes_and_pass_opcheck(probe):
    assert (
        probe["meta_shape_errors"]["apply_resolution"]
        == "RuntimeError: load must be a contiguous bool [12] tensor"
    )
    assert probe["meta_shape_errors"]["copy_host_rows"] == (
        "RuntimeError: kv_rows rows are 656 bytes, host_rows rows 600"
    )
    assert probe["meta_shape_errors"]["copy_host_rows_block_rows"] == (
        "RuntimeError: block_rows must be positive and at most block_stride_rows, got 33 and 32"
    )
    copy_pages_error = probe["meta_shape_errors"]["copy_pages"]
    assert copy_pages_error.startswith("RuntimeError: block_ids must be a contiguous int64")
    assert probe["meta_shape_errors"]["plan_resolution"].startswith(
        "RuntimeError: max_entries must be a power of two in [top-K, 8192], got 12"
    )
    assert probe["meta_shape_errors"]["plan_resolution_topk_0"].startswith(
        "RuntimeError: positions must select at least one row per token (top-K > 0)"
    )
    for op, results in probe["opcheck"].items():
        assert results and set(results.values()) == {"SUCCESS"}, (op, results)


def test_the_host_pool_maps_where_vllm_is_not_installed(probe):
    # gpu_check registers the production pool on bare GPU machines: host_memory's logging
    # falls back to the standard library's there.
    assert probe["host_pool_without_vllm"] == [1, 2, 64, 16]


def test_gpu_check_builds_and_loads_the_extension_without_a_gpu(cuda_wheel, tmp_path):
    """scripts/gpu_check.py's own build, the first step of every GPU run, works here, also
    with a compiler that would link a private copy of the C++ runtime (as a GPU machine's
    did: there the first warning the library formatted crashed the process).

    Stand-in compilers add -static-libstdc++; the build must link torch's own libstdc++
    instead, and the library it loads must format numbers into its messages."""
    compilers = {name: shutil.which(name) for name in ("gcc", "g++")}
    if None in compilers.values():
        pytest.skip("needs gcc and g++ to stand behind the static-linking compilers")
    wrappers = tmp_path / "bin"
    wrappers.mkdir()
    for name, real in compilers.items():
        (wrappers / name).write_text(f'#!/bin/sh\nexec "{real}" "$@" -static-libstdc++\n')
        (wrappers / name).chmod(0o755)
    python = str(cuda_build.BUILD_ENV / "bin" / "python")
    done = subprocess.run(
        [python, str(REPO / "scripts" / "gpu_check.py"), "--build-only"],
        cwd=REPO,
        env={**os.environ, "CC": str(wrappers / "gcc"), "CXX": str(wrappers / "g++")},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "linked libstdc++ statically; linking" in done.stdout
    assert "built and loaded the extension" in done.stdout
    library = done.stdout.strip().splitlines()[-1].rsplit(": ", 1)[1]
    assert cuda_build.CXX_RUNTIME in cuda_build.needed_libraries(Path(library))
    # Loaded on its own, the library formats the sizes into a refusal's message.
    probe = subprocess.run(
        [
            python,
            "-c",
            "import sys, torch\n"
            "torch.ops.load_library(sys.argv[1])\n"
            "m = lambda *s, d=torch.long: torch.empty(*s, dtype=d, device='meta')\n"
            "try:\n"
            "    torch.ops._hisparse_C.copy_host_rows(m(4, d=torch.uint8), m(2), m(4, 16, d=torch.uint8),"
            " m(2), m(2, d=torch.bool), m(1), 1, 1)\n"
            "except RuntimeError as e:\n"
            "    print(str(e).splitlines()[0])\n",
            library,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip().endswith("with contiguous columns, got [4]"), probe.stdout


def test_a_library_with_a_private_cxx_runtime_is_told_apart(tmp_path):
    """What the build checks: whether a library names the shared libstdc++ or carries its own."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("needs g++")
    source = tmp_path / "one.cpp"
    source.write_text(
        "#include <sstream>\n#include <string>\n"
        "std::string f(long x) { std::ostringstream s; s << x; return s.str(); }\n"
    )
    for flags, shared in (([], True), (["-static-libstdc++"], False)):
        library = tmp_path / f"lib{len(flags)}.so"
        subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(library), *flags], check=True)
        assert (cuda_build.CXX_RUNTIME in cuda_build.needed_libraries(library)) is shared, flags
