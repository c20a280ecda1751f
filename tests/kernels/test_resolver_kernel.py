"""The CUDA resolver kernel: compiles for sm_90a here; matches the torch reference bit for bit on a GPU."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from resolver_cases import BLOCK, build

from vllm.v1.hisparse.resolver import HotState, resolve_topk_slots

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"
SM90A = "-gencode=arch=compute_90a,code=sm_90a"


def test_resolver_kernel_compiles_for_sm90a(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed on this machine")
    done = subprocess.run(
        [
            nvcc,
            "-std=c++17",
            "-O3",
            SM90A,
            f"-I{CSRC}",
            "-c",
            str(CSRC / "hisparse_resolver.cu"),
            "-o",
            str(tmp_path / "resolver.o"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "resolver.o").stat().st_size > 0


@pytest.fixture(scope="module")
def kernel_ops(tmp_path_factory):
    """The compiled op: from the installed wheel if it carries it, else built just in time."""
    from vllm.v1.hisparse.resolver import cuda_kernel_available

    if not cuda_kernel_available():
        from torch.utils.cpp_extension import load

        load(
            name="hisparse_resolver_jit",
            sources=[str(CSRC / "hisparse_resolver.cu"), str(CSRC / "hisparse_ops.cpp")],
            extra_include_paths=[str(CSRC)],
            extra_cuda_cflags=["-O3", SM90A],
            build_directory=str(tmp_path_factory.mktemp("jit")),
            is_python_module=False,
        )
    return torch.ops._hisparse_C


@pytest.mark.gpu
def test_kernel_matches_the_reference_bit_for_bit(kernel_ops):
    for seed in range(40):
        _check_one_case(kernel_ops, seed)


def _check_one_case(kernel_ops, seed):
    shape = dict(
        num_reqs=1 + seed % 3,
        pages=1 + seed % 5,
        hot_slots=4 + seed % 9,
        tokens=1 + seed % 4,
        topk=1 + seed % 6,
        resident_p=(0.0, 0.5, 1.0)[seed % 3],
        hot_fill=seed % 7,
    )
    cpu = build(seed, **shape)
    gpu = build(seed, **shape)
    try:
        expected = resolve_topk_slots(  # CPU tensors: the torch reference
            cpu.positions,
            cpu.req_ids,
            cpu.page_table,
            BLOCK,
            cpu.kv_rows,
            cpu.host_rows,
            cpu.host_page_table,
            cpu.hot,
            cpu.step,
            cpu.stride,
        )
    except Exception as e:  # the kernel must refuse the same inputs
        with pytest.raises(RuntimeError):
            kernel_ops.resolve_topk_slots(*_cuda_args(gpu))
        assert type(e).__name__ in ("HotBufferTooSmall", "ValueError")
        return
    args = _cuda_args(gpu)
    out = kernel_ops.resolve_topk_slots(*args)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), expected)
    kv_rows, hot = args[3], HotState(args[6], args[7], args[8])
    assert torch.equal(hot.positions.cpu(), cpu.hot.positions)
    assert torch.equal(hot.stamps.cpu(), cpu.hot.stamps)
    assert torch.equal(kv_rows.cpu(), cpu.kv_rows)


def _cuda_args(s):
    cuda = torch.device("cuda")
    return (
        s.positions.to(cuda),
        s.req_ids.to(cuda),
        s.page_table.to(cuda),
        s.kv_rows.to(cuda),
        s.host_rows.pin_memory(),
        s.host_page_table.to(cuda),
        s.hot.rows.to(cuda),
        s.hot.positions.to(cuda),
        s.hot.stamps.to(cuda),
        BLOCK,
        s.stride,
        s.step,
    )
