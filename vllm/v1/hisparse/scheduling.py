# SPDX-License-Identifier: Apache-2.0
"""Hybrid HiSparse in the scheduler: residency wired to vLLM's KV cache manager.

Owns the glue between the residency state machine (`residency.py`) and the
scheduler process:
- residency works on the KV cache manager through `KVCacheBlockAccess`
  (`kv_cache_access.py`);
- pressure relief before preemption, called by `KVCacheManager.allocate_slots`
  when the pool cannot satisfy an allocation (new tokens, a new request);
- prefix hits from the host pool: a waiting request whose prefix pages live
  only in the host pool (its indexer blocks still cached on the device) takes
  them as placeholders plus a hot lease and starts NONE instead of recomputing;
- KV connector hits: the OffloadingConnector handles every group but the
  sparse-MLA ones (see offloading.py), so its hit is limited to pages the host
  pool holds; those pages are restored into the blocks allocated for the hit
  when the pool has room, else taken as placeholders plus a hot lease (NONE);
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
from vllm.v1.hisparse.plan import (
    HISPARSE_PLAN_VERSION,
    HiSparseStepPlan,
    PageCopy,
    PageRestore,
    RequestResidencyMap,
)
from vllm.v1.hisparse.residency import PageState, RequestState, ResidencyManager

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
        # Bytes one page (all sparse-MLA layers) and one layer's row move, on all workers.
        replicas = vllm_config.parallel_config.tensor_parallel_size
        self._page_bytes = sparse_mla_page_bytes(vllm_config) * replicas
        self._row_bytes = self._page_bytes // (
            self.block_size * vllm_config.model_config.get_total_num_hidden_layers()
        )
        self.residency = ResidencyManager(
            self.blocks,
            HostPagePool(num_host_pages),
            self.block_size,
            config.device_buffer_size,
            blocks_per_page=len(self.mla_group_ids),
            mode=config.mode,
            proactive_copy=config.proactive_copy,
        )
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
        # Steps x requests observed MIXED / NONE, and rows the workers loaded from host.
        self.request_steps = dict.fromkeys(RequestState, 0)
        self.rows_loaded = 0
        self.rows_hit = 0
        # Steps that verified draft tokens of a request with pages in the host pool.
        self.speculative_steps_with_host_pages = 0
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
        freed = self.residency.relieve_pressure(num_blocks, protected_blocks=protected)
        if freed >= num_blocks:
            self.residency.counters.preemptions_avoided += 1
            return True
        return False

    def defer_preemption(self, request: Request) -> bool:
        """True when copies about to run will make room: wait a step instead of preempting.

        Relief marks resident pages for copy-then-free when no page is durable on
        the host yet; their copies run after this step, so preempting now would
        throw away work the next step can keep.
        """
        if not self.issue_plans or not self.residency.relief_pending():
            return False
        self.residency.counters.preemptions_avoided += 1
        return True

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
            lease = self._lease_keeping(hit + [b for mla, other in pages for b in (mla or []) + other])
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
        if num_external_tokens <= 0 or not plans_executable():
            return new_computed_blocks, num_external_tokens  # the connector keeps every group
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
            lease = self._lease_keeping([b for group in new_computed_blocks.blocks for b in group])
            if not lease:
                self._connector_hits.pop(request_id, None)
                return new_computed_blocks, 0
            pending = ({}, lease)
            self._pending_hits[request_id] = pending
        pending[0].update(on_host)
        null_block = self.kv_cache_manager.block_pool.null_block
        extended = [list(group) for group in new_computed_blocks.blocks]
        for g in self.mla_group_ids:
            extended[g].extend([null_block] * len(on_host))
        return self.kv_cache_manager.create_kv_cache_blocks(tuple(extended)), num_external_tokens

    def _lease_keeping(self, hit_blocks: list[KVCacheBlock]) -> list[int]:
        """A hot lease for a request about to take `hit_blocks` from the prefix cache.

        Taking the lease may evict cached free blocks: the hit's are pinned meanwhile.
        When the pool is short of a lease, other requests' BOTH pages are demoted for
        it, as for any allocation under pressure.
        """
        block_pool = self.kv_cache_manager.block_pool
        block_pool.touch(hit_blocks)
        lease = self.residency.lease()
        if not lease:
            # Under pressure, demote other requests' BOTH pages for the lease: without it the
            # request recomputes its whole prefix, which needs far more blocks than the lease.
            short = self.residency.hot_lease_blocks - self.blocks.num_free_blocks()
            protected = {b.block_id for b in hit_blocks}
            if self.residency.relieve_pressure(short, protected_blocks=protected) > 0:
                lease = self.residency.lease()
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

    def release(self, request: Request) -> None:
        """The request finished, was aborted or preempted: before its blocks are freed."""
        self._return_pending_lease(request.request_id)
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
            copies = self.residency.plan_copies()
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
        scheduler_output.hisparse_plan = HiSparseStepPlan(
            version=HISPARSE_PLAN_VERSION,
            mla_group_ids=self.mla_group_ids,
            copies=tuple(copies),
            block_table_updates=tuple(updates),
            restores=tuple(restores),
            residency=self._residency_maps(),
        )

    def on_model_output(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """Mark the step's reported copies durable; cancel the ones not reported."""
        plan: HiSparseStepPlan | None = getattr(scheduler_output, "hisparse_plan", None)
        self.rows_loaded += getattr(output, "hisparse_rows_loaded", 0) or 0
        self.rows_hit += getattr(output, "hisparse_rows_hit", 0) or 0
        if plan is None or not plan.copies:
            return
        reported = getattr(output, "hisparse_copied", None)
        done_keys = set(map(tuple, reported or ()))
        done, failed = [], []
        for copy in plan.copies:
            key = (copy.request_id, copy.page_index)
            if self._in_flight.pop(key, None) is None:
                continue
            (done if key in done_keys else failed).append(copy)
        self.residency.cancel_copies(failed)
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
        pending = self._pending_hits.pop(request_id, None)
        if pending is not None:
            self.residency.allocator.give_back(pending[1])

    def _sync_request(self, request: Request) -> None:
        """Register the request's pages the KV cache manager added since the last step."""
        request_id = request.request_id
        residency = self.residency
        if request_id not in residency.requests:
            # The request's own list: it grows as the request decodes.
            residency.add_request(request_id, request.block_hashes if self.enable_caching else ())
        req = residency.requests[request_id]
        tables = [m.req_to_blocks.get(request_id, []) for m in self.blocks.managers]
        pending = self._pending_hits.pop(request_id, None)
        host_pages, lease = pending if pending is not None else ({}, [])
        restored = self._restored.pop(request_id, {})
        for position in range(len(req.pages), len(tables[0])):
            block_ids = tuple(t[position].block_id for t in tables)
            if position in host_pages:
                residency.append_host_pages(request_id, [host_pages.pop(position)], lease)
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
        stable = min(request.num_computed_tokens, request.num_tokens)
        if self.enable_caching:
            cached = min(m.num_cached_block.get(request_id, 0) for m in self.blocks.managers)
            stable = min(stable, cached * self.block_size)
        residency.advance(request_id, stable)

    def _residency_maps(self) -> tuple[RequestResidencyMap, ...]:
        maps = []
        k = len(self.mla_group_ids)
        for req in self.residency.requests.values():
            if req.state is RequestState.FULL:
                continue
            maps.append(
                RequestResidencyMap(
                    request_id=req.request_id,
                    host_pages=tuple(
                        (i, p.host_page) for i, p in enumerate(req.pages)
                        if p.state is PageState.HOST and p.host_page is not None
                    ),
                    hot_block_ids=tuple(tuple(req.hot_blocks[g::k]) for g in range(k)),
                )
            )
        return tuple(maps)

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
            # Pages of KV connector hits restored from the host pool.
            pages_restored=counters.pages_restored,
            preemptions_avoided=counters.preemptions_avoided,
            copies_in_flight=len(self._in_flight),
            # Rows the workers' resolvers loaded host -> device (hot-buffer misses), and
            # selected non-resident rows already in a hot buffer (hits).
            rows_loaded=self.rows_loaded,
            rows_hit=self.rows_hit,
            request_steps_mixed=self.request_steps[RequestState.MIXED],
            request_steps_none=self.request_steps[RequestState.NONE],
            speculative_steps_with_host_pages=self.speculative_steps_with_host_pages,
            bytes_to_host=counters.pages_copied_to_host * self._page_bytes,
            bytes_from_host=counters.pages_restored * self._page_bytes + self.rows_loaded * self._row_bytes,
        )
        return out


def attach_hisparse(scheduler: Scheduler) -> HiSparseScheduling | None:
    """HiSparse's scheduler state when `hisparse_config` is set and plans can run, else None."""
    if not hisparse_active(scheduler.vllm_config):
        return None
    return HiSparseScheduling(scheduler)

