"""The HiSparse resolver reference against a brute-force model of its contract."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from resolver_cases import BLOCK, Scenario, brute_force, build

from vllm.v1.hisparse.resolver import HotBufferTooSmall, HotState, resolve_topk_slots


def resolve(s: Scenario) -> torch.Tensor:
    return resolve_topk_slots(
        s.positions,
        s.req_ids,
        s.page_table,
        BLOCK,
        s.kv_rows,
        s.host_rows,
        s.host_page_table,
        s.hot,
        s.step,
        s.stride,
    )


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**20),
    num_reqs=st.integers(1, 3),
    pages=st.integers(1, 5),
    hot_slots=st.integers(1, 12),
    tokens=st.integers(1, 4),
    topk=st.integers(1, 6),
    resident_p=st.sampled_from([0.0, 0.5, 1.0]),
    hot_fill=st.integers(0, 12),
)
def test_reference_matches_the_contract_and_reads_the_true_rows(
    seed, num_reqs, pages, hot_slots, tokens, topk, resident_p, hot_fill
):
    s = build(seed, num_reqs, pages, hot_slots, tokens, topk, resident_p, hot_fill)
    try:
        expected, held, stamps = brute_force(
            build(seed, num_reqs, pages, hot_slots, tokens, topk, resident_p, hot_fill)
        )
    except HotBufferTooSmall:
        with pytest.raises(HotBufferTooSmall, match="raise hisparse_config.device_buffer_size"):
            resolve(s)
        return
    out = resolve(s)
    assert out.tolist() == expected
    assert s.hot.positions.tolist() == held and s.hot.stamps.tolist() == stamps
    for t in range(out.shape[0]):
        r = int(s.req_ids[t])
        for k in range(out.shape[1]):
            p = int(s.positions[t, k])
            if p >= 0:
                assert torch.equal(s.kv_rows[out[t, k]], s.truth[(r, p)]), "attention reads the true row"


def test_all_resident_is_the_plain_block_table_and_touches_nothing():
    s = build(1, num_reqs=2, pages=3, hot_slots=4, tokens=3, topk=5, resident_p=1.0, hot_fill=0)
    before = (s.kv_rows.clone(), s.hot.stamps.clone())
    out = resolve(s)
    for t, k in zip(*torch.nonzero(s.positions >= 0, as_tuple=True), strict=True):
        p, r = int(s.positions[t, k]), int(s.req_ids[t])
        assert int(out[t, k]) == int(s.page_table[r, p // BLOCK]) * s.stride + p % BLOCK
    assert torch.equal(s.kv_rows, before[0]) and torch.equal(s.hot.stamps, before[1])


def test_duplicates_miss_once_then_hit():
    s = build(2, num_reqs=1, pages=2, hot_slots=2, tokens=1, topk=1, resident_p=0.0, hot_fill=0)
    s.positions = torch.tensor([[5, 5, -1, 5]])
    s.req_ids = torch.tensor([0])
    out = resolve(s)
    assert out[0, 0] == out[0, 1] == out[0, 3] and out[0, 2] == -1
    assert (s.hot.positions[0] == 5).sum() == 1


def test_a_hot_buffer_exactly_as_large_as_the_step_suffices():
    s = build(3, num_reqs=1, pages=2, hot_slots=3, tokens=1, topk=1, resident_p=0.0, hot_fill=0)
    s.positions = torch.tensor([[1, 6, 7]])
    s.req_ids = torch.tensor([0])
    out = resolve(s)
    assert sorted(out[0].tolist()) == sorted(s.hot.rows[0].tolist())
    s.step += 1
    s.positions = torch.tensor([[1, 6, 7, 2]])
    with pytest.raises(HotBufferTooSmall):
        resolve(s)


def test_misses_evict_the_least_recently_used_slot_not_selected_this_step():
    s = build(4, num_reqs=1, pages=2, hot_slots=3, tokens=1, topk=1, resident_p=0.0, hot_fill=0)
    s.hot.positions[0] = torch.tensor([0, 1, 2])
    s.hot.stamps[0] = torch.tensor([5, 3, 7])
    for slot, p in enumerate([0, 1, 2]):
        s.kv_rows[s.hot.rows[0, slot]] = s.truth[(0, p)]
    s.positions = torch.tensor([[1, 6]])  # hit slot 1 (stamp 3), then miss: slot 1 is protected
    s.req_ids = torch.tensor([0])
    resolve(s)
    assert s.hot.positions[0].tolist() == [6, 1, 2], "slot 0 (stamp 5) was the oldest unprotected one"


def test_bad_shapes_are_refused_with_the_shapes_seen():
    s = build(5, num_reqs=1, pages=1, hot_slots=1, tokens=1, topk=1, resident_p=1.0, hot_fill=0)
    with pytest.raises(ValueError, match=r"positions must be \[T, K\]"):
        resolve(replace(s, positions=s.positions[0]))
    with pytest.raises(ValueError, match="hot state stamps must be 2-D int64"):
        resolve(replace(s, hot=HotState(s.hot.rows, s.hot.positions, s.hot.stamps.int())))
