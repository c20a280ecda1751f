# SPDX-License-Identifier: Apache-2.0
"""Hybrid HiSparse residency: per-page state of the sparse-MLA KV of each request.

Owns, on the scheduler side and in pure Python, where every page (one KV block
of the sparse-MLA cache) of every running request lives, and the decisions that
move pages: proactive device->host copies of completed pages, demotion of
pages under pool pressure (leasing the request a hot buffer), and returning
everything when a request ends. It decides; workers execute the copies it plans
and report them back through `complete_copies` (or `cancel_copies` when a copy
did not happen).

A page is the same 64-token block position in each of the k sparse-MLA KV cache
groups (see kv_grouping), so it holds k device blocks, moved together. Page
states: DEVICE (only on the GPU), BOTH (on the GPU and durably in the host
pool), HOST (only in the host pool). A request's state is derived from its
pages, never stored: FULL (no HOST page), MIXED (some HOST pages, some
resident pages outside its tail), NONE (HOST pages and no resident page outside
its tail: a request started from a host-only prefix, or one demoted to its tail).
The tail is the page being written plus the last RESIDENT_TAIL_PAGES complete
pages; policy never demotes it.

The device blocks of a page belong to the request's block table in the KV cache
manager: this module never frees them itself. It asks the allocator to drop a
demoted page from the table (`drop_page`), and to hold an extra reference on
the blocks of a copy still in flight when its request ends (`hold`), so a block
the worker is still reading is never handed to another request. Hot-buffer
leases are blocks this module takes from and gives back to the same pool.

Invariants (asserted by `check`, held by the property tests):
- a page leaves the GPU only after its host copy is durable;
- every device block reference is owned once: by a request's page (through
  its block table), a hot lease, or an in-flight copy of an ended request;
- host pool accounting never goes negative;
- a finished or aborted request returns every lease and host reference
  (held blocks of copies in flight return when the copy lands or is cancelled).

It never touches tensors, the scheduler's queues or the worker.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Hashable, Sequence, Set
from dataclasses import dataclass, field
from typing import Protocol

from vllm.config.hisparse import RESIDENT_TAIL_PAGES
from vllm.v1.hisparse.host_pool import HostPagePool, HostPoolExhausted
from vllm.v1.hisparse.plan import PageCopy


class PageState(enum.Enum):
    DEVICE = "device"
    BOTH = "both"
    HOST = "host"


class RequestState(enum.Enum):
    FULL = "full"
    MIXED = "mixed"
    NONE = "none"


class BlockAllocator(Protocol):
    """The shared device block pool and the requests' block tables, as HiSparse sees them."""

    def num_free_blocks(self) -> int: ...

    def take(self, num_blocks: int) -> list[int]:
        """New blocks for a hot lease (one reference each)."""

    def give_back(self, block_ids: Sequence[int]) -> None:
        """Drop one reference of each block (a lease or a `hold`)."""

    def hold(self, block_ids: Sequence[int]) -> None:
        """Take one more reference of each block (a copy outlives its request)."""

    def num_exclusive(self, block_ids: Sequence[int]) -> int:
        """How many of these blocks only one reference holds (dropping it frees them)."""

    def drop_page(self, request_id: str, page_index: int, block_ids: Sequence[int]) -> int:
        """Remove a demoted page from the request's block table and drop its references.

        Returns how many blocks that returned to the free pool (a block another
        request still shares stays allocated).
        """


@dataclass
class Page:
    block_ids: tuple[int, ...] | None  # one device block per sparse-MLA group; None once HOST
    host_page: int | None = None  # host slot (reserved while a copy is in flight)
    copying: bool = False  # a device->host copy into host_page is in flight
    demote_when_copied: bool = False  # free the device block once the copy lands

    @property
    def state(self) -> PageState:
        if self.block_ids is None:
            return PageState.HOST
        if self.host_page is not None and not self.copying:
            return PageState.BOTH
        return PageState.DEVICE


@dataclass
class RequestResidency:
    request_id: str
    pages: list[Page] = field(default_factory=list)
    num_complete_pages: int = 0  # pages whose tokens are all computed (and cached)
    hot_blocks: list[int] = field(default_factory=list)
    # Page-level block hashes; may be a live view that grows with the request.
    block_hashes: Sequence[Hashable] = ()
    # HOST pages never turn resident again, so a count keeps FULL an O(1) check.
    num_host_pages: int = 0

    @property
    def state(self) -> RequestState:
        if not self.num_host_pages:
            return RequestState.FULL
        if all(p.state is PageState.HOST for p in self.pages[: self.num_demotable_pages]):
            return RequestState.NONE
        return RequestState.MIXED

    def count(self, state: PageState) -> int:
        return sum(p.state is state for p in self.pages)

    @property
    def num_demotable_pages(self) -> int:
        """Leading pages that may leave the device: complete and not in the resident tail."""
        return max(0, self.num_complete_pages - RESIDENT_TAIL_PAGES)

    def page_hash(self, index: int) -> Hashable | None:
        return self.block_hashes[index] if index < len(self.block_hashes) else None


@dataclass
class ResidencyCounters:
    """Cumulative counts, for metrics and logs."""

    pages_copied_to_host: int = 0
    copies_cancelled: int = 0
    pages_demoted: int = 0
    blocks_freed_under_pressure: int = 0
    hot_leases: int = 0
    host_prefix_pages_reused: int = 0
    pages_restored: int = 0
    preemptions_avoided: int = 0


class ResidencyManager:
    def __init__(
        self,
        allocator: BlockAllocator,
        host_pool: HostPagePool,
        block_size: int,
        hot_buffer_rows: int,
        blocks_per_page: int = 1,
        mode: str = "hybrid",
        proactive_copy: bool = True,
        max_copies_per_step: int = 64,
    ) -> None:
        if mode not in ("hybrid", "always"):
            raise ValueError(f"unknown HiSparse mode {mode!r}")
        self.allocator = allocator
        self.host_pool = host_pool
        self.block_size = block_size
        self.blocks_per_page = blocks_per_page
        self.hot_lease_blocks = math.ceil(hot_buffer_rows / block_size) * blocks_per_page
        self.mode = mode
        self.proactive_copy = proactive_copy
        self.max_copies_per_step = max_copies_per_step
        self.requests: dict[str, RequestResidency] = {}
        # Copies still in flight for requests that already ended: (held blocks, host page, hash).
        self._orphans: dict[tuple[str, int], tuple[tuple[int, ...], int, Hashable | None]] = {}
        # Host pages held for restores into requests' blocks, until the pages are appended.
        self._restoring: dict[str, list[int]] = {}
        self.counters = ResidencyCounters()

    # -- request lifecycle ---------------------------------------------------

    def add_request(self, request_id: str, block_hashes: Sequence[Hashable] = ()) -> None:
        """Register a request. `block_hashes` holds one hash per page (a live view is fine)."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id} is already registered")
        self.requests[request_id] = RequestResidency(request_id, block_hashes=block_hashes)

    def host_prefix(self, block_hashes: Sequence[Hashable], start_page: int = 0) -> list[int]:
        """Host pages holding durable copies of consecutive pages from `start_page` on."""
        pages = []
        for block_hash in block_hashes[start_page:]:
            page = self.host_pool.lookup(block_hash)
            if page is None:
                break
            pages.append(page)
        return pages

    def lease(self) -> list[int]:
        """Take a hot buffer's blocks from the pool (for a request about to start NONE)."""
        if self.allocator.num_free_blocks() < self.hot_lease_blocks:
            return []
        return self.allocator.take(self.hot_lease_blocks)

    def append_host_pages(
        self, request_id: str, host_pages: Sequence[int], hot_blocks: Sequence[int]
    ) -> None:
        """Pages the request takes from the host pool instead of recomputing them (it turns NONE)."""
        req = self.requests[request_id]
        if req.hot_blocks:
            self.allocator.give_back(hot_blocks)  # a lease it already holds serves these too
        else:
            if len(hot_blocks) != self.hot_lease_blocks:
                raise ValueError(f"a hot lease is {self.hot_lease_blocks} blocks, got {len(hot_blocks)}")
            req.hot_blocks = list(hot_blocks)
            self.counters.hot_leases += 1
        for page in host_pages:
            self.host_pool.retain(page)
            req.pages.append(Page(block_ids=None, host_page=page))
        req.num_host_pages += len(host_pages)
        self.counters.host_prefix_pages_reused += len(host_pages)

    def append_pages(self, request_id: str, pages: Sequence[Sequence[int]]) -> None:
        """New pages the KV cache manager gave the request, in order: k block ids each."""
        for block_ids in pages:
            if len(block_ids) != self.blocks_per_page:
                raise ValueError(f"a page has {self.blocks_per_page} blocks, got {list(block_ids)}")
        self.requests[request_id].pages.extend(Page(block_ids=tuple(b)) for b in pages)

    def reserve_restore(self, request_id: str, host_page: int) -> None:
        """Hold `host_page` for a page about to be restored into a request's new blocks.

        The request need not be registered yet (it may wait for a KV connector's
        load); `append_restored_page` or `finish` takes the reference back.
        """
        self.host_pool.retain(host_page)
        self._restoring.setdefault(request_id, []).append(host_page)
        self.counters.pages_restored += 1

    def append_restored_page(self, request_id: str, block_ids: Sequence[int], host_page: int) -> None:
        """A new page whose device blocks were filled from a reserved host page: BOTH at once."""
        if len(block_ids) != self.blocks_per_page:
            raise ValueError(f"a page has {self.blocks_per_page} blocks, got {list(block_ids)}")
        reserved = self._restoring.get(request_id, [])
        reserved.remove(host_page)  # ValueError if it was never reserved
        if not reserved:
            self._restoring.pop(request_id, None)
        self.requests[request_id].pages.append(Page(block_ids=tuple(block_ids), host_page=host_page))

    def advance(self, request_id: str, num_stable_tokens: int) -> None:
        """Tokens computed and committed: pages wholly below this may be copied and demoted."""
        req = self.requests[request_id]
        req.num_complete_pages = min(len(req.pages), num_stable_tokens // self.block_size)

    def finish(self, request_id: str) -> None:
        """Return the leases and host references of a finished, aborted or preempted request.

        Its page blocks are the block table's to free; a page still being copied
        keeps one held reference until its copy lands or is cancelled.
        """
        for host_page in self._restoring.pop(request_id, ()):
            self.host_pool.release(host_page)
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for index, page in enumerate(req.pages):
            if page.copying:
                assert page.block_ids is not None and page.host_page is not None
                self.allocator.hold(page.block_ids)
                self._orphans[(request_id, index)] = (page.block_ids, page.host_page, req.page_hash(index))
            elif page.host_page is not None:
                self.host_pool.release(page.host_page)
        self.allocator.give_back(req.hot_blocks)

    # -- copies --------------------------------------------------------------

    def plan_copies(self) -> list[PageCopy]:
        """Device->host copies for this step's post-forward launch, bounded per step.

        Pages marked for demotion go first, then (mode "always" or proactive
        copy) every completed page. MIXED and NONE requests get proactive copies
        too: a later request's host prefix hit, or a KV connector hit, needs every
        page of the prefix in the host pool. Mode
        "always" also demotes, without pressure, every copied page that has left
        the resident tail.
        """
        if self.mode == "always":
            for req in list(self.requests.values()):
                settled = [i for i, p in enumerate(req.pages[: req.num_demotable_pages])
                           if p.state is PageState.BOTH]
                if settled:
                    self._demote(req, settled)
        wanted: list[tuple[RequestResidency, int]] = []
        for req in self.requests.values():
            eager = self.mode == "always" or self.proactive_copy
            for index, page in enumerate(req.pages[: req.num_complete_pages]):
                if page.state is PageState.DEVICE and not page.copying:
                    if page.demote_when_copied or eager:
                        wanted.append((req, index))
        if self.mode == "always":
            for req, index in wanted:
                if index < req.num_demotable_pages:
                    req.pages[index].demote_when_copied = True
        wanted.sort(key=lambda item: not item[0].pages[item[1]].demote_when_copied)
        copies: list[PageCopy] = []
        for req, index in wanted[: self.max_copies_per_step]:
            try:
                host_page = self.host_pool.allocate()
            except HostPoolExhausted:
                break
            page = req.pages[index]
            assert page.block_ids is not None
            page.host_page, page.copying = host_page, True
            copies.append(PageCopy(req.request_id, index, page.block_ids, host_page))
        return copies

    def complete_copies(self, copies: Sequence[PageCopy]) -> int:
        """The worker reports these copies durable: DEVICE -> BOTH (or -> HOST if demoting).

        Returns the device blocks that returned to the free pool.
        """
        freed = 0
        demote: dict[str, list[int]] = {}
        for copy in copies:
            orphan = self._orphans.pop((copy.request_id, copy.page_index), None)
            if orphan is not None:
                block_ids, host_page, block_hash = orphan
                if block_hash is not None:
                    self.host_pool.publish(host_page, block_hash)
                self.host_pool.release(host_page)
                self.allocator.give_back(block_ids)
                continue
            req = self.requests[copy.request_id]
            page = req.pages[copy.page_index]
            assert page.copying and page.block_ids == copy.block_ids and page.host_page == copy.host_page
            page.copying = False
            self.counters.pages_copied_to_host += 1
            block_hash = req.page_hash(copy.page_index)
            if block_hash is not None:
                self.host_pool.publish(copy.host_page, block_hash)
            if page.demote_when_copied:
                demote.setdefault(copy.request_id, []).append(copy.page_index)
        for request_id, indices in demote.items():
            freed += self._demote(self.requests[request_id], indices)
        return freed

    def cancel_copies(self, copies: Sequence[PageCopy]) -> None:
        """These copies did not happen: the pages stay DEVICE and their host slots return."""
        for copy in copies:
            self.counters.copies_cancelled += 1
            orphan = self._orphans.pop((copy.request_id, copy.page_index), None)
            if orphan is not None:
                block_ids, host_page, _ = orphan
                self.host_pool.release(host_page)
                self.allocator.give_back(block_ids)
                continue
            page = self.requests[copy.request_id].pages[copy.page_index]
            assert page.copying and page.host_page == copy.host_page
            self.host_pool.release(copy.host_page)
            page.host_page, page.copying = None, False

    # -- pressure ------------------------------------------------------------

    def demotable_blocks(self) -> int:
        """Blocks that pressure relief could free right now (BOTH pages), ignoring lease costs."""
        return self.blocks_per_page * sum(
            p.state is PageState.BOTH
            for req in self.requests.values()
            for p in req.pages[: req.num_demotable_pages]
        )

    def relieve_pressure(
        self, blocks_needed: int, protect: str | None = None, protected_blocks: Set[int] = frozenset()
    ) -> int:
        """Free device blocks by demoting pages, before the scheduler preempts anyone.

        Frees BOTH pages at once (their host copies are durable), cheapest first:
        requests with the most BOTH pages, oldest pages first. Never the tail
        (the page being written and the last RESIDENT_TAIL_PAGES complete ones),
        never `protect`'s pages, never a page holding one of `protected_blocks`.
        A request's first demotion costs it a hot lease, so it is demoted only
        if that frees more than the lease takes. If that is not enough, marks
        completed DEVICE pages for copy-then-free in the next `plan_copies`.
        Returns blocks freed now, net of leases taken.
        """
        freed_total = 0
        victims = sorted(
            (r for r in self.requests.values() if r.request_id != protect),
            key=lambda r: -r.count(PageState.BOTH),
        )
        for req in victims:
            if freed_total >= blocks_needed:
                break
            both = [i for i, p in enumerate(req.pages[: req.num_demotable_pages])
                    if p.state is PageState.BOTH
                    and not (protected_blocks and protected_blocks.intersection(p.block_ids or ()))]
            lease_cost = 0 if req.hot_blocks else self.hot_lease_blocks
            pages_wanted = math.ceil((blocks_needed - freed_total + lease_cost) / self.blocks_per_page)
            take = both[: max(0, pages_wanted)]
            if len(take) * self.blocks_per_page <= lease_cost:
                continue
            freed_total += self._demote(req, take)
        self.counters.blocks_freed_under_pressure += max(freed_total, 0)
        if freed_total < blocks_needed:
            self._mark_for_demotion(math.ceil((blocks_needed - freed_total) / self.blocks_per_page), protect)
        return freed_total

    def relief_pending(self) -> bool:
        """Whether pages marked for copy-then-free will free blocks once their copies land."""
        can_copy = self.host_pool.num_available > 0
        return any(
            page.demote_when_copied and page.block_ids is not None and (page.copying or can_copy)
            for req in self.requests.values()
            for page in req.pages
        )

    def _mark_for_demotion(self, num_pages: int, protect: str | None) -> None:
        for req in sorted(self.requests.values(), key=lambda r: -r.num_complete_pages):
            if req.request_id == protect:
                continue
            for page in req.pages[: req.num_demotable_pages]:
                if num_pages <= 0:
                    return
                if page.state is PageState.DEVICE and not page.demote_when_copied:
                    page.demote_when_copied = True
                    num_pages -= 1

    def _demote(self, req: RequestResidency, indices: Sequence[int]) -> int:
        """BOTH -> HOST for these pages; returns blocks returned to the pool, net of a new lease.

        A request's first demotion leases its hot buffer from the blocks the
        demotion frees (topped up from the pool); if even that cannot cover the
        lease, nothing is demoted and the pages stay BOTH, still marked.
        """
        if not req.hot_blocks:
            freeable = sum(
                self.allocator.num_exclusive(req.pages[i].block_ids or ()) for i in indices
            )
            if freeable + self.allocator.num_free_blocks() < self.hot_lease_blocks:
                return 0
        freed = 0
        for index in indices:
            page = req.pages[index]
            assert page.state is PageState.BOTH, "a page leaves the GPU only once its copy is durable"
            assert page.block_ids is not None
            freed += self.allocator.drop_page(req.request_id, index, page.block_ids)
            page.block_ids = None
            page.demote_when_copied = False
        req.num_host_pages += len(indices)
        self.counters.pages_demoted += len(indices)
        if not req.hot_blocks:
            req.hot_blocks = self.allocator.take(self.hot_lease_blocks)
            freed -= self.hot_lease_blocks
            self.counters.hot_leases += 1
        return freed

    # -- observation ---------------------------------------------------------

    def requests_by_state(self) -> dict[RequestState, int]:
        out = dict.fromkeys(RequestState, 0)
        for req in self.requests.values():
            out[req.state] += 1
        return out

    def pages_by_state(self) -> dict[PageState, int]:
        out = dict.fromkeys(PageState, 0)
        for req in self.requests.values():
            for page in req.pages:
                out[page.state] += 1
        return out

    def leased_blocks(self) -> list[int]:
        return [b for req in self.requests.values() for b in req.hot_blocks]

    def held_blocks(self) -> list[int]:
        return [b for blocks, _, _ in self._orphans.values() for b in blocks]

    def check(self) -> None:
        """Assert the invariants in the module docstring."""
        leased = self.leased_blocks()
        assert len(leased) == len(set(leased)), "a hot-lease block is leased twice"
        host_refs: dict[int, int] = {}
        for req in self.requests.values():
            assert req.num_host_pages == req.count(PageState.HOST)
            assert len(req.hot_blocks) in (0, self.hot_lease_blocks)
            if req.state is not RequestState.FULL:
                assert req.hot_blocks, "a request with HOST pages has a hot buffer"
            for page in req.pages:
                if page.block_ids is None:
                    assert page.host_page is not None and not page.copying
                if page.host_page is not None:
                    host_refs[page.host_page] = host_refs.get(page.host_page, 0) + 1
        for _, host_page, _ in self._orphans.values():
            host_refs[host_page] = host_refs.get(host_page, 0) + 1
        for host_page in (page for pages in self._restoring.values() for page in pages):
            host_refs[host_page] = host_refs.get(host_page, 0) + 1
        for host_page, refs in host_refs.items():
            assert self.host_pool.refs(host_page) == refs, f"host page {host_page} refs disagree"
        assert self.host_pool.num_referenced == len(host_refs)
        self.host_pool.check()
