# SPDX-License-Identifier: Apache-2.0
"""The fused plan kernel's algorithm (csrc/hisparse_plan.h, built for the host) decides
exactly what the torch reference, plan_resolution, decides."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_host import fused_plan_on_host
from resolver_cases import BLOCK, Scenario, build

from vllm.v1.hisparse.resolver import (
    ERROR_REQUEST_OUT_OF_BOUNDS,
    HotState,
    apply_resolution,
    fused_plan_shape,
    plan_resolution,
)


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("plan-host")


def both_plans(s: Scenario, build_dir):
    hot_ref = HotState(s.hot.positions.clone(), s.hot.stamps.clone())
    hot_fused = HotState(s.hot.positions.clone(), s.hot.stamps.clone())
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
    fused = fused_plan_on_host(
        build_dir,
        s.positions,
        s.token_requests,
        s.host_page_table,
        BLOCK,
        hot_fused,
        s.staging_slots,
        s.step,
        s.table_rows,
    )
    return ref, hot_ref, fused, hot_fused


def loads(plan) -> list[tuple[int, int, int]]:
    chosen = plan.load
    return sorted(
        zip(
            plan.load_request[chosen].tolist(),
            plan.load_slot[chosen].tolist(),
            plan.load_host_row[chosen].tolist(),
            strict=True,
        )
    )


@settings(max_examples=250, deadline=None)
@given(
    seed=st.integers(0, 2**20),
    num_reqs=st.integers(1, 4),
    pages=st.integers(1, 6),
    hot_slots=st.integers(1, 12),
    tokens=st.integers(1, 6),
    topk=st.integers(1, 7),
    resident_p=st.sampled_from([0.0, 0.5, 0.9]),
    hot_fill=st.integers(0, 12),
    staging=st.integers(0, 8),
)
def test_the_fused_plan_decides_what_the_reference_decides(
    build_dir, seed, num_reqs, pages, hot_slots, tokens, topk, resident_p, hot_fill, staging
):
    s = build(seed, num_reqs, pages, hot_slots, tokens, topk, resident_p, hot_fill, staging)
    if not len(s.table_rows):
        return
    ref, hot_ref, fused, hot_fused = both_plans(s, build_dir)
    for field in ("on_host", "entry_request", "entry_slot", "counts", "error", "request_error"):
        assert torch.equal(getattr(fused, field), getattr(ref, field)), field
    assert torch.equal(hot_fused.positions, hot_ref.positions)
    assert torch.equal(hot_fused.stamps, hot_ref.stamps)
    assert loads(fused) == loads(ref)
    # Replayed, both plans read the same rows and leave the same cache.
    kv_ref, kv_fused = s.kv_rows.clone(), s.kv_rows.clone()
    out_ref = apply_resolution(ref, s.rows, s.slot_rows, kv_ref, s.host_rows)
    out_fused = apply_resolution(fused, s.rows, s.slot_rows, kv_fused, s.host_rows)
    assert torch.equal(out_fused, out_ref) and torch.equal(kv_fused, kv_ref)


def test_a_request_row_outside_the_page_table_is_flagged_and_read_as_resident(build_dir):
    s = build(7, num_reqs=2, pages=3, hot_slots=4, tokens=2, topk=3, resident_p=0.0, hot_fill=2)
    bad = replace(s, table_rows=s.table_rows + s.host_page_table.shape[0])
    ref, _, fused, _ = both_plans(bad, build_dir)
    assert int(ref.error) & ERROR_REQUEST_OUT_OF_BOUNDS
    assert int(fused.error) & ERROR_REQUEST_OUT_OF_BOUNDS


def test_a_token_request_outside_the_hot_state_is_flagged_by_both_plans(build_dir):
    # No request row plans such a token, so both read it as resident; both flag it too.
    s = build(7, num_reqs=2, pages=3, hot_slots=4, tokens=2, topk=3, resident_p=0.0, hot_fill=2)
    for stray in (-2, len(s.table_rows)):
        token_requests = s.token_requests.clone()
        token_requests[0] = stray
        ref, _, fused, _ = both_plans(replace(s, token_requests=token_requests), build_dir)
        assert int(ref.error) & ERROR_REQUEST_OUT_OF_BOUNDS, stray
        assert int(fused.error) & ERROR_REQUEST_OUT_OF_BOUNDS, stray
        assert torch.equal(fused.on_host, ref.on_host) and not fused.on_host[0].any()


def test_production_sized_steps_fit_the_fused_plan_and_prefill_chunks_do_not():
    assert fused_plan_shape(1, 2048, 4096) == (2048, 4096)
    assert fused_plan_shape(4, 2048, 8192) == (8192, 8192), "decode with 3 MTP drafts"
    assert fused_plan_shape(3, 2048, 6144) == (8192, 8192)
    assert fused_plan_shape(5, 2048, 4096) is None
    assert fused_plan_shape(1, 2048, 8193) is None
    assert fused_plan_shape(8192, 2048, 4096) is None, "an 8K-token prefill chunk"


@pytest.mark.parametrize("seed", [38, 55])
def test_the_gpu_checks_token_bound_holds_for_cases_whose_host_page_requests_have_no_tokens(seed):
    """The GPU checks give the fused plan the most tokens any request has in the step, as
    the worker does (at least 1). The case builder makes steps in which the requests with
    host pages have no tokens (seeds 38 and 55 of tests/kernels/test_plan_kernel.py); the
    bound must come out as the worker's default, not raise on an empty count."""
    from types import SimpleNamespace

    from kernel_checks import most_tokens

    s = build(seed, num_reqs=1 + seed % 4, pages=1 + seed % 6, hot_slots=1 + seed % 12,
              tokens=1 + seed % 6, topk=1 + seed % 7, resident_p=(0.0, 0.5, 0.9)[seed % 3],
              hot_fill=seed % 12, staging=seed % 8)  # fmt: skip
    valid = s.token_requests[s.token_requests >= 0]
    expected = int(torch.bincount(valid).max()) if valid.numel() else 1
    assert most_tokens(SimpleNamespace(token_requests=s.token_requests)) == expected
    assert most_tokens(SimpleNamespace(token_requests=torch.tensor([-1, -1]))) == 1
    assert most_tokens(SimpleNamespace(token_requests=torch.tensor([0, 2, 2, -1]))) == 2
