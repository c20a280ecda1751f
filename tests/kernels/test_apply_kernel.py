# SPDX-License-Identifier: Apache-2.0
"""The resolver's fused replay kernel (csrc/hisparse_apply.cu): compiles for sm_90a here; on
a GPU it resolves rows and copies misses exactly as the torch reference does, in one launch."""

from __future__ import annotations

import pytest
import torch
from kernel_build import compile_for_sm90a, hisparse_ops
from resolver_cases import BLOCK, build, servable_cases

from vllm.v1.hisparse.resolver import (
    ERROR_ROW_OUT_OF_BOUNDS,
    HotState,
    ResolutionPlan,
    apply_resolution,
    plan_resolution,
)


def test_apply_kernel_compiles_for_sm90a(tmp_path):
    compile_for_sm90a("hisparse_apply.cu", tmp_path)


@pytest.fixture(scope="module")
def kernel_ops(tmp_path_factory):
    return hisparse_ops(tmp_path_factory.mktemp("jit"))


def on_gpu(plan: ResolutionPlan) -> ResolutionPlan:
    return ResolutionPlan(**{name: value.cuda() for name, value in vars(plan).items()})


@pytest.mark.gpu
def test_the_fused_replay_matches_the_reference_rows_and_copies(kernel_ops):
    checked = 0
    for seed, shape in servable_cases(40):
        s = build(seed, **shape)
        hot = HotState(s.hot.positions.clone(), s.hot.stamps.clone())
        plan = plan_resolution(
            s.positions,
            s.token_requests,
            s.host_page_table,
            BLOCK,
            hot,
            s.staging_slots,
            s.step,
            s.table_rows,
        )
        for dtype in (torch.int32, torch.int64):
            rows = s.rows.to(dtype)
            kv_expected = s.kv_rows.clone()
            expected = apply_resolution(plan, rows, s.slot_rows, kv_expected, s.host_rows, use_kernel=False)
            gpu_plan = on_gpu(plan)
            kv = s.kv_rows.cuda()
            out = apply_resolution(
                gpu_plan, rows.cuda(), s.slot_rows.cuda(), kv, s.host_rows.pin_memory(), use_kernel=True
            )
            torch.cuda.synchronize()
            assert out.dtype == dtype and torch.equal(out.cpu(), expected), seed
            assert torch.equal(kv.cpu(), kv_expected), seed
            assert int(gpu_plan.error) == 0, seed
        checked += 1
    assert checked >= 10


@pytest.mark.gpu
def test_the_fused_replay_flags_a_slot_out_of_bounds_and_copies_nothing_for_it(kernel_ops):
    """One token selecting two host rows: the first resolves and copies as planned; the
    second names a slot past the request's [H + S) and is flagged, resolving to row 0."""
    slot_rows = torch.tensor([[10, 11]])  # one request, two slots (rows of kv)
    plan = ResolutionPlan(
        on_host=torch.tensor([[True, True]]),
        entry_request=torch.tensor([[0, 0]]),
        entry_slot=torch.tensor([[1, 5]]),
        load=torch.tensor([True, True]),
        load_request=torch.tensor([0, 0]),
        load_slot=torch.tensor([1, 7]),
        load_host_row=torch.tensor([2, 3]),
        counts=torch.zeros(3, dtype=torch.int64),
        error=torch.zeros((), dtype=torch.int64),
        request_error=torch.zeros(1, dtype=torch.int64),
    )
    host = (torch.arange(4 * 656) % 251).to(torch.uint8).reshape(4, 656).pin_memory()
    kv = torch.zeros(16, 656, dtype=torch.uint8, device="cuda")
    gpu_plan = on_gpu(plan)
    out = apply_resolution(
        gpu_plan,
        torch.tensor([[3, 4]], dtype=torch.int32).cuda(),
        slot_rows.cuda(),
        kv,
        host,
        use_kernel=True,
    )
    torch.cuda.synchronize()
    assert int(gpu_plan.error) == ERROR_ROW_OUT_OF_BOUNDS
    assert out.cpu().tolist() == [[11, 0]]
    assert torch.equal(kv[11].cpu(), host[2])
    assert int(kv.count_nonzero(dim=1).gt(0).sum()) == 1, "only the planned row is written"
