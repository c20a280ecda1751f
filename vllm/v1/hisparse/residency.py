# SPDX-License-Identifier: Apache-2.0
"""Hybrid HiSparse residency: per-page state of the sparse-MLA KV of each request.

Owns, on the scheduler side and in pure Python, where every page (one KV block
of the sparse-MLA cache) of every running request lives, and the decisions that
move pages: proactive device->host copies of completed pages, demotion of
pages under pool pressure (leasing the request a hot buffer), and returning
everything when a request ends. It decides; workers execute the copies it plans
and report them back through `complete_copies`.

A page is the same 64-token block position in each of the k sparse-MLA KV cache
groups (see kv_grouping), so it holds k device blocks, moved together. Page
states: DEVICE (only on the GPU), BOTH (on the GPU and durably in the host
pool), HOST (only in the host pool). A request's state is derived from its
pages, never stored: FULL (no HOST page), MIXED (some HOST pages, others
resident), NONE (no resident page outside its tail).

Invariants (asserted by `check`, held by the property tests):
- a page leaves the GPU only after its host copy is durable;
- every device block is owned once: by a page, a hot lease, an in-flight copy
  of a finished request, or the allocator;
- host pool accounting never goes negative;
- a finished or aborted request returns every block and host reference
  (blocks still being copied return when their copy completes).

It never touches tensors, the scheduler's queues or the worker.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from vllm.v1.hisparse.host_pool import HostPagePool, HostPoolExhausted


class PageState(enum.Enum):
    DEVICE = "device"
    BOTH = "both"
    HOST = "host"


class RequestState(enum.Enum):
    FULL = "full"
    MIXED = "mixed"
    NONE = "none"


class BlockAllocator(Protocol):
    """The shared device block pool, as HiSparse sees it."""

    def num_free_blocks(self) -> int: ...

    def take(self, num_blocks: int) -> list[int]: ...

    def give_back(self, block_ids: Sequence[int]) -> None: ...


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
    num_complete_pages: int = 0  # pages whose tokens are all computed
    hot_blocks: list[int] = field(default_factory=list)
    block_hashes: list[Hashable] = field(default_factory=list)

    @property
    def state(self) -> RequestState:
        complete = self.pages[: self.num_complete_pages]
        if all(p.state is not PageState.HOST for p in self.pages):
            return RequestState.FULL
        if all(p.state is PageState.HOST for p in complete):
            return RequestState.NONE
        return RequestState.MIXED

    def count(self, state: PageState) -> int:
        return sum(p.state is state for p in self.pages)


@dataclass(frozen=True)
class PageCopy:
    """One page, all sparse-MLA layers, device -> host after the forward."""

    request_id: str
    page_index: int
    block_ids: tuple[int, ...]
    host_page: int


@dataclass
class ResidencyCounters:
    pages_copied_to_host: int = 0
    pages_demoted: int = 0
    blocks_freed_under_pressure: int = 0
    hot_leases: int = 0
    host_prefix_pages_reused: int = 0


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
        # Copies still in flight for requests that already ended: (blocks, host page, hash).
        self._orphans: dict[tuple[str, int], tuple[tuple[int, ...], int, Hashable | None]] = {}
        self.counters = ResidencyCounters()

    # -- request lifecycle ---------------------------------------------------

    def add_request(self, request_id: str, block_hashes: Sequence[Hashable] = ()) -> int:
        """Register a request; returns the prompt tokens its host-only prefix provides.

        Leading complete blocks whose copies sit in the host pool become HOST pages
        (the request starts NONE, with a hot buffer) instead of being recomputed.
        """
        if request_id in self.requests:
            raise ValueError(f"request {request_id} is already registered")
        req = RequestResidency(request_id, block_hashes=list(block_hashes))
        self.requests[request_id] = req
        hits = []
        for block_hash in block_hashes:
            page = self.host_pool.lookup(block_hash)
            if page is None:
                break
            hits.append(page)
        if not hits or self.allocator.num_free_blocks() < self.hot_lease_blocks:
            return 0
        for page in hits:
            self.host_pool.retain(page)
            req.pages.append(Page(block_ids=None, host_page=page))
        req.num_complete_pages = len(hits)
        self._lease_hot_buffer(req)
        self.counters.host_prefix_pages_reused += len(hits)
        return len(hits) * self.block_size

    def append_pages(self, request_id: str, pages: Sequence[Sequence[int]]) -> None:
        """New pages the KV cache manager gave the request, in order: k block ids each."""
        for block_ids in pages:
            if len(block_ids) != self.blocks_per_page:
                raise ValueError(f"a page has {self.blocks_per_page} blocks, got {list(block_ids)}")
        self.requests[request_id].pages.extend(Page(block_ids=tuple(b)) for b in pages)

    def advance(self, request_id: str, num_computed_tokens: int) -> None:
        req = self.requests[request_id]
        req.num_complete_pages = min(len(req.pages), num_computed_tokens // self.block_size)

    def finish(self, request_id: str) -> None:
        """Return every block and host reference of a finished, aborted or preempted request."""
        req = self.requests.pop(request_id)
        blocks = list(req.hot_blocks)
        for index, page in enumerate(req.pages):
            if page.copying:
                # The worker still reads the block and writes the host page.
                assert page.block_ids is not None and page.host_page is not None
                block_hash = req.block_hashes[index] if index < len(req.block_hashes) else None
                self._orphans[(request_id, index)] = (page.block_ids, page.host_page, block_hash)
                continue
            if page.block_ids is not None:
                blocks.extend(page.block_ids)
            if page.host_page is not None:
                self.host_pool.release(page.host_page)
        self.allocator.give_back(blocks)

    # -- copies --------------------------------------------------------------

    def plan_copies(self) -> list[PageCopy]:
        """Device->host copies for this step's post-forward launch, bounded per step.

        Pages marked for demotion go first, then (mode "always") every completed
        page, then (proactive copy) completed pages of FULL requests.
        """
        wanted: list[tuple[RequestResidency, int]] = []
        for req in self.requests.values():
            eager = self.mode == "always" or (self.proactive_copy and req.state is RequestState.FULL)
            for index, page in enumerate(req.pages[: req.num_complete_pages]):
                if page.state is PageState.DEVICE and not page.copying:
                    if page.demote_when_copied or eager:
                        wanted.append((req, index))
        wanted.sort(key=lambda item: not item[0].pages[item[1]].demote_when_copied)
        if self.mode == "always":
            for req, index in wanted:
                req.pages[index].demote_when_copied = True
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

    def complete_copies(self, copies: Sequence[PageCopy]) -> None:
        """The worker reports these copies durable: DEVICE -> BOTH (or -> HOST if demoting)."""
        freed: list[int] = []
        demote: dict[str, list[int]] = {}
        for copy in copies:
            orphan = self._orphans.pop((copy.request_id, copy.page_index), None)
            if orphan is not None:
                block_ids, host_page, block_hash = orphan
                if block_hash is not None:
                    self.host_pool.publish(host_page, block_hash)
                self.host_pool.release(host_page)
                freed.extend(block_ids)
                continue
            req = self.requests[copy.request_id]
            page = req.pages[copy.page_index]
            assert page.copying and page.block_ids == copy.block_ids and page.host_page == copy.host_page
            page.copying = False
            self.counters.pages_copied_to_host += 1
            if copy.page_index < len(req.block_hashes):
                self.host_pool.publish(copy.host_page, req.block_hashes[copy.page_index])
            if page.demote_when_copied:
                demote.setdefault(copy.request_id, []).append(copy.page_index)
        for request_id, indices in demote.items():
            freed.extend(self._demote(self.requests[request_id], indices))
        self.allocator.give_back(freed)

    # -- pressure ------------------------------------------------------------

    def relieve_pressure(self, blocks_needed: int, protect: str | None = None) -> int:
        """Free device blocks by demoting pages, before the scheduler preempts anyone.

        Frees BOTH pages at once (their host copies are durable), cheapest first:
        requests with the most BOTH pages, oldest pages first, never the tail
        (incomplete pages), never `protect`'s pages. A request's first demotion
        costs it a hot lease, so it is demoted only if that frees more than the
        lease takes. If that is not enough, marks completed DEVICE pages for
        copy-then-free in the next `plan_copies`. Returns blocks freed now.
        """
        freed_total = 0
        victims = sorted(
            (r for r in self.requests.values() if r.request_id != protect),
            key=lambda r: -r.count(PageState.BOTH),
        )
        for req in victims:
            if freed_total >= blocks_needed:
                break
            both = [i for i, p in enumerate(req.pages[: req.num_complete_pages])
                    if p.state is PageState.BOTH]
            lease_cost = 0 if req.hot_blocks else self.hot_lease_blocks
            pages_wanted = math.ceil((blocks_needed - freed_total + lease_cost) / self.blocks_per_page)
            take = both[: max(0, pages_wanted)]
            if len(take) * self.blocks_per_page <= lease_cost:
                continue
            blocks = self._demote(req, take)
            self.allocator.give_back(blocks)
            freed_total += len(blocks)
        self.counters.blocks_freed_under_pressure += freed_total
        if freed_total < blocks_needed:
            self._mark_for_demotion(math.ceil((blocks_needed - freed_total) / self.blocks_per_page), protect)
        return freed_total

    def _mark_for_demotion(self, num_pages: int, protect: str | None) -> None:
        for req in sorted(self.requests.values(), key=lambda r: -r.num_complete_pages):
            if req.request_id == protect:
                continue
            for page in req.pages[: req.num_complete_pages]:
                if num_pages <= 0:
                    return
                if page.state is PageState.DEVICE and not page.demote_when_copied:
                    page.demote_when_copied = True
                    num_pages -= 1

    def _demote(self, req: RequestResidency, indices: Sequence[int]) -> list[int]:
        """BOTH -> HOST for these pages; returns the device blocks to free (net of a new lease).

        A request's first demotion leases its hot buffer out of the freed blocks
        (topped up from the pool); if even that cannot cover the lease, nothing
        is demoted and the pages stay BOTH, still marked.
        """
        freeable = len(indices) * self.blocks_per_page
        if not req.hot_blocks and freeable + self.allocator.num_free_blocks() < self.hot_lease_blocks:
            return []
        blocks: list[int] = []
        for index in indices:
            page = req.pages[index]
            assert page.state is PageState.BOTH, "a page leaves the GPU only once its copy is durable"
            assert page.block_ids is not None
            blocks.extend(page.block_ids)
            page.block_ids = None
            page.demote_when_copied = False
        self.counters.pages_demoted += len(indices)
        if not req.hot_blocks:
            req.hot_blocks, blocks = blocks[: self.hot_lease_blocks], blocks[self.hot_lease_blocks :]
            if len(req.hot_blocks) < self.hot_lease_blocks:
                req.hot_blocks += self.allocator.take(self.hot_lease_blocks - len(req.hot_blocks))
            self.counters.hot_leases += 1
        return blocks

    def _lease_hot_buffer(self, req: RequestResidency) -> None:
        req.hot_blocks = self.allocator.take(self.hot_lease_blocks)
        self.counters.hot_leases += 1

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

    def device_blocks_held(self) -> list[int]:
        held = [b for blocks, _, _ in self._orphans.values() for b in blocks]
        for req in self.requests.values():
            held += req.hot_blocks
            held += [b for p in req.pages if p.block_ids is not None for b in p.block_ids]
        return held

    def check(self) -> None:
        """Assert the invariants in the module docstring."""
        held = self.device_blocks_held()
        assert len(held) == len(set(held)), "a device block is owned twice"
        host_refs: dict[int, int] = {}
        for req in self.requests.values():
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
        for host_page, refs in host_refs.items():
            assert self.host_pool.refs(host_page) == refs, f"host page {host_page} refs disagree"
        assert self.host_pool.num_referenced == len(host_refs)
        self.host_pool.check()
