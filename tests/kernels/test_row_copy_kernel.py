# SPDX-License-Identifier: Apache-2.0
"""The resolver's row copy kernel: compiles for sm_90a here; a whole resolution with it
matches the torch reference bit for bit on a GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_build import compile_for_sm90a, hisparse_ops
from resolver_cases import BLOCK, build, servable_cases

from vllm.v1.hisparse.ops import narrow_copy_launches
from vllm.v1.hisparse.resolver import HotState, copy_host_rows, resolve_topk_slots


def test_row_copy_kernel_compiles_for_sm90a(tmp_path):
    compile_for_sm90a("hisparse_row_copy.cu", tmp_path)


@pytest.fixture(scope="module")
def kernel_ops(tmp_path_factory):
    return hisparse_ops(tmp_path_factory.mktemp("jit"))


def test_without_the_extension_a_gpu_resolution_fails_instead_of_reading_wrong_rows():
    from vllm.v1.hisparse.ops import extension_problem

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; this machine has none")
    if extension_problem() is None:
        # scripts/gpu_check.py loads it before the tests run: the case cannot arise here.
        pytest.skip("the extension is loaded in this process; this checks a process without it")
    rows = torch.zeros((4, 2), device="cuda")
    index = torch.zeros(1, dtype=torch.long, device="cuda")
    copy = torch.ones(1, dtype=torch.bool, device="cuda")
    with pytest.raises(RuntimeError, match="needs its compiled kernels"):
        copy_host_rows(rows, index, torch.zeros((4, 2)), index, copy, use_kernel=False)


@pytest.mark.gpu
def test_kernel_copies_exactly_the_masked_rows(kernel_ops):
    g = torch.Generator().manual_seed(3)
    for width, dtype in ((576, torch.bfloat16), (656, torch.uint8), (3, torch.float32)):
        host = (torch.randn(64, width, generator=g) * 50).to(dtype).pin_memory()
        storage = (torch.randn(200, width + 8, generator=g) * 50).to(dtype)
        expected = storage[:, :width].clone()
        device = storage.cuda()[:, :width]  # strided rows, as a block-outermost cache has
        dst = torch.randperm(200, generator=g)[:48]
        src = torch.randint(0, 64, (48,), generator=g)
        copy = torch.rand(48, generator=g) < 0.6
        copy_host_rows(expected, dst, host, src, copy, use_kernel=False)
        before = narrow_copy_launches()
        copy_host_rows(device, dst.cuda(), host, src.cuda(), copy.cuda(), use_kernel=True)
        torch.cuda.synchronize()
        assert torch.equal(device.cpu(), expected)
        # 16-byte words unless the row or the device stride is not a multiple of 16 bytes.
        size = torch.empty((), dtype=dtype).element_size()
        narrow = (width * size) % 16 != 0 or ((width + 8) * size) % 16 != 0
        assert narrow_copy_launches() - before == narrow, (width, dtype)


@pytest.mark.gpu
def test_a_resolution_on_the_gpu_matches_the_reference_bit_for_bit(kernel_ops):
    for seed, shape in servable_cases(40):
        cpu = build(seed, **shape)
        expected = _resolve(cpu, "cpu")
        gpu = build(seed, **shape)
        out = _resolve(gpu, "cuda")
        assert torch.equal(out.cpu(), expected)
        assert torch.equal(gpu.hot.positions.cpu(), cpu.hot.positions)
        assert torch.equal(gpu.hot.stamps.cpu(), cpu.hot.stamps)
        assert torch.equal(gpu.kv_rows.cpu(), cpu.kv_rows)


def _resolve(s, device: str) -> torch.Tensor:
    def on(t):
        return t.to(device)

    hot = HotState(on(s.hot.positions), on(s.hot.stamps))
    kv_rows = on(s.kv_rows)
    host_rows = s.host_rows.pin_memory() if device == "cuda" else s.host_rows
    out, _ = resolve_topk_slots(
        on(s.positions),
        on(s.token_requests),
        on(s.rows),
        on(s.host_page_table),
        BLOCK,
        hot,
        on(s.slot_rows),
        on(s.staging_slots),
        kv_rows,
        host_rows,
        s.step,
        on(s.table_rows),
    )
    s.hot.positions, s.hot.stamps, s.kv_rows = hot.positions, hot.stamps, kv_rows
    return out
