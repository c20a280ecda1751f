# SPDX-License-Identifier: Apache-2.0
"""Scheduler-side accounting of the Hybrid HiSparse host page pool.

Owns which host pages are free, which hold a page of a running request
(reference counted: requests sharing a prefix share its host pages), and which
host pages still hold a copy identified by its block hash after every request
let go of it, so a later request with the same prefix can start from the host
copy instead of recomputing it. Evicts those cached copies least recently used
first when a fresh page is needed.

It never touches memory: the worker owns the pinned buffer; this module only
decides indices into it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable

from vllm.v1.hisparse.plan import HostPage

# The most page hashes `HostPagePool.withdraw` keeps: only failed requests add to them
# (64K pages: 4M tokens).
MAX_WITHDRAWN = 1 << 16


class HostPoolExhausted(Exception):
    """No free or evictable host page is left."""


class HostPagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"host pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._never_used = list(range(num_pages - 1, -1, -1))
        self._refs: dict[int, int] = {}
        # Cached copies nobody references, oldest first: evicted before failing.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[Hashable, HostPage] = {}
        self._hash_of: dict[int, Hashable] = {}
        # The request whose copy (or import) each indexed page holds.
        self._publisher: dict[int, str] = {}
        # Page hashes a request that failed on the workers wrote (`withdraw`), oldest first.
        self._withdrawn: dict[Hashable, None] = {}
        # Cached copies evicted so far: while it stands, every lookup made since still holds.
        self.evictions = 0
        # With `track_releases` (a connector that writes landed pages from the host, outside
        # the device's stream order): each free or cached page released since the last
        # settled step -> the latest step scheduled when it was (`allocate_settled`).
        self.track_releases = False
        self.step_scheduled = -1  # steps count from 0
        self.step_settled = -1
        self._released_at: dict[int, int] = {}
        # The same by step, oldest first: pruned a step at a time.
        self._released_steps: deque[tuple[int, list[int]]] = deque()

    # -- queries -------------------------------------------------------------

    @property
    def num_referenced(self) -> int:
        return len(self._refs)

    @property
    def num_available(self) -> int:
        """Pages an allocation could take now (free, or cached and evictable)."""
        return len(self._never_used) + len(self._evictable)

    def refs(self, page: int) -> int:
        return self._refs.get(page, 0)

    def lookup(self, block_hash: Hashable) -> HostPage | None:
        """The host page holding a durable copy of this block, if any (not retained: an
        allocation may evict it; `retain_cached` for a page the caller will read)."""
        return self._by_hash.get(block_hash)

    def lookup_all(self, block_hashes: Iterable[Hashable]) -> list[HostPage | None]:
        """`lookup` of each of these blocks (a new turn's history, in one call)."""
        return list(map(self._by_hash.get, block_hashes))

    @property
    def num_settled(self) -> int:
        """Pages `allocate_settled` could take now."""
        self._prune_released()
        return self.num_available - len(self._released_at)

    def is_indexed(self, page: int) -> bool:
        """Whether the page is findable by a block hash (its copy is durable)."""
        return page in self._hash_of

    # -- changes -------------------------------------------------------------

    def allocate(self) -> HostPage:
        if self._never_used:
            page = self._never_used.pop()
        elif self._evictable:
            page, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(page)]
            self._publisher.pop(page, None)
            self.evictions += 1
        else:
            raise HostPoolExhausted(f"all {self.num_pages} host pages are referenced")
        self._refs[page] = 1
        if self._released_at:
            self._released_at.pop(page, None)
        return HostPage(page)

    def settle(self, step: int) -> None:
        """Step `step`'s output is processed: its forward, and every earlier one, is done."""
        self.step_settled = max(self.step_settled, step)

    def _prune_released(self) -> None:
        settled, released, steps = self.step_settled, self._released_at, self._released_steps
        while steps and steps[0][0] <= settled:
            step, pages = steps.popleft()
            for page in pages:
                if released.get(page) == step:
                    del released[page]

    def allocate_settled(self, num_pages: int) -> list[HostPage] | None:
        """`num_pages` pages, each referenced once, none released while a step scheduled
        before the release may still be running (None, and nothing taken, if the pool
        has too few). For a KV connector's landing: it writes the pages from the host as
        the step starts, outside the device's stream order, while a forward still queued
        may read a page its request held (a request preempted or finished with a step in
        flight under asynchronous scheduling). Every other writer of a page is a copy the
        device orders after that forward."""
        self._prune_released()
        released = self._released_at
        if not released:
            if self.num_available < num_pages:
                return None
            return [self.allocate() for _ in range(num_pages)]
        if self.num_available - len(released) < num_pages:
            return None
        taken: list[int] = []
        skipped: list[int] = []
        never_used = self._never_used
        while len(taken) < num_pages and never_used:
            page = never_used.pop()
            (skipped if page in released else taken).append(page)
        never_used.extend(reversed(skipped))
        if len(taken) < num_pages:
            # Pages released since are the most recently used: the scan meets them last.
            settled = (p for p in self._evictable if p not in released)
            for page in list(itertools.islice(settled, num_pages - len(taken))):
                del self._evictable[page]
                del self._by_hash[self._hash_of.pop(page)]
                self._publisher.pop(page, None)
                self.evictions += 1
                taken.append(page)
        for page in taken:
            self._refs[page] = 1
        return [HostPage(page) for page in taken]

    def _note_released(self, page: int) -> None:
        self._note_released_all([page])

    def _note_released_all(self, pages: list[int]) -> None:
        step = self.step_scheduled
        if step <= self.step_settled:
            return  # no step that could read them is in flight
        steps = self._released_steps
        if steps and steps[-1][0] == step:
            steps[-1][1].extend(pages)
        else:
            steps.append((step, list(pages)))
        self._released_at.update(dict.fromkeys(pages, step))

    def retain(self, page: int) -> None:
        """Take another reference, reviving a cached copy if nobody held it."""
        if page in self._refs:
            self._refs[page] += 1
            return
        if page not in self._evictable:
            raise KeyError(f"host page {page} is neither referenced nor cached")
        del self._evictable[page]
        self._refs[page] = 1
        if self._released_at:
            self._released_at.pop(page, None)

    def retain_all(self, pages: Iterable[int]) -> None:
        """`retain` each of these pages (a turn's history of thousands, in one call)."""
        refs, evictable, released = self._refs, self._evictable, self._released_at
        for page in pages:
            if page in refs:
                refs[page] += 1
            elif page in evictable:
                del evictable[page]
                refs[page] = 1
                if released:
                    released.pop(page, None)
            else:
                raise KeyError(f"host page {page} is neither referenced nor cached")

    def retain_cached(self, block_hash: Hashable) -> HostPage | None:
        """The host page holding a durable copy of this block, retained, or None: the
        caller's reference keeps it from eviction until released or handed on."""
        page = self._by_hash.get(block_hash)
        if page is not None:
            self.retain(page)
        return page

    def retain_all_cached(self, block_hashes: Iterable[Hashable]) -> list[HostPage | None]:
        """`retain_cached` of each of these blocks (a new turn's history, in one call)."""
        found = list(map(self._by_hash.get, block_hashes))
        self.retain_all([page for page in found if page is not None])
        return found

    def touch(self, pages: Iterable[int]) -> None:
        """Make these pages' cached copies the most recently used, in this order (as
        retaining and releasing each would); referenced pages are left as they are."""
        evictable = self._evictable
        for page in pages:
            if page in evictable:
                evictable.move_to_end(page)

    def release(self, page: int, written: bool = True) -> None:
        """Drop a reference. `written=False`: a page `allocate_settled` handed out that
        nothing wrote or read since (a landing whose request was not scheduled): it stays
        settled for the next landing."""
        refs = self._refs.get(page, 0)
        if refs <= 0:
            raise KeyError(f"host page {page} released more often than retained")
        if refs > 1:
            self._refs[page] = refs - 1
            return
        del self._refs[page]
        if page in self._hash_of:
            self._evictable[page] = None
        else:
            self._never_used.append(page)
        if self.track_releases and written:
            self._note_released(page)

    def release_all(self, pages: Iterable[int]) -> None:
        """`release` each of these pages (a request's thousands at its end, in one call)."""
        refs, hash_of, evictable, never_used = self._refs, self._hash_of, self._evictable, self._never_used
        track, freed = self.track_releases, []
        try:
            for page in pages:
                n = refs.get(page, 0)
                if n > 1:
                    refs[page] = n - 1
                    continue
                if n <= 0:
                    raise KeyError(f"host page {page} released more often than retained")
                del refs[page]
                if page in hash_of:
                    evictable[page] = None
                else:
                    never_used.append(page)
                if track:
                    freed.append(page)
        finally:
            if freed:
                self._note_released_all(freed)

    def publish(self, page: int, block_hash: Hashable, publisher: str = "") -> None:
        """Index a referenced page, whose copy (made by request `publisher`) is now durable,
        by its block hash."""
        if page not in self._refs:
            raise KeyError(f"host page {page} is not referenced")
        if block_hash in self._by_hash or page in self._hash_of:
            return  # an identical copy is already indexed; keep the first
        self._by_hash[block_hash] = HostPage(page)
        self._hash_of[page] = block_hash
        self._publisher[page] = publisher

    def published_by(self, page: int) -> str | None:
        """The request whose copy an indexed page holds (None: not indexed)."""
        return self._publisher.get(page)

    def withdraw(self, hashes: Iterable[Hashable], publisher: str) -> list[HostPage]:
        """Request `publisher` failed on the workers, and the KV of its pages with these
        hashes is not to be trusted: the pages it published under them are forgotten
        (returned; another request's copy under the same hash, computed by that request,
        stays), and a KV connector's hit stops before them from now on (`is_withdrawn`).
        The most recent `MAX_WITHDRAWN` hashes are kept, until `forget_all`."""
        found = []
        withdrawn = self._withdrawn
        for block_hash in hashes:
            page = self._by_hash.get(block_hash)
            if page is not None and self._publisher.get(page) == publisher:
                self.forget(page, block_hash)
                found.append(page)
            withdrawn.pop(block_hash, None)
            withdrawn[block_hash] = None
        while len(withdrawn) > MAX_WITHDRAWN:
            del withdrawn[next(iter(withdrawn))]
        return found

    def has_withdrawn(self) -> bool:
        return bool(self._withdrawn)

    def is_withdrawn(self, block_hash: Hashable) -> bool:
        """Whether a failed request wrote the KV of pages with this hash (`withdraw`)."""
        return block_hash in self._withdrawn

    def forget(self, page: int, block_hash: Hashable) -> None:
        """No lookup finds this page under `block_hash` any more (its copy is not to be
        trusted); a page indexed under another hash, or not at all, is left as it is."""
        if self._hash_of.get(page) != block_hash:
            return
        del self._by_hash[self._hash_of.pop(page)]
        self._publisher.pop(page, None)
        if page in self._evictable:
            del self._evictable[page]
            self._never_used.append(page)
        self.evictions += 1

    def forget_all(self) -> None:
        """Forget every copy's block hash (vLLM's prefix cache was reset, as after a weight
        update): no lookup finds a copy made before. Referenced pages stay with their
        holders, and cached ones nobody references become free."""
        self._never_used.extend(reversed(self._evictable))
        self._evictable.clear()
        self._by_hash.clear()
        self._hash_of.clear()
        self._publisher.clear()
        self._withdrawn.clear()  # the connectors' tiers were reset too
        self.evictions += 1  # a lookup made before no longer holds

    def check(self) -> None:
        """Assert the pool's invariants (used by tests and debug builds)."""
        # Every page is free, cached or referenced, and only one of them: the three hold
        # num_pages entries in all, and num_pages distinct pages.
        never_used, cached, refs, hash_of = self._never_used, self._evictable, self._refs, self._hash_of
        assert len(never_used) + len(cached) + len(refs) == self.num_pages
        pages = set(never_used)
        pages.update(cached)
        pages.update(refs)
        assert len(pages) == self.num_pages, "a host page is in two of free, cached and referenced"
        assert not refs or min(refs.values()) > 0
        assert len(hash_of) == len(self._by_hash) and hash_of.keys() == set(self._by_hash.values())
        assert self._publisher.keys() == hash_of.keys(), "an indexed page without its publisher"
        assert cached.keys() <= hash_of.keys() and hash_of.keys().isdisjoint(never_used)
        assert self._released_at.keys().isdisjoint(refs), "a page released since is referenced again"
