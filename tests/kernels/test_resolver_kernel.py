"""The CUDA resolver kernel: compiles for sm_90a here; matches the torch reference bit for bit on a GPU."""

from __future__ import annotations

import pytest
import torch
from cuda_build import compile_for_sm90a, hisparse_ops
from resolver_cases import BLOCK, build

from vllm.v1.hisparse.resolver import HotState, resolve_topk_slots


def test_resolver_kernel_compiles_for_sm90a(tmp_path):
    compile_for_sm90a("hisparse_resolver.cu", tmp_path)


@pytest.fixture(scope="module")
def kernel_ops(tmp_path_factory):
    return hisparse_ops(tmp_path_factory.mktemp("jit"))


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
