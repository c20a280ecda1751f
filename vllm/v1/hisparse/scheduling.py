# SPDX-License-Identifier: Apache-2.0
"""Hybrid HiSparse in the scheduler: residency wired to vLLM's KV cache manager.

Owns the glue between the residency state machine (`residency.py`) and the
scheduler process:
- residency works on the KV cache manager through `KVCacheBlockAccess`
  (`kv_cache_access.py`);
- pressure relief before preemption, called by `KVCacheManager.allocate_slots`
  when the pool cannot satisfy an allocation (new tokens, a new request); a
  finished request whose blocks a KV connector still sends is held, never a victim;
- prefix hits from the host pool: a waiting request whose prefix pages live
  only in the host pool (its indexer blocks still cached on the device) takes
  them as placeholders plus a hot lease and starts NONE instead of recomputing;
- KV connector hits: the OffloadingConnector handles every group but the
  sparse-MLA ones (see offloading.py), so its hit is limited to pages the host
  pool holds; those pages are restored into the blocks allocated for the hit
  when the pool has room, else taken as placeholders plus a hot lease (NONE);
- imports of a connector that loads every group (P/D, shared storage): when
  the pool is tight, the sparse-MLA pages of the import land in the host pool
  (placeholders, host pages allocated for them, a hot lease: NONE) and the
  connector writes them there (kv_import.py); else they land on the device;
- the step plan that crosses to the workers in `SchedulerOutput.hisparse_plan`
  (host->device restores and block-table point updates to apply before the
  forward, copies to run after it, the residency map of every request that is
  not FULL), and the workers' copy reports from
  `ModelRunnerOutput.hisparse_copied`.

Workers that do not execute plans report nothing; their step's copies are
cancelled and planning stops, so no page ever leaves the device without a
durable host copy. It never touches tensors, the worker or the scheduler's
queues.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from vllm.config.hisparse import hisparse_active, host_pool_pages, plans_executable, sparse_mla_page_bytes
from vllm.logger import init_logger
from vllm.v1.hisparse.host_pool import HostPagePool
from vllm.v1.hisparse.kv_cache_access import KVCacheBlockAccess
from vllm.v1.hisparse.kv_grouping import hisparse_managed_group_ids
from vllm.v1.hisparse.kv_import import ImportKind, import_kind
from vllm.v1.hisparse.plan import (
    HISPARSE_PLAN_VERSION,
    WORKER_COUNTERS,
    HiSparseStepPlan,
    HostPageUpdate,
    HotLeaseUpdate,
    PageCopy,
    PageRestore,
    StepStaging,
)
from vllm.v1.hisparse.residency import RequestState, ResidencyManager

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

class HiSparseScheduling:
    """Hybrid HiSparse's scheduler-side state for one Scheduler."""

    def __init__(self, scheduler: Scheduler) -> None:
        vllm_config = scheduler.vllm_config
        config = vllm_config.attention_config.hisparse_config
        assert config is not None and config.device_buffer_size is not None
        self.kv_cache_manager = scheduler.kv_cache_manager
        groups = self.kv_cache_manager.kv_cache_config.kv_cache_groups
        self.mla_group_ids = hisparse_managed_group_ids(groups)
        self.other_group_ids = tuple(i for i in range(len(groups)) if i not in self.mla_group_ids)
        if not self.mla_group_ids or not self.other_group_ids:
            raise ValueError(
                "Hybrid HiSparse needs sparse-MLA KV cache groups separate from the indexer's; got "
                f"{[list(g.layer_names)[:2] for g in groups]}"
            )
        self.block_size = groups[self.mla_group_ids[0]].kv_cache_spec.block_size
        self.blocks = KVCacheBlockAccess(self.kv_cache_manager, self.mla_group_ids)
        self.null_block_id = self.kv_cache_manager.block_pool.null_block.block_id
        num_host_pages = host_pool_pages(vllm_config)
        # Bytes of one page (all sparse-MLA layers) and of one layer's row, one replica.
        # Copies to the host go once into each node's pool; every rank reads back into
        # its own device.
        self._page_bytes = sparse_mla_page_bytes(vllm_config)
        self._row_bytes = self._page_bytes // (
            self.block_size * vllm_config.model_config.get_total_num_hidden_layers()
        )
        self._readers = vllm_config.parallel_config.tensor_parallel_size
        self.residency = ResidencyManager(
            self.blocks,
            HostPagePool(num_host_pages),
            self.block_size,
            config.device_buffer_size,
            blocks_per_page=len(self.mla_group_ids),
            mode=config.mode,
            proactive_copy=config.proactive_copy,
        )
        self.hot_rows = config.device_buffer_size
        self.max_model_len = vllm_config.model_config.max_model_len
        self.index_topk = int(vllm_config.model_config.hf_text_config.index_topk)
        self.num_groups = len(groups)
        # Chunks scheduled this step whose staging counted their HOST pages: no demotion
        # may add to those pages before the forward. Cleared when the plan is attached.
        self._frozen: set[str] = set()
        # Staging blocks leased for this step's chunks (request -> blocks, group-major),
        # then, per plan, held until the step's output comes back.
        self._staging: dict[str, list[int]] = {}
        # Chunks fitted with staging that then could not be allocated: their next chunk
        # takes no staging (the estimate of a chunk's own blocks missed something).
        self._unplaced: set[str] = set()
        self.staging_rows_leased = 0
        self.chunks_shortened = 0
        self.enable_caching = self.kv_cache_manager.enable_caching
        # Host prefix hits need page-sized hashes (the hash block is the page).
        self.host_prefix_hits = self.enable_caching and scheduler.hash_block_size == self.block_size
        self.issue_plans = True
        self._in_flight: dict[tuple[str, int], PageCopy] = {}
        # Host prefix hits found this step, claimed when the request is scheduled.
        self._pending_hits: dict[str, tuple[dict[int, int], list[int]]] = {}
        # KV connector hits: host pages found (page index -> host page), then, once
        # blocks are allocated, the pages restored into them until they are registered.
        self._connector_hits: dict[str, dict[int, int]] = {}
        self._restored: dict[str, dict[int, int]] = {}
        self._restores: list[PageRestore] = []
        # Imports landing in the host pool (page index -> host page allocated for it),
        # from the hit until the request's pages are registered; the connector reads
        # them through `host_landing` when it builds the step's metadata.
        self.import_kind = import_kind(scheduler.connector)
        self._imports: dict[str, dict[int, int]] = {}
        if self.import_kind is ImportKind.LANDS_ON_HOST:
            scheduler.connector.host_landing = self.host_landing
        elif self.import_kind is ImportKind.DEVICE and scheduler.connector is not None:
            logger.info(
                "Hybrid HiSparse: %s loads imports into device blocks, as upstream; a connector "
                "that moves blocks between instances needs the same KV cache groups on both "
                "(give the other instance hisparse_config too)",
                type(scheduler.connector).__name__,
            )
        # Steps x requests observed MIXED / NONE, and rows the workers loaded from host.
        self.request_steps = dict.fromkeys(RequestState, 0)
        # The workers' data path counters (see WORKER_COUNTERS), summed over steps.
        self.worker_counts = dict.fromkeys(WORKER_COUNTERS, 0)
        # Steps that verified draft tokens of a request with pages in the host pool.
        self.speculative_steps_with_host_pages = 0
        # Requests whose first step found every page outside the tail in the host pool.
        self.requests_started_none = 0
        self.kv_cache_manager.pressure_relief = self.relieve_pressure
        if plans_executable():
            # Admission by tail + lease rather than by whole context: relief makes
            # room for the rest as it is computed.
            scheduler.scheduler_reserve_full_isl = False
        logger.info(
            "Hybrid HiSparse: %d host pages of %d bytes, hot lease %d blocks, mode=%s, "
            "sparse-MLA groups %s",
            num_host_pages,
            sparse_mla_page_bytes(vllm_config),
            self.residency.hot_lease_blocks,
            config.mode,
            list(self.mla_group_ids),
        )

    # -- hooks called by the scheduler and the KV cache manager ---------------

    def relieve_pressure(self, request: Request, num_blocks: int, new_computed_blocks: Any = ()) -> bool:
        """Free `num_blocks` by demotion before the scheduler preempts; True if it did."""
        # Blocks the request is about to take from the prefix cache must stay put:
        # they are already counted as allocations if they sit in the free queue.
        protected = {b.block_id for group in new_computed_blocks for b in group}
        freed = self.residency.relieve_pressure(num_blocks, protected_blocks=protected, frozen=self._frozen)
        if freed >= num_blocks:
            self.residency.counters.preemptions_avoided += 1
            return True
        return False

    def defer_preemption(self, request: Request) -> bool:
        """True when copies about to run will make room: wait a step instead of preempting.

        Relief marks resident pages for copy-then-free when no page is durable on
        the host yet; their copies run after this step, so preempting now would
        throw away work the next step can keep. The wait is bounded (see
        `ResidencyManager.defer_preemption`).
        """
        if not self.issue_plans or not self.residency.defer_preemption():
            return False
        self.residency.counters.preemptions_avoided += 1
        return True

    def fit_chunk(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """The tokens of `request` this step can compute, with staging rows leased for them.

        All query tokens of a step resolve at once. A request's selections this
        step are at most T x top-K distinct rows, or its HOST rows if fewer; what
        its hot buffer cannot hold is staged in blocks leased from the pool for
        this step only (returned when the step's output comes back). Pressure
        relief for the chunk's own new blocks runs first, since it may demote
        the request's own older pages; then the staging is counted, and when the
        pool cannot spare it, even after demoting other requests' settled pages,
        the chunk is shortened to what fits (at least hot rows / top-K tokens,
        which need no staging). A chunk that could need staging freezes its
        request's residency for the step, so its HOST rows stay what was counted.
        """
        self._return_staging(request.request_id)
        if num_new_tokens * self.index_topk <= self.hot_rows or not self.issue_plans:
            return num_new_tokens

        def own_blocks(num_tokens: int) -> int:
            # The chunk's own new blocks: a page more than it spans, in every group.
            end = -(-(num_computed_tokens + num_tokens) // self.block_size)
            return (end - num_computed_tokens // self.block_size + 1) * self.num_groups

        short = own_blocks(num_new_tokens) - self.blocks.num_free_blocks()
        if short > 0:
            self.residency.relieve_pressure(short, frozen=self._frozen)
        self._frozen.add(request.request_id)
        host_rows = self._host_pages(request.request_id) * self.block_size

        def needed(num_tokens: int) -> int:
            return own_blocks(num_tokens) + self._staging_blocks(num_tokens, host_rows)

        if not self._staging_blocks(num_new_tokens, host_rows):
            return num_new_tokens
        if request.request_id in self._unplaced:
            # Progress first: a chunk that needs no staging rows at all.
            self.chunks_shortened += 1
            return min(num_new_tokens, max(1, self.hot_rows // self.index_topk))
        short = needed(num_new_tokens) - self.blocks.num_free_blocks()
        if short > 0:
            self.residency.relieve_pressure(short, frozen=self._frozen)
        free = self.blocks.num_free_blocks()
        if needed(num_new_tokens) > free:
            # The longest chunk that fits; hot rows / top-K tokens need no staging at all.
            low, high = max(1, self.hot_rows // self.index_topk), num_new_tokens
            while low < high:
                middle = (low + high + 1) // 2
                low, high = (middle, high) if needed(middle) <= free else (low, middle - 1)
            num_new_tokens = min(low, num_new_tokens)
            self.chunks_shortened += 1
        blocks = self._staging_blocks(num_new_tokens, host_rows)
        if blocks:
            self._staging[request.request_id] = self.blocks.take(blocks)
            self.staging_rows_leased += blocks // len(self.mla_group_ids) * self.block_size
        return num_new_tokens

    def _staging_blocks(self, num_tokens: int, host_rows: int) -> int:
        """Blocks (all sparse-MLA groups) to stage what `num_tokens` may select beyond the hot buffer."""
        rows = min(num_tokens * self.index_topk, host_rows) - self.hot_rows
        return -(-max(rows, 0) // self.block_size) * len(self.mla_group_ids)

    def _host_pages(self, request_id: str) -> int:
        """HOST pages the request has, or takes with the host hit it is about to be scheduled with."""
        req = self.residency.requests.get(request_id)
        pending = self._pending_hits.get(request_id)
        return (req.num_host_pages if req is not None else 0) + (len(pending[0]) if pending else 0)

    def _return_staging(self, request_id: str) -> None:
        blocks = self._staging.pop(request_id, None)
        if blocks:
            self.blocks.give_back(blocks)

    def extend_prefix_hit(
        self, request: Request, blocks: KVCacheBlocks, num_tokens: int
    ) -> tuple[KVCacheBlocks, int]:
        """Extend a device prefix hit with pages the host pool still holds.

        Page by page past the device hit: the indexer blocks must still be cached
        on the device (the indexer scores every token); the sparse-MLA page is
        taken from the device prefix cache when every group still has it, else
        from the host pool as a null placeholder. The first page neither holds
        ends the hit; with an EAGLE/MTP drafter the hit then drops its last page,
        as upstream's does. Host pages cost the request a hot lease, taken here.
        """
        self._return_pending_lease(request.request_id)
        if not self.host_prefix_hits or num_tokens % self.block_size:
            return blocks, num_tokens
        block_pool = self.kv_cache_manager.block_pool
        start = num_tokens // self.block_size
        max_pages = (request.num_tokens - 1) // self.block_size
        mla_ids, other_ids = list(self.mla_group_ids), list(self.other_group_ids)
        pages: list[tuple[list | None, list]] = []  # (sparse-MLA blocks or None if host, others)
        host_pages: dict[int, int] = {}
        for position in range(start, max_pages):
            block_hash = request.block_hashes[position]
            other = block_pool.get_cached_block(block_hash, other_ids)
            if other is None:
                break  # the indexer K cache of this page is gone: recompute from here
            mla = block_pool.get_cached_block(block_hash, mla_ids)
            if mla is None:
                host_page = self.residency.host_pool.lookup(block_hash)
                if host_page is None:
                    break
                host_pages[position] = host_page
            pages.append((mla, other))
        if pages and self.kv_cache_manager.use_eagle:
            # As upstream's hit: an EAGLE/MTP drafter recomputes the last page of a hit for
            # the hidden states it drafts from (the device hit already dropped one).
            pages.pop()
            host_pages.pop(start + len(pages), None)
        if host_pages:
            hit = [b for group in blocks.blocks for b in group]
            lease = self._lease_keeping(
                request, hit + [b for mla, other in pages for b in (mla or []) + other]
            )
            if lease:
                self._pending_hits[request.request_id] = (host_pages, lease)
            else:
                host_pages = {}
        if not host_pages:
            # Without host pages only the pages every group still caches count (with a
            # drafter, the device hit's dropped page can be one).
            pages = list(itertools.takewhile(lambda page: page[0] is not None, pages))
            if not pages:
                return blocks, num_tokens
        extended = [list(group) for group in blocks.blocks]
        for mla, other in pages:
            for i, g in enumerate(mla_ids):
                extended[g].append(mla[i] if mla is not None else block_pool.null_block)
            for i, g in enumerate(other_ids):
                extended[g].append(other[i])
        new_blocks = self.kv_cache_manager.create_kv_cache_blocks(tuple(extended))
        return new_blocks, num_tokens + len(pages) * self.block_size

    def cap_external_hit(
        self,
        request: Request,
        new_computed_blocks: KVCacheBlocks,
        num_local_tokens: int,
        num_external_tokens: int,
    ) -> tuple[KVCacheBlocks, int]:
        """A KV connector's hit past the local one, as HiSparse can serve it.

        The connector loads only the groups HiSparse does not manage, so every page
        of its hit needs its sparse-MLA content from the host pool: the hit stands
        if the host pool holds every one of its pages, else nothing is loaded (the
        connector's hits are whole chunks, which a shorter hit could split). Then,
        in hybrid mode with room in the pool (the restored pages take at most half
        of the free blocks), the pages are restored into the blocks allocated for
        the hit (`restore_external_pages`); otherwise they stay in the host pool:
        the local hit's blocks gain null placeholders for them in the sparse-MLA
        groups, and the request takes a hot lease and starts NONE, as on a host
        prefix hit. Returns the (possibly extended) local hit blocks and the hit.
        """
        request_id = request.request_id
        self._connector_hits.pop(request_id, None)
        self._drop_import(request_id)
        if num_external_tokens <= 0 or not plans_executable() or self.import_kind is ImportKind.DEVICE:
            return new_computed_blocks, num_external_tokens  # the connector loads every group
        if self.import_kind is ImportKind.LANDS_ON_HOST:
            return self._land_import(request, new_computed_blocks, num_local_tokens, num_external_tokens)
        if not (self.issue_plans and self.host_prefix_hits) or num_local_tokens % self.block_size:
            return new_computed_blocks, 0
        end = num_local_tokens + num_external_tokens
        host_pages: dict[int, int] = {}
        for position in range(num_local_tokens // self.block_size, -(-end // self.block_size)):
            if position >= len(request.block_hashes):
                return new_computed_blocks, 0  # a partial page: its sparse-MLA rows were never copied
            host_page = self.residency.host_pool.lookup(request.block_hashes[position])
            if host_page is None:
                return new_computed_blocks, 0
            host_pages[position] = host_page
        pending = self._pending_hits.get(request_id)
        restore_blocks = len(host_pages) * len(self.mla_group_ids)
        if (
            pending is None
            and self.residency.mode == "hybrid"
            and restore_blocks <= self.blocks.num_free_blocks() // 2
        ):
            self._connector_hits[request_id] = host_pages
            return new_computed_blocks, num_external_tokens
        # The page holding the last prompt token is written again (a full-prompt hit
        # recomputes that token): it is restored, never a placeholder.
        last_page = (request.num_tokens - 1) // self.block_size
        on_host = {p: h for p, h in host_pages.items() if p < last_page}
        if len(on_host) < len(host_pages):
            self._connector_hits[request_id] = {p: h for p, h in host_pages.items() if p >= last_page}
        if not on_host:
            return new_computed_blocks, num_external_tokens
        if pending is None:
            lease = self._lease_keeping(request, [b for group in new_computed_blocks.blocks for b in group])
            if not lease:
                self._connector_hits.pop(request_id, None)
                return new_computed_blocks, 0
            pending = ({}, lease)
            self._pending_hits[request_id] = pending
        pending[0].update(on_host)
        return self._with_host_placeholders(new_computed_blocks, len(on_host)), num_external_tokens

    def _with_host_placeholders(self, blocks: KVCacheBlocks, num_pages: int) -> KVCacheBlocks:
        """`blocks` whose sparse-MLA groups go on with null placeholders for `num_pages` HOST pages."""
        null_block = self.kv_cache_manager.block_pool.null_block
        extended = [list(group) for group in blocks.blocks]
        for g in self.mla_group_ids:
            extended[g].extend([null_block] * num_pages)
        return self.kv_cache_manager.create_kv_cache_blocks(tuple(extended))

    def _land_import(
        self,
        request: Request,
        new_computed_blocks: KVCacheBlocks,
        num_local_tokens: int,
        num_external_tokens: int,
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
        host pool or for a lease, the import lands on the device.
        """
        request_id = request.request_id
        if not self.issue_plans or num_local_tokens % self.block_size:
            return new_computed_blocks, num_external_tokens
        end = min(num_local_tokens + num_external_tokens, request.num_tokens - 1) // self.block_size
        positions = list(range(num_local_tokens // self.block_size, end))
        if not positions:
            return new_computed_blocks, num_external_tokens
        pending = self._pending_hits.get(request_id)
        if (
            pending is None
            and self.residency.mode == "hybrid"
            and len(positions) * len(self.mla_group_ids) <= self.blocks.num_free_blocks() // 2
        ):
            return new_computed_blocks, num_external_tokens
        host_pool = self.residency.host_pool
        # The local hit's host pages are not referenced yet: hold them while pages are
        # allocated, so no allocation evicts them.
        held = list(pending[0].values()) if pending is not None else []
        for page in held:
            host_pool.retain(page)
        try:
            if host_pool.num_available < len(positions):
                return new_computed_blocks, num_external_tokens
            if pending is None:
                hit = [b for group in new_computed_blocks.blocks for b in group]
                lease = self._lease_keeping(request, hit)
                if not lease:
                    return new_computed_blocks, num_external_tokens
                pending = ({}, lease)
                self._pending_hits[request_id] = pending
            landed = {position: host_pool.allocate() for position in positions}
        finally:
            for page in held:
                host_pool.release(page)
        self._imports[request_id] = landed
        pending[0].update(landed)
        return self._with_host_placeholders(new_computed_blocks, len(landed)), num_external_tokens

    def host_landing(self, request_id: str) -> dict[int, int]:
        """The pages of `request_id`'s import that land in the host pool: page index -> host page."""
        return self._imports.get(request_id, {})

    def _drop_import(self, request_id: str) -> None:
        """An import not taken after all: its host pages go back (its lease goes with the hit)."""
        landed = self._imports.pop(request_id, None)
        if not landed:
            return
        pending = self._pending_hits.get(request_id)
        for position, page in landed.items():
            self.residency.host_pool.release(page)
            if pending is not None:
                pending[0].pop(position, None)

    def _max_tokens(self, request: Request) -> int:
        """The most tokens the request's context can reach: what its hot lease must cover."""
        return min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)

    def _lease_keeping(self, request: Request, hit_blocks: list[KVCacheBlock]) -> list[int]:
        """A hot lease for `request`, about to take `hit_blocks` from the prefix cache.

        Taking the lease may evict cached free blocks: the hit's are pinned meanwhile.
        When the pool is short of a lease, other requests' BOTH pages are demoted for
        it, as for any allocation under pressure.
        """
        block_pool = self.kv_cache_manager.block_pool
        block_pool.touch(hit_blocks)
        num_blocks = self.residency.lease_blocks_for(self._max_tokens(request))
        lease = self.residency.lease(num_blocks)
        if not lease:
            # Under pressure, demote other requests' BOTH pages for the lease: without it the
            # request recomputes its whole prefix, which needs at least as many blocks.
            short = num_blocks - self.blocks.num_free_blocks()
            protected = {b.block_id for b in hit_blocks}
            if self.residency.relieve_pressure(short, protected_blocks=protected, frozen=self._frozen) > 0:
                lease = self.residency.lease(num_blocks)
        block_pool.free_blocks(hit_blocks)
        return lease

    def restore_external_pages(self, request: Request, num_external_tokens: int) -> None:
        """Blocks are allocated for the connector's hit: restore its sparse-MLA pages into them."""
        host_pages = self._connector_hits.pop(request.request_id, None)
        if not host_pages or num_external_tokens <= 0:
            return
        tables = [m.req_to_blocks[request.request_id] for m in self.blocks.managers]
        restored = self._restored.setdefault(request.request_id, {})
        for position, host_page in host_pages.items():
            self.residency.reserve_restore(request.request_id, host_page)
            restored[position] = host_page
            block_ids = tuple(t[position].block_id for t in tables)
            self._restores.append(PageRestore(request.request_id, position, block_ids, host_page))

    def hold(self, request: Request) -> None:
        """The request finished and the KV connector keeps its blocks to send them (a P/D
        producer): none of its pages may leave the device until `release`. The
        OffloadingConnector's groups hold no sparse-MLA page, so its sends need no hold."""
        if self.import_kind is not ImportKind.HOST_POOL_GROUPS:
            self.residency.hold(request.request_id)

    def release(self, request: Request) -> None:
        """The request finished, was aborted or preempted: before its blocks are freed."""
        self._return_pending_lease(request.request_id)
        self._return_staging(request.request_id)
        self._frozen.discard(request.request_id)
        self._unplaced.discard(request.request_id)
        self._connector_hits.pop(request.request_id, None)
        self._restored.pop(request.request_id, None)
        self.residency.finish(request.request_id)

    def finish_step(self, scheduler: Scheduler, scheduler_output: SchedulerOutput) -> None:
        """After schedule(): register new pages, plan this step's copies, attach the plan."""
        for request_id in list(self._pending_hits):
            if request_id in scheduler_output.num_scheduled_tokens:
                continue  # registered below
            # A hit the scheduler took holds its blocks until the request is scheduled: while
            # a KV connector loads, and after the load until the request gets its turn.
            if not self.blocks.managers[0].req_to_blocks.get(request_id):
                self._return_pending_lease(request_id)  # the scheduler did not take the hit
        for request_id in scheduler_output.num_scheduled_tokens:
            self._sync_request(scheduler.requests[request_id])
        copies: list[PageCopy] = []
        if self.issue_plans:
            # Also in a step that schedules no token: the workers run every step's plan.
            copies = self.residency.plan_copies(frozen=self._frozen)
            for copy in copies:
                self._in_flight[(copy.request_id, copy.page_index)] = copy
        for state, n in self.residency.requests_by_state().items():
            self.request_steps[state] += n
        for request_id in scheduler_output.scheduled_spec_decode_tokens:
            req = self.residency.requests.get(request_id)
            if req is not None and req.state is not RequestState.FULL:
                self.speculative_steps_with_host_pages += 1
        updates, self.blocks.updates = self.blocks.updates, []
        restores, self._restores = self._restores, []
        new_host_pages, new_leases = self.residency.drain_changes()
        k = len(self.mla_group_ids)
        staging = []
        for request_id in list(self._staging):
            if request_id not in scheduler_output.num_scheduled_tokens:
                self._return_staging(request_id)  # the chunk was not scheduled after all
                self._unplaced.add(request_id)
                continue
            blocks = self._staging.pop(request_id)
            staging.append(StepStaging(request_id, len(blocks) // k * self.block_size,
                                       tuple(tuple(blocks[g::k]) for g in range(k))))
        self._unplaced.difference_update(scheduler_output.num_scheduled_tokens)
        self._frozen.clear()
        self.residency.end_schedule()
        scheduler_output.hisparse_plan = HiSparseStepPlan(
            version=HISPARSE_PLAN_VERSION,
            mla_group_ids=self.mla_group_ids,
            copies=tuple(copies),
            block_table_updates=tuple(updates),
            restores=tuple(restores),
            host_pages=tuple(HostPageUpdate(*change) for change in new_host_pages),
            leases=tuple(self._lease_update(rid, blocks) for rid, blocks in new_leases),
            staging=tuple(staging),
        )

    def _lease_update(self, request_id: str, blocks: list[int]) -> HotLeaseUpdate:
        """A lease as the workers map it: every group's blocks, padded to the default lease
        with the null block (a smaller lease covers all the request's HOST rows, so its
        resolver never places a row past them)."""
        k = len(self.mla_group_ids)
        width = self.residency.hot_lease_blocks // k
        return HotLeaseUpdate(
            request_id,
            tuple(tuple(blocks[g::k]) + (self.null_block_id,) * (width - len(blocks) // k) for g in range(k)),
        )

    def on_model_output(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """The step is done: return its staging rows; mark the copies the workers report durable.

        Workers report a copy once it is known to be done, which on CUDA can be a
        step or more after the step that planned it: until then it stays in
        flight. Workers that report nothing do not run HiSparse: every copy in
        flight is cancelled and planning stops.
        """
        plan: HiSparseStepPlan | None = getattr(scheduler_output, "hisparse_plan", None)
        if plan is not None:
            for entry in plan.staging:
                self.blocks.give_back([b for group in entry.block_ids for b in group])
        counts = self.worker_counts
        for name, value in (getattr(output, "hisparse_counters", None) or {}).items():
            if name in counts:
                counts[name] = max(counts[name], value) if name.startswith("max_") else counts[name] + value
        reported = getattr(output, "hisparse_copied", None)
        if plan is None or (reported is None and not plan.copies):
            return
        if reported is None:
            failed = list(self._in_flight.values())
            self._in_flight.clear()
            self.residency.cancel_copies(failed)
        else:
            done = [copy for key in map(tuple, reported) if (copy := self._in_flight.pop(key, None))]
            self.residency.complete_copies(done)
        if reported is None and self.issue_plans:
            self.issue_plans = False
            logger.warning(
                "Hybrid HiSparse: the workers did not execute the step's residency plan; "
                "no further pages are copied or demoted and the sparse-MLA KV cache stays "
                "resident on the device."
            )

    # -- state ---------------------------------------------------------------

    def _return_pending_lease(self, request_id: str) -> None:
        self._drop_import(request_id)
        pending = self._pending_hits.pop(request_id, None)
        if pending is not None:
            self.residency.allocator.give_back(pending[1])

    def _sync_request(self, request: Request) -> None:
        """Register the request's pages the KV cache manager added since the last step."""
        request_id = request.request_id
        residency = self.residency
        new_request = request_id not in residency.requests
        if new_request:
            # The request's own list: it grows as the request decodes.
            residency.add_request(
                request_id, request.block_hashes if self.enable_caching else (), self._max_tokens(request)
            )
        req = residency.requests[request_id]
        tables = [m.req_to_blocks.get(request_id, []) for m in self.blocks.managers]
        pending = self._pending_hits.pop(request_id, None)
        host_pages, lease = pending if pending is not None else ({}, [])
        imported = self._imports.pop(request_id, {})
        restored = self._restored.pop(request_id, {})
        for position in range(len(req.pages), len(tables[0])):
            block_ids = tuple(t[position].block_id for t in tables)
            if position in host_pages:
                residency.append_host_pages(
                    request_id, [host_pages.pop(position)], lease, imported=position in imported
                )
                lease = []
            elif position in restored:
                residency.append_restored_page(request_id, block_ids, restored.pop(position))
            else:
                # A null placeholder always comes with its host page (pending or restored).
                assert self.null_block_id not in block_ids, f"{request_id}: page {position} has no copy"
                residency.append_pages(request_id, [block_ids])
        assert not host_pages, f"{request_id}: host pages {host_pages} beyond its block table"
        assert not restored, f"{request_id}: restored pages {restored} beyond its block table"
        if lease:  # the scheduler did not take the hit after all
            residency.allocator.give_back(lease)
        if new_request and req.state is RequestState.NONE:
            self.requests_started_none += 1
        residency.set_prefilling(request_id, request.num_computed_tokens < request.num_prompt_tokens)
        stable = min(request.num_computed_tokens, request.num_tokens)
        if self.enable_caching:
            cached = min(m.num_cached_block.get(request_id, 0) for m in self.blocks.managers)
            stable = min(stable, cached * self.block_size)
        residency.advance(request_id, stable)

    # -- observation -----------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counters for metrics: requests and pages per state, host pool, copies, demotions."""
        out: dict[str, int] = {}
        for state, n in self.residency.requests_by_state().items():
            out[f"requests_{state.value}"] = n
        for page_state, n in self.residency.pages_by_state().items():
            out[f"pages_{page_state.value}"] = n
        pool = self.residency.host_pool
        out["host_pages_used"] = pool.num_referenced
        out["host_pages_free"] = pool.num_available
        out["host_pages_total"] = pool.num_pages
        counters = self.residency.counters
        out.update(
            pages_copied_to_host=counters.pages_copied_to_host,
            copies_cancelled=counters.copies_cancelled,
            pages_demoted=counters.pages_demoted,
            hot_leases=counters.hot_leases,
            host_prefix_pages_reused=counters.host_prefix_pages_reused,
            # Pages of a KV connector's import that landed in the host pool.
            pages_imported_to_host=counters.pages_imported_to_host,
            # Pages of KV connector hits restored from the host pool.
            pages_restored=counters.pages_restored,
            preemptions_avoided=counters.preemptions_avoided,
            victims_skipped=counters.victims_skipped,
            deferrals_exhausted=counters.deferrals_exhausted,
            hot_lease_blocks=sum(len(req.hot_blocks) for req in self.residency.requests.values()),
            copies_in_flight=len(self._in_flight),
            # Rows leased for one step to stage misses beyond hot buffers, and chunks
            # shortened because the pool could not spare them.
            staging_rows_leased=self.staging_rows_leased,
            chunks_shortened=self.chunks_shortened,
            # Rows the workers' resolvers loaded host -> device (hot-buffer misses), and
            # selected non-resident rows already in a hot buffer (hits).
            **self.worker_counts,
            request_steps_mixed=self.request_steps[RequestState.MIXED],
            request_steps_none=self.request_steps[RequestState.NONE],
            requests_started_none=self.requests_started_none,
            speculative_steps_with_host_pages=self.speculative_steps_with_host_pages,
            bytes_to_host=counters.pages_copied_to_host * self._page_bytes
            * max(self.worker_counts["max_host_pools"], 1),
            bytes_from_host=self._readers * (
                counters.pages_restored * self._page_bytes
                + self.worker_counts["rows_loaded"] * self._row_bytes
            ),
        )
        return out


def attach_hisparse(scheduler: Scheduler) -> HiSparseScheduling | None:
    """HiSparse's scheduler state when `hisparse_config` is set and plans can run, else None."""
    if not hisparse_active(scheduler.vllm_config):
        return None
    return HiSparseScheduling(scheduler)

