# SPDX-License-Identifier: Apache-2.0
"""The HiSparse residency state machine under random operation sequences."""

from __future__ import annotations

import gc
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vllm.config.hisparse import MAX_PREEMPTION_DEFERRALS
from vllm.v1.hisparse.host_pool import HostPagePool, HostPoolExhausted
from vllm.v1.hisparse.plan import CopyId, host_page_runs
from vllm.v1.hisparse.residency import PageState, RequestState, ResidencyManager

BLOCK = 64


def ids(copies) -> list:
    """The copy ids a worker reports for these copies."""
    return [copy.copy_id for copy in copies]


class BlockPoolModel:
    """The shared block pool plus the requests' block tables, with reference counts.

    Mirrors how vLLM's KV cache manager owns page blocks (through each request's
    table) so double ownership and leaks show as wrong reference counts.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks))
        self.refs = [0] * num_blocks
        self.tables: dict[str, list[tuple[int, ...] | None]] = {}

    def num_free_blocks(self) -> int:
        return len(self.free)

    def take(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self.free):
            raise RuntimeError(f"asked {num_blocks} blocks, {len(self.free)} free")
        taken, self.free = self.free[:num_blocks], self.free[num_blocks:]
        for block in taken:
            assert self.refs[block] == 0
            self.refs[block] = 1
        return taken

    def give_back(self, block_ids) -> None:
        for block in block_ids:
            assert self.refs[block] > 0, f"block {block} returned more often than taken"
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.append(block)

    def hold(self, block_ids) -> None:
        for block in block_ids:
            assert self.refs[block] > 0, "only a referenced block can be held"
            self.refs[block] += 1

    def num_exclusive(self, block_ids) -> int:
        return sum(self.refs[b] == 1 for b in block_ids)

    def frees_are_deferred(self) -> bool:
        return False

    def drop_pages(self, request_id, pages) -> int:
        before = len(self.free)
        for page_index, block_ids in pages:
            assert self.tables[request_id][page_index] == tuple(block_ids)
            self.tables[request_id][page_index] = None
            self.give_back(block_ids)
        return len(self.free) - before

    # -- the KV cache manager's side ------------------------------------------

    def allocate_pages(self, request_id: str, num_pages: int, blocks_per_page: int) -> list[list[int]]:
        blocks = self.take(num_pages * blocks_per_page)
        pages = [blocks[i * blocks_per_page : (i + 1) * blocks_per_page] for i in range(num_pages)]
        self.tables.setdefault(request_id, []).extend(tuple(p) for p in pages)
        return pages

    def add_placeholders(self, request_id: str, num_pages: int) -> None:
        self.tables.setdefault(request_id, []).extend([None] * num_pages)

    def free_request(self, request_id: str) -> None:
        for page in self.tables.pop(request_id, []):
            if page is not None:
                self.give_back(page)

    def check(self, mgr: ResidencyManager) -> None:
        expected = [0] * self.num_blocks
        owners = [b for t in self.tables.values() for p in t if p is not None for b in p]
        for block in owners + mgr.leased_blocks() + mgr.held_blocks():
            expected[block] += 1
        assert expected == self.refs, "every block reference is owned once"
        assert sorted(self.free) == [b for b in range(self.num_blocks) if self.refs[b] == 0]


def manager(num_blocks=32, host_pages=16, hot_rows=128, **kwargs) -> tuple[ResidencyManager, BlockPoolModel]:
    pool = BlockPoolModel(num_blocks)
    return ResidencyManager(pool, HostPagePool(host_pages), BLOCK, hot_rows, **kwargs), pool


def grow(mgr: ResidencyManager, pool: BlockPoolModel, request_id: str, pages: int, computed: int) -> None:
    mgr.append_pages(request_id, pool.allocate_pages(request_id, pages, mgr.blocks_per_page))
    mgr.advance(request_id, computed)


def end(mgr: ResidencyManager, pool: BlockPoolModel, request_id: str) -> None:
    """The scheduler's order: residency first (holds in-flight blocks), then the block table."""
    mgr.finish(request_id)
    pool.free_request(request_id)


def test_no_pressure_keeps_every_request_full_and_copies_ahead():
    mgr, pool = manager()
    for name in ("a", "b"):
        mgr.add_request(name)
        grow(mgr, pool, name, 4, 4 * BLOCK - 10)  # three complete pages, one tail
    copies = mgr.plan_copies()
    assert len(copies) == 6 and {c.page_index for c in copies} == {0, 1, 2}
    mgr.complete_copies(ids(copies))
    assert mgr.requests_by_state()[RequestState.FULL] == 2
    assert mgr.pages_by_state() == {PageState.DEVICE: 2, PageState.BOTH: 6, PageState.HOST: 0}
    assert mgr.counters.hot_leases == 0 and mgr.counters.pages_demoted == 0
    mgr.check()


def test_pressure_demotes_copied_pages_and_leases_a_hot_buffer():
    mgr, pool = manager(num_blocks=16, hot_rows=64)  # lease = one block
    mgr.add_request("a")
    grow(mgr, pool, "a", 6, 6 * BLOCK - 1)
    mgr.complete_copies(ids(mgr.plan_copies()))
    free_before = pool.num_free_blocks()
    freed = mgr.relieve_pressure(2, protect="b")
    assert freed == 2 and pool.num_free_blocks() == free_before + 2
    req = mgr.requests["a"]
    assert req.state is RequestState.MIXED and len(req.hot_blocks) == 1
    assert [p.state for p in req.pages][:4] == [PageState.HOST] * 3 + [PageState.BOTH], "oldest first"
    assert req.pages[-1].state is PageState.DEVICE, "the tail never leaves"
    mgr.relieve_pressure(8)
    assert req.state is RequestState.NONE, "demoted down to its tail"
    assert [p.state for p in req.pages][4:] == [PageState.BOTH, PageState.DEVICE], "the tail stays"
    mgr.check()


def test_a_page_moves_its_blocks_in_every_sparse_mla_group_together():
    mgr, pool = manager(num_blocks=24, hot_rows=64, blocks_per_page=2)  # lease = one page, two blocks
    mgr.add_request("a")
    grow(mgr, pool, "a", 5, 5 * BLOCK - 1)
    copies = mgr.plan_copies()
    assert all(len(c.block_ids) == 2 for c in copies)
    mgr.complete_copies(ids(copies))
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
    # Two pages for the blocks wanted and two for the lease (128 rows) the demotion takes.
    assert len(copies) == 4, "pressure marks pages for copy-then-free"
    assert mgr.relieve_pressure(2) == 0, "still in flight"
    assert mgr.complete_copies(ids(copies)) == 2
    assert mgr.requests["a"].count(PageState.HOST) == 4
    mgr.check()


def test_copies_reported_in_one_batch_keep_every_count_even_when_one_report_is_wrong():
    mgr, pool = manager(num_blocks=24, hot_rows=64, proactive_copy=False)
    mgr.add_request("a")
    grow(mgr, pool, "a", 7, 7 * BLOCK)
    # Marked pages land out of order and demote in that order: not the front of the
    # request's BOTH pages.
    mgr.relieve_pressure(4)
    copies = mgr.plan_copies()
    assert len(copies) >= 4
    first, second, *rest = copies
    mgr.complete_copies([second.copy_id])
    mgr.check()
    with pytest.raises(RuntimeError, match="not in flight"):
        mgr.complete_copies([first.copy_id, CopyId(10_000)])
    mgr.check()  # the page reported before the wrong report changed state, and is counted
    assert mgr.counters.pages_copied_to_host == 2
    mgr.complete_copies(ids(rest))
    req = mgr.requests["a"]
    assert req.count(PageState.DEVICE) == 7 - len(copies) and mgr.counters.pages_copied_to_host == len(copies)
    assert req.count(PageState.HOST) >= 3, "the pages landed in later reports were demoted"
    mgr.check()


@pytest.mark.parametrize("mode", ["hybrid", "always"])
def test_a_held_request_keeps_every_page_while_a_connector_sends_its_blocks(mode):
    mgr, pool = manager(proactive_copy=False, mode=mode, hot_rows=64)
    mgr.add_request("sending")
    grow(mgr, pool, "sending", 5, 5 * BLOCK)
    assert mgr.relieve_pressure(2) == 0
    copies = mgr.plan_copies()
    assert any(mgr.requests["sending"].pages[c.page_index].demote_when_copied for c in copies)
    mgr.hold("sending")  # it finished; a P/D producer still reads its blocks
    mgr.complete_copies(ids(copies))
    mgr.complete_copies(ids(mgr.plan_copies()))
    assert mgr.relieve_pressure(8) == 0
    mgr.complete_copies(ids(mgr.plan_copies()))
    assert mgr.counters.pages_demoted == 0
    assert mgr.requests["sending"].count(PageState.HOST) == 0, "no page left the device"
    mgr.check()
    end(mgr, pool, "sending")
    pool.check(mgr)
    assert pool.num_free_blocks() == pool.num_blocks, "everything returned once it ends"


@pytest.mark.parametrize("mode", ["hybrid", "always"])
def test_pages_first_copied_after_a_request_is_held_stay_on_the_device(mode):
    """A request finishes with pages not yet copied (the step's copy budget or the host
    pool ran short) while a connector still sends its blocks. Its copies made afterwards
    (mode "always" copies every complete page) land as BOTH: none is marked, demoted or
    freed under the connector."""
    mgr, pool = manager(mode=mode, proactive_copy=True, hot_rows=64, max_copies_per_step=1)
    mgr.add_request("sending")
    grow(mgr, pool, "sending", 5, 5 * BLOCK)
    mgr.hold("sending")
    table = list(pool.tables["sending"])
    copies = []
    for _ in range(6):
        planned = mgr.plan_copies()
        assert not any(mgr.requests["sending"].pages[c.page_index].demote_when_copied for c in planned)
        copies += planned
        mgr.complete_copies(ids(planned))
        mgr.check()
    assert len(copies) == 5, "every complete page was copied once"
    assert [p.state for p in mgr.requests["sending"].pages] == [PageState.BOTH] * 5
    assert pool.tables["sending"] == table and mgr.counters.pages_demoted == 0
    end(mgr, pool, "sending")
    pool.check(mgr)
    assert pool.num_free_blocks() == pool.num_blocks


def test_always_mode_demotes_without_pressure():
    mgr, pool = manager(mode="always", hot_rows=64)
    mgr.add_request("a")
    grow(mgr, pool, "a", 4, 4 * BLOCK - 1)
    mgr.complete_copies(ids(mgr.plan_copies()))
    states = [p.state for p in mgr.requests["a"].pages]
    assert states == [PageState.HOST] * 2 + [PageState.BOTH, PageState.DEVICE], "the tail stays"
    assert mgr.requests["a"].state is RequestState.NONE
    grow(mgr, pool, "a", 1, 5 * BLOCK - 1)  # the tail moves on: its old last page can go
    mgr.complete_copies(ids(mgr.plan_copies()))
    assert mgr.requests["a"].pages[2].state is PageState.BOTH, "demoted once the step's output is processed"
    mgr.demote_settled()  # as HiSparseScheduling.on_model_output does
    assert [p.state for p in mgr.requests["a"].pages][:3] == [PageState.HOST] * 3
    mgr.check()


def tracked_objects() -> int:
    """Objects Python's garbage collector tracks now (after a collection, which stops
    tracking tuples of plain values)."""
    gc.collect()
    return len(gc.get_objects())


def test_a_long_history_adds_no_object_the_garbage_collector_tracks_per_page():
    """A turn's history of thousands of pages is held column by column, and its host pages
    cross to the workers as one run: each tracked object per page would be promoted to
    the collector's oldest generation and bring forward its full passes, which walk every
    request's token lists."""
    num_pages = 2000
    mgr, pool = manager(
        num_blocks=2 * num_pages + 64, host_pages=2 * num_pages, hot_rows=64, max_copies_per_step=num_pages
    )
    hashes = [f"h{i}" for i in range(num_pages)]
    mgr.add_request("a", block_hashes=hashes)
    grow(mgr, pool, "a", num_pages + 1, num_pages * BLOCK)
    mgr.complete_copies(ids(mgr.plan_copies()))
    end(mgr, pool, "a")
    hits = mgr.retain_host_prefix(hashes)
    assert len(hits) == num_pages
    mgr.add_request("b", block_hashes=hashes)
    before = tracked_objects()
    pool.add_placeholders("b", num_pages)
    mgr.append_host_pages("b", hits, mgr.lease())
    grow(mgr, pool, "b", num_pages, 2 * num_pages * BLOCK)
    grown = tracked_objects() - before
    assert grown < 50, f"{grown} tracked objects for {2 * num_pages} pages"
    host_runs, leases = mgr.drain_changes()
    assert [(run.request_id, run.first_page, len(run.host_pages)) for run in host_runs] == [
        ("b", 0, num_pages)
    ], "the hit's pages cross as one run"
    assert leases and mgr.requests["b"].state is RequestState.MIXED
    mgr.check()
    pool.check(mgr)


def test_a_page_table_reads_and_changes_one_page_through_its_view():
    mgr, pool = manager(hot_rows=64)
    mgr.add_request("a", block_hashes=["h0", "h1", "h2"])
    grow(mgr, pool, "a", 3, 3 * BLOCK)
    pages = mgr.requests["a"].pages
    assert len(pages) == 3 and [p.state for p in pages] == [PageState.DEVICE] * 3
    assert pages[-1].index == 2 and [p.index for p in pages[1:]] == [1, 2]
    with pytest.raises(IndexError):
        pages[3]
    page = pages[1]
    page.host_page = 7
    assert pages[1].state is PageState.BOTH and pages.host_page == [None, 7, None]
    page.copy_id = 3
    assert pages[1].copying and pages[1].state is PageState.DEVICE
    page.copy_id, page.block_ids = None, None
    assert pages[1].state is PageState.HOST
    assert pages.num_leading_off_device(3) == 0
    pages[0].host_page = 5
    assert pages.num_leading_off_device(3) == 2 and pages.num_leading_off_device(1) == 1


def test_host_page_runs_group_consecutive_pages_in_order():
    runs = host_page_runs("r", [(4, 40), (5, 50), (7, 70), (2, 20), (3, 30)])
    assert [(run.first_page, run.host_pages) for run in runs] == [(4, (40, 50)), (7, (70,)), (2, (20, 30))]
    assert [page for run in runs for page in run.pages()] == [(4, 40), (5, 50), (7, 70), (2, 20), (3, 30)]
    assert host_page_runs("r", []) == []


def each_or_all(pool: HostPagePool, operation: str, pages: list, at_once: bool) -> None:
    """`pool.<operation>` of each page in turn, or `pool.<operation>_all` of them at once."""
    if at_once:
        getattr(pool, f"{operation}_all")(pages)
    else:
        for page in pages:
            getattr(pool, operation)(page)
    pool.check()


def test_releasing_many_host_pages_at_once_is_releasing_each():
    def pool_after(release_all: bool) -> tuple:
        pool = HostPagePool(8)
        pages = [pool.allocate() for _ in range(6)]
        for page, block_hash in zip(pages[:4], "abcd", strict=True):
            pool.publish(page, block_hash)
        pool.retain(pages[1])
        each_or_all(pool, "release", [pages[3], pages[1], pages[0], pages[4]], release_all)
        return pool.num_referenced, pool.num_available, [pool.allocate() for _ in range(pool.num_available)]

    assert pool_after(True) == pool_after(False)
    pool = HostPagePool(2)
    page = pool.allocate()
    with pytest.raises(KeyError, match="released more often than retained"):
        pool.release_all([page, page])


def five_published_pages() -> tuple[HostPagePool, list]:
    """A pool of 8 host pages: copies "a" and "b" referenced, "c", "d" and "e" cached."""
    pool = HostPagePool(8)
    pages = [pool.allocate() for _ in range(5)]
    for page, block_hash in zip(pages, "abcde", strict=True):
        pool.publish(page, block_hash)
    for page in pages[2:]:
        pool.release(page)  # cached, not referenced
    return pool, pages


def test_retaining_many_host_pages_at_once_is_retaining_each():
    def pool_after(retain_all: bool) -> tuple:
        pool, pages = five_published_pages()
        each_or_all(pool, "retain", [pages[3], pages[0], pages[4], pages[0]], retain_all)
        return [pool.refs(page) for page in pages], pool.num_available, pool.allocate()

    assert pool_after(True) == pool_after(False)
    pool = HostPagePool(2)
    with pytest.raises(KeyError, match="neither referenced nor cached"):
        pool.retain_all([1])


def test_retaining_many_cached_copies_by_hash_at_once_is_retaining_each():
    def pool_after(at_once: bool) -> tuple:
        pool, pages = five_published_pages()
        wanted = ["d", "x", "a", "e", "a"]  # "x": no copy
        if at_once:
            found = pool.retain_all_cached(wanted)
        else:
            found = [pool.retain_cached(block_hash) for block_hash in wanted]
        return found, [pool.refs(page) for page in pages], pool.num_available, pool.allocate()

    found, refs, *_ = pool_after(True)
    assert found[1] is None and refs == [3, 1, 0, 1, 1]
    assert pool_after(True) == pool_after(False)


def test_a_host_only_prefix_starts_the_next_request_none():
    mgr, pool = manager(mode="always", hot_rows=64)
    mgr.add_request("a", block_hashes=["h0", "h1", "h2"])
    grow(mgr, pool, "a", 4, 4 * BLOCK - 1)
    mgr.complete_copies(ids(mgr.plan_copies()))
    end(mgr, pool, "a")
    assert pool.num_free_blocks() == pool.num_blocks
    hits = mgr.retain_host_prefix(["h0", "h1", "hX"])
    assert len(hits) == 2
    mgr.add_request("b", block_hashes=["h0", "h1", "hX"])
    pool.add_placeholders("b", len(hits))
    mgr.append_host_pages("b", hits, mgr.lease())
    grow(mgr, pool, "b", 1, 2 * BLOCK)
    assert mgr.requests["b"].state is RequestState.NONE
    assert mgr.counters.host_prefix_pages_reused == 2
    mgr.check()
    pool.check(mgr)
    end(mgr, pool, "b")
    assert pool.num_free_blocks() == pool.num_blocks and mgr.host_pool.num_referenced == 0


def test_restored_pages_start_both_and_are_the_first_relief_can_free():
    hashes = ["h0", "h1", "h2", "h3"]
    mgr, pool = manager(hot_rows=64)
    mgr.add_request("a", block_hashes=hashes)
    grow(mgr, pool, "a", 5, 5 * BLOCK - 1)
    mgr.complete_copies(ids(mgr.plan_copies()))  # h0..h3 durable in the host pool
    end(mgr, pool, "a")
    hits = mgr.retain_host_prefix(hashes)
    assert len(hits) == 4
    # A KV connector hit: blocks are allocated for the pages and filled from the host pool;
    # the request registers (its first scheduled step) only after the connector's load,
    # and until then the hit's references are its admission's.
    mgr.check(other_host_references=Counter(hits))
    blocks = pool.allocate_pages("b", 4, mgr.blocks_per_page)
    mgr.add_request("b", block_hashes=hashes)
    for block_ids, page in zip(blocks, hits, strict=True):
        mgr.append_restored_page("b", block_ids, page)
    grow(mgr, pool, "b", 1, 4 * BLOCK + 1)
    assert [p.state for p in mgr.requests["b"].pages] == [PageState.BOTH] * 4 + [PageState.DEVICE]
    assert mgr.requests["b"].state is RequestState.FULL
    assert mgr.plan_copies() == [], "restored pages are durable already"
    free_before = pool.num_free_blocks()
    assert mgr.relieve_pressure(1) > 0, "they are freed without a copy"
    assert pool.num_free_blocks() > free_before and mgr.requests["b"].state is RequestState.MIXED
    mgr.check()
    pool.check(mgr)
    end(mgr, pool, "b")
    assert pool.num_free_blocks() == pool.num_blocks and mgr.host_pool.num_referenced == 0


def test_a_retained_host_prefix_is_never_evicted_by_an_allocation():
    mgr, pool = manager(host_pages=2)
    mgr.add_request("a", block_hashes=["h0", "h1"])
    grow(mgr, pool, "a", 3, 3 * BLOCK)
    mgr.complete_copies(ids(mgr.plan_copies()))
    end(mgr, pool, "a")
    assert mgr.host_pool.num_available == 2, "both host pages are cached and evictable"
    (page,) = mgr.retain_host_prefix(["h0"])
    assert mgr.host_pool.num_available == 1
    mgr.check(other_host_references=Counter([page]))
    assert mgr.host_pool.allocate() != page
    with pytest.raises(HostPoolExhausted):
        mgr.host_pool.allocate()
    assert mgr.host_pool.lookup("h0") == page, "the retained copy is still indexed"


def test_touching_cached_copies_orders_them_as_taking_and_giving_back_would():
    """`touch` makes unreferenced cached copies the most recently used, in the order given,
    exactly as a retain and a release of each would, and leaves referenced pages alone."""

    def pool_with_copies() -> HostPagePool:
        pool = HostPagePool(6)
        for i in range(5):
            page = pool.allocate()
            pool.publish(page, f"h{i}")
        for page in (0, 1, 2, 3):  # page 4 stays referenced
            pool.release(page)
        return pool

    touched, retained = pool_with_copies(), pool_with_copies()
    order = [2, 4, 0]
    touched.touch(order)
    for page in order:
        retained.retain(page)
    for page in order:
        retained.release(page)
    assert list(touched._evictable) == list(retained._evictable) == [1, 3, 2, 0]
    assert touched.refs(4) == retained.refs(4) == 1
    assert [touched.allocate() for _ in range(3)] == [5, 1, 3], "least recently used first"
    touched.check()


def test_finishing_mid_copy_returns_blocks_only_when_the_copy_lands():
    mgr, pool = manager()
    mgr.add_request("a", block_hashes=["x"])
    grow(mgr, pool, "a", 2, BLOCK)
    copies = mgr.plan_copies()
    end(mgr, pool, "a")
    assert not set(copies[0].block_ids) & set(pool.free), "the worker still reads those blocks"
    mgr.check()
    pool.check(mgr)
    mgr.complete_copies(ids(copies))
    assert pool.num_free_blocks() == pool.num_blocks
    assert mgr.host_pool.lookup("x") == copies[0].host_page, "the landed copy serves later prefixes"
    mgr.check()


def test_a_cancelled_copy_leaves_the_page_resident_and_returns_its_host_slot():
    mgr, pool = manager(proactive_copy=False, hot_rows=64)  # a one-block lease: two pages pay for it
    mgr.add_request("a", block_hashes=["x", "y"])
    grow(mgr, pool, "a", 3, 3 * BLOCK)
    mgr.relieve_pressure(2)
    copies = mgr.plan_copies()
    assert len(copies) == 2
    mgr.cancel_copies(ids(copies))
    assert mgr.pages_by_state()[PageState.DEVICE] == 3 and mgr.host_pool.num_referenced == 0
    assert mgr.host_pool.lookup("x") is None, "a copy that did not happen is never published"
    retry = mgr.plan_copies()
    assert [c.page_index for c in retry] == [0, 1], "still marked for demotion"
    mgr.complete_copies(ids(retry))
    assert mgr.requests["a"].count(PageState.HOST) == 2
    mgr.check()
    pool.check(mgr)


def test_pages_whose_copies_the_pool_holds_become_both_in_any_order_and_keep_relief_ascending():
    # Proactive copy finds the host pool already holding two pages' content (an earlier
    # request's landed copies) and makes them BOTH without a copy, in one batch. They come
    # after pages the request copied itself (a cancelled copy's page is retried last), so
    # relief's list, oldest first, must take them in before those.
    mgr, pool = manager(num_blocks=40, host_pages=32)
    hashes = [f"h{i}" for i in range(6)]
    mgr.add_request("b", block_hashes=hashes)
    grow(mgr, pool, "b", 6, 6 * BLOCK)
    copies = mgr.plan_copies()
    assert sorted(c.page_index for c in copies) == list(range(6))
    mgr.cancel_copies(ids(c for c in copies if c.page_index < 2))
    mgr.complete_copies(ids(c for c in copies if c.page_index >= 2))
    req = mgr.requests["b"]
    assert req.both_demotable == [2, 3, 4] and list(req.uncopied) == [0, 1]
    earlier = {}
    for block_hash in ("h1", "h0"):
        page = mgr.host_pool.allocate()
        mgr.host_pool.publish(page, block_hash)
        mgr.host_pool.release(page)
        earlier[block_hash] = page
    assert mgr.plan_copies() == [], "both pages' content is in the pool already"
    assert req.both_demotable == [0, 1, 2, 3, 4] and not req.uncopied
    assert [req.pages[i].host_page for i in (0, 1)] == [earlier["h0"], earlier["h1"]]
    assert mgr.counters.copies_avoided == 2
    assert mgr.pages_by_state() == {PageState.DEVICE: 0, PageState.BOTH: 6, PageState.HOST: 0}
    mgr.check()
    pool.check(mgr)
    assert mgr.relieve_pressure(2) == 2  # net of the hot lease the first demotion takes
    host = [i for i in range(6) if req.pages[i].state is PageState.HOST]
    assert host[:2] == [0, 1] and host == list(range(len(host))), "oldest first"
    mgr.check()
    pool.check(mgr)


def test_a_page_shared_with_another_request_frees_nothing_when_demoted():
    mgr, pool = manager(num_blocks=16, hot_rows=64, proactive_copy=True)
    mgr.add_request("a")
    grow(mgr, pool, "a", 3, 3 * BLOCK)
    shared = pool.tables["a"][0]
    pool.hold(shared)  # another request's block table references the same prefix block
    pool.tables["b"] = [shared]
    mgr.complete_copies(ids(mgr.plan_copies()))
    free_before = pool.num_free_blocks()
    freed = mgr.relieve_pressure(2)
    assert pool.num_free_blocks() == free_before + freed
    assert shared[0] not in pool.free and mgr.requests["a"].pages[0].state is PageState.HOST
    mgr.check()
    pool.check(mgr)
    end(mgr, pool, "a")
    pool.free_request("b")
    assert pool.num_free_blocks() == pool.num_blocks


def test_a_lease_is_no_larger_than_the_whole_context():
    mgr, pool = manager(num_blocks=64, hot_rows=512)  # the default lease: 8 blocks
    mgr.add_request("short", max_tokens=200)  # 4 pages at most
    mgr.add_request("long", max_tokens=4000)
    mgr.add_request("unknown")
    assert mgr.requests["short"].lease_blocks == 4
    assert mgr.requests["long"].lease_blocks == mgr.requests["unknown"].lease_blocks == 8
    lease = mgr.lease(mgr.requests["short"].lease_blocks)
    mgr.add_request("hit", max_tokens=200)
    pool.add_placeholders("hit", 1)
    host_page = mgr.host_pool.allocate()
    mgr.append_host_pages("hit", [host_page], lease)  # the reference passes to the request
    assert len(mgr.requests["hit"].hot_blocks) == 4
    with pytest.raises(ValueError, match="hot lease is 4 blocks, got 8"):
        mgr.add_request("hit2", max_tokens=200)
        mgr.append_host_pages("hit2", [], mgr.lease())
    mgr.check()


def test_relief_never_marks_a_victim_whose_demotion_cannot_pay_for_its_lease():
    """Ten short requests (each a whole context smaller than the default lease, but more
    than its demotable pages): demoting any of them frees less than its lease takes, so
    relief frees nothing, marks nothing, and the scheduler is not asked to wait."""
    mgr, pool = manager(num_blocks=60, host_pages=64, hot_rows=1024, proactive_copy=False)
    for i in range(10):
        mgr.add_request(f"r{i}", max_tokens=5 * BLOCK)
        grow(mgr, pool, f"r{i}", 5, 5 * BLOCK)
    for _ in range(60):
        assert mgr.relieve_pressure(4) == 0
        assert not mgr.relief_pending() and not mgr.defer_preemption()
        mgr.complete_copies(ids(mgr.plan_copies()))
        mgr.end_schedule()
    assert mgr.counters.pages_demoted == 0 and mgr.counters.hot_leases == 0
    mgr.check()


def test_a_marked_victim_that_cannot_pay_when_its_copies_land_is_unmarked():
    mgr, pool = manager(num_blocks=12, hot_rows=128, proactive_copy=False)  # two-block lease
    mgr.add_request("a")
    grow(mgr, pool, "a", 5, 5 * BLOCK)
    assert mgr.relieve_pressure(2) == 0
    copies = mgr.plan_copies()
    assert len(copies) == 4 and mgr.relief_pending()
    # Meanwhile another request shares the marked pages (a prefix hit): demoting them
    # would free nothing, and the pool cannot spare the lease either.
    for page in mgr.requests["a"].pages[:4]:
        pool.hold(page.block_ids)
    pool.take(pool.num_free_blocks())
    assert mgr.complete_copies(ids(copies)) == 0
    assert not mgr.relief_pending() and not mgr.defer_preemption(), "nothing left to wait for"
    assert mgr.counters.victims_skipped == 1 and mgr.requests["a"].count(PageState.HOST) == 0
    mgr.check()


def test_preemption_waits_for_relief_a_bounded_number_of_steps():
    mgr, pool = manager(num_blocks=16, hot_rows=64, proactive_copy=False)
    mgr.add_request("a")
    grow(mgr, pool, "a", 6, 6 * BLOCK)
    mgr.relieve_pressure(2)
    in_flight = mgr.plan_copies()  # copies that never land: a stalled worker
    waited = 0
    while mgr.defer_preemption():
        assert mgr.defer_preemption(), "one step defers each of its requests alike"
        mgr.end_schedule()
        waited += 1
        assert waited <= MAX_PREEMPTION_DEFERRALS
    assert waited == MAX_PREEMPTION_DEFERRALS and mgr.counters.deferrals_exhausted == 1
    mgr.end_schedule()  # a step that deferred nothing (the scheduler preempted)
    assert mgr.defer_preemption(), "the next pressure may wait again"
    mgr.end_schedule()
    assert mgr.complete_copies(ids(in_flight)) > 0
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
        self.pool = BlockPoolModel(num_blocks * blocks_per_page)
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
        self.in_flight: list[list] = []
        self.next_id = 0
        self.tokens: dict[str, int] = {}
        self.max_tokens: dict[str, int | None] = {}
        # Finished requests whose blocks a KV connector still sends: their block tables as
        # they were when the connector took them, until they end.
        self.held: dict[str, list] = {}

    def active(self) -> list[str]:
        """Requests still running (a held request has finished: it neither grows nor is
        preempted)."""
        return sorted(name for name in self.mgr.requests if name not in self.held)

    @rule(shared_prefix=st.integers(0, 3), restore=st.booleans(), max_tokens=st.none() | st.integers(1, 800))
    def add(self, shared_prefix, restore, max_tokens):
        """A new request; a host-only prefix is taken as placeholders plus a hot lease, or
        (`restore`, a KV connector hit) restored into newly allocated blocks. `max_tokens`
        bounds its context (None: unknown), which sizes its lease."""
        if max_tokens is not None:
            max_tokens = max(max_tokens, (shared_prefix + 4) * BLOCK)
        name = f"r{self.next_id}"
        self.next_id += 1
        hashes = [f"p{i}" for i in range(shared_prefix)] + [f"{name}-{i}" for i in range(4)]
        hits = self.mgr.retain_host_prefix(hashes)
        if restore and hits and len(hits) * self.mgr.blocks_per_page <= self.pool.num_free_blocks():
            blocks = self.pool.allocate_pages(name, len(hits), self.mgr.blocks_per_page)
            self.mgr.add_request(name, hashes, max_tokens)
            for block_ids, page in zip(blocks, hits, strict=True):
                self.mgr.append_restored_page(name, block_ids, page)
        else:
            self.mgr.add_request(name, hashes, max_tokens)
            lease = self.mgr.lease(self.mgr.requests[name].lease_blocks) if hits else []
            if not lease:
                for page in hits:  # no room for a hot buffer: the prefix is recomputed
                    self.mgr.host_pool.release(page)
                hits = []
            self.pool.add_placeholders(name, len(hits))
            if hits:
                self.mgr.append_host_pages(name, hits, lease)
        self.tokens[name] = len(hits) * BLOCK
        self.max_tokens[name] = max_tokens
        self.mgr.advance(name, self.tokens[name])

    @precondition(lambda self: self.active())
    @rule(data=st.data(), new_tokens=st.integers(1, 200))
    def grow(self, data, new_tokens):
        name = data.draw(st.sampled_from(self.active()))
        req = self.mgr.requests[name]
        target = min(self.tokens[name] + new_tokens, self.max_tokens.get(name) or 1 << 30)
        need = max(-(-target // BLOCK) - len(req.pages), 0)
        blocks = need * self.mgr.blocks_per_page
        if blocks > self.pool.num_free_blocks():
            self.mgr.relieve_pressure(blocks - self.pool.num_free_blocks(), protect=name)
        if blocks > self.pool.num_free_blocks():
            return  # the scheduler would preempt: modelled by finish
        self.mgr.append_pages(name, self.pool.allocate_pages(name, need, self.mgr.blocks_per_page))
        self.tokens[name] = target
        self.mgr.advance(name, target)

    @precondition(lambda self: self.active())
    @rule(data=st.data(), rejected=st.integers(1, 130), prefilling=st.booleans())
    def reject(self, data, rejected, prefilling):
        """Rejected draft tokens: the stable count falls back, and completed pages with it."""
        name = data.draw(st.sampled_from(self.active()))
        self.tokens[name] = max(self.tokens[name] - rejected, 0)
        self.mgr.advance(name, self.tokens[name])
        self.mgr.set_prefilling(name, prefilling)

    @rule()
    def plan(self):
        copies = self.mgr.plan_copies()
        for copy in copies:  # only complete pages: their rows are all verified tokens'
            assert copy.page_index < self.mgr.requests[copy.request_id].num_complete_pages, copy
        self.in_flight.append(copies)

    @rule()
    def output_processed(self):
        """A step's output is processed: mode "always" demotes the settled pages."""
        self.mgr.demote_settled()

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), lands=st.booleans())
    def land(self, data, lands):
        batch = self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1)))
        free_before = self.pool.num_free_blocks()
        if lands:
            freed = self.mgr.complete_copies(ids(batch))
            assert self.pool.num_free_blocks() >= free_before + freed
        else:
            self.mgr.cancel_copies(ids(batch))

    @precondition(lambda self: self.mgr.requests)
    @rule(data=st.data(), blocks=st.integers(1, 12))
    def pressure(self, data, blocks):
        protect = data.draw(st.sampled_from(sorted(self.mgr.requests)))
        hosted = self.mgr.requests[protect].num_host_pages
        free_before = self.pool.num_free_blocks()
        freed = self.mgr.relieve_pressure(blocks, protect=protect)
        assert self.pool.num_free_blocks() == free_before + freed
        assert self.mgr.requests[protect].num_host_pages == hosted, "the protected request keeps its pages"

    @precondition(lambda self: self.mgr.requests)
    @rule(data=st.data(), blocks=st.integers(1, 12))
    def wait_for_blocks(self, data, blocks):
        """Liveness: while a request waits for blocks, every step frees some, or the
        scheduler preempts after at most MAX_PREEMPTION_DEFERRALS steps that freed none,
        whether or not the workers report their copies."""
        protect = data.draw(st.sampled_from(sorted(self.mgr.requests)))
        idle_steps = 0
        for _ in range(3 * MAX_PREEMPTION_DEFERRALS):
            free_before = self.pool.num_free_blocks()
            if free_before >= blocks:
                return
            self.mgr.relieve_pressure(blocks - free_before, protect=protect)
            if self.pool.num_free_blocks() >= blocks or not self.mgr.defer_preemption():
                self.mgr.end_schedule()
                return  # served, or the scheduler preempts
            self.in_flight.append(self.mgr.plan_copies())
            if data.draw(st.booleans()):
                self.mgr.complete_copies(ids(self.in_flight.pop()))
            self.mgr.end_schedule()
            idle_steps = 0 if self.pool.num_free_blocks() > free_before else idle_steps + 1
            assert idle_steps <= MAX_PREEMPTION_DEFERRALS, "preemption waited on relief that frees nothing"

    @precondition(lambda self: self.active())
    @rule(data=st.data())
    def preempt_and_resume(self, data):
        """Preemption: the request ends (copies of its pages may still be in flight) and comes
        back under the same id, so its pages are planned again before the first reports land."""
        name = data.draw(st.sampled_from(self.active()))
        hashes = self.mgr.requests[name].block_hashes
        end(self.mgr, self.pool, name)
        self.mgr.add_request(name, hashes, self.max_tokens[name])
        self.tokens[name] = 0

    @precondition(lambda self: self.mgr.requests)
    @rule(data=st.data())
    def finish(self, data):
        """A request ends: it finished (or its connector finished sending), or was aborted."""
        name = data.draw(st.sampled_from(sorted(self.mgr.requests)))
        end(self.mgr, self.pool, name)
        del self.tokens[name]
        self.held.pop(name, None)

    @precondition(lambda self: self.active())
    @rule(data=st.data())
    def hold(self, data):
        """A request finishes while a KV connector still sends its blocks (a P/D producer):
        from here until it ends, its block table must not change, whatever copies, landings
        and pressure come."""
        name = data.draw(st.sampled_from(self.active()))
        self.mgr.hold(name)
        self.held[name] = list(self.pool.tables.get(name, []))

    @invariant()
    def invariants_hold(self):
        if not hasattr(self, "mgr"):
            return
        self.mgr.check()
        self.pool.check(self.mgr)
        for name, table in self.held.items():
            changed = self.pool.tables.get(name, []) != table
            assert not changed, f"held {name}'s blocks changed while a connector sends them"

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for name in list(self.mgr.requests):
            end(self.mgr, self.pool, name)
        for batch in self.in_flight:
            self.mgr.complete_copies(ids(batch))
        assert self.pool.num_free_blocks() == self.pool.num_blocks, "everything returns at the end"
        assert self.mgr.host_pool.num_referenced == 0
        self.mgr.check()


TestResidencyMachine = ResidencyMachine.TestCase
TestResidencyMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("mode", ["eager", ""])
def test_unknown_modes_are_refused(mode):
    with pytest.raises(ValueError, match="unknown HiSparse mode"):
        manager(mode=mode)


class _CountedPool(HostPagePool):
    """A host pool that counts the block hashes looked up (one by one and in batches)."""

    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages)
        self.looked_up: Counter[object] = Counter()

    def lookup(self, block_hash):
        self.looked_up[block_hash] += 1
        return super().lookup(block_hash)

    def lookup_all(self, block_hashes):
        self.looked_up.update(block_hashes)
        return super().lookup_all(block_hashes)


def _cached_copy(pool: HostPagePool, block_hash: str) -> int:
    """A durable copy of `block_hash` that nobody references (a finished turn's)."""
    page = pool.allocate()
    pool.publish(page, block_hash)
    pool.release(page)
    return page


def test_a_waiting_turns_host_copies_are_looked_up_again_only_when_they_may_have_changed():
    """`Admissions._waiting_copies`, which a turn waiting for its lease calls every step: the
    copies of its history from its first host page up to the first page the pool lacks. While
    no host page is evicted it looks up only the page past the copies it found last step; a
    copy published there lengthens the run; after an eviction it looks the run up again and
    ends it at the evicted page."""
    from types import SimpleNamespace

    from vllm.v1.hisparse.admission import Admissions
    from vllm.v1.hisparse.kv_import import ConnectorImports

    pool = _CountedPool(16)
    hashes = [f"h{i}" for i in range(12)]
    copies = [_cached_copy(pool, h) for h in hashes[:10]]  # h10 and h11: never copied
    admissions = Admissions(
        None,  # type: ignore[arg-type]  # the host pool is all this method reads
        SimpleNamespace(host_pool=pool),  # type: ignore[arg-type]
        block_size=16,
        host_prefix_hits=True,
        imports=ConnectorImports(None),
        lease_blocks_for=lambda request: 1,
        plans_issued=lambda: True,
    )

    def waiting_walk() -> list[int]:
        pool.looked_up.clear()
        first = [pool.lookup(hashes[0])]  # the walk's lookup of its first host page
        found = admissions._waiting_copies("turn", hashes, first)
        admissions.end_step()
        return found

    assert waiting_walk() == copies and set(pool.looked_up) == set(hashes), "first step: every page"
    for _ in range(3):
        assert waiting_walk() == copies
        assert set(pool.looked_up) == {"h0", "h10"}, f"a later step looked up {sorted(pool.looked_up)}"
    published = _cached_copy(pool, "h10")
    assert waiting_walk() == [*copies, published], "a copy published past the run lengthens it"
    # Every other copy referenced and every free page taken: the next allocation evicts h5's.
    pool.retain_all(c for c in [*copies, published] if c != copies[5])
    for _ in range(pool.num_pages - 11):
        pool.allocate()
    evictions = pool.evictions
    pool.allocate()
    assert pool.evictions == evictions + 1 and pool.lookup("h5") is None
    assert waiting_walk() == copies[:5], "the run ends at the evicted page"
    assert {"h1", "h2", "h3", "h4", "h5"} <= set(pool.looked_up), "looked up again after an eviction"


def test_a_landing_takes_only_host_pages_released_before_the_last_step_whose_output_is_in():
    """Pages released while step 5 may still run (scheduled, its output not processed) are
    not given to a connector's landing until step 5 is settled; other allocations take
    them (the device orders their copies after the forward)."""
    pool = HostPagePool(4)
    pool.track_releases = True
    pages = [pool.allocate() for _ in range(4)]
    pool.publish(pages[0], "h0")
    pool.settle(4)
    pool.step_scheduled = 5
    pool.release(pages[0])
    pool.release_all([pages[1]])
    assert pool.num_available == 2 and pool.num_settled == 0
    assert pool.allocate_settled(1) is None and pool.num_available == 2, "nothing taken"
    pool.settle(5)
    assert pool.num_settled == 2
    taken = pool.allocate_settled(2)
    assert taken is not None and sorted(taken) == sorted(pages[:2])
    assert pool.lookup("h0") is None, "the cached copy was evicted for the landing"
    pool.check()
    pool.release_all(taken)
    again = pool.allocate()  # a copy's allocation does not wait
    assert again in pages[:2] and pool.num_settled == 1, "released after step 5 settled: free at once"
    pool.check()


def test_a_landings_pages_given_back_unwritten_stay_settled_for_the_next_landing():
    """A landing took settled pages, but its request was not scheduled (its allocation
    failed): no connector wrote them and no forward read them. Given back stamped with the
    step in flight, they could not be landed on in the next step, and that landing went to
    the device for want of settled pages."""
    pool = HostPagePool(6)
    pool.track_releases = True
    pool.settle(4)
    pool.step_scheduled = 5
    taken = pool.allocate_settled(6)
    assert taken is not None
    for page in taken:
        pool.release(page, written=False)
    assert pool.num_settled == 6, "the next step's landing may take them"
    pool.release(pool.allocate())  # written (by a copy), released while step 5 may run
    assert pool.num_settled == 5
    pool.check()


class Draws:
    """A fixed sequence of the state machine's draws."""

    def __init__(self, *values):
        self.values = list(values)

    def draw(self, strategy):
        return self.values.pop(0)


def marked_under_pressure(host_pages: int, budget: int) -> ResidencyMachine:
    """r0 with three complete pages, then r1, whose arrival's pressure marks r0's pages."""
    machine = ResidencyMachine()
    machine.setup(num_blocks=8, host_pages=host_pages, hot_rows=64, mode="hybrid", proactive=False,
                  budget=budget, blocks_per_page=1)  # fmt: skip
    machine.add(max_tokens=None, restore=False, shared_prefix=0)
    machine.grow(data=Draws("r0"), new_tokens=192)
    machine.add(max_tokens=None, restore=False, shared_prefix=0)
    machine.pressure(blocks=1, data=Draws("r1"))
    return machine


def test_a_marked_page_that_rejected_drafts_left_incomplete_is_not_copied():
    """r0's pages are marked for demotion under pressure, then rejected drafts make page 1
    incomplete again: its rows past the verified tokens hold the rejected drafts' KV, so
    it is neither copied nor demoted until it is complete again (the scheduler passes
    `advance` the verified tokens, which never fall back; the manager does not rely on it)."""

    machine = marked_under_pressure(host_pages=4, budget=4)
    r0 = machine.mgr.requests["r0"]
    assert r0.pages.demote_when_copied[:2] == [True, True], "pages 0 and 1 were marked"
    machine.reject(data=Draws("r0"), prefilling=False, rejected=65)
    assert r0.num_complete_pages == 1
    copies = machine.mgr.plan_copies()
    assert [(c.request_id, c.page_index) for c in copies] == [("r0", 0)]
    machine.in_flight.append(copies)
    machine.invariants_hold()
    machine.grow(data=Draws("r0"), new_tokens=65)  # page 1 complete again: pressure may mark it
    assert 1 in r0.uncopied and not r0.pages.demote_when_copied[1]


def test_a_held_requests_marked_page_that_rejected_drafts_left_incomplete_awaits_no_copy():
    """Found by the state machine: r0's pages are marked for demotion under pressure, then
    rejected drafts make page 1 incomplete again, then r0 is held for a KV connector. The
    hold unmarked page 1 and put it among the pages awaiting a copy, incomplete."""

    machine = marked_under_pressure(host_pages=1, budget=1)
    machine.reject(data=Draws("r0"), prefilling=False, rejected=65)
    assert not machine.mgr.requests["r0"].pages.demote_when_copied[1], "the rejection unmarked page 1"
    machine.hold(data=Draws("r0"))
    assert 1 not in machine.mgr.requests["r0"].uncopied
    machine.invariants_hold()
