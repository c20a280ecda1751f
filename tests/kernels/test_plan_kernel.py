# SPDX-License-Identifier: Apache-2.0
"""The fused resolution plan kernel: compiles for sm_90a here; on a GPU it decides exactly
what the torch reference decides (its algorithm is also held to the reference on the CPU,
built for the host: tests/unit/test_fused_plan.py)."""

from __future__ import annotations

import pytest
import torch
from kernel_build import compile_for_sm90a, hisparse_ops
from kernel_checks import loads, most_tokens
from resolver_cases import BLOCK, build

from vllm.v1.hisparse.resolver import HotState, plan_resolution


def test_plan_kernel_compiles_for_sm90a(tmp_path):
    compile_for_sm90a("hisparse_plan.cu", tmp_path)


@pytest.fixture(scope="module")
def kernel_ops(tmp_path_factory):
    return hisparse_ops(tmp_path_factory.mktemp("jit"))


@pytest.mark.gpu
def test_the_fused_kernel_on_a_gpu_decides_what_the_reference_decides(kernel_ops):
    import tempfile
    from pathlib import Path

    from kernel_build import hisparse_ops

    hisparse_ops(Path(tempfile.mkdtemp()))
    for seed in range(60):
        s = build(
            seed,
            num_reqs=1 + seed % 4,
            pages=1 + seed % 6,
            hot_slots=1 + seed % 12,
            tokens=1 + seed % 6,
            topk=1 + seed % 7,
            resident_p=(0.0, 0.5, 0.9)[seed % 3],
            hot_fill=seed % 12,
            staging=seed % 8,
        )
        if not len(s.table_rows):
            continue
        hot_ref = HotState(s.hot.positions.clone(), s.hot.stamps.clone())
        ref = plan_resolution(
            s.positions,
            s.token_requests,
            s.host_page_table,
            BLOCK,
            hot_ref,
            s.staging_slots,
            s.step,
            s.table_rows,
        )
        hot = HotState(s.hot.positions.cuda(), s.hot.stamps.cuda())
        fused = plan_resolution(
            s.positions.cuda(),
            s.token_requests.cuda(),
            s.host_page_table.cuda(),
            BLOCK,
            hot,
            s.staging_slots.cuda(),
            s.step,
            s.table_rows.cuda(),
            max_tokens_per_request=most_tokens(s),
        )
        assert fused.error.is_cuda
        for field in ("on_host", "entry_request", "entry_slot", "counts", "error"):
            assert torch.equal(getattr(fused, field).cpu(), getattr(ref, field)), (seed, field)
        assert torch.equal(hot.positions.cpu(), hot_ref.positions)
        assert torch.equal(hot.stamps.cpu(), hot_ref.stamps)
        assert loads(fused) == loads(ref)
