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
demoted pages from the table (`drop_pages`), and to hold an extra reference on
the blocks of a copy still in flight when its request ends (`hold`), so a block
the worker is still reading is never handed to another request. Hot-buffer
leases are blocks this module takes from and gives back to the same pool.

Every copy it plans has its own id (`PageCopy.copy_id`), and reports name
copies by id: a preempted request that resumes plans its pages again while the
first copies may still be in flight, and a late report must reach its own copy.

Host pages come to a request with their reference: `append_host_pages` and
`append_restored_page` take over the reference the caller (admission) holds.

Invariants (asserted by `check`, held by the property tests; the ownership of
every block across all its holders is `ownership.py`'s):
- a page leaves the GPU only after its host copy is durable;
- every copy in flight is the copy of exactly one page (or of an ended request's
  page, whose blocks it holds), and holds its host page alone;
- host pool accounting never goes negative;
- a finished or aborted request returns every lease and host reference
  (held blocks of copies in flight return when the copy lands or is cancelled).

It never touches tensors, the scheduler's queues or the worker.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import math
from collections import Counter
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, overload

from vllm.config.hisparse import MAX_PREEMPTION_DEFERRALS, RESIDENT_TAIL_PAGES
from vllm.v1.hisparse.host_pool import HostPagePool, HostPoolExhausted
from vllm.v1.hisparse.plan import (
    NOT_ON_HOST,
    BlockId,
    CopyId,
    HostPage,
    HostPageRun,
    PageCopy,
    PageIndex,
    host_page_runs,
)


class PageState(enum.Enum):
    DEVICE = "device"
    BOTH = "both"
    HOST = "host"

    # Members are singletons compared by identity: hashing by identity agrees with that,
    # and costs a C call instead of Enum's Python-level hash of the name (the per-state
    # counts are updated for every page a request registers).
    __hash__ = object.__hash__


class RequestState(enum.Enum):
    FULL = "full"
    MIXED = "mixed"
    NONE = "none"

    __hash__ = object.__hash__  # as PageState's


class BlockAllocator(Protocol):
    """The shared device block pool and the requests' block tables, as HiSparse sees them."""

    def num_free_blocks(self) -> int: ...

    def take(self, num_blocks: int) -> list[BlockId]:
        """New blocks for a hot lease (one reference each)."""

    def give_back(self, block_ids: Sequence[int]) -> int:
        """Drop one reference of each block (a lease or a `hold`); how many lost their last one."""

    def frees_are_deferred(self) -> bool:
        """Whether a block whose last reference is dropped now returns only after the step
        in flight (the scheduler's deferred-free fence), not at once."""

    def hold(self, block_ids: Sequence[int]) -> None:
        """Take one more reference of each block (a copy outlives its request)."""

    def num_exclusive(self, block_ids: Sequence[int]) -> int:
        """How many of these blocks only one reference holds (dropping it frees them)."""

    def drop_pages(self, request_id: str, pages: Sequence[tuple[int, Sequence[int]]]) -> int:
        """Remove demoted pages, (page index, block ids) each, from the request's block
        table and drop their references, all at once.

        Returns how many blocks lost their last reference (a block another request
        still shares stays allocated); they return to the free pool at once, or
        after the step in flight when frees are deferred.
        """


class PageTable:
    """One request's pages, held column by column: a page is an index into four lists.

    A request's history is thousands of pages (2,200 at 142K tokens), and a page object
    per page would be that many objects the garbage collector tracks for the life of
    the request: each admitted history then brings Python's full collection closer,
    which walks every request's token lists (about 90 ms per pass at 64 sessions of
    142K tokens). Four lists are four objects however long the history is. `Page` is
    a view of one index, made where code reads or changes one page.
    """

    __slots__ = ("block_ids", "copy_id", "demote_when_copied", "host_page")

    def __init__(self) -> None:
        # One device block per sparse-MLA group; None once HOST.
        self.block_ids: list[tuple[BlockId, ...] | None] = []
        # Host slot (reserved while a copy is in flight).
        self.host_page: list[HostPage | None] = []
        # The device->host copy into host_page in flight.
        self.copy_id: list[CopyId | None] = []
        # Free the device block once the copy lands.
        self.demote_when_copied: list[bool] = []

    def __len__(self) -> int:
        return len(self.block_ids)

    @overload
    def __getitem__(self, index: int) -> Page: ...

    @overload
    def __getitem__(self, index: slice) -> list[Page]: ...

    def __getitem__(self, index: int | slice) -> Page | list[Page]:
        if isinstance(index, slice):
            return [Page(self, i) for i in range(*index.indices(len(self.block_ids)))]
        if index < 0:
            index += len(self.block_ids)
        if not 0 <= index < len(self.block_ids):
            raise IndexError(f"page {index} of {len(self.block_ids)}")
        return Page(self, index)

    def __iter__(self) -> Iterator[Page]:
        return (Page(self, index) for index in range(len(self.block_ids)))

    def append(self, block_ids: tuple[BlockId, ...] | None, host_page: HostPage | None = None) -> None:
        self.block_ids.append(block_ids)
        self.host_page.append(host_page)
        self.copy_id.append(None)
        self.demote_when_copied.append(False)

    def extend_device(self, rows: Iterable[tuple[BlockId, ...]]) -> None:
        """DEVICE pages, one row of block ids each."""
        rows = list(rows)
        self.block_ids += rows
        self.host_page += [None] * len(rows)
        self._extend_unmarked(len(rows))

    def extend_host(self, host_pages: Iterable[HostPage]) -> None:
        """HOST pages, one host page each."""
        host_pages = list(host_pages)
        self.host_page += host_pages
        self.block_ids += [None] * len(host_pages)
        self._extend_unmarked(len(host_pages))

    def _extend_unmarked(self, num: int) -> None:
        """No copy in flight and no demotion mark for `num` new pages."""
        self.copy_id += [None] * num
        self.demote_when_copied += [False] * num

    def states(self) -> list[PageState]:
        """Every page's state, as `Page.state` gives one page's (for checks that read them all)."""
        host, both, device = PageState.HOST, PageState.BOTH, PageState.DEVICE
        return [
            host if ids is None else both if slot is not None and copy is None else device
            for ids, slot, copy in zip(self.block_ids, self.host_page, self.copy_id, strict=True)
        ]

    def num_leading_off_device(self, end: int) -> int:
        """How many pages from the first, before `end`, the host pool holds (HOST or BOTH),
        up to the first DEVICE one."""
        block_ids, host_page, copy_id = self.block_ids, self.host_page, self.copy_id
        for index in range(min(end, len(block_ids))):
            if block_ids[index] is not None and (host_page[index] is None or copy_id[index] is not None):
                return index
        return min(end, len(block_ids))


class Page:
    """One page of a `PageTable`, read and changed in place."""

    __slots__ = ("_table", "index")

    def __init__(self, table: PageTable, index: int) -> None:
        self._table = table
        self.index = index

    @property
    def block_ids(self) -> tuple[BlockId, ...] | None:
        return self._table.block_ids[self.index]

    @block_ids.setter
    def block_ids(self, value: tuple[BlockId, ...] | None) -> None:
        self._table.block_ids[self.index] = value

    @property
    def host_page(self) -> HostPage | None:
        return self._table.host_page[self.index]

    @host_page.setter
    def host_page(self, value: HostPage | None) -> None:
        self._table.host_page[self.index] = value

    @property
    def copy_id(self) -> CopyId | None:
        return self._table.copy_id[self.index]

    @copy_id.setter
    def copy_id(self, value: CopyId | None) -> None:
        self._table.copy_id[self.index] = value

    @property
    def demote_when_copied(self) -> bool:
        return self._table.demote_when_copied[self.index]

    @demote_when_copied.setter
    def demote_when_copied(self, value: bool) -> None:
        self._table.demote_when_copied[self.index] = value

    @property
    def copying(self) -> bool:
        return self._table.copy_id[self.index] is not None

    @property
    def state(self) -> PageState:
        table, index = self._table, self.index
        if table.block_ids[index] is None:
            return PageState.HOST
        if table.host_page[index] is not None and table.copy_id[index] is None:
            return PageState.BOTH
        return PageState.DEVICE


@dataclass
class RequestResidency:
    """One request's pages, with the counts and index lists the policy reads kept up to date
    as pages change state, so no decision rescans the pages a request holds."""

    request_id: str
    # Blocks of its hot lease (all sparse-MLA groups): the default lease, or fewer when
    # the request's whole context fits in fewer rows.
    lease_blocks: int
    pages: PageTable = field(default_factory=PageTable)
    num_complete_pages: int = 0  # pages whose tokens are all computed (and cached)
    hot_blocks: list[BlockId] = field(default_factory=list)
    # Page-level block hashes; may be a live view that grows with the request.
    block_hashes: Sequence[Hashable] = ()
    # Pages from this one on are never published (their KV is not to be trusted).
    publish_below: int = 1 << 62
    # Kept as pages change state, so FULL is an O(1) check.
    num_host_pages: int = 0
    num_both_pages: int = 0
    # HOST pages among the demotable ones (NONE when that is all of them).
    num_host_demotable: int = 0
    # BOTH pages among the demotable ones, ascending: what relief frees, oldest first.
    both_demotable: list[int] = field(default_factory=list)
    # Complete DEVICE pages with no copy in flight: proactive copy candidates.
    uncopied: dict[int, None] = field(default_factory=dict)
    # Pages whose device->host copy is in flight.
    copying: dict[int, None] = field(default_factory=dict)
    # Set by the scheduler: the request still has prompt tokens to compute.
    prefilling: bool = False
    # The request finished but a KV connector still reads its blocks: no page leaves
    # the device until it ends (`ResidencyManager.hold`).
    held: bool = False
    # A KV connector sends its blocks once it ends (a P/D producer's request): mode
    # "always" demotes none of its pages; relief under pressure still may.
    sends: bool = False

    @property
    def state(self) -> RequestState:
        if not self.num_host_pages:
            return RequestState.FULL
        if self.num_host_demotable == self.num_demotable_pages:
            return RequestState.NONE
        return RequestState.MIXED

    def count(self, state: PageState) -> int:
        if state is PageState.HOST:
            return self.num_host_pages
        if state is PageState.BOTH:
            return self.num_both_pages
        return len(self.pages) - self.num_host_pages - self.num_both_pages

    @property
    def num_demotable_pages(self) -> int:
        """Leading pages that may leave the device: complete and not in the resident tail."""
        return max(0, self.num_complete_pages - RESIDENT_TAIL_PAGES)

    def page_hash(self, index: int) -> Hashable | None:
        """The hash a copy of the page is published under; None where it has none yet,
        or where its KV is not to be published (`ResidencyManager.withdraw`)."""
        if index >= self.publish_below:
            return None
        return self.block_hashes[index] if index < len(self.block_hashes) else None


class PageHashes(Sequence[Hashable]):
    """A request's block hashes, one per page, from hashes made every `1 / ratio` of a page
    (vLLM's `hash_block_size` below the page, `--prefix-match-unit`): a page's is the hash of
    its last hash block, which, chained, names the whole prefix to the page's end. A live
    view: it grows with the request's list. (A finer hash alone names only the tokens up
    to its own end, and a host copy published under it would serve another prefix.)"""

    __slots__ = ("_hashes", "_ratio")

    def __init__(self, hashes: Sequence[Hashable], ratio: int) -> None:
        self._hashes, self._ratio = hashes, ratio

    def __len__(self) -> int:
        return len(self._hashes) // self._ratio

    @overload
    def __getitem__(self, index: int) -> Hashable: ...
    @overload
    def __getitem__(self, index: slice) -> list[Hashable]: ...
    def __getitem__(self, index: int | slice) -> Hashable | list[Hashable]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(index)
        return self._hashes[(index + 1) * self._ratio - 1]


def page_hashes(hashes: Sequence[Hashable], hash_block_size: int, page_size: int) -> Sequence[Hashable]:
    """One hash per page of `page_size` tokens from hashes made every `hash_block_size`; none
    (nothing published) where no hash ends at a page's end, or `hash_block_size` is 0."""
    if hash_block_size == page_size:
        return hashes
    if hash_block_size <= 0 or page_size % hash_block_size:
        return ()
    return PageHashes(hashes, page_size // hash_block_size)


@dataclass
class ResidencyCounters:
    """Cumulative counts, for metrics and logs."""

    pages_copied_to_host: int = 0
    copies_cancelled: int = 0
    pages_demoted: int = 0
    blocks_freed_under_pressure: int = 0
    hot_leases: int = 0
    host_prefix_pages_reused: int = 0
    # Pages of a KV connector's import written straight into the host pool.
    pages_imported_to_host: int = 0
    preemptions_avoided: int = 0
    # Proactive copies not made: the host pool already held the page's content.
    copies_avoided: int = 0
    # Victims unmarked because demoting them could not pay for their lease, and
    # preemptions allowed once deferrals reached MAX_PREEMPTION_DEFERRALS.
    victims_skipped: int = 0
    deferrals_exhausted: int = 0
    # HOST pages a prefill chunk restored to the device instead of staging their rows.
    pages_restored_for_prefill: int = 0


class ResidencyManager:
    """Per-page residency of every running request, and the policy that moves pages.

    Every decision works from counts and index lists kept up to date as pages
    change state (`RequestResidency`, `_marked`, `_page_counts`), so the work of
    a step follows what changed in it, not the pages the requests hold.
    """

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
        # Every copy planned and not yet reported, by id.
        self._in_flight: dict[CopyId, PageCopy] = {}
        self._copy_ids = itertools.count()
        # Those whose request already ended: the page's block hash, published once the
        # copy lands. The copy holds the page's blocks (`hold`) and its host page.
        self._orphans: dict[CopyId, Hashable | None] = {}
        self.counters = ResidencyCounters()
        # What changed since the last `drain_changes`, for the workers' maps: pages that
        # turned HOST (request, page index, host page) and leases taken (request, blocks).
        self._new_host_pages: list[HostPageRun] = []
        self._new_leases: list[tuple[str, list[BlockId]]] = []
        # DEVICE pages marked for copy-then-free, in marking order.
        self._marked: dict[tuple[str, int], None] = {}
        # Requests with demotable BOTH pages (mode "always" demotes them at once).
        self._settled: dict[str, None] = {}
        self._page_counts = dict.fromkeys(PageState, 0)
        # Consecutive scheduling steps that deferred a preemption with nothing freed since.
        self._deferrals = 0
        self._deferred_this_step = False

    # -- request lifecycle ---------------------------------------------------

    def add_request(
        self, request_id: str, block_hashes: Sequence[Hashable] = (), max_tokens: int | None = None
    ) -> None:
        """Register a request. `block_hashes` holds one hash per page (a live view is fine);
        `max_tokens`, the most tokens its context can reach, sizes its lease."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id} is already registered")
        self.requests[request_id] = RequestResidency(
            request_id, self.lease_blocks_for(max_tokens), block_hashes=block_hashes
        )

    def lease_blocks_for(self, max_tokens: int | None) -> int:
        """Blocks of the hot lease of a request whose context reaches at most `max_tokens`.

        The hot buffer holds only HOST rows, and a request never has more of them
        than its whole context: leasing more would take blocks nothing can use. A
        lease this small covers every row the request can demote, so its buffer
        never evicts and its steps never need staging rows.
        """
        if max_tokens is None:
            return self.hot_lease_blocks
        return min(self.hot_lease_blocks, -(-max_tokens // self.block_size) * self.blocks_per_page)

    def retain_host_prefix(self, block_hashes: Sequence[Hashable], start_page: int = 0) -> list[HostPage]:
        """Host pages holding durable copies of consecutive pages from `start_page` on,
        each retained for the caller (who hands the references on or releases them)."""
        pages = []
        for block_hash in block_hashes[start_page:]:
            page = self.host_pool.retain_cached(block_hash)
            if page is None:
                break
            pages.append(page)
        return pages

    def lease(self, num_blocks: int | None = None) -> list[BlockId]:
        """Take a hot buffer's blocks from the pool (for a request about to start NONE);
        `num_blocks` as `lease_blocks_for` sizes it, the default lease if None."""
        num_blocks = self.hot_lease_blocks if num_blocks is None else num_blocks
        if self.allocator.num_free_blocks() < num_blocks:
            return []
        return self.allocator.take(num_blocks)

    def append_host_pages(
        self,
        request_id: str,
        host_pages: Sequence[HostPage],
        hot_blocks: Sequence[BlockId],
        imported: bool = False,
        publish: bool = True,
    ) -> None:
        """Pages the request takes from the host pool instead of computing them (it turns NONE).

        The caller's reference of each host page passes to the request, and the
        lease's blocks pass to it too (or go back, if it already has a lease).
        `imported`: the pages are a KV connector's import that landed in the host
        pool; they are indexed by the request's block hashes, so later requests can
        start from them too (with `publish` False, once `publish_imported` says the
        load that fills them is done).
        """
        req = self.requests[request_id]
        if req.hot_blocks:
            if hot_blocks:
                self.allocator.give_back(hot_blocks)  # a lease it already holds serves these too
        else:
            if len(hot_blocks) != req.lease_blocks:
                raise ValueError(
                    f"{request_id}'s hot lease is {req.lease_blocks} blocks, got {len(hot_blocks)}"
                )
            req.hot_blocks = list(hot_blocks)
            self.counters.hot_leases += 1
            self._new_leases.append((request_id, req.hot_blocks))
        start = len(req.pages)
        if imported and publish:
            for index, page in enumerate(host_pages, start):
                if (block_hash := req.page_hash(index)) is not None:
                    self.host_pool.publish(page, block_hash, request_id)
        host_pages = tuple(host_pages)
        if host_pages:
            self._new_host_pages.append(HostPageRun(request_id, PageIndex(start), host_pages))
        req.pages.extend_host(host_pages)
        req.num_host_demotable += max(0, min(req.num_demotable_pages, start + len(host_pages)) - start)
        req.num_host_pages += len(host_pages)
        self._page_counts[PageState.HOST] += len(host_pages)
        if imported:
            self.counters.pages_imported_to_host += len(host_pages)
        else:
            self.counters.host_prefix_pages_reused += len(host_pages)

    def publish_imported(self, request_id: str, start: int, host_pages: Sequence[HostPage]) -> None:
        """Index imported pages (`append_host_pages` with `publish` False) by the request's
        block hashes, now that the load that filled them is done: those still the
        request's, on the same host pages."""
        req = self.requests.get(request_id)
        if req is None:
            return
        table = req.pages
        for index, page in enumerate(host_pages, start):
            if index < len(table) and table.host_page[index] == page and (block_hash := req.page_hash(index)):
                self.host_pool.publish(page, block_hash, request_id)

    def append_pages(self, request_id: str, pages: Sequence[Sequence[BlockId]]) -> None:
        """New pages the KV cache manager gave the request, in order: k block ids each."""
        width = self.blocks_per_page
        for block_ids in pages:
            if len(block_ids) != width:
                raise ValueError(f"a page has {width} blocks, got {list(block_ids)}")
        req = self.requests[request_id]
        start = len(req.pages)
        req.pages.extend_device(tuple(block_ids) for block_ids in pages)
        # Complete ones are proactive copy candidates, in page order.
        req.uncopied.update(dict.fromkeys(range(start, min(len(req.pages), req.num_complete_pages))))
        self._page_counts[PageState.DEVICE] += len(pages)

    def append_restored_page(
        self, request_id: str, block_ids: Sequence[BlockId], host_page: HostPage
    ) -> None:
        """A new page whose device blocks were filled from `host_page`: BOTH at once.

        The caller's reference of the host page passes to the request.
        """
        if len(block_ids) != self.blocks_per_page:
            raise ValueError(f"a page has {self.blocks_per_page} blocks, got {list(block_ids)}")
        req = self.requests[request_id]
        req.pages.append(tuple(block_ids), host_page)
        req.num_both_pages += 1
        self._page_counts[PageState.BOTH] += 1
        if len(req.pages) - 1 < req.num_demotable_pages:
            self._add_settled(req, len(req.pages) - 1)

    def host_page_indices(self, request_id: str) -> list[int]:
        """Indices of the request's HOST pages, ascending."""
        req = self.requests[request_id]
        if not req.num_host_pages:
            return []
        return [i for i, page in enumerate(req.pages) if page.block_ids is None]

    def restore_pages(self, request_id: str, pages: Sequence[tuple[int, Sequence[BlockId]]]) -> None:
        """HOST -> BOTH for these pages (index, device blocks each), filled from their host
        copies before the step's forward (the caller plans those copies and the block-table
        points); a prefill chunk restores instead of staging (`HiSparseScheduling.fit_chunk`).

        Each page keeps its host page, so it is durable at once and relief may drop it again
        without a copy (a relief later in the same step too: the restore then leaves the
        step's plan, `HiSparseScheduling._own_restores`). A request left with no HOST page
        is FULL: its hot lease goes back.
        """
        req = self.requests[request_id]
        demotable = req.num_demotable_pages
        for index, block_ids in pages:
            if len(block_ids) != self.blocks_per_page:
                raise ValueError(f"a page has {self.blocks_per_page} blocks, got {list(block_ids)}")
            page = req.pages[index]
            assert page.state is PageState.HOST, f"{request_id} page {index} is {page.state.name}, not HOST"
            page.block_ids = tuple(block_ids)
            if index < demotable:
                req.num_host_demotable -= 1
                self._add_settled(req, index)
        self._new_host_pages += host_page_runs(request_id, ((index, NOT_ON_HOST) for index, _ in pages))
        req.num_host_pages -= len(pages)
        req.num_both_pages += len(pages)
        self._page_counts[PageState.HOST] -= len(pages)
        self._page_counts[PageState.BOTH] += len(pages)
        self.counters.pages_restored_for_prefill += len(pages)
        if not req.num_host_pages and req.hot_blocks:
            self.allocator.give_back(req.hot_blocks)
            req.hot_blocks = []
            # A lease taken in this same step never reaches the workers.
            self._new_leases = [c for c in self._new_leases if c[0] != request_id]

    def advance(self, request_id: str, num_stable_tokens: int) -> None:
        """Tokens computed and committed: pages wholly below this may be copied and demoted."""
        req = self.requests[request_id]
        num_complete = min(len(req.pages), num_stable_tokens // self.block_size)
        if num_complete == req.num_complete_pages:  # most decode steps complete no page
            if not req.both_demotable:
                self._settled.pop(request_id, None)
            return
        complete_before, demotable_before = req.num_complete_pages, req.num_demotable_pages
        req.num_complete_pages = num_complete
        # A new turn completes its whole history at once: `Page.state` spelled out below,
        # on the page table's columns.
        uncopied = req.uncopied
        block_ids, host_page, copy_id = req.pages.block_ids, req.pages.host_page, req.pages.copy_id
        demote = req.pages.demote_when_copied
        for index in range(complete_before, req.num_complete_pages):  # newly complete
            # DEVICE, no copy in flight, not marked.
            if (
                block_ids[index] is not None
                and host_page[index] is None
                and copy_id[index] is None
                and not demote[index]
            ):
                uncopied[index] = None
        for index in range(req.num_complete_pages, complete_before):  # rejected speculative tokens
            uncopied.pop(index, None)
            if demote[index]:  # not to be copied (nor demoted) until it is complete again
                demote[index] = False
                self._marked.pop((request_id, index), None)
        for index in range(demotable_before, req.num_demotable_pages):  # newly demotable
            if block_ids[index] is None:  # HOST
                req.num_host_demotable += 1
            elif host_page[index] is not None and copy_id[index] is None:  # BOTH
                self._add_settled(req, index)
        for index in range(req.num_demotable_pages, demotable_before):
            state = req.pages[index].state
            if state is PageState.HOST:
                req.num_host_demotable -= 1
            elif state is PageState.BOTH:
                req.both_demotable.remove(index)
        if not req.both_demotable:
            self._settled.pop(request_id, None)

    def finish(self, request_id: str) -> None:
        """Return the leases and host references of a finished, aborted or preempted request.

        Its page blocks are the block table's to free; a page still being copied
        keeps one held reference until its copy lands or is cancelled.
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self._settled.pop(request_id, None)
        if req.num_host_pages or req.hot_blocks:
            self._new_host_pages = [c for c in self._new_host_pages if c[0] != request_id]
            self._new_leases = [c for c in self._new_leases if c[0] != request_id]
        for state in PageState:
            self._page_counts[state] -= req.count(state)  # kept as pages change (`check`)
        pages = req.pages
        # The marked pages and those being copied, from the columns and `copying` (kept as
        # pages change, `check`): not a pass per page of a history of thousands.
        if any(pages.demote_when_copied):
            for index in itertools.compress(itertools.count(), pages.demote_when_copied):
                self._marked.pop((request_id, index), None)
        for index in req.copying:
            copy_id = pages.copy_id[index]
            block_ids = pages.block_ids[index]
            assert copy_id is not None and block_ids is not None and pages.host_page[index] is not None
            self.allocator.hold(block_ids)
            self._orphans[copy_id] = req.page_hash(index)
        self.host_pool.release_all(
            page
            for page, copy_id in zip(pages.host_page, pages.copy_id, strict=True)
            if page is not None and copy_id is None
        )
        self.allocator.give_back(req.hot_blocks)

    def hold(self, request_id: str) -> None:
        """The request finished, but a KV connector still reads its blocks (a P/D producer
        sending them): from now until `finish`, none of its pages is demoted or marked."""
        req = self.requests.get(request_id)
        if req is None or req.held:
            return
        req.held = True
        self._settled.pop(request_id, None)
        for index, page in enumerate(req.pages):
            if page.demote_when_copied:
                page.demote_when_copied = False
                self._marked.pop((request_id, index), None)
                # Only a complete page awaits a copy (rejected drafts may have made a marked
                # page incomplete again).
                if page.state is PageState.DEVICE and not page.copying and index < req.num_complete_pages:
                    req.uncopied[index] = None

    def set_prefilling(self, request_id: str, prefilling: bool) -> None:
        """Whether the request still has prompt tokens to compute (relief prefers other victims)."""
        self.requests[request_id].prefilling = prefilling

    def drain_changes(self) -> tuple[list[HostPageRun], list[tuple[str, list[BlockId]]]]:
        """Pages that turned HOST and leases taken since the last call, for the workers' maps."""
        changes = self._new_host_pages, self._new_leases
        self._new_host_pages, self._new_leases = [], []
        return changes

    # -- copies --------------------------------------------------------------

    def demote_settled(self) -> None:
        """Mode "always": demote, without pressure, every copied page that has left the
        resident tail, except a held request's (`hold`), whose pages only become BOTH.
        Run once a step's output is processed (`HiSparseScheduling.on_model_output`), not
        while a step is scheduled: a demotion may take a hot lease, and every block taken
        in a schedule must be taken before the KV connector's step is built (an
        OffloadingConnector fences the blocks taken before it, `offloading.py`)."""
        if self.mode != "always":
            return
        for request_id in list(self._settled):
            req = self.requests[request_id]
            if not req.sends:
                self._demote(req, list(req.both_demotable))

    def plan_copies(self) -> list[PageCopy]:
        """Device->host copies for this step's post-forward launch, bounded per step.

        Pages marked for demotion go first, then (mode "always" or proactive
        copy) every completed page. MIXED and NONE requests get proactive copies
        too: a later request's host prefix hit, or a KV connector hit, needs every
        page of the prefix in the host pool.
        """
        wanted: list[tuple[str, int]] = []
        requests = self.requests
        for request_id, index in self._marked:
            if len(wanted) >= self.max_copies_per_step:
                break
            # DEVICE and not copying (`Page.state`, on the table's columns: the marked pages
            # of a step's many copies in flight are read every step); a BOTH one waits for
            # its lease.
            table = requests[request_id].pages
            if (
                table.block_ids[index] is not None
                and table.copy_id[index] is None
                and table.host_page[index] is None
            ):
                wanted.append((request_id, index))
        if self.mode == "always" or self.proactive_copy:
            for req in self.requests.values():
                if len(wanted) >= self.max_copies_per_step:
                    break
                if not req.uncopied:
                    continue
                indices = list(itertools.islice(req.uncopied, self.max_copies_per_step - len(wanted)))
                wanted += [(req.request_id, index) for index in self._reuse_host_copies(req, indices)]
        copies: list[PageCopy] = []
        for request_id, index in wanted[: self.max_copies_per_step]:
            try:
                host_page = self.host_pool.allocate()
            except HostPoolExhausted:
                break
            req = self.requests[request_id]
            table = req.pages  # DEVICE, not copying (`Page.state`, on the columns)
            block_ids = table.block_ids[index]
            assert block_ids is not None and table.host_page[index] is None and table.copy_id[index] is None
            copy = PageCopy(CopyId(next(self._copy_ids)), request_id, PageIndex(index), block_ids, host_page)
            table.host_page[index], table.copy_id[index] = host_page, copy.copy_id
            self._in_flight[copy.copy_id] = copy
            req.uncopied.pop(index, None)
            req.copying[index] = None
            if (
                self.mode == "always"
                and not req.held  # a connector still sends its blocks (`hold`)
                and not req.sends  # or will
                and index < req.num_demotable_pages
                and not table.demote_when_copied[index]
            ):
                self._mark(req, index)
            copies.append(copy)
        return copies

    def _reuse_host_copies(self, req: RequestResidency, indices: Sequence[int]) -> list[int]:
        """Complete DEVICE pages whose content the host pool already holds (an earlier
        request's copy of the same block hash, e.g. a session's history found again on the
        device): BOTH at once with that copy, retained, instead of copying it again. The
        pages, in order, that still need a copy."""
        hashes, host_pages, demote = req.block_hashes, req.pages.host_page, req.pages.demote_when_copied
        num_hashes, num_demotable = len(hashes), req.num_demotable_pages
        # A new turn's history is thousands of pages: retained in one call. A page marked for
        # demotion, or without a hash yet, is copied.
        eligible = [i for i in indices if i < num_hashes and not demote[i]]
        found = self.host_pool.retain_all_cached([hashes[i] for i in eligible])
        reused = [i for i, host_page in zip(eligible, found, strict=True) if host_page is not None]
        if not reused:
            return list(indices)
        copies = [host_page for host_page in found if host_page is not None]
        uncopied = req.uncopied
        for index, host_page in zip(reused, copies, strict=True):
            host_pages[index] = host_page
            uncopied.pop(index, None)
        self._add_all_settled(req, [i for i in reused if i < num_demotable])
        if len(reused) == len(indices):
            to_copy = []
        else:
            taken = set(reused)
            to_copy = [i for i in indices if i not in taken]
        req.num_both_pages += len(copies)
        self._page_counts[PageState.DEVICE] -= len(copies)
        self._page_counts[PageState.BOTH] += len(copies)
        self.counters.copies_avoided += len(copies)
        return to_copy

    def _reported(self, copy_id: CopyId) -> PageCopy:
        copy = self._in_flight.pop(copy_id, None)
        if copy is None:
            raise RuntimeError(
                f"Hybrid HiSparse: a worker reported copy {copy_id}, which is not in flight "
                "(never planned, or reported twice): scheduler and workers disagree"
            )
        return copy

    def _end_orphan(self, copy: PageCopy, landed: bool) -> bool:
        """A copy of an ended request's page ends: its host page and held blocks return
        (the host copy stays cached under its block hash if it landed). False if the
        copy's request is still running."""
        if copy.copy_id not in self._orphans:
            return False
        block_hash = self._orphans.pop(copy.copy_id)
        if landed and block_hash is not None:
            self.host_pool.publish(copy.host_page, block_hash, copy.request_id)
        self.host_pool.release(copy.host_page)
        self.allocator.give_back(copy.block_ids)
        return True

    def complete_copies(self, copy_ids: Iterable[CopyId]) -> int:
        """The worker reports these copies durable: DEVICE -> BOTH (or -> HOST if demoting).

        Returns the device blocks that lost their last reference.
        """
        freed = 0
        landed = 0
        demote: dict[str, list[int]] = {}
        requests, orphans, publish = self.requests, self._orphans, self.host_pool.publish
        try:
            for copy_id in copy_ids:
                copy = self._reported(copy_id)
                if orphans and self._end_orphan(copy, landed=True):
                    continue
                req = requests[copy.request_id]
                # DEVICE -> BOTH on the table's columns (`Page.state`): a first turn's prefill
                # lands about a page per 64 tokens, each read here once.
                table, index = req.pages, copy.page_index
                assert table.copy_id[index] == copy_id and table.block_ids[index] == copy.block_ids
                assert table.host_page[index] == copy.host_page
                table.copy_id[index] = None
                req.copying.pop(index, None)
                req.num_both_pages += 1
                landed += 1
                if index < req.num_demotable_pages:
                    self._add_settled(req, index)
                block_hash = req.page_hash(index)
                if block_hash is not None:
                    publish(copy.host_page, block_hash, copy.request_id)
                if table.demote_when_copied[index]:
                    demote.setdefault(copy.request_id, []).append(index)
        finally:
            # Counted once for the call; a report that names no copy in flight raises
            # after the pages before it changed state, and the counts keep up with them.
            self._page_counts[PageState.DEVICE] -= landed
            self._page_counts[PageState.BOTH] += landed
            self.counters.pages_copied_to_host += landed
        for request_id, indices in demote.items():
            freed += self._demote(self.requests[request_id], indices)
        return freed

    def cancel_copies(self, copy_ids: Iterable[CopyId]) -> None:
        """These copies did not happen: the pages stay DEVICE and their host slots return."""
        for copy_id in copy_ids:
            copy = self._reported(copy_id)
            self.counters.copies_cancelled += 1
            if self._end_orphan(copy, landed=False):
                continue
            req = self.requests[copy.request_id]
            page = req.pages[copy.page_index]
            assert page.copy_id == copy_id and page.host_page == copy.host_page
            self.host_pool.release(copy.host_page)
            page.host_page, page.copy_id = None, None
            req.copying.pop(copy.page_index, None)
            if copy.page_index < req.num_complete_pages and not page.demote_when_copied:
                req.uncopied[copy.page_index] = None

    def withdraw(self, request_id: str, first_page: int) -> list[HostPage]:
        """The request's KV from page `first_page` on is not to be trusted (a step of it
        failed on the workers): those pages' copies are never published, nor an ended
        request's copies of them in flight, and those it published already are forgotten
        (`HostPagePool.withdraw`). Its own host pages from there on (its copies and imports,
        not another request's copies it reused), which other requests may have taken."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        req.publish_below = min(req.publish_below, first_page)
        pool = self.host_pool
        found = [
            p
            for p in req.pages.host_page[first_page:]
            if p is not None and pool.published_by(p) in (request_id, None)
        ]
        hashes = req.block_hashes[first_page : req.num_complete_pages]
        pool.withdraw(hashes, request_id)
        self._unpublish_orphans(hashes)
        return found

    def withdraw_ended(self, request_id: str, page_hashes: Sequence[Hashable]) -> list[HostPage]:
        """`withdraw` for a request that has ended: its copies still in flight are not
        published when they land, and the copies it published under its pages' hashes are
        forgotten (returned)."""
        for copy_id in self._orphans:
            if self._in_flight[copy_id].request_id == request_id:
                self._orphans[copy_id] = None
        self._unpublish_orphans(page_hashes)
        return self.host_pool.withdraw(page_hashes, request_id)

    def _unpublish_orphans(self, page_hashes: Sequence[Hashable]) -> None:
        """Copies in flight of ended requests' pages with these hashes are not published
        when they land: another request that took a failed request's blocks as its prefix
        hit, and ended before the failure was reported, copies the same wrong KV."""
        if not self._orphans:
            return
        withdrawn = set(page_hashes)
        for copy_id, block_hash in self._orphans.items():
            if block_hash is not None and block_hash in withdrawn:
                self._orphans[copy_id] = None

    def forget_host_copies(self) -> None:
        """vLLM's prefix cache was reset (after a weight update, say): no copy made before
        is found again, and none in flight is published when it lands."""
        self.host_pool.forget_all()
        self._orphans = dict.fromkeys(self._orphans)
        for req in self.requests.values():
            req.publish_below = 0

    def cancel_all_copies(self) -> None:
        """Every copy in flight did not happen (the workers do not run plans)."""
        self.cancel_copies(list(self._in_flight))

    def copies_in_flight(self) -> list[PageCopy]:
        """Every copy planned and not yet reported, its request running or ended."""
        return list(self._in_flight.values())

    def num_copies_in_flight(self) -> int:
        return len(self._in_flight)

    # -- pressure ------------------------------------------------------------

    def relieve_pressure(
        self,
        blocks_needed: int,
        protect: str | None = None,
        protected_blocks: frozenset[int] | set[int] = frozenset(),
        durable_only: bool = False,
    ) -> int:
        """Free device blocks by demoting pages, before the scheduler preempts anyone.

        Frees BOTH pages at once (their host copies are durable), cheapest first:
        requests past their prompt before those still prefilling (a prefill chunk
        that reads host rows needs staging rows), then those with the most
        demotable BOTH pages, oldest pages first. Never the tail (the page being
        written and the last RESIDENT_TAIL_PAGES complete ones), never
        `protect`'s pages, never a page holding one of `protected_blocks` (a
        pending admission's prefix hit). A chunk scheduled this step may lose
        pages to a later relief in the same step: the step's plan carries them,
        and its resolution takes passes if its selections then outgrow its
        rows. A request's first demotion costs it a hot lease, so it is
        demoted only if that frees more than the lease takes. If that is
        not enough, marks completed DEVICE pages for copy-then-free in the next
        `plan_copies` (not with `durable_only`: only pages already on the host go).
        Returns blocks freed, net of leases taken (when frees are deferred, some of
        them return only after the step in flight).
        """
        freed_total = 0
        victims = sorted(
            (rid for rid in self._settled if rid != protect),
            key=lambda rid: (self.requests[rid].prefilling, -len(self.requests[rid].both_demotable)),
        )
        for request_id in victims:
            if freed_total >= blocks_needed:
                break
            req = self.requests[request_id]
            lease_cost = 0 if req.hot_blocks else req.lease_blocks
            pages_wanted = math.ceil((blocks_needed - freed_total + lease_cost) / self.blocks_per_page)
            take = list(
                itertools.islice(
                    (
                        i
                        for i in req.both_demotable
                        if not (
                            protected_blocks and protected_blocks.intersection(req.pages[i].block_ids or ())
                        )
                    ),
                    max(0, pages_wanted),
                )
            )
            if len(take) * self.blocks_per_page <= lease_cost:
                continue
            freed_total += self._demote(req, take)
        self.counters.blocks_freed_under_pressure += max(freed_total, 0)
        if freed_total < blocks_needed and not durable_only:
            self._mark_for_demotion(math.ceil((blocks_needed - freed_total) / self.blocks_per_page), protect)
        return freed_total

    def relief_pending(self) -> bool:
        """Whether pages marked for copy-then-free will free blocks once their copies land."""
        if not self._marked:
            return False
        if self.host_pool.num_available > 0:
            return True
        return any(self.requests[rid].pages[i].copying for rid, i in self._marked)

    def defer_preemption(self, frees_pending: bool = False) -> bool:
        """Whether the scheduler should wait a step for marked pages instead of preempting.

        Only while relief is pending (or `frees_pending`: freed blocks return after
        the step in flight), and for at most MAX_PREEMPTION_DEFERRALS consecutive
        steps with nothing freed: copies land within a step or two, so a longer wait
        means the marked pages cannot free anything and preempting is the only way
        forward.
        """
        if not (frees_pending or self.relief_pending()):
            return False
        if not self._deferred_this_step:
            if self._deferrals >= MAX_PREEMPTION_DEFERRALS:
                self.counters.deferrals_exhausted += 1
                return False
            self._deferrals += 1
            self._deferred_this_step = True
        return True

    def end_schedule(self) -> None:
        """A scheduling step is over: a step that deferred nothing ends a run of deferrals."""
        if not self._deferred_this_step:
            self._deferrals = 0
        self._deferred_this_step = False

    def _pays_for_lease(self, req: RequestResidency, num_pages: int) -> bool:
        """Whether demoting `num_pages` of the request's pages frees more blocks than its lease takes."""
        return bool(req.hot_blocks) or num_pages * self.blocks_per_page > req.lease_blocks

    def _mark_for_demotion(self, num_pages: int, protect: str | None) -> None:
        for req in sorted(self.requests.values(), key=lambda r: -r.num_complete_pages):
            if num_pages <= 0:
                return
            if req.request_id == protect or req.held:
                continue
            demotable = req.num_demotable_pages
            candidates = sorted(i for i in (*req.copying, *req.uncopied) if i < demotable)
            marks = req.pages.demote_when_copied
            already = sum(marks[i] for i in candidates)
            # A first demotion also pays for the lease, out of the pages it frees.
            lease_pages = 0 if req.hot_blocks or already else -(-req.lease_blocks // self.blocks_per_page)
            take = [i for i in candidates if not marks[i]][: num_pages + lease_pages]
            if not self._pays_for_lease(req, len(take) + already):
                continue  # its demotion would cost more blocks than it frees
            for index in take:
                self._mark(req, index)
            num_pages -= len(take) - lease_pages

    def _mark(self, req: RequestResidency, index: int) -> None:
        req.pages.demote_when_copied[index] = True
        req.uncopied.pop(index, None)
        self._marked[(req.request_id, index)] = None

    def _add_settled(self, req: RequestResidency, index: int) -> None:
        bisect.insort(req.both_demotable, index)
        if not req.held:
            self._settled[req.request_id] = None

    def _add_all_settled(self, req: RequestResidency, indices: list[int]) -> None:
        """`_add_settled` of each of these pages (a new turn's history reused at once: one
        merge, not an insertion per page)."""
        if not indices:
            return
        # Two ascending runs (a history's usual case) sort in one pass, the second past the
        # first in a few comparisons.
        req.both_demotable += indices
        req.both_demotable.sort()
        if not req.held:
            self._settled[req.request_id] = None

    def _demote(self, req: RequestResidency, indices: Sequence[int]) -> int:
        """BOTH -> HOST for these pages; returns blocks freed (now or at the fence), net of a new lease.

        A request's first demotion leases its hot buffer from the blocks the
        demotion frees (topped up from the pool); if even that cannot cover the
        lease, nothing is demoted and the pages stay BOTH, still marked.
        """
        if not indices:
            return 0
        table, request_id = req.pages, req.request_id
        block_ids, host_page, demote_when_copied = table.block_ids, table.host_page, table.demote_when_copied
        if not req.hot_blocks:
            # Blocks whose frees wait for the step in flight cannot fund the lease now.
            freeable = (
                0
                if self.allocator.frees_are_deferred()
                else sum(self.allocator.num_exclusive(block_ids[i] or ()) for i in indices)
            )
            if freeable + self.allocator.num_free_blocks() < req.lease_blocks:
                # It cannot pay for its lease: unmark, so no one waits on these pages.
                for index in indices:
                    if demote_when_copied[index]:
                        demote_when_copied[index] = False
                        self._marked.pop((request_id, index), None)
                self.counters.victims_skipped += 1
                return 0
        # BOTH pages only (`Page.state`, on the table's columns).
        copy_id = table.copy_id
        dropped = []
        for index in indices:
            blocks = block_ids[index]
            assert blocks is not None and host_page[index] is not None and copy_id[index] is None, (
                "a page leaves the GPU only once its copy is durable"
            )
            dropped.append((index, blocks))
        freed = self.allocator.drop_pages(request_id, dropped)
        demotable = req.num_demotable_pages
        marked = self._marked
        for index in indices:
            block_ids[index] = None
            if demote_when_copied[index]:
                demote_when_copied[index] = False
                marked.pop((request_id, index), None)
        req.num_host_demotable += sum(1 for index in indices if index < demotable)
        both = req.both_demotable
        if both:
            num = len(indices)
            if both[:num] == list(indices):
                # Relief takes the oldest BOTH pages first: drop them from the front.
                del both[:num]
            else:
                demoted = set(indices)
                req.both_demotable = [i for i in both if i not in demoted]
        req.num_host_pages += len(indices)
        req.num_both_pages -= len(indices)
        self._page_counts[PageState.BOTH] -= len(indices)
        self._page_counts[PageState.HOST] += len(indices)
        if not req.both_demotable:
            self._settled.pop(request_id, None)
        self.counters.pages_demoted += len(indices)
        demoted_pages: list[tuple[int, HostPage]] = []
        for i in indices:
            page = host_page[i]
            assert page is not None
            demoted_pages.append((i, page))
        self._new_host_pages += host_page_runs(request_id, demoted_pages)
        if not req.hot_blocks:
            req.hot_blocks = self.allocator.take(req.lease_blocks)
            freed -= req.lease_blocks
            self.counters.hot_leases += 1
            self._new_leases.append((req.request_id, req.hot_blocks))
        if freed > 0:
            self._deferrals = 0
        return freed

    # -- observation ---------------------------------------------------------

    def requests_by_state(self) -> dict[RequestState, int]:
        out = dict.fromkeys(RequestState, 0)
        for req in self.requests.values():
            out[req.state] += 1
        return out

    def pages_by_state(self) -> dict[PageState, int]:
        return dict(self._page_counts)

    def leased_blocks(self) -> list[int]:
        return [b for req in self.requests.values() for b in req.hot_blocks]

    def held_blocks(self) -> list[int]:
        """Blocks held for copies in flight of requests that ended (one reference each)."""
        return [b for copy_id in self._orphans for b in self._in_flight[copy_id].block_ids]

    def host_references(self) -> Counter[int]:
        """Host page -> the references this module holds: the pages of running requests
        (BOTH, HOST, or the destination of a copy in flight) and the destinations of
        ended requests' copies in flight."""
        refs: Counter[int] = Counter(
            page.host_page
            for req in self.requests.values()
            for page in req.pages
            if page.host_page is not None
        )
        refs.update(self._in_flight[copy_id].host_page for copy_id in self._orphans)
        return refs

    def check(self, other_host_references: Counter[int] | None = None) -> None:
        """Assert the invariants in the module docstring, and that every kept count and
        index list equals what the pages say. `other_host_references`: the host pool
        references held elsewhere (admission), so every reference has a holder."""
        leased = self.leased_blocks()
        assert len(leased) == len(set(leased)), "a hot-lease block is leased twice"
        page_counts = dict.fromkeys(PageState, 0)
        marked = set()
        for req in self.requests.values():
            pages = req.pages
            states = pages.states()
            demotable = req.num_demotable_pages
            assert req.num_host_pages == states.count(PageState.HOST)
            assert req.num_both_pages == states.count(PageState.BOTH)
            assert req.num_host_demotable == states[:demotable].count(PageState.HOST)
            assert req.both_demotable == [i for i in range(demotable) if states[i] is PageState.BOTH]
            assert (req.request_id in self._settled) == (bool(req.both_demotable) and not req.held)
            copying = [i for i, copy_id in enumerate(pages.copy_id) if copy_id is not None]
            assert set(req.copying) == set(copying)
            demote = pages.demote_when_copied
            assert set(req.uncopied) == {
                i
                for i in range(min(req.num_complete_pages, len(states)))
                if states[i] is PageState.DEVICE and pages.copy_id[i] is None and not demote[i]
            }
            marked |= {(req.request_id, i) for i, d in enumerate(demote) if d}
            # A connector still sends a held request's blocks: none of its pages may go.
            assert not (req.held and any(demote)), f"a page of held request {req.request_id} is marked"
            for state in states:
                page_counts[state] += 1
            assert len(req.hot_blocks) in (0, req.lease_blocks) and req.lease_blocks <= self.hot_lease_blocks
            if req.state is not RequestState.FULL:
                assert req.hot_blocks, "a request with HOST pages has a hot buffer"
            if req.lease_blocks < self.hot_lease_blocks:
                assert req.num_host_pages * self.blocks_per_page <= req.lease_blocks, (
                    "a lease sized to the whole context holds every HOST row"
                )
            assert all(
                slot is not None and copy_id is None
                for ids, slot, copy_id in zip(pages.block_ids, pages.host_page, pages.copy_id, strict=True)
                if ids is None
            ), "a HOST page has no host copy, or a copy in flight"
            for index in copying:
                page = pages[index]
                copy = self._in_flight.get(page.copy_id)  # type: ignore[arg-type]
                assert copy is not None and page.copy_id not in self._orphans, (
                    f"{req.request_id} page {index}: copy {page.copy_id} is not in flight for it"
                )
                assert (copy.request_id, copy.page_index) == (req.request_id, index)
                assert (copy.block_ids, copy.host_page) == (page.block_ids, page.host_page)
        for copy_id, copy in self._in_flight.items():
            if copy_id not in self._orphans:
                owner = self.requests.get(copy.request_id)
                assert owner is not None and owner.pages[copy.page_index].copy_id == copy_id, (
                    f"copy {copy_id} of {copy.request_id} page {copy.page_index} has no page waiting for it"
                )
            alone = self.host_pool.refs(copy.host_page) == 1 and not self.host_pool.is_indexed(copy.host_page)
            assert alone, f"host page {copy.host_page} is written by copy {copy_id} and held by another"
        assert set(self._orphans) <= set(self._in_flight)
        assert page_counts == self._page_counts
        assert marked == set(self._marked)
        host_refs = self.host_references()
        if other_host_references:
            host_refs.update(other_host_references)
        for host_page, refs in host_refs.items():
            assert self.host_pool.refs(host_page) == refs, (
                f"host page {host_page}: {self.host_pool.refs(host_page)} references, {refs} holders"
            )
        assert self.host_pool.num_referenced == len(host_refs), "a host page is referenced by no holder"
        self.host_pool.check()
