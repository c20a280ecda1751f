# SPDX-License-Identifier: Apache-2.0
"""Hybrid HiSparse admission: what a waiting request will use before it runs.

Owns one record per waiting request (`PendingAdmission`) holding everything
the request takes from the moment its prefix is looked up until its pages are
registered with residency:
- its device prefix-hit blocks, guarded from the lookup until the request's own
  allocation takes them: no hot lease or staging lease taken meanwhile (for any
  request, by pressure relief too) may pop one from the free queue, and relief
  demotes no page that holds one. Guarding takes no reference, so a request
  that is not admitted leaves the prefix cache's LRU order as it was;
- host pool pages it will read or that a connector writes for it, each retained
  as its record is made (or allocated, for an import landing in the host pool), so no
  allocation can evict or reuse them while the request waits: pages taken as
  null placeholders (a host prefix hit, a KV connector hit kept on the host, an
  import's landing) and pages restored into its newly allocated blocks (a KV
  connector hit with room on the device);
- the hot lease its HOST pages need.

A record takes its references when it is made and gives them back in exactly
one place (`give_back`, through `release`): when the request is not scheduled
after all, is aborted, preempted or fails. When the request is scheduled, the
record hands its references over to residency (`take`), which then owns them.

It never decides residency or touches tensors; it reaches the KV cache manager
only through `KVCacheBlockAccess`.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.v1.hisparse.kv_import import ConnectorImports, ImportKind
from vllm.v1.hisparse.plan import BlockId, HostPage, PageIndex, PageRestore

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock
    from vllm.v1.hisparse.kv_cache_access import KVCacheBlockAccess
    from vllm.v1.hisparse.residency import ResidencyManager
    from vllm.v1.request import Request

    # A walk's page: its sparse-MLA blocks (None where it comes from the host pool), and the
    # other groups' blocks of the resident block it starts (none for a page inside one).
    WalkPage = tuple[list[KVCacheBlock] | None, Sequence[KVCacheBlock]]

# A HOST page inside a resident block, as the walk lists it: one shared object, which the
# garbage collector does not track (a history's thousands of pages allocate nothing).
_HOST_PAGE_INSIDE: tuple[None, tuple[()]] = (None, ())


@dataclass
class PendingAdmission:
    """Everything one waiting request holds before its pages are registered."""

    request_id: str
    # Device prefix-hit blocks (no reference taken), guarded until the request's blocks
    # are allocated.
    hit: list[KVCacheBlock] = field(default_factory=list)
    # Pages taken as null placeholders: page index -> host page, one reference each.
    host_pages: dict[PageIndex, HostPage] = field(default_factory=dict)
    # Of those, the pages a KV connector writes (an import landing in the host pool).
    landed: set[PageIndex] = field(default_factory=set)
    # Pages restored into the request's newly allocated blocks: page index -> host page,
    # one reference each.
    restores: dict[PageIndex, HostPage] = field(default_factory=dict)
    # The hot lease the HOST pages need, one reference per block.
    lease: list[BlockId] = field(default_factory=list)
    # The local hit the walk returned, in tokens.
    hit_tokens: int = 0
    # The request's blocks are allocated (its table holds the hit, restores are planned): the record
    # waits for the request's first scheduled step, possibly after a connector's load.
    allocated: bool = False
    # No room for a hot lease in this step (the walk's check, or a lease that failed): it
    # is not asked for again for a connector's hit in the same step, and the try counts once.
    no_lease: bool = False
    # The host pages the hit leaves out for want of that lease (the request would recompute
    # them): the measure `waits_for_lease` weighs.
    unleased_pages: int = 0
    # The host copies the walk found from the page where it stopped for want of the lease
    # (first page, copies in page order), already touched: a connector's hit of the same
    # history in the same step reads them from here instead of looking each up again.
    walk_copies: tuple[int, list[HostPage]] = (0, [])


@dataclass
class AdmissionCounters:
    """Cumulative counts, for metrics."""

    # Pages of KV connector hits restored from the host pool.
    pages_restored: int = 0
    # KV connector hits cut short where the host pool's pages of them ended.
    hits_cut: int = 0
    # Tries to admit a request whose host pages (a host prefix hit or a connector's hit)
    # found no room for a hot lease: it waits for room, or recomputes the prefix. A turn
    # that waits counts once per step it tries.
    hits_without_lease: int = 0
    # Steps a request spent waiting for room for its hot lease instead of recomputing the
    # host pages of its hit (`waits_for_lease`).
    lease_waits: int = 0
    # KV connector hits not taken, or cut short, because which of a MultiConnector's
    # connectors loads them could not be read, or a failed request stored their keys: once
    # per request, however many steps it tries.
    hits_refused: int = 0
    # Pages of host prefix hits dropped for an EAGLE/MTP drafter, which computes them again
    # (the hit's last pages, as upstream's device hit drops its last one).
    pages_dropped_for_drafter: int = 0


class Admissions:
    """The pending admissions of one scheduler, and the hit-time decisions that make them."""

    def __init__(
        self,
        blocks: KVCacheBlockAccess,
        residency: ResidencyManager,
        *,
        block_size: int,
        host_prefix_hits: bool,
        imports: ConnectorImports,
        lease_blocks_for: Callable[[Request], int],
        plans_issued: Callable[[], bool],
        release_histories: Callable[[int], int] = lambda num_blocks: 0,
        nothing_runs: Callable[[], bool] = lambda: False,
        chunk_tokens: int = 0,
        lookahead_tokens: int = 0,
        written: Callable[[], set[int]] = set,
    ) -> None:
        self.blocks = blocks
        self.residency = residency
        self.host_pool = residency.host_pool
        self.block_size = block_size
        self.host_prefix_hits = host_prefix_hits
        # Which connector loads a request's hit, and how.
        self.imports = imports
        self._lease_blocks_for = lease_blocks_for
        self._plans_issued = plans_issued
        # Gives back held histories (oldest first) until this many blocks are free.
        self._release_histories = release_histories
        # Whether no request runs (nothing else will free blocks for an admission).
        self._nothing_runs = nothing_runs
        # The most tokens a step schedules for one request, and a drafter's lookahead slots.
        self.chunk_tokens = chunk_tokens
        self.lookahead_tokens = lookahead_tokens
        # The blocks running requests may write from this step on.
        self._written = written
        self._records: dict[str, PendingAdmission] = {}
        self.counters = AdmissionCounters()
        # The host copies that waiting turns' walks found past the first page they had no
        # lease for (`_waiting_copies`), this step's and the last step's: request ->
        # ((the first page's hash, the pages looked up, host pool evictions then), copies).
        self._copies_this_step: dict[str, tuple[tuple[BlockHash, int, int], list[HostPage]]] = {}
        self._copies_last_step: dict[str, tuple[tuple[BlockHash, int, int], list[HostPage]]] = {}
        # The requests whose connector hit was refused (`hits_refused` counts each once).
        self._refused: weakref.WeakSet[Request] = weakref.WeakSet()

    # -- the record's life ---------------------------------------------------------

    def begin(self, request: Request, hit: KVCacheBlocks) -> PendingAdmission:
        """A fresh record for `request`, guarding its device prefix hit (an earlier record of
        the same request, from a step that did not admit it, is released first)."""
        self.release(request.request_id)
        record = PendingAdmission(request.request_id)
        record.hit = [b for group in hit.blocks for b in group if not b.is_null]
        self._records[request.request_id] = record
        return record

    def after_allocation(self, request: Request, num_external_tokens: int) -> list[PageRestore]:
        """The request's blocks are allocated (its table holds the hit now); the restores to plan.

        A request that waited for a connector's load is allocated again for its first
        compute: its restores were planned with its first allocation, and stay its own."""
        record = self._records.get(request.request_id)
        if record is None or record.allocated:
            return []
        record.allocated = True
        record.hit = []
        if num_external_tokens <= 0:
            self._release_host_pages(record.restores)
            record.restores = {}
        rid = request.request_id
        restores = [
            PageRestore(rid, position, self.blocks.page_block_ids(rid, position), page)
            for position, page in record.restores.items()
        ]
        self.counters.pages_restored += len(restores)
        return restores

    def take(self, request_id: str) -> PendingAdmission | None:
        """The record of a request scheduled for the first time since its allocation; its
        references pass to the caller, which registers them with residency."""
        record = self._records.get(request_id)
        if record is None or not record.allocated:
            return None
        return self._records.pop(request_id)

    def release(self, request_id: str) -> None:
        """Give back everything the request's record holds (the one place that does)."""
        record = self._records.pop(request_id, None)
        if record is not None:
            self.give_back(record)

    def give_back(self, record: PendingAdmission) -> None:
        """Give back what a record still holds: one of `release`'s, or one `take` handed out
        whose registration failed part way (what it handed over is residency's)."""
        self._release_host_pages(record.host_pages)
        self._release_host_pages(record.restores)
        self.residency.allocator.give_back(record.lease)
        record.host_pages, record.restores, record.lease = {}, {}, []

    def end_step(self) -> None:
        """schedule() is over: a record whose request was not allocated goes back."""
        for request_id in [rid for rid, record in self._records.items() if not record.allocated]:
            record = self._records.pop(request_id)
            # Its landing's pages went to no connector (it was not scheduled): unwritten.
            for position in record.landed:
                self.host_pool.release(record.host_pages.pop(position), written=False)
            record.landed.clear()
            self.give_back(record)
        self._copies_last_step, self._copies_this_step = self._copies_this_step, {}

    def forget_lookups(self) -> None:
        """The host pool forgot its copies (`HostPagePool.forget_all`): no lookup of an
        earlier step stands (their keys count the pool's evictions too)."""
        self._copies_last_step, self._copies_this_step = {}, {}

    def _release_host_pages(self, pages: dict[PageIndex, HostPage]) -> None:
        for page in pages.values():
            self.host_pool.release(page)

    # -- what other parts read ---------------------------------------------------------

    def num_host_pages(self, request_id: str) -> int:
        record = self._records.get(request_id)
        return len(record.host_pages) if record is not None else 0

    def host_landing(self, request_id: str) -> dict[int, int]:
        """The pages of `request_id`'s import that land in the host pool: page index -> host page."""
        record = self._records.get(request_id)
        if record is None:
            return {}
        return {position: record.host_pages[position] for position in sorted(record.landed)}

    def hit_blocks(self) -> Iterator[KVCacheBlock]:
        """The device prefix-hit blocks of every pending admission (what `take` must not pop)."""
        for record in self._records.values():
            yield from record.hit

    def hit_block_ids(self) -> set[int]:
        return {b.block_id for b in self.hit_blocks()}

    def records(self) -> Iterator[PendingAdmission]:
        return iter(self._records.values())

    def host_references(self) -> Counter[int]:
        """Host page -> references the pending admissions hold."""
        return Counter(
            page
            for record in self._records.values()
            for page in itertools.chain(record.host_pages.values(), record.restores.values())
        )

    # -- hit-time decisions ------------------------------------------------------------

    def _take_lease(self, request: Request) -> list[BlockId]:
        """A hot lease for `request`'s HOST pages. Under pressure, other requests' BOTH pages
        are demoted for it (without it the request recomputes its whole prefix, which
        needs at least as many blocks); no page holding a pending hit's block is demoted."""
        num_blocks = self._lease_blocks_for(request)
        lease = self.residency.lease(num_blocks)
        if not lease:
            short = num_blocks - self.blocks.num_free_blocks()
            protected = self.hit_block_ids()
            if self.residency.relieve_pressure(short, protected_blocks=protected) > 0:
                lease = self.residency.lease(num_blocks)
            if not lease and self._release_histories(num_blocks - self.blocks.num_free_blocks()) > 0:
                lease = self.residency.lease(num_blocks)
        return [BlockId(b) for b in lease]

    def guard_prefix_hit(self, request: Request, blocks: KVCacheBlocks) -> None:
        """A device prefix hit HiSparse does not extend (a connector that reconciles hits
        across groups itself): guarded all the same until the request is allocated."""
        self.begin(request, blocks)

    def extend_prefix_hit(
        self, request: Request, blocks: KVCacheBlocks, num_tokens: int
    ) -> tuple[KVCacheBlocks, int]:
        """Guard a device prefix hit, and extend it with pages the host pool still holds
        (`_walk`)."""
        blocks, num_tokens = self._walk(request, blocks, num_tokens)
        self._records[request.request_id].hit_tokens = num_tokens
        return blocks, num_tokens

    def _walk(self, request: Request, blocks: KVCacheBlocks, num_tokens: int) -> tuple[KVCacheBlocks, int]:
        """Guard a device prefix hit, and extend it with pages the host pool still holds.

        Page by page past the device hit: the indexer blocks must still be cached
        on the device (the indexer scores every token); the sparse-MLA page is
        taken from the device prefix cache when every group still has it, else
        from the host pool as a null placeholder. The first page neither holds
        ends the hit; with an EAGLE/MTP drafter the hit then drops its last page,
        as upstream's does. Host pages cost the request a hot lease, taken here; its room
        is made (other requests' BOTH pages demoted) at the first host page, and when the
        pool still has no room the hit ends there, before the rest of the history is
        walked (a turn waiting for room would otherwise walk all of it every step).

        When no request runs, nothing else will free blocks: the hit, upstream's device
        hit included, then touches at most the free blocks that the request's chunk
        after it (`room_when_alone`) and its lease leave; a sparse-MLA page past that
        comes from the host pool where it holds one, else the hit ends there. Without
        that cap, a history cached on the device could take the free blocks the
        request's own chunk needs, and the engine would wait for ever.

        In the page layout a resident block holds m pages, and the hit may end on any
        page of one (the last resident block of a history that is not full is found by
        its partial entry, `KVCacheBlockAccess.cache_pages`); the drafter's drop is then
        one page. vLLM gives the request a private copy of a resident block its hit ends
        inside (copy-on-write, run by the workers before the step's forward), so only a
        block whose pages no request computes in this step may be copied: one no running
        request may write (`_final`); when no request runs, the room left must hold the
        copy too. A hit ending inside another block ends at its first page instead.
        """
        capped = self._nothing_runs()
        room = 0
        if capped:
            room = self.room_when_alone(request)
            blocks, num_tokens, room = self._cap_device_hit(blocks, num_tokens, room)
        record = self.begin(request, blocks)
        if not self.host_prefix_hits or num_tokens % self.block_size:
            return blocks, num_tokens
        mla_ids, other_ids = self.blocks.mla_group_ids, self.blocks.other_group_ids
        start = num_tokens // self.block_size
        max_pages = (request.num_tokens - 1) // self.block_size
        # The page layout's resident blocks hold m pages each; upstream's device hit ends on
        # a whole one, where the walk starts.
        m = self.blocks.resident_multiple
        if start % m:
            return blocks, num_tokens
        pages: list[WalkPage] = []
        host_pages: dict[PageIndex, HostPage] = {}
        other_page = self.blocks.page_lookup(other_ids)
        hashes = request.block_hashes
        # The pages' lookups, from page `start` on: the sparse-MLA groups' and the host
        # pool's, each made in windows that double as the walk goes, from one page (a history
        # of thousands of pages costs a dozen calls, and a walk that ends at its first page
        # looks up no other page). Nothing below allocates a host page or a block, so
        # nothing they found can be evicted before the walk has retained or guarded it.
        mla_at: list[list[KVCacheBlock] | None] = []
        host_at: list[HostPage | None] = []
        other_at: list[list[KVCacheBlock] | None] = []  # a block per page: the other groups'
        mla_lookup_all = functools.partial(self.blocks.pages_cached, mla_ids)
        other_lookup_all = functools.partial(self.blocks.pages_cached, other_ids)

        def look_up(
            found: list[Any], lookup_all: Callable[[Sequence[BlockHash]], list[Any]], position: int
        ) -> None:
            """Extend `found` (one entry per page from `start` on) to cover `position`."""
            while position - start >= len(found):
                first = start + len(found)
                found += lookup_all(hashes[first : min(first + len(found) + 1, max_pages)])

        def mla_pages(position: int) -> list[KVCacheBlock] | None:
            """The page's sparse-MLA blocks where every group caches it."""
            look_up(mla_at, mla_lookup_all, position)
            return mla_at[position - start]

        def host_copy(position: int) -> HostPage | None:
            """The host pool's copy of the page (not retained)."""
            look_up(host_at, self.host_pool.lookup_all, position)
            return host_at[position - start]

        resident: dict[int, tuple[list[KVCacheBlock] | None, int]] = {}
        room_left = room  # alone: the room the pages taken leave

        def resident_block(first: int) -> tuple[list[KVCacheBlock] | None, int]:
            """The other groups' blocks of the resident block starting at page `first`, and
            the end of the pages of it the walk may take (`first` when none)."""
            if m == 1 and first < max_pages:
                # A block per page (the groups layout): the lookups batched as the others'.
                look_up(other_at, other_lookup_all, first)
                other = other_at[first - start]
                return (None, first) if other is None else (other, first + 1)
            if first not in resident:
                found: tuple[list[KVCacheBlock] | None, int] = (None, first)
                # The longest entry of the block: its full one, else its partial one.
                for last in range(min(first + m, len(hashes)) - 1, first - 1, -1):
                    other = other_page(hashes[last])
                    if other is not None:
                        found = (other, min(last + 1, max_pages))
                        break
                resident[first] = found
            return resident[first]

        def walks(position: int) -> bool:
            """Whether the walk takes this page (the loop's test, without the cap)."""
            if position >= max_pages:
                return False
            return resident_block(position - (position - start) % m)[1] > position and (
                mla_pages(position) is not None or host_copy(position) is not None
            )

        def ends_at(num_pages: int) -> int:
            """The pages a hit of `num_pages` keeps: all of them where it ends on a resident
            block or inside one that may be copied (alone, with room for the copy), else up
            to that block's first page."""
            inside = num_pages % m
            if inside and not (
                self._final(pages[num_pages - inside][1]) and (not capped or room_left >= len(other_ids))
            ):
                return num_pages - inside
            return num_pages

        # Pages whose blocks the record guards already; the first page whose lease failed.
        guarded = 0
        no_lease_at: int | None = None
        block_end = start
        other: Sequence[KVCacheBlock] | None = ()
        position = start - 1
        while position + 1 < max_pages:
            position += 1
            if (position - start) % m == 0:
                # The other groups' blocks of the resident block starting here (the hash of
                # its last page, or of the last page its partial entry holds, names it),
                # none for the pages inside it.
                other, block_end = resident_block(position)
                if other is None:
                    break  # the indexer K cache of this page is gone: recompute from here
                first, end = position - start, block_end - start
                if (
                    m > 1
                    and host_pages
                    and not capped
                    and host_copy(block_end - 1) is not None
                    and None not in host_at[first:end]
                ):
                    # Past the first host page (whose lease found room), a resident block of
                    # the page layout whose every page the host pool holds: no page of it
                    # ends the hit, so it is taken whole, as the page-by-page loop below would
                    # take it (deep in a session's history, every block).
                    mla_pages(block_end - 1)
                    mla_run = mla_at[first:end]
                    pages.append((mla_run[0], other))
                    if mla_run.count(None) == len(mla_run):
                        pages += [_HOST_PAGE_INSIDE] * (len(mla_run) - 1)
                        host_pages.update(zip(range(position, block_end), host_at[first:end], strict=True))  # type: ignore[arg-type]
                    else:
                        pages += [(mla, ()) for mla in mla_run[1:]]
                        host_pages.update(
                            (PageIndex(p), h)
                            for p, mla, h in zip(
                                range(position, block_end), mla_run, host_at[first:end], strict=True
                            )
                            if mla is None and h is not None
                        )
                    room_left = room
                    position = block_end - 1
                    continue
            else:
                other = ()
                if position >= block_end:
                    break  # past the pages the resident block's entry holds
            mla = mla_at[position - start] if position - start < len(mla_at) else mla_pages(position)
            if capped:
                room -= sum(b.ref_cnt == 0 for b in other)
                if room < 0:
                    break
                if mla is not None:
                    touched = sum(b.ref_cnt == 0 for b in mla)
                    if touched > room and host_copy(position) is not None:
                        mla = None  # its host copy instead: the chunk needs the blocks
                    else:
                        room -= touched
                        if room < 0:
                            break
            if mla is None:
                # Looked up, not yet retained: nothing below allocates a host page, so
                # nothing can evict it before it is retained with the lease.
                host_page = (
                    host_at[position - start] if position - start < len(host_at) else host_copy(position)
                )
                if host_page is None:
                    break
                if not host_pages and not capped and (not self.blocks.use_eagle or walks(position + 1)):
                    # The first host page needs the lease: when it cannot be had, the
                    # hit ends here, and the rest of the history is not walked.
                    record.hit += self._blocks_of(pages)
                    guarded = len(pages)
                    if not self._room_for_lease(request):
                        no_lease_at = position
                        record.no_lease = True
                        self.counters.hits_without_lease += 1
                        break
                host_pages[PageIndex(position)] = host_page
            pages.append((mla, other))
            room_left = room
        kept_pages = ends_at(len(pages))
        if kept_pages < len(pages):
            # The pages of a resident block the hit may not end inside go.
            self._unguard(record, pages[kept_pages:])
            for position in range(start + kept_pages, start + len(pages)):
                host_pages.pop(PageIndex(position), None)
            del pages[kept_pages:]
            guarded = min(guarded, len(pages))
        if no_lease_at is not None:
            # The copies the request wants stay the most recently used, as if taken and
            # given back; its hit is the pages before them (each cached in every group).
            position = no_lease_at
            copies = self._waiting_copies(
                request.request_id, hashes[position:max_pages], host_at[position - start :]
            )
            self.host_pool.touch(copies)
            record.unleased_pages = len(copies)
            record.walk_copies = (position, copies)
            return self._extension(blocks, num_tokens, pages)
        if pages and self.blocks.use_eagle:
            # As upstream's hit: an EAGLE/MTP drafter recomputes the last page of a hit for
            # the hidden states it drafts from (the device hit already dropped one; in the
            # page layout, one page, or a whole resident block where the hit may not end
            # inside it).
            num_pages = len(pages)
            kept_pages = ends_at(num_pages - 1)
            self.counters.pages_dropped_for_drafter += num_pages - kept_pages
            if m > 1:
                self._unguard(record, pages[kept_pages:])
            del pages[kept_pages:]
            guarded = min(guarded, len(pages))
            dropped = [
                host_pages.pop(PageIndex(p))
                for p in range(start + len(pages), start + num_pages)
                if PageIndex(p) in host_pages
            ]
            if dropped:
                self.host_pool.touch(dropped)
        # The extension's device blocks are guarded with the hit before a lease is taken.
        record.hit += self._blocks_of(pages[guarded:])
        if host_pages:
            record.lease = self._take_lease(request)
            if record.lease:
                self.host_pool.retain_all(host_pages.values())
            else:
                record.no_lease = True
                self.counters.hits_without_lease += 1
                # The copies the request wants stay the most recently used, as if taken and
                # given back.
                self.host_pool.touch(host_pages.values())
                host_pages = {}
        if not host_pages:
            # Without host pages only the pages every group still caches count (with a
            # drafter, the device hit's dropped page can be one).
            kept = list(itertools.takewhile(lambda page: page[0] is not None, pages))
            del kept[ends_at(len(kept)) :]
            if record.no_lease:
                record.unleased_pages = len(pages) - len(kept)
            if len(kept) < len(pages):
                unused = {b.block_id for b in self._blocks_of(pages[len(kept) :])}
                record.hit = [b for b in record.hit if b.block_id not in unused]
            pages = kept
            if not pages:
                return blocks, num_tokens
        record.host_pages = host_pages
        return self._extension(blocks, num_tokens, pages)

    def _waiting_copies(
        self, request_id: str, hashes: Sequence[BlockHash], looked_up: list[HostPage | None]
    ) -> list[HostPage]:
        """The host copies of a request's pages with these hashes, up to the first page the
        pool does not hold: a hit that found no room for its lease at the first of them.
        `looked_up` is what the walk found for the first pages (the first one's a copy).

        Such a turn waits, and walks its history again every step (`waits_for_lease`): while
        no host page has been evicted, every copy its last walk found is still the pool's,
        and only a copy published since, of the page past the last of them, can lengthen
        the run; that one page is looked up, and the run again only when it is found."""

        def copy_at(index: int) -> HostPage | None:
            return looked_up[index] if index < len(looked_up) else self.host_pool.lookup(hashes[index])

        key = (hashes[0], len(hashes), self.host_pool.evictions)
        found = self._copies_this_step.get(request_id) or self._copies_last_step.get(request_id)
        if found is not None and found[0] == key and found[1][0] == looked_up[0]:
            copies = found[1]
            if len(copies) == len(hashes) or copy_at(len(copies)) is None:
                self._copies_this_step[request_id] = found
                return copies
        copies = []
        for host_page in looked_up:
            if host_page is None:
                break
            copies.append(host_page)
        else:
            for host_page in self.host_pool.lookup_all(hashes[len(looked_up) :]):
                if host_page is None:
                    break
                copies.append(host_page)
        self._copies_this_step[request_id] = (key, copies)
        return copies

    def _final(self, other: Sequence[KVCacheBlock]) -> bool:
        """Whether a resident block's blocks may be copied for a hit ending inside it: no
        request computes pages into them in this step (each is in the free queue, or no
        running request may write it: a finished request's, a held history's)."""
        if all(b.ref_cnt == 0 for b in other):
            return True
        written = self._written()
        return not any(b.block_id in written for b in other)

    @staticmethod
    def _blocks_of(pages: list[WalkPage]) -> list[KVCacheBlock]:
        """The device blocks of a walk's pages, in order (a HOST page has none in the
        sparse-MLA groups, a page inside a resident block none in the others)."""
        blocks: list[KVCacheBlock] = []
        for mla, other in pages:
            if mla:
                blocks += mla
            if other:
                blocks += other
        return blocks

    @staticmethod
    def _unguard(record: PendingAdmission, pages: list[WalkPage]) -> None:
        """The hit's guard no longer covers these pages' device blocks (the hit ends before them)."""
        unused = {b.block_id for b in Admissions._blocks_of(pages)}
        if unused:
            record.hit = [b for b in record.hit if b.block_id not in unused]

    def _extension(
        self,
        blocks: KVCacheBlocks,
        num_tokens: int,
        pages: list[WalkPage],
    ) -> tuple[KVCacheBlocks, int]:
        """The hit extended by `pages`, group by group: a HOST page is the null block in
        every sparse-MLA group."""
        if not pages:
            return blocks, num_tokens
        null = self.blocks.null_block
        columns: dict[int, list[KVCacheBlock]] = {}
        for i, g in enumerate(self.blocks.mla_group_ids):
            columns[g] = [mla[i] if mla is not None else null for mla, _ in pages]
        for i, g in enumerate(self.blocks.other_group_ids):
            columns[g] = [other[i] for _, other in pages if other]
        return self.blocks.with_columns(blocks, columns), num_tokens + len(pages) * self.block_size

    def waits_for_lease(self, request: Request, num_computed_tokens: int) -> bool:
        """Whether `request`, about to be admitted without the host pages of its hit (no room
        for their hot lease in this step), waits for room instead of recomputing them.

        It waits when the lease would at least halve its prefill (the pages left out hold
        at least as many tokens as it computes with them) and a request runs: running
        requests free blocks as they finish, and each step's try demotes their BOTH pages
        for the lease (`_room_for_lease`), so room comes. Recomputing instead would take
        device blocks for the whole history, the pressure that demoted it, and compute it
        again. Alone, or with a lease the pool could not hold even with nothing else on
        it, the request recomputes. vLLM admits no request behind a waiting one in the
        same step (first come, first served).
        """
        record = self._records.get(request.request_id)
        if record is None or record.allocated or not record.no_lease or self._nothing_runs():
            return False
        saved = record.unleased_pages * self.block_size
        if saved < request.num_tokens - num_computed_tokens - saved:
            return False
        if self._alone_needs(request) > len(self.blocks.pool_blocks()) - 1:
            return False  # the lease and the first chunk would not fit an empty pool
        self.counters.lease_waits += 1
        return True

    def _room_for_lease(self, request: Request) -> bool:
        """Whether the pool has the request's hot lease free, after demoting other requests'
        BOTH pages for it as `_take_lease` does (no page holding a pending hit's block)."""
        num_blocks = self._lease_blocks_for(request)
        short = num_blocks - self.blocks.num_free_blocks()
        if short > 0:
            self.residency.relieve_pressure(short, protected_blocks=self.hit_block_ids())
        return self.blocks.num_free_blocks() >= num_blocks

    def room_when_alone(self, request: Request) -> int:
        """Free blocks a hit may touch when no request runs: what the request's first chunk
        and its hot lease (`_alone_needs`) leave."""
        return self.blocks.num_free_blocks() - self._alone_needs(request)

    def _alone_needs(self, request: Request) -> int:
        """Blocks the request needs beside its hit: its first chunk (a whole step's tokens,
        one page more for an unaligned start and one for a drafter's lookahead, at least
        three pages, in every group) and its hot lease."""
        tokens = min(self.chunk_tokens, request.num_tokens) + self.lookahead_tokens
        chunk_pages = max(3, -(-tokens // self.block_size) + 1)
        return self.blocks.blocks_for_pages(0, chunk_pages) + self._lease_blocks_for(request)

    def _cap_device_hit(
        self, blocks: KVCacheBlocks, num_tokens: int, room: int
    ) -> tuple[KVCacheBlocks, int, int]:
        """Upstream's device hit cut at the first page whose free blocks pass `room` (the
        extension then goes on from there, taking host copies where the pool holds them);
        the hit and the room left."""
        num_pages = min((len(group) for group in blocks.blocks), default=0)
        for position in range(num_pages):
            touched = sum(
                1 for group in blocks.blocks if not group[position].is_null and group[position].ref_cnt == 0
            )
            if touched > room:
                from vllm.v1.core.kv_cache_manager import KVCacheBlocks

                cut = KVCacheBlocks(tuple(list(group[:position]) for group in blocks.blocks))
                return cut, position * self.block_size, room
            room -= touched
        return blocks, num_tokens, room

    def _count_refused(self, request: Request) -> None:
        if request not in self._refused:
            self._refused.add(request)
            self.counters.hits_refused += 1

    def cap_external_hit(
        self,
        request: Request,
        new_computed_blocks: KVCacheBlocks,
        num_local_tokens: int,
        num_external_tokens: int,
        *,
        executable: bool,
    ) -> tuple[KVCacheBlocks, int]:
        """A KV connector's hit past the local one, as HiSparse can serve it.

        The OffloadingConnector loads only the groups HiSparse does not manage, so
        every page of its hit needs its sparse-MLA content from the host pool: the
        hit stands as far as the host pool holds its pages (each retained), cut at
        the connector's chunk boundary below the first page it lacks (a session's
        next turn keeps the history the pool holds and recomputes only the rest);
        a connector whose hits cannot be cut loads all of it or nothing. When no
        request runs, the hit is also cut where its blocks would leave the chunk after
        it too few (`room_when_alone`). Then, in hybrid mode with room in the pool
        (the restored pages take at most half of the free blocks, or alone, what the
        chunk leaves), the pages are
        restored into the blocks allocated for the hit (`after_allocation`);
        otherwise they stay in the host pool: the local hit's blocks gain null
        placeholders for them in the sparse-MLA groups, and the request takes a hot
        lease and starts NONE, as on a host prefix hit. A connector that loads
        every group lands its import (`_land_import`). `executable`: whether the
        workers run plans at all. Returns the (possibly extended) local hit blocks
        and the hit.
        """
        record = self._records.get(request.request_id)
        if record is None:
            record = self.begin(request, new_computed_blocks)
        elif num_local_tokens < record.hit_tokens:
            self._cut_walk(record, new_computed_blocks, num_local_tokens)
        if num_external_tokens <= 0 or not executable:
            return new_computed_blocks, num_external_tokens
        imported = self.imports.of(request.request_id)
        if imported is None:  # which connector loads it is not known: not taken
            self._count_refused(request)
            return new_computed_blocks, 0
        if imported.kind is ImportKind.DEVICE:
            return new_computed_blocks, num_external_tokens  # the connector loads every group
        if imported.kind is ImportKind.LANDS_ON_HOST:
            return self._land_import(
                request, record, new_computed_blocks, num_local_tokens, num_external_tokens, imported.may_land
            )
        chunk = imported.chunk_tokens
        if self.host_pool.has_withdrawn():
            # The connector's tier may hold the indexer (and drafter) keys of pages a failed
            # request wrote, stored from the same wrong step, and never overwrites a key it
            # holds: a hit would pair them with another request's good sparse-MLA pages.
            hashes, withdrawn = request.block_hashes, self.host_pool.is_withdrawn
            first = num_local_tokens // self.block_size
            last = min(-(-(num_local_tokens + num_external_tokens) // self.block_size), len(hashes))
            refused = next((p for p in range(first, last) if withdrawn(hashes[p])), None)
            if refused is not None:
                self._count_refused(request)
                num_external_tokens = self._cut_hit({}, num_local_tokens, refused * self.block_size, chunk)
                if not num_external_tokens:
                    return new_computed_blocks, 0
        if not (self._plans_issued() and self.host_prefix_hits) or num_local_tokens % self.block_size:
            return new_computed_blocks, 0
        end = num_local_tokens + num_external_tokens
        # The hit's host pages are looked up, not retained, until it is decided what the
        # request takes: nothing below allocates a host page, so none can be evicted
        # meanwhile. A hit the request does not take (most often a waiting turn that finds
        # no room for its lease, every step) then costs no reference taken and given back.
        hit: dict[PageIndex, HostPage] = {}
        hashes, lookup = request.block_hashes, self.host_pool.lookup
        copies_from, copies = record.walk_copies
        first_page, end_page = num_local_tokens // self.block_size, -(-end // self.block_size)
        if copies_from == first_page and copies:
            # The walk's copies, this step (every one a copy): the hit's first pages at once.
            first_page = min(end_page, copies_from + len(copies))
            hit.update(zip(range(copies_from, first_page), copies, strict=False))  # type: ignore[arg-type]
        for position in range(first_page, end_page):
            host_page = None
            if 0 <= position - copies_from < len(copies):
                host_page = copies[position - copies_from]  # the walk's lookup, this step
            elif position < len(hashes):  # else a partial page: never copied
                host_page = lookup(hashes[position])
            if host_page is None:
                num_external_tokens = self._cut_hit(hit, num_local_tokens, position * self.block_size, chunk)
                if not num_external_tokens:
                    return new_computed_blocks, 0
                break
            hit[PageIndex(position)] = host_page
        restore_blocks = len(hit) * len(self.blocks.mla_group_ids)
        room = self.blocks.num_free_blocks() // 2
        if self._nothing_runs():
            # Alone, the load's blocks (the connector's groups, every page) and any restore
            # must leave the chunk after it its blocks, as a device hit does.
            num_other = len(self.blocks.other_group_ids)
            m = self.blocks.resident_multiple
            room = self.room_when_alone(request) - sum(b.ref_cnt == 0 for b in record.hit)
            affordable = max(room, 0) // num_other * m if num_other else len(hit)
            if len(hit) > affordable:
                num_external_tokens = self._cut_hit(
                    hit, num_local_tokens, num_local_tokens + affordable * self.block_size, chunk
                )
                if not num_external_tokens:
                    return new_computed_blocks, 0
            room -= -(-len(hit) // m) * num_other
            restore_blocks = len(hit) * len(self.blocks.mla_group_ids)
        if not record.host_pages and self.residency.mode == "hybrid" and restore_blocks <= room:
            record.restores = self._retained(hit)
            return new_computed_blocks, num_external_tokens
        # The page holding the last prompt token is written again (a full-prompt hit
        # recomputes that token): it is restored, never a placeholder.
        last_page = (request.num_tokens - 1) // self.block_size
        on_host = {p: h for p, h in hit.items() if p < last_page}
        restores = {p: h for p, h in hit.items() if p >= last_page}
        if not on_host:
            record.restores = self._retained(restores)
            return new_computed_blocks, num_external_tokens
        if not record.lease and not record.no_lease:
            record.lease = self._take_lease(request)
            if not record.lease:
                record.no_lease = True
                self.counters.hits_without_lease += 1
        if not record.lease:
            # No room for the lease in this step (found by the walk, or now): the copies the
            # request wants stay the most recently used, as if taken and given back.
            # (The walk's copies are touched already, in page order.)
            self.host_pool.touch(h for p, h in hit.items() if not 0 <= p - copies_from < len(copies))
            record.unleased_pages = max(record.unleased_pages, len(hit))
            return new_computed_blocks, 0
        record.restores = self._retained(restores)
        record.host_pages.update(self._retained(on_host))
        return self.blocks.with_host_placeholders(new_computed_blocks, len(on_host)), num_external_tokens

    def _cut_walk(self, record: PendingAdmission, blocks: KVCacheBlocks, num_local_tokens: int) -> None:
        """The scheduler cut the walk's hit to `num_local_tokens` (vLLM drops a hit's part
        inside a resident block when a connector's hit goes further, to load that block
        whole): the host pages and guarded blocks past the cut go."""
        end = num_local_tokens // self.block_size
        past = {p: page for p, page in record.host_pages.items() if p >= end}
        if past:
            self._release_host_pages(past)
            record.host_pages = {p: page for p, page in record.host_pages.items() if p < end}
        kept = {b.block_id for group in blocks.blocks for b in group}
        record.hit = [b for b in record.hit if b.block_id in kept]

    def _retained(self, pages: dict[PageIndex, HostPage]) -> dict[PageIndex, HostPage]:
        """`pages`, each retained for the caller (looked up in this same step)."""
        self.host_pool.retain_all(pages.values())
        return pages

    def _cut_hit(
        self, hit: dict[PageIndex, HostPage], num_local_tokens: int, held_end: int, chunk: int | None
    ) -> int:
        """Cut a connector hit whose host pages end at token `held_end` to the last boundary
        of `chunk` tokens at or below it (None: the hit cannot be cut, nothing of it stays);
        the pages past the cut (looked up, not retained) become the most recently used, as
        if taken and given back. The hit's new length."""
        end = held_end // chunk * chunk if chunk else num_local_tokens
        if end <= num_local_tokens:
            self.host_pool.touch(hit.values())
            hit.clear()
            return 0
        beyond = {p: h for p, h in hit.items() if p * self.block_size >= end}
        self.host_pool.touch(beyond.values())
        for position in beyond:
            del hit[position]
        self.counters.hits_cut += 1
        return end - num_local_tokens

    def _land_import(
        self,
        request: Request,
        record: PendingAdmission,
        new_computed_blocks: KVCacheBlocks,
        num_local_tokens: int,
        num_external_tokens: int,
        may_land: Callable[[Request], bool],
    ) -> tuple[KVCacheBlocks, int]:
        """An import of a connector that loads every group: where its sparse-MLA pages land.

        On the device, as upstream, when the pool is not tight: in hybrid mode, when
        the pages take at most half of the free blocks (the rule of a connector hit's
        restore). Otherwise in the host pool: host pages are allocated for the whole
        pages of the import before the page of the last prompt token (that one and a
        partial page are written by the step's own compute, on the device), the local
        hit's sparse-MLA groups gain null placeholders for them, and the request takes a
        hot lease and starts NONE. The connector writes those pages into the host pool
        (`host_landing`); the indexer's pages land on the device. Without room in the
        host pool or for a lease, the import lands on the device (a lease the same step's
        walk found no room for is not asked for again). No allocation here
        can evict a page another pending admission will read: those are retained.
        """
        if not self._plans_issued() or num_local_tokens % self.block_size or not may_land(request):
            return new_computed_blocks, num_external_tokens
        end = min(num_local_tokens + num_external_tokens, request.num_tokens - 1) // self.block_size
        positions = [PageIndex(p) for p in range(num_local_tokens // self.block_size, end)]
        if not positions:
            return new_computed_blocks, num_external_tokens
        if (
            not record.host_pages
            and self.residency.mode == "hybrid"
            and len(positions) * len(self.blocks.mla_group_ids) <= self.blocks.num_free_blocks() // 2
        ):
            return new_computed_blocks, num_external_tokens
        # The connector writes landed pages as the step starts, from the host: only pages
        # no forward still in flight may read (`HostPagePool.allocate_settled`).
        if self.host_pool.num_settled < len(positions):
            return new_computed_blocks, num_external_tokens
        if not record.lease and not record.no_lease:
            record.lease = self._take_lease(request)
            record.no_lease = not record.lease
        if not record.lease:
            # No room for the lease in this step (found by the walk, or now): the import
            # lands on the device, as upstream's.
            return new_computed_blocks, num_external_tokens
        pages = self.host_pool.allocate_settled(len(positions))
        assert pages is not None, "counted above, and nothing between allocates a host page"
        for position, page in zip(positions, pages, strict=True):
            record.host_pages[position] = page
            record.landed.add(position)
        return self.blocks.with_host_placeholders(new_computed_blocks, len(positions)), num_external_tokens
