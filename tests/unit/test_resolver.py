# SPDX-License-Identifier: Apache-2.0
"""The HiSparse resolver reference against a brute-force model of its contract."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from resolver_cases import BLOCK, Scenario, StagingOverflow, brute_force, build

from vllm.v1.hisparse.resolver import (
    ERROR_STAGING_OVERFLOW,
    HotState,
    ResolverError,
    apply_resolution,
    copy_host_rows,
    host_entries,
    partition_passes,
    plan_passes,
    plan_resolution,
    resolve_topk_slots,
)


def resolve(s: Scenario) -> torch.Tensor:
    rows, _ = resolve_topk_slots(
        s.positions,
        s.token_requests,
        s.rows,
        s.host_page_table,
        BLOCK,
        s.hot,
        s.slot_rows,
        s.staging_slots,
        s.kv_rows,
        s.host_rows,
        s.step,
        s.table_rows,
    )
    return rows


def copy_of(s: Scenario) -> Scenario:
    return replace(
        s,
        kv_rows=s.kv_rows.clone(),
        hot=HotState(s.hot.positions.clone(), s.hot.stamps.clone()),
    )


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**20),
    num_reqs=st.integers(1, 3),
    pages=st.integers(1, 5),
    hot_slots=st.integers(1, 12),
    tokens=st.integers(1, 5),
    topk=st.integers(1, 6),
    resident_p=st.sampled_from([0.0, 0.5, 0.9]),
    hot_fill=st.integers(0, 12),
    staging=st.integers(0, 8),
)
def test_reference_matches_the_contract_and_reads_the_true_rows(
    seed, num_reqs, pages, hot_slots, tokens, topk, resident_p, hot_fill, staging
):
    s = build(seed, num_reqs, pages, hot_slots, tokens, topk, resident_p, hot_fill, staging)
    if not len(s.table_rows):
        return  # every page resident: the backend's own conversion stands, nothing to resolve
    try:
        expected, held, stamps = brute_force(copy_of(s))
    except StagingOverflow:
        with pytest.raises(ResolverError, match="staging rows the scheduler leased"):
            resolve(s)
        return
    out = resolve(s)
    assert out.tolist() == expected
    assert s.hot.positions.tolist() == held and s.hot.stamps.tolist() == stamps
    for t in range(out.shape[0]):
        r = s.batch_request[t]
        for k in range(out.shape[1]):
            p = int(s.positions[t, k])
            if p >= 0:
                assert torch.equal(s.kv_rows[out[t, k]], s.truth[(r, p)]), "attention reads the true row"


def one_request(seed: int, hot_slots: int, staging: int = 0) -> Scenario:
    s = build(
        seed,
        num_reqs=1,
        pages=3,
        hot_slots=hot_slots,
        tokens=1,
        topk=1,
        resident_p=0.0,
        hot_fill=0,
        staging=staging,
    )
    assert len(s.table_rows) == 1
    return s


def with_selection(s: Scenario, selection: list[list[int]]) -> Scenario:
    from vllm.v1.attention.ops import dsa_torch

    positions = torch.tensor(selection)
    null_table = torch.zeros((1, 3), dtype=torch.int64)
    return replace(
        s,
        positions=positions,
        token_requests=torch.zeros(len(selection), dtype=torch.int64),
        rows=dsa_torch.positions_to_slots(
            positions, torch.zeros(len(selection), dtype=torch.int64), null_table, BLOCK
        ),
        batch_request=[0] * len(selection),
    )


def test_a_position_picked_by_several_tokens_is_one_row_loaded_once():
    s = with_selection(one_request(2, hot_slots=2), [[5, 5, -1], [5, 6, -1], [6, 5, 5]])
    out = resolve(s)
    assert out[0, 0] == out[0, 1] == out[1, 0] == out[2, 1] == out[2, 2]
    assert out[1, 1] == out[2, 0] and out[0, 2] == -1
    assert sorted(s.hot.positions[0].tolist()) == [5, 6]


def test_misses_take_eligible_slots_in_lru_order_by_ascending_position():
    s = one_request(4, hot_slots=4)
    s.hot.positions[0] = torch.tensor([0, 1, 2, -1])
    s.hot.stamps[0] = torch.tensor([5, 3, 7, -1])
    for slot, p in enumerate([0, 1, 2]):
        s.kv_rows[s.slot_rows[0, slot]] = s.truth[(0, p)]
    # 1 is a hit (slot 1 protected); misses 9 and 6, ascending: 6 -> empty slot 3, 9 -> slot 0 (stamp 5).
    s = with_selection(s, [[9, 1], [6, 1]])
    resolve(s)
    assert s.hot.positions[0].tolist() == [9, 1, 2, 6]
    assert s.hot.stamps[0].tolist() == [s.step, s.step, 7, s.step]


def test_a_step_beyond_the_hot_buffer_stages_the_rest_and_keeps_them_out_of_the_hot_state():
    s = with_selection(one_request(3, hot_slots=2, staging=3), [[1, 6, 7], [2, 9, -1]])
    out = resolve(s)
    hot_rows, staging_rows = s.slot_rows[0, :2].tolist(), s.slot_rows[0, 2:].tolist()
    # Ascending: 1, 2 fill the hot slots; 6, 7, 9 go to staging slots 0, 1, 2.
    assert s.hot.positions[0].tolist() == [1, 2]
    assert out[0].tolist() == [hot_rows[0], staging_rows[0], staging_rows[1]]
    assert out[1, 1] == staging_rows[2]


def test_a_step_beyond_hot_and_staging_rows_is_an_error_not_a_wrong_row():
    s = with_selection(one_request(3, hot_slots=2, staging=1), [[1, 6, 7, 9]])
    plan = plan_resolution(
        s.positions, s.token_requests, s.host_page_table, BLOCK, s.hot, s.staging_slots, s.step, s.table_rows
    )
    assert int(plan.error) & ERROR_STAGING_OVERFLOW
    assert int(plan.rows_loaded) == 3, "the rows that fit are still served"


def test_a_staging_overflow_is_the_overflowing_requests_own_error():
    s = build(3, num_reqs=2, pages=3, hot_slots=2, tokens=1, topk=1, resident_p=0.0, hot_fill=0, staging=1)
    assert len(s.table_rows) == 2
    positions = torch.tensor([[1, 6, 7, 9], [2, 5, -1, -1]])  # request 0: 4 rows; request 1: 2
    plan = plan_resolution(
        positions,
        torch.tensor([0, 1]),
        s.host_page_table,
        BLOCK,
        s.hot,
        torch.tensor([1, 1]),
        s.step,
        s.table_rows,
    )
    assert int(plan.error) & ERROR_STAGING_OVERFLOW
    assert plan.request_error.tolist() == [ERROR_STAGING_OVERFLOW, 0], "request 1 fits its hot buffer"


def test_resident_entries_keep_the_backends_own_rows_and_touch_nothing():
    s = build(1, num_reqs=3, pages=3, hot_slots=30, tokens=6, topk=5, resident_p=0.5, hot_fill=0)
    resident = s.token_requests < 0
    out = resolve(s)
    assert torch.equal(out[resident], s.rows[resident])


def test_bad_shapes_are_refused_with_the_shapes_seen():
    s = one_request(5, hot_slots=1)
    with pytest.raises(ValueError, match=r"positions must be \[T, K\]"):
        resolve(replace(s, positions=s.positions[0]))
    with pytest.raises(ValueError, match=r"the top-K\) > 0, got \(\d+, 0\)"):
        resolve(replace(s, positions=s.positions[:, :0]))
    with pytest.raises(ValueError, match="hot state stamps must be 2-D int64"):
        resolve(replace(s, hot=HotState(s.hot.positions, s.hot.stamps.int())))
    with pytest.raises(ValueError, match="staging_slots and table_rows must be"):
        resolve(replace(s, staging_slots=torch.zeros(2, dtype=torch.int64)))


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**20),
    num_reqs=st.integers(1, 3),
    hot_slots=st.integers(1, 12),
    tokens=st.integers(1, 5),
    topk=st.integers(1, 6),
    hot_fill=st.integers(0, 12),
    staging=st.integers(0, 8),
)
def test_a_plan_never_copies_two_rows_into_one_destination(
    seed, num_reqs, hot_slots, tokens, topk, hot_fill, staging
):
    """The row copy kernel's warps never race: every copied entry has its own destination row."""
    s = build(seed, num_reqs, 4, hot_slots, tokens, topk, 0.3, hot_fill, staging)
    if not len(s.table_rows):
        return
    plan = plan_resolution(
        s.positions, s.token_requests, s.host_page_table, BLOCK, s.hot, s.staging_slots, s.step, s.table_rows
    )
    destinations = s.slot_rows[plan.load_request, plan.load_slot][plan.load]
    assert torch.unique(destinations).numel() == destinations.numel()


@pytest.mark.parametrize(
    ("dst", "src", "message"),
    [
        ([0, 9], [0, 1], r"a destination row is outside \[0, 9\)"),
        ([-1, 2], [0, 1], "a destination row is outside"),
        ([0, 1], [0, 4], r"a host row is outside \[0, 4\)"),
        ([3, 3], [0, 1], "two copies write one destination row"),
    ],
)
def test_the_row_copy_reference_raises_on_out_of_bounds_rows_and_shared_destinations(dst, src, message):
    kv_rows = torch.zeros(9, 3)
    host_rows = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    with pytest.raises(ResolverError, match=message):
        copy_host_rows(
            kv_rows, torch.tensor(dst), host_rows, torch.tensor(src), torch.ones(2, dtype=torch.bool)
        )
    assert not kv_rows.any(), "nothing is written"


def test_the_row_copy_reference_refuses_a_destination_between_the_layers_blocks():
    """Where layers share a block-outermost allocation, a layer's rows view spans the other
    layers' pages between its blocks; a destination there is another layer's row."""
    storage = torch.zeros(3, 2, 3, 3)  # [block, layer, row in block, width]
    layer_rows = storage.flatten().as_strided((2 * 6 + 3, 3), (3, 1))  # block stride: 6 rows
    host_rows = torch.arange(12, dtype=torch.float32).reshape(4, 3) + 1

    def copy(dst: list[int], block_stride_rows: int = 6) -> None:
        copy_host_rows(
            layer_rows,
            torch.tensor(dst),
            host_rows,
            torch.arange(len(dst)),
            torch.ones(len(dst), dtype=torch.bool),
            block_stride_rows=block_stride_rows,
            block_rows=3,
        )

    with pytest.raises(ResolverError, match="lies between this layer's blocks"):
        copy([1, 7 + 3])
    assert not storage.any(), "nothing is written, in either layer"
    copy([1, 6 + 2])
    assert torch.equal(storage[0, 0, 1], host_rows[0]) and torch.equal(storage[1, 0, 2], host_rows[1])
    assert not storage[:, 1].any(), "the other layer's rows are untouched"
    with pytest.raises(ValueError, match="block_rows must be positive and at most block_stride_rows"):
        copy([1], block_stride_rows=2)


def test_masked_entries_are_not_checked_or_copied():
    kv_rows = torch.zeros(9, 3)
    host_rows = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    copy_host_rows(
        kv_rows, torch.tensor([2, 99]), host_rows, torch.tensor([1, -5]), torch.tensor([True, False])
    )
    assert torch.equal(kv_rows[2], host_rows[1]) and kv_rows.sum() == host_rows[1].sum()


def test_a_token_request_outside_the_hot_state_is_an_error_not_an_out_of_bounds_read():
    s = one_request(5, hot_slots=2)
    with pytest.raises(ResolverError, match="request row is outside the step's hot state"):
        resolve(replace(s, token_requests=torch.full_like(s.token_requests, 1)))
    with pytest.raises(ResolverError, match="request row is outside the step's hot state"):
        resolve(replace(s, table_rows=s.table_rows + s.host_page_table.shape[0]))


def test_error_bits_match_the_kernels():
    """csrc/hisparse_errors.h and the Python error bits are one table."""
    import re
    from pathlib import Path

    from vllm.v1.hisparse import page_copy, resolver

    header = (Path(__file__).resolve().parents[2] / "csrc" / "hisparse_errors.h").read_text()
    bits = {name: int(value) for name, value in re.findall(r"kError(\w+) = (\d+)ull", header)}
    assert bits == {
        "StagingOverflow": resolver.ERROR_STAGING_OVERFLOW,
        "RowOutOfBounds": resolver.ERROR_ROW_OUT_OF_BOUNDS,
        "PageOutOfBounds": resolver.ERROR_PAGE_OUT_OF_BOUNDS,
        "RequestOutOfBounds": resolver.ERROR_REQUEST_OUT_OF_BOUNDS,
    }
    assert page_copy.ERROR_PAGE_OUT_OF_BOUNDS == resolver.ERROR_PAGE_OUT_OF_BOUNDS
    every = [v for k, v in vars(resolver).items() if k.startswith("ERROR_")]
    assert len(set(every)) == len(every) and all(v & (v - 1) == 0 for v in every), "distinct single bits"
    for bit in every:
        with pytest.raises(ResolverError):
            resolver.check_resolution_error(bit)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**20),
    num_reqs=st.integers(1, 3),
    pages=st.integers(2, 6),
    hot_slots=st.integers(2, 8),
    tokens=st.integers(1, 10),
    topk=st.integers(1, 4),
    hot_fill=st.integers(0, 8),
    staging=st.integers(0, 4),
)
def test_a_step_beyond_hot_and_staging_rows_resolves_in_passes_that_read_the_true_rows(
    seed, num_reqs, pages, hot_slots, tokens, topk, hot_fill, staging
):
    """Any step, however many rows its tokens select, is cut into passes whose union of host
    rows fits each request's hot and staging slots; replayed pass by pass (as attention
    runs them), every token reads its true rows in its own pass, and no pass overflows."""
    topk = min(topk, hot_slots)  # a single token always fits: the hot buffer holds top-K rows
    s = build(seed, num_reqs, pages, hot_slots, tokens, topk, 0.3, hot_fill, staging)
    if not len(s.table_rows):
        return
    capacity = hot_slots + s.staging_slots
    table = s.host_page_table
    token_pass, num_passes = partition_passes(
        s.positions, s.token_requests, table, s.table_rows, BLOCK, capacity
    )
    assert num_passes == int(token_pass.max()) + 1
    passes = plan_passes(
        s.positions,
        s.token_requests,
        table,
        BLOCK,
        s.hot,
        s.staging_slots,
        s.step,
        s.table_rows,
        token_pass,
        num_passes,
    )
    on_host = host_entries(s.positions, s.token_requests, s.host_page_table, s.table_rows, BLOCK)
    for p, (tokens_p, plan) in enumerate(passes):
        assert int(plan.error) == 0, f"pass {p} overflowed"
        for m in range(len(s.table_rows)):
            mine = tokens_p[s.token_requests[tokens_p] == m]
            union = {int(x) for x in s.positions[mine][on_host[mine]]}
            assert len(union) <= int(capacity[m]), "a pass's union fits the request's slots"
        out = apply_resolution(plan, s.rows[tokens_p], s.slot_rows, s.kv_rows, s.host_rows)
        for i, t in enumerate(tokens_p.tolist()):
            for k in range(out.shape[1]):
                position = int(s.positions[t, k])
                if position >= 0:
                    assert torch.equal(s.kv_rows[out[i, k]], s.truth[(s.batch_request[t], position)])
    # Passes are the longest runs: merging a run with the next one's first token overflows.
    for m in range(len(s.table_rows)):
        mine = torch.nonzero(s.token_requests == m).squeeze(1)
        for p in range(num_passes - 1):
            next_first = torch.arange(len(mine)) == int((token_pass[mine] <= p).sum())
            run = mine[(token_pass[mine] == p) | next_first]
            if (token_pass[mine] == p + 1).any():
                union = {int(x) for x in s.positions[run][on_host[run]]}
                assert len(union) > int(capacity[m]), "a pass ended early"


def test_a_chunk_over_a_long_host_context_takes_passes_not_a_shorter_chunk():
    """Eight tokens, each selecting four new host rows, with four hot and four staging slots:
    two tokens fit a pass, so four passes; one token per pass would waste passes."""
    s = build(1, num_reqs=1, pages=8, hot_slots=4, tokens=1, topk=4, resident_p=0.0, hot_fill=0, staging=4)
    positions = torch.arange(32).view(8, 4)
    token_pass, num_passes = partition_passes(
        positions,
        torch.zeros(8, dtype=torch.int64),
        s.host_page_table,
        s.table_rows,
        BLOCK,
        torch.tensor([8]),
    )
    assert token_pass.tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and num_passes == 4
    shared = torch.tensor([[0, 1, 2, 3]] * 8)  # every token selects the same rows: one pass
    token_pass, num_passes = partition_passes(
        shared, torch.zeros(8, dtype=torch.int64), s.host_page_table, s.table_rows, BLOCK, torch.tensor([8])
    )
    assert token_pass.tolist() == [0] * 8 and num_passes == 1
