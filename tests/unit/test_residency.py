"""The HiSparse residency state machine under random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vllm.v1.hisparse.host_pool import HostPagePool
from vllm.v1.hisparse.residency import PageState, RequestState, ResidencyManager

BLOCK = 64


class FreeList:
    """A device block pool that records every hand-out, so double ownership shows."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks))

    def num_free_blocks(self) -> int:
        return len(self.free)

    def take(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self.free):
            raise RuntimeError(f"asked {num_blocks} blocks, {len(self.free)} free")
        taken, self.free = self.free[:num_blocks], self.free[num_blocks:]
        return taken

    def give_back(self, block_ids) -> None:
        assert not set(block_ids) & set(self.free), "a block returned twice"
        self.free.extend(block_ids)


def manager(num_blocks=32, host_pages=16, hot_rows=128, **kwargs) -> tuple[ResidencyManager, FreeList]:
    pool = FreeList(num_blocks)
    return ResidencyManager(pool, HostPagePool(host_pages), BLOCK, hot_rows, **kwargs), pool


def take_pages(mgr: ResidencyManager, pool: FreeList, num_pages: int) -> list[list[int]]:
    blocks = pool.take(num_pages * mgr.blocks_per_page)
    k = mgr.blocks_per_page
    return [blocks[i * k : (i + 1) * k] for i in range(num_pages)]


def grow(mgr: ResidencyManager, pool: FreeList, request_id: str, pages: int, computed: int) -> None:
    mgr.append_pages(request_id, take_pages(mgr, pool, pages))
    mgr.advance(request_id, computed)


def test_no_pressure_keeps_every_request_full_and_copies_ahead():
    mgr, pool = manager()
    for name in ("a", "b"):
        mgr.add_request(name)
        grow(mgr, pool, name, 4, 4 * BLOCK - 10)  # three complete pages, one tail
    copies = mgr.plan_copies()
    assert len(copies) == 6 and {c.page_index for c in copies} == {0, 1, 2}
    mgr.complete_copies(copies)
    assert mgr.requests_by_state()[RequestState.FULL] == 2
    assert mgr.pages_by_state() == {PageState.DEVICE: 2, PageState.BOTH: 6, PageState.HOST: 0}
    assert mgr.counters.hot_leases == 0 and mgr.counters.pages_demoted == 0
    mgr.check()


def test_pressure_demotes_copied_pages_and_leases_a_hot_buffer():
    mgr, pool = manager(num_blocks=16, hot_rows=64)  # lease = one block
    mgr.add_request("a")
    grow(mgr, pool, "a", 6, 6 * BLOCK - 1)
    mgr.complete_copies(mgr.plan_copies())
    free_before = pool.num_free_blocks()
    freed = mgr.relieve_pressure(3, protect="b")
    assert freed == 3 and pool.num_free_blocks() == free_before + 3
    req = mgr.requests["a"]
    assert req.state is RequestState.MIXED and len(req.hot_blocks) == 1
    assert [p.state for p in req.pages][:4] == [PageState.HOST] * 4, "oldest pages go first"
    assert req.pages[-1].state is PageState.DEVICE, "the tail never leaves"
    mgr.check()


def test_a_page_moves_its_blocks_in_every_sparse_mla_group_together():
    mgr, pool = manager(num_blocks=24, hot_rows=64, blocks_per_page=2)  # lease = one page, two blocks
    mgr.add_request("a")
    grow(mgr, pool, "a", 5, 5 * BLOCK - 1)
    copies = mgr.plan_copies()
    assert all(len(c.block_ids) == 2 for c in copies)
    mgr.complete_copies(copies)
    free_before = pool.num_free_blocks()
    assert mgr.relieve_pressure(4) == 4
    req = mgr.requests["a"]
    assert len(req.hot_blocks) == 2 and pool.num_free_blocks() == free_before + 4
    assert [p.state for p in req.pages] == [PageState.HOST] * 3 + [PageState.BOTH, PageState.DEVICE]
    with pytest.raises(ValueError, match="a page has 2 blocks"):
        mgr.append_pages("a", [[1]])
    mgr.check()


def test_pressure_never_frees_a_page_whose_copy_is_in_flight():
    mgr, pool = manager(proactive_copy=False)
    mgr.add_request("a")
    grow(mgr, pool, "a", 5, 5 * BLOCK)
    assert mgr.relieve_pressure(2) == 0, "nothing is durable on the host yet"
    copies = mgr.plan_copies()
    assert len(copies) == 2, "pressure marks pages for copy-then-free"
    assert mgr.relieve_pressure(2) == 0, "still in flight"
    mgr.complete_copies(copies)
    assert mgr.requests["a"].count(PageState.HOST) == 2
    mgr.check()


def test_always_mode_demotes_without_pressure():
    mgr, pool = manager(mode="always", hot_rows=64)
    mgr.add_request("a")
    grow(mgr, pool, "a", 4, 4 * BLOCK - 1)
    mgr.complete_copies(mgr.plan_copies())
    assert [p.state for p in mgr.requests["a"].pages] == [PageState.HOST] * 3 + [PageState.DEVICE]
    assert mgr.requests["a"].state is RequestState.NONE
    mgr.check()


def test_a_host_only_prefix_starts_the_next_request_none():
    mgr, pool = manager(mode="always", hot_rows=64)
    mgr.add_request("a", block_hashes=["h0", "h1", "h2"])
    grow(mgr, pool, "a", 4, 4 * BLOCK - 1)
    mgr.complete_copies(mgr.plan_copies())
    mgr.finish("a")
    assert pool.num_free_blocks() == pool.num_blocks
    tokens = mgr.add_request("b", block_hashes=["h0", "h1", "hX"])
    assert tokens == 2 * BLOCK
    assert mgr.requests["b"].state is RequestState.NONE
    assert mgr.counters.host_prefix_pages_reused == 2
    mgr.check()


def test_finishing_mid_copy_returns_blocks_only_when_the_copy_lands():
    mgr, pool = manager()
    mgr.add_request("a", block_hashes=["x"])
    grow(mgr, pool, "a", 2, BLOCK)
    copies = mgr.plan_copies()
    mgr.finish("a")
    assert not set(copies[0].block_ids) & set(pool.free), "the worker still reads those blocks"
    mgr.check()
    mgr.complete_copies(copies)
    assert pool.num_free_blocks() == pool.num_blocks
    assert mgr.host_pool.lookup("x") == copies[0].host_page, "the landed copy serves later prefixes"
    mgr.check()


class ResidencyMachine(RuleBasedStateMachine):
    """Random add / grow / copy / pressure / finish sequences keep every invariant."""

    @initialize(
        num_blocks=st.integers(8, 48),
        host_pages=st.integers(1, 24),
        hot_rows=st.sampled_from([64, 128, 200]),
        mode=st.sampled_from(["hybrid", "always"]),
        proactive=st.booleans(),
        budget=st.integers(1, 8),
        blocks_per_page=st.integers(1, 3),
    )
    def setup(self, num_blocks, host_pages, hot_rows, mode, proactive, budget, blocks_per_page):
        self.pool = FreeList(num_blocks * blocks_per_page)
        self.mgr = ResidencyManager(
            self.pool,
            HostPagePool(host_pages),
            BLOCK,
            hot_rows,
            blocks_per_page=blocks_per_page,
            mode=mode,
            proactive_copy=proactive,
            max_copies_per_step=budget,
        )
        self.in_flight = []
        self.next_id = 0
        self.tokens: dict[str, int] = {}

    @rule(shared_prefix=st.integers(0, 3))
    def add(self, shared_prefix):
        name = f"r{self.next_id}"
        self.next_id += 1
        hashes = [f"p{i}" for i in range(shared_prefix)] + [f"{name}-{i}" for i in range(4)]
        self.tokens[name] = self.mgr.add_request(name, hashes)

    @precondition(lambda self: self.mgr.requests)
    @rule(data=st.data(), new_tokens=st.integers(1, 200))
    def grow(self, data, new_tokens):
        name = data.draw(st.sampled_from(sorted(self.mgr.requests)))
        req = self.mgr.requests[name]
        target = self.tokens[name] + new_tokens
        need = max(-(-target // BLOCK) - len(req.pages), 0)
        blocks = need * self.mgr.blocks_per_page
        if blocks > self.pool.num_free_blocks():
            self.mgr.relieve_pressure(blocks - self.pool.num_free_blocks(), protect=name)
        if blocks > self.pool.num_free_blocks():
            return  # the scheduler would preempt: modelled by finish
        self.mgr.append_pages(name, take_pages(self.mgr, self.pool, need))
        self.tokens[name] = target
        self.mgr.advance(name, target)

    @rule()
    def plan(self):
        self.in_flight.append(self.mgr.plan_copies())

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def land(self, data):
        batch = self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1)))
        self.mgr.complete_copies(batch)

    @precondition(lambda self: self.mgr.requests)
    @rule(data=st.data(), blocks=st.integers(1, 12))
    def pressure(self, data, blocks):
        protect = data.draw(st.sampled_from(sorted(self.mgr.requests)))
        free_before = self.pool.num_free_blocks()
        freed = self.mgr.relieve_pressure(blocks, protect=protect)
        assert self.pool.num_free_blocks() == free_before + freed

    @precondition(lambda self: self.mgr.requests)
    @rule(data=st.data())
    def finish(self, data):
        name = data.draw(st.sampled_from(sorted(self.mgr.requests)))
        self.mgr.finish(name)
        del self.tokens[name]

    @invariant()
    def invariants_hold(self):
        if not hasattr(self, "mgr"):
            return
        self.mgr.check()
        held = self.mgr.device_blocks_held()
        assert sorted(held + self.pool.free) == list(range(self.pool.num_blocks)), "every block owned once"

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for name in list(self.mgr.requests):
            self.mgr.finish(name)
        for batch in self.in_flight:
            self.mgr.complete_copies(batch)
        assert self.pool.num_free_blocks() == self.pool.num_blocks, "everything returns at the end"
        assert self.mgr.host_pool.num_referenced == 0
        self.mgr.check()


TestResidencyMachine = ResidencyMachine.TestCase
TestResidencyMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("mode", ["eager", ""])
def test_unknown_modes_are_refused(mode):
    with pytest.raises(ValueError, match="unknown HiSparse mode"):
        manager(mode=mode)
