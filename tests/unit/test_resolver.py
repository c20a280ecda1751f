"""The HiSparse resolver reference against a brute-force model of its contract."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.v1.hisparse.resolver import HotBufferTooSmall, HotState, resolve_topk_slots

BLOCK = 4
WIDTH = 3


@dataclass
class Scenario:
    positions: torch.Tensor
    req_ids: torch.Tensor
    page_table: torch.Tensor
    host_page_table: torch.Tensor
    kv_rows: torch.Tensor
    host_rows: torch.Tensor
    hot: HotState
    truth: dict[tuple[int, int], torch.Tensor]
    stride: int
    step: int


def build(
    seed: int,
    num_reqs: int,
    pages: int,
    hot_slots: int,
    tokens: int,
    topk: int,
    resident_p: float,
    hot_fill: int,
) -> Scenario:
    rng = random.Random(seed)
    stride = BLOCK + rng.choice([0, 2])
    truth = {
        (r, p): torch.tensor([float(r), float(p), rng.random()])
        for r in range(num_reqs)
        for p in range(pages * BLOCK)
    }
    num_device_blocks = num_reqs * pages + num_reqs * hot_slots
    kv_rows = torch.full((num_device_blocks * stride, WIDTH), -9.0)
    host_rows = torch.full((num_reqs * pages * BLOCK, WIDTH), -7.0)
    page_table = torch.full((num_reqs, pages), -1, dtype=torch.int64)
    host_page_table = torch.full((num_reqs, pages), -1, dtype=torch.int64)
    block_ids = list(range(num_device_blocks))
    rng.shuffle(block_ids)
    host_ids = list(range(num_reqs * pages))
    rng.shuffle(host_ids)
    for r in range(num_reqs):
        for page in range(pages):
            resident = rng.random() < resident_p
            if resident:
                block = block_ids.pop()
                page_table[r, page] = block
                for o in range(BLOCK):
                    kv_rows[block * stride + o] = truth[(r, page * BLOCK + o)]
            if not resident or rng.random() < 0.5:
                host = host_ids.pop()
                host_page_table[r, page] = host
                for o in range(BLOCK):
                    host_rows[host * BLOCK + o] = truth[(r, page * BLOCK + o)]
    step = 10
    rows = torch.zeros(num_reqs, hot_slots, dtype=torch.int64)
    held = torch.full((num_reqs, hot_slots), -1, dtype=torch.int64)
    stamps = torch.full((num_reqs, hot_slots), -1, dtype=torch.int64)
    for r in range(num_reqs):
        slot_rows = [block_ids.pop() * stride for _ in range(hot_slots)]
        rows[r] = torch.tensor(slot_rows)
        off_device = [p for p in range(pages * BLOCK) if page_table[r, p // BLOCK] < 0]
        for slot, p in enumerate(rng.sample(off_device, min(hot_fill, len(off_device), hot_slots))):
            held[r, slot] = p
            stamps[r, slot] = rng.randrange(0, step)
            kv_rows[slot_rows[slot]] = truth[(r, p)]
    req_ids = torch.tensor([rng.randrange(num_reqs) for _ in range(tokens)])
    positions = torch.tensor(
        [[rng.choice([-1, *range(pages * BLOCK)]) for _ in range(topk)] for _ in range(tokens)]
    )
    return Scenario(
        positions,
        req_ids,
        page_table,
        host_page_table,
        kv_rows,
        host_rows,
        HotState(rows, held, stamps),
        truth,
        stride,
        step,
    )


def brute_force(s: Scenario) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """The contract, written out with plain lists."""
    held = s.hot.positions.tolist()
    stamps = s.hot.stamps.tolist()
    rows = s.hot.rows.tolist()
    out = []
    for t, entries in enumerate(s.positions.tolist()):
        r = int(s.req_ids[t])
        line = []
        for p in entries:
            if p < 0:
                line.append(-1)
                continue
            block = int(s.page_table[r, p // BLOCK])
            if block >= 0:
                line.append(block * s.stride + p % BLOCK)
                continue
            if p in held[r]:
                slot = held[r].index(p)
            else:
                candidates = [i for i in range(len(held[r])) if stamps[r][i] != s.step]
                if not candidates:
                    raise HotBufferTooSmall
                slot = min(candidates, key=lambda i: (stamps[r][i], i))
                held[r][slot] = p
            stamps[r][slot] = s.step
            line.append(rows[r][slot])
        out.append(line)
    return out, held, stamps


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
        resolve_topk_slots(
            s.positions[0],
            s.req_ids,
            s.page_table,
            BLOCK,
            s.kv_rows,
            s.host_rows,
            s.host_page_table,
            s.hot,
            s.step,
        )
    with pytest.raises(ValueError, match="hot state stamps must be 2-D int64"):
        bad = HotState(s.hot.rows, s.hot.positions, s.hot.stamps.int())
        resolve_topk_slots(
            s.positions,
            s.req_ids,
            s.page_table,
            BLOCK,
            s.kv_rows,
            s.host_rows,
            s.host_page_table,
            bad,
            s.step,
        )
