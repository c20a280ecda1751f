# SPDX-License-Identifier: Apache-2.0
"""The KV cache manager's block pool and block tables, as Hybrid HiSparse sees them.

Owns the adapter between HiSparse's scheduler side (residency and admission,
which speak of block ids) and vLLM's `KVCacheManager`: every read of the block
pool, the block tables and the prefix cache, and every change HiSparse makes to
them, goes through this class. Hot leases and staging are ordinary pool blocks
taken and given back; a demoted page leaves the request's block table for the
null block in every sparse-MLA group, and each such change is recorded as a
`BlockTableUpdate` (one per page, every group's entry) for the step's plan.
Blocks HiSparse takes never include a guarded block (a pending admission's
prefix hit, `guard_with`), and the free blocks it counts leave those out.

Frees follow upstream's fence: when the scheduler defers frees (a KV consumer
connector with more than one batch in flight), a block whose last reference
HiSparse drops returns to the pool only once the step in flight is processed,
through the scheduler's own deferred-free queue, so no connector load into a
reallocated block races a step that still reads it.

It never decides what to demote, lease or guard; it only carries out what
residency and admission ask, through the block pool's and the single-type
managers' own structures.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, cast

from vllm.v1.core.kv_cache_utils import BlockHash, BlockHashWithGroupId, make_block_hash_with_group_id
from vllm.v1.hisparse.plan import BlockId, BlockTableUpdate, PageIndex

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request


class KVCacheBlockAccess:
    """The KV cache manager's block pool, block tables and prefix cache, as HiSparse sees them."""

    def __init__(
        self, kv_cache_manager: KVCacheManager, mla_group_ids: Sequence[int], other_group_ids: Sequence[int]
    ) -> None:
        self._manager = kv_cache_manager
        self._pool = kv_cache_manager.block_pool
        self._groups = kv_cache_manager.coordinator.single_type_managers
        self._mla = [self._groups[g] for g in mla_group_ids]
        self.mla_group_ids = tuple(mla_group_ids)
        self.other_group_ids = tuple(other_group_ids)
        # Pages per block of the other groups: 1, but for the page layout's resident group
        # (docs/architecture.md, "The page layout").
        page = self._mla[0].block_size
        multiples = {self._groups[g].block_size // page for g in other_group_ids}
        if len(multiples) != 1 or any(self._groups[g].block_size % page for g in other_group_ids):
            raise ValueError(
                "Hybrid HiSparse: the groups outside the sparse-MLA ones need one block size, "
                f"a multiple of the sparse-MLA page ({page} tokens); got "
                f"{[self._groups[g].block_size for g in other_group_ids]}"
            )
        self.resident_multiple = multiples.pop()
        self.null_block = self._pool.null_block
        self.null_block_id = BlockId(self.null_block.block_id)
        # A demoted page's entries, one per sparse-MLA group.
        self._null_ids = (self.null_block_id,) * len(self.mla_group_ids)
        # With one sparse-MLA group (the page layout), a page's entry is one block id: one
        # shared tuple per block, made here, so that registering a new turn's history of
        # thousands of pages allocates none (each would count towards the garbage
        # collector's next young collection, which walks the new requests' token lists).
        self._rows: list[tuple[BlockId, ...]] | None = None
        if len(self._mla) == 1:
            self._rows = [(BlockId(i),) for i in range(self._pool.num_gpu_blocks)]
        self.use_eagle = kv_cache_manager.use_eagle
        self.updates: list[BlockTableUpdate] = []
        self._scheduler: Scheduler | None = None
        self._guarded: Callable[[], Iterable[KVCacheBlock]] = tuple
        # Staging blocks a finished step gave up, held (one reference each) for the next
        # step's takes instead of round trips through the pool's free queue; given back
        # whenever the pool itself must have them (`release_spare`).
        self._spare: list[BlockId] = []

    def guard_with(self, guarded: Callable[[], Iterable[KVCacheBlock]]) -> None:
        """Never take the blocks `guarded()` names (pending admissions' prefix hits)."""
        self._guarded = guarded

    def use_fence_of(self, scheduler: Scheduler) -> None:
        """Free through `scheduler`'s deferred-free fence whenever it applies."""
        self._scheduler = scheduler

    # -- the pool ----------------------------------------------------------------

    def _guarded_free(self) -> list[KVCacheBlock]:
        """Guarded blocks in the free queue, where an allocation could pop them."""
        seen: dict[int, KVCacheBlock] = {}
        for block in self._guarded():
            if block.ref_cnt == 0:
                seen[block.block_id] = block
        return list(seen.values())

    def num_free_blocks(self) -> int:
        """Free blocks HiSparse may take: the pool's, less the guarded ones, and the spare ones."""
        return self._pool.get_num_free_blocks() - len(self._guarded_free()) + len(self._spare)

    def keep_spare(self, block_ids: Sequence[BlockId]) -> None:
        """Hold these staging blocks (the caller's references pass on) for the next takes."""
        self._spare.extend(block_ids)

    def release_spare(self) -> int:
        """Give every spare block back to the pool; how many. Straight to the pool, also
        while frees are deferred: a spare block's last step has been processed, and no
        step in flight holds it (a step's staging comes back only once its output is in)."""
        spare, self._spare = self._spare, []
        if spare:
            self._pool.free_blocks(self._blocks(spare))
        return len(spare)

    def spare_blocks(self) -> list[BlockId]:
        return list(self._spare)

    def num_spare(self) -> int:
        return len(self._spare)

    def frees_are_deferred(self) -> bool:
        scheduler = self._scheduler
        return (
            scheduler is not None
            and scheduler.defer_block_free
            and scheduler.sched_step_seq > scheduler.processed_step_seq
        )

    def _free(self, blocks: list[KVCacheBlock]) -> int:
        """Drop one reference of each block; returns how many lost their last one."""
        last = sum(b.ref_cnt == 1 for b in blocks)
        if self.frees_are_deferred():
            assert self._scheduler is not None
            # Upstream's queue frees an entry in reverse, once its fence step is processed.
            self._scheduler.deferred_frees.append((self._scheduler.sched_step_seq, blocks[::-1]))
        else:
            self._pool.free_blocks(blocks)
        return last

    def _blocks(self, block_ids: Iterable[int]) -> list[KVCacheBlock]:
        return [self._pool.blocks[b] for b in block_ids]

    def take(self, num_blocks: int) -> list[BlockId]:
        """`num_blocks` new blocks, none of them guarded: spare ones first, then the pool's
        (`_guarded_ahead`)."""
        spare = self._spare
        if spare:
            n = min(num_blocks, len(spare))
            taken = spare[len(spare) - n :]
            del spare[len(spare) - n :]
            if n == num_blocks:
                return taken
            return taken + self._take_from_pool(num_blocks - n)
        return self._take_from_pool(num_blocks)

    def _take_from_pool(self, num_blocks: int) -> list[BlockId]:
        guarded = self._guarded_ahead(num_blocks)
        if not guarded:
            return [BlockId(b.block_id) for b in self._pool.get_new_blocks(num_blocks)]
        self._pool.touch(guarded)
        try:
            return [BlockId(b.block_id) for b in self._pool.get_new_blocks(num_blocks)]
        finally:
            self._pool.free_blocks(guarded)

    def _guarded_ahead(self, num_blocks: int) -> list[KVCacheBlock]:
        """The guarded free blocks an allocation of `num_blocks` would reach: those before the
        `num_blocks`-th unguarded block of the free queue. They are held out of the queue while
        it allocates (and return to its LRU end); the guarded blocks beyond keep their place."""
        guarded_ids = {b.block_id for b in self._guarded() if b.ref_cnt == 0}
        if not guarded_ids:
            return []
        queue = self._pool.free_block_queue
        tail = queue.fake_free_list_tail
        block = queue.fake_free_list_head.next_free_block
        ahead = []
        while num_blocks > 0 and block is not None and block is not tail:
            if block.block_id in guarded_ids:
                ahead.append(block)
            else:
                num_blocks -= 1
            block = block.next_free_block
        return ahead

    def give_back(self, block_ids: Sequence[int]) -> int:
        """Drop one reference of each block; how many lost their last one."""
        return self._free(self._blocks(block_ids))

    def hold(self, block_ids: Sequence[int]) -> None:
        blocks = self._blocks(block_ids)
        assert all(b.ref_cnt > 0 for b in blocks), "only a referenced block can be held"
        self._pool.touch(blocks)

    def num_exclusive(self, block_ids: Sequence[int]) -> int:
        return sum(b.ref_cnt == 1 for b in self._blocks(block_ids))

    def front_is_cached(self) -> bool:
        """Whether the next block an allocation takes holds a prefix-cache entry."""
        queue = self._pool.free_block_queue
        front = queue.fake_free_list_head.next_free_block
        return front is not None and front is not queue.fake_free_list_tail and front.block_hash is not None

    def free_first(self, blocks: list[KVCacheBlock]) -> int:
        """Drop one reference of each block (none of them deferred); those that lose their last
        go to the front of the pool's eviction order, in this order: the host pool holds their
        content. How many."""
        freed = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block)
        self._pool.free_block_queue.prepend_n(freed)
        return len(freed)

    def frees_uncached(self, request_id: str) -> bool:
        """Whether freeing the request's blocks puts a block holding no prefix-cache entry at
        the front of the eviction order (its partial last page, in some group)."""
        for manager in self._groups:
            table = manager.req_to_blocks.get(request_id)
            if table:
                last = table[-1]
                if not last.is_null and last.block_hash is None and last.ref_cnt == 1:
                    return True
        return False

    # -- the prefix cache ----------------------------------------------------------

    def page_lookup(self, group_ids: Sequence[int]) -> Callable[[BlockHash], list[KVCacheBlock] | None]:
        """A function for a walk over many pages: a page's device blocks where the prefix
        cache holds it in every one of `group_ids`, else None (the block pool's
        `get_cached_block`, with each group's key suffix made once)."""
        suffixes = [make_block_hash_with_group_id(BlockHash(b""), g) for g in group_ids]
        get_one_block = self._pool.cached_block_hash_to_block.get_one_block
        if len(suffixes) == 1:
            (suffix,) = suffixes

            def lookup_one(block_hash: BlockHash) -> list[KVCacheBlock] | None:
                block = get_one_block(BlockHashWithGroupId(block_hash + suffix))
                return None if block is None else [block]

            return lookup_one

        def lookup(block_hash: BlockHash) -> list[KVCacheBlock] | None:
            blocks = []
            for suffix in suffixes:
                block = get_one_block(BlockHashWithGroupId(block_hash + suffix))
                if block is None:
                    return None
                blocks.append(block)
            return blocks

        return lookup

    def pages_cached(
        self, group_ids: Sequence[int], block_hashes: Sequence[BlockHash]
    ) -> list[list[KVCacheBlock] | None]:
        """`page_lookup(group_ids)` of each of these pages, in one pass per group (a new
        turn's walk over a history of thousands of pages: no call per page and group). A
        group is asked only for the pages every group before it caches, as `page_lookup`
        stops at the first group that lacks the page."""
        # A group's key is the page's hash and the group's suffix (`make_block_hash_with_group_id`).
        get_one_block = cast(
            "Callable[[bytes], KVCacheBlock | None]", self._pool.cached_block_hash_to_block.get_one_block
        )
        if not group_ids:
            return [[] for _ in block_hashes]  # as `page_lookup`: no group lacks the page
        found: list[list[KVCacheBlock] | None] = []
        wanted: list[int] = []  # the pages every group so far caches
        for n, g in enumerate(group_ids):
            suffix = make_block_hash_with_group_id(BlockHash(b""), g)
            if n == 0:
                column = map(get_one_block, map(bytes.__add__, block_hashes, repeat(suffix)))
                found = [None if block is None else [block] for block in column]
                wanted = [i for i, blocks in enumerate(found) if blocks is not None]
                continue
            still = []
            for i, block in zip(
                wanted, map(get_one_block, [block_hashes[i] + suffix for i in wanted]), strict=True
            ):
                blocks = found[i]
                if block is None or blocks is None:
                    found[i] = None
                else:
                    blocks.append(block)
                    still.append(i)
            wanted = still
            if not wanted:
                break
        return found

    def with_columns(
        self, blocks: KVCacheBlocks, columns: Mapping[int, Sequence[KVCacheBlock]]
    ) -> KVCacheBlocks:
        """`blocks` with more pages appended, given group by group (`columns[g]` for group g;
        every group has an entry, all of one length)."""
        extended = [[*group, *columns[g]] for g, group in enumerate(blocks.blocks)]
        return self._manager.create_kv_cache_blocks(tuple(extended))

    def with_host_placeholders(self, blocks: KVCacheBlocks, num_pages: int) -> KVCacheBlocks:
        """`blocks` whose sparse-MLA groups go on with null placeholders for `num_pages` HOST pages."""
        extended = [list(group) for group in blocks.blocks]
        for g in self.mla_group_ids:
            extended[g].extend([self.null_block] * num_pages)
        return self._manager.create_kv_cache_blocks(tuple(extended))

    # -- the block tables ----------------------------------------------------------

    def has_blocks(self, request_id: str) -> bool:
        return bool(self._mla[0].req_to_blocks.get(request_id))

    def num_table_pages(self, request_id: str) -> int:
        return len(self._mla[0].req_to_blocks.get(request_id, ()))

    def page_rows(self, request_id: str, start: int, end: int) -> list[tuple[BlockId, ...]]:
        """The request's pages [start, end), each as `page_block_ids` gives it (one block
        id per sparse-MLA group), in one pass per group. A group whose table ends before
        `end` raises ValueError."""
        if self._rows is not None:
            rows = self._rows
            column = self._mla[0].req_to_blocks[request_id][start:end]
            if len(column) != end - start:
                raise ValueError(f"{request_id}: {len(column)} pages from page {start}, not {end - start}")
            return [rows[b.block_id] for b in column]
        columns = [
            [b.block_id for b in column[: end - start]] for column in self.page_columns(request_id, start)
        ]
        return list(zip(*columns, strict=True))  # type: ignore[arg-type]

    def first_group_blocks(self, request_id: str, start: int, end: int | None) -> list[KVCacheBlock]:
        """The request's pages [start, end) in the first sparse-MLA group's table (to its end
        with None; none where it has no table)."""
        return self._mla[0].req_to_blocks.get(request_id, [])[start:end]

    def page_block_sets(self, request_id: str, start: int, end: int) -> list[tuple[int, frozenset[int]]]:
        """The request's pages [start, end): each page's block in the first sparse-MLA group
        and its blocks in every group (a resident block of m pages counts for each)."""
        page = self._mla[0].block_size
        first = self._mla[0].req_to_blocks.get(request_id, [])[start:end]
        found: list[set[int]] = [set() for _ in first]
        for manager in self._groups:
            per_block = manager.block_size // page
            table = manager.req_to_blocks.get(request_id, [])
            for i in range(len(first)):
                index = (start + i) // per_block
                if index < len(table):
                    found[i].add(table[index].block_id)
        return [(block.block_id, frozenset(blocks)) for block, blocks in zip(first, found, strict=True)]

    def page_columns(self, request_id: str, start: int) -> list[list[KVCacheBlock]]:
        """The request's sparse-MLA table entries from page `start` on, one list per group:
        `page_block_ids(request_id, start + i)` is every column's block i."""
        return [m.req_to_blocks[request_id][start:] for m in self._mla]

    def pages_named(self, request_id: str, block_ids: set[int]) -> list[BlockId]:
        """One block id per page of the request's table, for a scan that reads one group
        (upstream's scan for blocks a KV load failed to fill): a block of that page named
        in `block_ids`, in whichever group (a resident block names each page it covers),
        where there is one, else the page's block in the first sparse-MLA group (the null
        block for a HOST page)."""
        page = self._mla[0].block_size
        pages = [BlockId(block.block_id) for block in self._mla[0].req_to_blocks.get(request_id, ())]
        null = self.null_block_id
        for manager in self._groups:
            per_block = manager.block_size // page
            for index, block in enumerate(manager.req_to_blocks.get(request_id, ())):
                if block.block_id in block_ids and block.block_id != null:
                    for position in range(index * per_block, min((index + 1) * per_block, len(pages))):
                        if pages[position] not in block_ids:
                            pages[position] = BlockId(block.block_id)
        return pages

    def first_pages_holding(self, block_ids: set[int], from_page: int = 0) -> dict[str, int]:
        """Request -> the first page of its table held by one of these blocks, in any group,
        for every request whose table holds one. The blocks hold pages `from_page` on: in a
        resident block of several pages, the first of them at or after it."""
        page = self._mla[0].block_size
        found: dict[str, int] = {}
        for manager in self._groups:
            per_block = manager.block_size // page
            for request_id, blocks in manager.req_to_blocks.items():
                for index, block in enumerate(blocks):
                    if block.block_id in block_ids:
                        first = index if per_block == 1 else max(index * per_block, from_page)
                        found[request_id] = min(found.get(request_id, first), first)
                        break
        return found

    def blocks_from_page(self, request_id: str, first: int) -> set[BlockId]:
        """The request's blocks, in every group, that hold page `first` or a later one (a
        resident block holding it holds earlier pages too); the null block left out."""
        page = self._mla[0].block_size
        found: set[BlockId] = set()
        for manager in self._groups:
            per_block = manager.block_size // page
            blocks = manager.req_to_blocks.get(request_id, ())
            found.update(BlockId(block.block_id) for block in blocks[first // per_block :])
        found.discard(BlockId(self.null_block_id))
        return found

    def page_in_table(self, request_id: str, position: int) -> tuple[BlockId, ...] | None:
        """The request's blocks of one page, one per sparse-MLA group, or None where its
        table has no such page (or it has no table: it ended or was preempted). Reads
        without adding a table."""
        found = []
        for manager in self._mla:
            table = manager.req_to_blocks.get(request_id)
            if table is None or position >= len(table):
                return None
            found.append(BlockId(table[position].block_id))
        return tuple(found)

    def page_block_ids(self, request_id: str, position: int) -> tuple[BlockId, ...]:
        """The request's blocks of one page, one per sparse-MLA group (the null block for HOST)."""
        return tuple(BlockId(m.req_to_blocks[request_id][position].block_id) for m in self._mla)

    def blocks_for_pages(self, first: int, end: int) -> int:
        """Blocks that pages [first, end) take in every group, the pages before `first` held:
        one per page in each sparse-MLA group, and in each other group one per block of
        `resident_multiple` pages they start."""
        m = self.resident_multiple
        resident = -(-end // m) - -(-first // m)
        return (end - first) * len(self.mla_group_ids) + resident * len(self.other_group_ids)

    def history_block_ids(self, request_id: str, num_pages: int) -> list[int]:
        """The request's first `num_pages` pages' blocks in the groups outside the sparse-MLA
        ones (the indexer's, an MTP drafter's) that the prefix cache holds."""
        ids = []
        num_blocks = -(-num_pages // self.resident_multiple)
        for group_id in self.other_group_ids:
            for block in self._groups[group_id].req_to_blocks.get(request_id, ())[:num_blocks]:
                if not block.is_null and block.block_hash is not None:
                    ids.append(block.block_id)
        return ids

    def blocks_from(self, request_id: str, num_tokens: int) -> Iterator[int]:
        """The request's blocks in the groups outside the sparse-MLA ones from the one
        holding token `num_tokens` on."""
        for group_id in self.other_group_ids:
            manager = self._groups[group_id]
            for block in manager.req_to_blocks.get(request_id, ())[num_tokens // manager.block_size :]:
                yield block.block_id

    def cache_pages(self, request: Request, num_tokens: int) -> None:
        """Commit the request's complete sparse-MLA pages among its first `num_tokens` tokens
        to the prefix cache, page by page, and make its last resident block reachable from
        its last complete page.

        Upstream commits a layout's blocks only up to a whole block of its coarsest group,
        and a resident block that is not full only at the prompt's last page boundary; in
        the page layout that would leave up to m - 1 complete pages of every request out
        of the prefix cache, so residency could neither copy nor demote them, and the next
        turn of a session would recompute them. The resident block not yet full gets a
        partial entry at the last complete page (vLLM's `cache_partial_block`, one entry
        per block, the longest), so a hit may end on any page: the request it serves
        writes the pages past its hit into a private copy of that block (vLLM's
        copy-on-write of a partial hit). A no-op where every group has one page per block."""
        if self.resident_multiple == 1:
            return
        if self.use_eagle:
            # Tokens a multi-module drafter may compute again are not final yet.
            num_tokens -= self._manager.coordinator.num_reprefillable_tokens
        for manager in self._mla:
            manager.cache_blocks(request, num_tokens)
        self._cache_resident_tail(request, num_tokens)

    def _cache_resident_tail(self, request: Request, num_tokens: int) -> None:
        """A partial prefix-cache entry for the request's resident block that holds its last
        complete page among its first `num_tokens` tokens, where that block is not full."""
        page = self._mla[0].block_size
        boundary = num_tokens // page * page
        resident = page * self.resident_multiple
        if boundary <= 0 or boundary % resident == 0 or boundary // page > len(request.block_hashes):
            return
        index = boundary // resident
        for group_id in self.other_group_ids:
            table = self._groups[group_id].req_to_blocks.get(request.request_id)
            if not table or index >= len(table):
                continue
            block = table[index]
            if block.is_null or (block.block_hash_num_tokens or 0) >= boundary:
                continue
            self._pool.cache_partial_block(request, block, boundary, group_id, resident)

    def num_cached_pages(self, request_id: str) -> int:
        """Pages of the request every sparse-MLA group has committed to the prefix cache."""
        return min(m.num_cached_block.get(request_id, 0) for m in self._mla)

    def take_out_pages(
        self, request_id: str, pages: Sequence[tuple[int, Sequence[int]]], *, record: bool = True
    ) -> list[KVCacheBlock]:
        """These pages, (page index, block per sparse-MLA group) each, leave the request's
        block table for the null block (each page's change recorded for the plan unless
        `record` is False: a released request's table goes with it). The blocks, whose
        references pass to the caller, in page order."""
        null, nulls = self.null_block, self._null_ids
        tables = [manager.req_to_blocks[request_id] for manager in self._mla]
        taken: list[KVCacheBlock] = []
        for page_index, block_ids in pages:
            row = [table[page_index] for table in tables]
            assert [block.block_id for block in row] == list(block_ids), (
                f"{request_id} page {page_index}: table holds {[b.block_id for b in row]}, "
                f"residency {list(block_ids)}"
            )
            for table in tables:
                table[page_index] = null
            taken += row
            if record:
                self.updates.append(BlockTableUpdate(request_id, PageIndex(page_index), nulls))
        return taken

    def drop_pages(self, request_id: str, pages: Sequence[tuple[int, Sequence[int]]]) -> int:
        dropped = self.take_out_pages(request_id, pages)
        if not dropped:
            return 0
        if self.frees_are_deferred():
            return self._free(dropped)
        # The host pool holds these pages: evicting them costs nothing it cannot give back.
        return self.free_first(dropped)

    def fill_pages(self, request_id: str, pages: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Point the request's HOST pages (null entries) at these taken blocks, (page index,
        block per sparse-MLA group) each: the table's reference becomes the blocks' own."""
        tables = [manager.req_to_blocks[request_id] for manager in self._mla]
        pool_blocks = self._pool.blocks
        for page_index, block_ids in pages:
            for table, block_id in zip(tables, block_ids, strict=True):
                assert table[page_index].is_null, f"{request_id} page {page_index} is not a HOST page"
                table[page_index] = pool_blocks[block_id]
            self.updates.append(
                BlockTableUpdate(request_id, PageIndex(page_index), tuple(BlockId(b) for b in block_ids))
            )

    # -- what the ownership check reads ----------------------------------------------

    def table_block_ids(self) -> Iterator[tuple[str, list[int]]]:
        """(request, the block ids of its table in one group), for every group and request:
        every entry, the null block's included."""
        for manager in self._groups:
            for request_id, blocks in manager.req_to_blocks.items():
                yield request_id, [block.block_id for block in blocks]

    def deferred_references(self) -> Counter[int]:
        """Block -> references waiting in the scheduler's deferred-free queue."""
        if self._scheduler is None:
            return Counter()
        return Counter(b.block_id for _, blocks in self._scheduler.deferred_frees for b in blocks)

    def pool_blocks(self) -> Sequence[KVCacheBlock]:
        return self._pool.blocks

    def free_queue_ids(self) -> list[int]:
        return [b.block_id for b in self._pool.free_block_queue.get_all_free_blocks()]
