# SPDX-License-Identifier: Apache-2.0
"""Hybrid HiSparse in the scheduler: residency wired to vLLM's KV cache manager.

Owns the step loop that joins residency (`residency.py`), admission
(`admission.py`) and the workers:
- residency and admission work on the KV cache manager only through
  `KVCacheBlockAccess` (`kv_cache_access.py`), whose frees follow upstream's
  deferred-free fence;
- pressure relief before preemption, called by `KVCacheManager.allocate_slots`
  when the pool cannot satisfy an allocation (new tokens, a new request); a
  finished request whose blocks a KV connector still sends is held, never a
  victim; no lease or staging ever takes a block a pending admission will read;
- prefix hits from the host pool, KV connector hits and imports: decided and
  held by admission (one record per waiting request), registered with
  residency when the request is first scheduled;
- the staging rows a prefill chunk over host pages may need this step, leased
  for the step and returned when its output comes back;
- the step plan that crosses to the workers in `SchedulerOutput.hisparse_plan`
  (host->device restores and block-table point updates to apply before the
  forward, copies to run after it, the residency map of every request that is
  not FULL), and the workers' copy reports (by copy id) from
  `ModelRunnerOutput.hisparse_copied`;
- the ownership check (`ownership.py`) over all of these, on demand or, with
  VLLM_HISPARSE_CHECK_OWNERSHIP=1, after every schedule and every output.

Workers that do not execute plans report nothing; their step's copies are
cancelled and planning stops, so no page ever leaves the device without a
durable host copy. It never touches tensors, the worker or the scheduler's
queues.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from vllm.config.hisparse import hisparse_active, host_pool_pages, plans_executable, sparse_mla_page_bytes
from vllm.logger import init_logger
from vllm.v1.hisparse.admission import Admissions, PendingAdmission
from vllm.v1.hisparse.histories import HeldHistories
from vllm.v1.hisparse.host_pool import HostPagePool
from vllm.v1.hisparse.kv_cache_access import KVCacheBlockAccess
from vllm.v1.hisparse.kv_grouping import hisparse_managed_group_ids
from vllm.v1.hisparse.kv_import import ConnectorImports, ImportKind, import_kind, reads_block_id_snapshot
from vllm.v1.hisparse.offloading import fence_block_pool_takes
from vllm.v1.hisparse.ownership import check_ownership, check_plan
from vllm.v1.hisparse.plan import (
    HISPARSE_PLAN_VERSION,
    WORKER_COUNTERS,
    BlockId,
    HiSparseStepPlan,
    HostPage,
    HotLeaseUpdate,
    PageIndex,
    PageRestore,
    StepStaging,
)
from vllm.v1.hisparse.residency import PageState, RequestState, ResidencyManager, page_hashes
from vllm.v1.request import RequestStatus

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

# Set to 1 to run the ownership check after every schedule() and every model output
# (tests and debugging: it walks every block of the pool).
CHECK_OWNERSHIP_ENV = "VLLM_HISPARSE_CHECK_OWNERSHIP"
# A turn that ended so: its session may come back for its history (histories.py).
HISTORY_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


# Copies a step plans at least; and per page a full token budget of prefill completes,
# that many more (twice: one step's pages, and as many of a backlog).
MIN_COPIES_PER_STEP = 64


def copies_per_step(max_num_batched_tokens: int, block_size: int) -> int:
    """The device->host copies one step may plan: enough to keep pace with a step that
    prefills a whole token budget (its completed pages, and as many of a backlog), so a
    turn does not end with pages that were never copied."""
    return max(MIN_COPIES_PER_STEP, 2 * -(-max_num_batched_tokens // block_size))


# Ended requests whose writes are kept for a failure reported late (`_keep_ended_writes`).
MAX_ENDED_WRITES = 4096


class EndedWrites(NamedTuple):
    """What an ended (or preempted) request wrote, kept until its steps are reported."""

    last_step: int  # the latest step it was scheduled in
    first_page: int  # its first written page
    blocks: list[tuple[int, Any]]  # its blocks from its first written page, with their hashes then
    page_hashes: list[Any]  # its complete pages' hashes from that page on
    # What it took before that page (its prefix hit): its first sparse-MLA group's blocks
    # and its host pages, as its table held them (`_withdraw_with_followers`).
    taken_blocks: Sequence[Any] = ()
    taken_host_pages: Sequence[Any] = ()


class UnconfirmedLoad(NamedTuple):
    """A KV connector's load during a step's forward, until that step's output confirms it."""

    step: int  # the step's plan
    first_page: int  # the request's first page the load fills
    # Each loaded page's block of the first sparse-MLA group (the null block for a page
    # landing in the host pool) and its blocks of every group.
    pages: list[tuple[int, frozenset[int]]]
    # The same of the pages the step computes past the load (they attend over it).
    after: list[tuple[int, frozenset[int]]]


class HiSparseScheduling:
    """Hybrid HiSparse's scheduler-side state for one Scheduler."""

    def __init__(self, scheduler: Scheduler) -> None:
        vllm_config = scheduler.vllm_config
        config = vllm_config.attention_config.hisparse_config
        assert config is not None and config.device_buffer_size is not None
        self.scheduler = scheduler
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
        self.blocks = KVCacheBlockAccess(self.kv_cache_manager, self.mla_group_ids, self.other_group_ids)
        self.blocks.use_fence_of(scheduler)
        self.null_block_id = self.blocks.null_block_id
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
            max_copies_per_step=copies_per_step(
                vllm_config.scheduler_config.max_num_batched_tokens, self.block_size
            ),
        )
        self.hot_rows = config.device_buffer_size
        assert config.staging_rows is not None
        self.staging_budget = config.staging_rows
        # Blocks left free for the rest of a step when staging takes more than its budget:
        # every group's blocks for a step's whole token budget, and one hot lease.
        self._step_reserve = (
            self.blocks.blocks_for_pages(
                0, vllm_config.scheduler_config.max_num_batched_tokens // self.block_size + 1
            )
            + self.residency.hot_lease_blocks
        )
        self.max_model_len = vllm_config.model_config.max_model_len
        self.index_topk = int(vllm_config.model_config.hf_text_config.index_topk)
        # Staging blocks leased for this step's chunks (request -> blocks, group-major),
        # until the plan is attached; then each plan's, by step, until its output comes back.
        self._staging: dict[str, list[BlockId]] = {}
        self._staging_in_flight: dict[int, list[BlockId]] = {}
        # Chunks fitted with staging that then could not be allocated: their next chunk
        # takes no staging (the estimate of a chunk's own blocks missed something).
        self._unplaced: set[str] = set()
        # Host -> device restores of connector hits allocated this step.
        self._restores: list[PageRestore] = []
        # Tokens a KV connector loads in the step that schedules the request (a load during
        # the forward), this step's: request -> tokens; and the loads not yet confirmed by
        # their step's output (`UnconfirmedLoad`).
        self._loads_this_step: dict[str, int] = {}
        self._unconfirmed_loads: dict[str, UnconfirmedLoad] = {}
        # The tokens each request had computed before the earliest step it was scheduled
        # in (what a step that fails on the workers cannot have written, `_withdraw`), and
        # the latest step it was scheduled in: request -> [tokens, step].
        self._first_written: dict[str, list[int]] = {}
        # What requests that ended (or were preempted) wrote, until the workers have
        # reported every step they were scheduled in (a failure may be reported late).
        self._ended_writes: dict[str, EndedWrites] = {}
        # Their pages' blocks (the first sparse-MLA group's), by the step that loads them:
        # upstream caches a load's blocks when it allocates them, so another request's prefix
        # hit can share them before the load is confirmed.
        self._unconfirmed_blocks: dict[int, int] = {}
        # The blocks of loads that failed (the first sparse-MLA group's), until they are
        # written again or go back to the pool (`_confirm_loads`).
        self._failed_load_blocks: set[int] = set()
        # Pages of such a load that landed in the host pool, published once it is confirmed:
        # request -> runs of (first page, host pages).
        self._unpublished_imports: dict[str, list[tuple[int, list[HostPage]]]] = {}
        self._steps = itertools.count()
        self.staging_rows_leased = 0
        # Prefill chunks that restored their request's HOST pages instead of staging.
        self.prefill_restores = 0
        # Restores a step planned whose page gave its blocks back before the step's plan was
        # made (`_own_restores`).
        self.restores_dropped = 0
        # A released request's host-backed sparse-MLA blocks, out of its table until upstream
        # has freed the rest (`after_free`); and how many went first in the eviction order.
        self._host_backed: list[KVCacheBlock] = []
        self.blocks_evicted_first = 0
        # Pages whose KV a request's failed step may have written wrong (`_withdraw`).
        self.pages_withdrawn = 0
        # Blocks vLLM copied on the device for prefix hits ending inside one (the page
        # layout's resident blocks: copy-on-write).
        self.resident_blocks_copied = 0
        # Rows of the staging budget the pool could not spare (those chunks took more passes).
        self.staging_rows_short = 0
        self.enable_caching = self.kv_cache_manager.enable_caching
        # Host prefix hits need page-sized hashes (the hash block is the page).
        # Without prefix caching nothing is published (and vLLM may hash in larger blocks).
        self.hash_block_size = scheduler.hash_block_size if self.enable_caching else 0
        self.host_prefix_hits = self.enable_caching and scheduler.hash_block_size == self.block_size
        self.issue_plans = True
        # Which connector loads a request's hit, and how (a MultiConnector's, per request).
        self.imports = ConnectorImports(scheduler.connector)
        # A connector that lands imports in the host pool writes them outside the device's
        # stream order: host pages released while a step is in flight wait for its output.
        self.residency.host_pool.track_releases = ImportKind.LANDS_ON_HOST in self.imports.kinds
        # Whether a connector may send a request's blocks to a peer once it ends (a P/D
        # producer): one that loads more than the groups HiSparse leaves to it.
        self.sends = bool(self.imports.kinds - {ImportKind.HOST_POOL_GROUPS})
        # Finished sessions' indexer (and drafter) pages held on the device under pressure.
        self.histories = HeldHistories(self.blocks)
        self.admissions = Admissions(
            self.blocks,
            self.residency,
            block_size=self.block_size,
            host_prefix_hits=self.host_prefix_hits,
            imports=self.imports,
            lease_blocks_for=lambda request: self.residency.lease_blocks_for(self._max_tokens(request)),
            plans_issued=lambda: self.issue_plans,
            release_histories=self._release_histories_for_admission,
            nothing_runs=lambda: not self.scheduler.running,
            chunk_tokens=scheduler.scheduler_config.max_num_batched_tokens,
            lookahead_tokens=scheduler.num_lookahead_tokens,
            written=self._blocks_written,
        )
        self.blocks.guard_with(self.admissions.hit_blocks)
        if scheduler.connector is not None and not reads_block_id_snapshot(scheduler.connector):
            # The scheduler then skips the per-request block ids (every KV cache group's).
            setattr(scheduler.connector, "reads_block_id_snapshot", False)  # noqa: B010
        # An OffloadingConnector's store fences the reuse of its blocks: every block the pool
        # hands out, in whichever group or to whichever lease, must be fenced.
        fence_block_pool_takes(scheduler.connector, self.kv_cache_manager.block_pool)
        for leaf in self.imports.leaves:
            kind = import_kind(leaf)
            if kind is ImportKind.LANDS_ON_HOST:
                setattr(leaf, "host_landing", self.admissions.host_landing)  # noqa: B010
            elif kind is ImportKind.DEVICE:
                logger.info(
                    "Hybrid HiSparse: %s loads imports into device blocks, as upstream; a connector "
                    "that moves blocks between instances needs the same KV cache groups on both "
                    "(give the other instance hisparse_config too)",
                    type(leaf).__name__,
                )
        # Steps x requests observed MIXED / NONE, and rows the workers loaded from host.
        self.request_steps = dict.fromkeys(RequestState, 0)
        # The workers' data path counters (see WORKER_COUNTERS), summed over steps.
        self.worker_counts = dict.fromkeys(WORKER_COUNTERS, 0)
        # Steps that verified draft tokens of a request with pages in the host pool.
        self.speculative_steps_with_host_pages = 0
        # Requests whose first step found every page outside the tail in the host pool.
        self.requests_started_none = 0
        self.check_each_step = os.environ.get(CHECK_OWNERSHIP_ENV, "0") == "1"
        self.ownership_checks = 0
        # Requests HiSparse could not serve (a worker's error bit of theirs, or their own
        # bookkeeping): each ends with an error, the others go on. Request -> why.
        self._failed: dict[str, str] = {}
        self.requests_failed = 0
        self.kv_cache_manager.pressure_relief = self.relieve_pressure
        if plans_executable():
            # Admission by tail + lease rather than by whole context: relief makes
            # room for the rest as it is computed.
            scheduler.scheduler_reserve_full_isl = False
        logger.info(
            "Hybrid HiSparse: %d host pages of %d bytes, hot lease %d blocks, mode=%s, sparse-MLA groups %s",
            num_host_pages,
            sparse_mla_page_bytes(vllm_config),
            self.residency.hot_lease_blocks,
            config.mode,
            list(self.mla_group_ids),
        )

    # -- hooks called by the scheduler and the KV cache manager ---------------

    def relieve_pressure(self, request: Request, num_blocks: int, new_computed_blocks: Any = ()) -> bool:
        """Free `num_blocks` by demotion before the scheduler preempts; True if that many are free now."""
        # The pool counts none of the spare staging blocks free: they go back first.
        free_before = self.blocks.num_free_blocks() - self.blocks.release_spare()
        if self.blocks.num_free_blocks() - free_before >= num_blocks:
            return True
        protected = self.admissions.hit_block_ids()
        protected.update(b.block_id for group in new_computed_blocks for b in group)
        self.residency.relieve_pressure(
            num_blocks - (self.blocks.num_free_blocks() - free_before), protected_blocks=protected
        )
        short = num_blocks - (self.blocks.num_free_blocks() - free_before)
        if short > 0 and (request.status is RequestStatus.RUNNING or not self.scheduler.running):
            # Demotion could not free enough for a running request (or for any request, with
            # none running): finished sessions' histories go, oldest first, before it is
            # preempted. A new admission waits for room instead.
            self.histories.release(short)
        if self.blocks.num_free_blocks() - free_before >= num_blocks:
            self.residency.counters.preemptions_avoided += 1
            return True
        return False

    def _relieve(self, num_blocks: int, durable_only: bool = False) -> None:
        """Relief for this step's own needs (a chunk, its staging), sparing pending hits.
        Held histories stay: staging rows the pool cannot spare cost a chunk more passes,
        a history given back costs its session's next turn a recomputation."""
        self.residency.relieve_pressure(
            num_blocks, protected_blocks=self.admissions.hit_block_ids(), durable_only=durable_only
        )

    def defer_preemption(self, request: Request) -> bool:
        """True when copies or frees about to complete will make room: wait a step instead of
        preempting.

        Relief marks resident pages for copy-then-free when no page is durable on
        the host yet; their copies run after this step, so preempting now would
        throw away work the next step can keep. Likewise for blocks demoted while a
        step was in flight, which return once it is processed (upstream's fence).
        The wait is bounded (see `ResidencyManager.defer_preemption`).
        """
        if not self.issue_plans:
            return False
        if not self.residency.defer_preemption(frees_pending=bool(self.blocks.deferred_references())):
            return False
        self.residency.counters.preemptions_avoided += 1
        return True

    def fit_chunk(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Lease the staging rows `request`'s chunk of this step may use; the chunk keeps its length.

        All query tokens of a step resolve at once. A request's selections this
        step are at most T x top-K distinct rows, or its HOST rows if fewer; what
        its hot buffer cannot hold is staged in blocks leased from the pool for
        this step only (returned when the step's output comes back), at most
        `staging_rows` (`hisparse_config`). A step whose selections need more
        attends in passes (resolver.py), so the chunk is never shortened: when the
        pool cannot spare the whole budget, even after demoting other requests'
        settled pages, the chunk takes what it can (down to none, passes of at most
        the hot buffer's rows). Beyond the budget, up to what the chunk may select,
        it takes blocks the pool has free or frees by demoting pages already on the
        host (no copies waited for), leaving the rest of the step its reserve: a pass
        costs a whole attention call for the layer, such a block almost nothing.
        Pressure relief for the chunk's own new blocks runs first, since it may demote
        the request's own older pages. The staging is an estimate the resolution does
        not rely on: pages demoted after it in the same step only add passes.

        One exception: a waiting request whose hit left its host pages out for want of
        room for their hot lease gets no tokens while it waits for that room
        (`Admissions.waits_for_lease`), and vLLM admits no one behind it this step.
        """
        self._return_staging(request.request_id)
        if self.admissions.waits_for_lease(request, num_computed_tokens):
            return 0
        if num_new_tokens * self.index_topk <= self.hot_rows or not self.issue_plans:
            return num_new_tokens
        # The chunk's own new blocks: a page more than it spans, in every group.
        end = -(-(num_computed_tokens + num_new_tokens) // self.block_size)
        own_blocks = self.blocks.blocks_for_pages(num_computed_tokens // self.block_size, end + 1)
        short = own_blocks - self.blocks.num_free_blocks()
        if short > 0:
            self._relieve(short)
        host_rows = self._host_pages(request.request_id) * self.block_size
        if self._restore_instead(request, num_new_tokens, host_rows, own_blocks):
            return num_new_tokens
        wanted = self._staging_blocks(num_new_tokens, host_rows)
        if not wanted or request.request_id in self._unplaced:
            # After a chunk whose staging left no room for its own blocks: none this time.
            return num_new_tokens
        short = own_blocks + wanted - self.blocks.num_free_blocks()
        if short > 0:
            self._relieve(short)
        page = len(self.mla_group_ids)
        spare = max(self.blocks.num_free_blocks() - own_blocks, 0) // page * page
        blocks = min(wanted, spare)
        self.staging_rows_short += (wanted - blocks) // page * self.block_size
        # The budget's blocks are taken before any further relief: a victim's first demotion
        # takes its hot lease from the free blocks at once, while the blocks it frees may
        # return only after the step in flight (deferred frees).
        staging = self.blocks.take(blocks) if blocks else []
        if blocks == wanted:
            more = self._staging_blocks(num_new_tokens, host_rows, budget=None) - blocks
            short = own_blocks + more + self._step_reserve - self.blocks.num_free_blocks()
            if more > 0 and short > 0:
                self._relieve(short, durable_only=True)
            room = self.blocks.num_free_blocks() - own_blocks - self._step_reserve
            extra = min(more, max(room, 0) // page * page)
            if extra > 0:
                staging += self.blocks.take(extra)
        if staging:
            self._staging[request.request_id] = staging
            self.staging_rows_leased += len(staging) // page * self.block_size
        return num_new_tokens

    def _restore_instead(
        self, request: Request, num_new_tokens: int, host_rows: int, own_blocks: int
    ) -> bool:
        """Restore the request's HOST pages for its chunk instead of staging; True if it did.

        It does when the chunk may select every HOST row (tokens x top-K at least the
        rows), so staging what it may select would take as many blocks as the pages
        themselves, and the pool has those blocks free beyond the chunk's own and the
        step's reserve. A restored page is BOTH: its blocks serve the request's later
        chunks and decodes in place, and relief can drop it again without a copy. Mode
        "always" never restores (it keeps only the tail on the device).
        """
        request_id = request.request_id
        req = self.residency.requests.get(request_id)
        if (
            req is None
            or req.held
            or not req.num_host_pages
            or self.residency.mode != "hybrid"
            or self.admissions.num_host_pages(request_id)
            or num_new_tokens * self.index_topk < host_rows
        ):
            return False
        page = len(self.mla_group_ids)
        if self.blocks.num_free_blocks() - own_blocks - self._step_reserve < req.num_host_pages * page:
            return False
        indices = self.residency.host_page_indices(request_id)
        blocks = self.blocks.take(len(indices) * page)
        pages = [(index, blocks[i * page : (i + 1) * page]) for i, index in enumerate(indices)]
        host_pages = [hp for index in indices if (hp := req.pages[index].host_page) is not None]
        assert len(host_pages) == len(indices), f"{request_id}: a HOST page has no host page"
        self.blocks.fill_pages(request_id, pages)
        self.residency.restore_pages(request_id, pages)
        self._restores.extend(
            PageRestore(request_id, PageIndex(i), tuple(block_ids), host_page)
            for (i, block_ids), host_page in zip(pages, host_pages, strict=True)
        )
        self.prefill_restores += 1
        return True

    def _staging_blocks(self, num_tokens: int, host_rows: int, budget: int | None = -1) -> int:
        """Blocks (all sparse-MLA groups) to stage what `num_tokens` may select beyond the hot
        buffer, up to `budget` rows (default the staging budget; None: no cap); more is
        resolved in passes."""
        budget = self.staging_budget if budget == -1 else budget
        selected = min(num_tokens * self.index_topk, host_rows)
        rows = selected - self.hot_rows if budget is None else min(selected - self.hot_rows, budget)
        return -(-max(rows, 0) // self.block_size) * len(self.mla_group_ids)

    def _host_pages(self, request_id: str) -> int:
        """HOST pages the request has, or takes with the admission it is about to be scheduled with."""
        req = self.residency.requests.get(request_id)
        return (req.num_host_pages if req is not None else 0) + self.admissions.num_host_pages(request_id)

    def _return_staging(self, request_id: str) -> None:
        blocks = self._staging.pop(request_id, None)
        if blocks:
            self.blocks.keep_spare(blocks)

    def extend_prefix_hit(
        self, request: Request, blocks: KVCacheBlocks, num_tokens: int
    ) -> tuple[KVCacheBlocks, int]:
        """A waiting request's device prefix hit: guarded, and extended from the host pool."""
        return self.admissions.extend_prefix_hit(request, blocks, num_tokens)

    def blocks_by_page_after_load_failure(
        self, request_id: str, invalid_block_ids: set[int]
    ) -> list[BlockId]:
        """The request's table as upstream's scan for blocks a KV load failed to fill reads
        it: one block id per page, a block that failed in any group where there is one
        (`KVCacheBlockAccess.pages_named`), so the request recomputes from its first page
        that failed in any group. An import landing in the host pool that failed goes
        whole: its landed pages have only placeholders in the table, so the recompute could
        not write them, and their host pages were never filled; the request starts again
        from its first page (its admission record, landed pages included, goes back when
        it is looked up again, `Admissions.begin`)."""
        pages = self.blocks.pages_named(request_id, invalid_block_ids)
        if pages and self.admissions.host_landing(request_id):
            failed = next((block for block in pages if block in invalid_block_ids), None)
            if failed is not None:
                pages[0] = failed
        return pages

    def blocks_from_page(self, request_id: str, first: int) -> set[BlockId]:
        """What a failed KV load leaves unwritten from page `first` on: the request's blocks
        of that page and every later one in every group, for upstream to evict from the
        prefix cache (its own scan names one block per page)."""
        return self.blocks.blocks_from_page(request_id, first)

    def guard_prefix_hit(self, request: Request, blocks: KVCacheBlocks) -> None:
        """A waiting request's device prefix hit that a connector reconciles: guarded."""
        self.admissions.guard_prefix_hit(request, blocks)

    def cap_external_hit(
        self,
        request: Request,
        new_computed_blocks: KVCacheBlocks,
        num_local_tokens: int,
        num_external_tokens: int,
    ) -> tuple[KVCacheBlocks, int]:
        """A KV connector's hit past the local one, as HiSparse can serve it (admission.py)."""
        return self.admissions.cap_external_hit(
            request, new_computed_blocks, num_local_tokens, num_external_tokens, executable=plans_executable()
        )

    def after_allocation(self, request: Request, num_external_tokens: int) -> None:
        """A waiting request's blocks are allocated: restore its connector hit's pages."""
        self._restores.extend(self.admissions.after_allocation(request, num_external_tokens))
        if num_external_tokens > 0:
            self._loads_this_step[request.request_id] = num_external_tokens

    def host_landing(self, request_id: str) -> dict[int, int]:
        """The pages of `request_id`'s import that land in the host pool: page index -> host page."""
        return self.admissions.host_landing(request_id)

    def hold(self, request: Request) -> None:
        """The request finished and the KV connector keeps its blocks to send them (a P/D
        producer): none of its pages may leave the device until `release`. The
        OffloadingConnector's groups hold no sparse-MLA page, so its sends need no hold."""
        if self.imports.kinds != {ImportKind.HOST_POOL_GROUPS}:
            self.residency.hold(request.request_id)

    def release(self, request: Request) -> None:
        """The request finished, was aborted or preempted: before its blocks are freed."""
        self.admissions.release(request.request_id)
        self._unpublished_imports.pop(request.request_id, None)
        written = self._first_written.pop(request.request_id, None)
        if written is not None and self.issue_plans:
            self._keep_ended_writes(request, *written)
        self._return_staging(request.request_id)
        self._unplaced.discard(request.request_id)
        self._evict_host_backed_first(request)
        self._hold_history(request)
        self.residency.finish(request.request_id)
        if not self.residency.pages_by_state()[PageState.HOST]:
            # Nothing stages any more: an idle engine holds no spare blocks (upstream's
            # reset_prefix_cache needs every block free).
            self.blocks.release_spare()
        if not self.residency.requests:
            self.histories.release_all()  # idle: the LRU order serves them again

    def _hold_history(self, request: Request) -> None:
        """A session's turn ended with pages in the host pool: hold its indexer (and
        drafter) blocks of the leading pages the host pool holds, so its next turn finds
        its whole history (see histories.py). Not for a preempted request (its blocks must
        free room) or one that failed or was aborted."""
        if not self.enable_caching or request.status not in HISTORY_STATUSES:
            return
        req = self.residency.requests.get(request.request_id)
        if req is None:
            return
        num_pages = req.pages.num_leading_off_device(req.num_complete_pages)
        if num_pages:
            self.histories.hold(
                request.request_id, self.blocks.history_block_ids(request.request_id, num_pages)
            )

    def _evict_host_backed_first(self, request: Request) -> None:
        """Under pressure, before an immediate free of a released request: its BOTH pages'
        sparse-MLA blocks go to the front of the pool's eviction order (the host pool holds
        their content), ahead of every other cached block. A session's indexer pages, which
        exist nowhere else, then outlive them, and its next turn starts from the host pool
        instead of recomputing. Without pressure the LRU order stands, for a next turn that
        finds its whole history on the device."""
        req = self.residency.requests.get(request.request_id)
        if req is None or not req.num_both_pages or not self.enable_caching:
            return
        scheduler = self.scheduler
        if scheduler.defer_block_free and request.last_sched_seq > scheduler.processed_step_seq:
            return  # upstream defers this free to the step in flight's fence
        # The device stays under pressure after this free (as `under_pressure` would read it
        # then): other requests' pages live only in the host pool, or the pool's next free
        # block is a prefix-cache entry and this free puts no uncached block before it.
        others_host = self.residency.pages_by_state()[PageState.HOST] - req.num_host_pages
        if not (
            others_host > 0
            or (self.blocks.front_is_cached() and not self.blocks.frees_uncached(request.request_id))
        ):
            return
        table = req.pages
        pages = [
            (index, block_ids)  # BOTH (`Page.state`, on the page table's columns)
            for index, (block_ids, host_page, copy_id) in enumerate(
                zip(table.block_ids, table.host_page, table.copy_id, strict=True)
            )
            if block_ids is not None and host_page is not None and copy_id is None
        ]
        self._host_backed += self.blocks.take_out_pages(request.request_id, pages, record=False)

    def after_free(self) -> None:
        """Right after upstream freed a released request's blocks: the host-backed ones taken
        out of its table go to the front of the eviction order."""
        if self._host_backed:
            self.blocks_evicted_first += self.blocks.free_first(self._host_backed)
            self._host_backed = []

    def under_pressure(self) -> bool:
        """Whether the device is short of blocks: pages live only in the host pool (relief
        demoted them, or mode "always" does), or allocations already evict cached blocks."""
        return self.residency.pages_by_state()[PageState.HOST] > 0 or self.blocks.front_is_cached()

    def _blocks_written(self) -> set[int]:
        """The blocks outside the sparse-MLA groups that running requests may write from this
        step on: each one's blocks from the one holding its next token, or its first token
        a KV connector loads in this step's forward (its computed tokens count them, while
        the workers copy blocks before the load); and the blocks of loads whose step's
        output has not confirmed them (async scheduling: a copy made now would keep what a
        failed load left unwritten, where no failure scan looks)."""
        written: set[int] = set()
        loading = self._loads_this_step
        for request in self.scheduler.running:
            start = request.num_computed_tokens - loading.get(request.request_id, 0)
            written.update(self.blocks.blocks_from(request.request_id, start))
        for load in self._unconfirmed_loads.values():
            for _, blocks in (*load.pages, *load.after):
                written.update(blocks)
        return written

    def _release_histories_for_admission(self, num_blocks: int) -> int:
        """An admission's hot lease finds no room after demotion: held histories make room
        only when no request runs (one that runs ends, and frees room, in time)."""
        return 0 if self.scheduler.running else self.histories.release(num_blocks)

    def has_copies_in_flight(self) -> bool:
        """Copies to the host not yet reported: their pages' blocks may come back."""
        return self.residency.num_copies_in_flight() > 0

    def has_pending_work(self) -> bool:
        """Copies in flight whose reports only later steps collect, or spare staging blocks
        only a step's scheduling returns: the engine keeps stepping."""
        return self.residency.num_copies_in_flight() > 0 or self.blocks.num_spare() > 0

    def finish_step(self, scheduler: Scheduler, scheduler_output: SchedulerOutput) -> None:
        """After schedule(): register new pages, plan this step's copies, attach the plan."""
        step = next(self._steps)
        self.residency.host_pool.step_scheduled = step
        if self._loads_this_step:
            self._note_loads(scheduler, scheduler_output, step)
        if self._failed_load_blocks:
            self._forget_rewritten_blocks(scheduler, scheduler_output)
            pool = self.kv_cache_manager.block_pool.blocks  # a free one's next owner writes it
            self._failed_load_blocks = {b for b in self._failed_load_blocks if pool[b].ref_cnt > 0}
        first_written = self._first_written
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            if request_id not in self._failed:
                request = scheduler.requests[request_id]
                before = request.num_computed_tokens - num_tokens
                written = first_written.get(request_id)
                if written is None:
                    first_written[request_id] = [before, step]
                else:
                    written[0] = min(written[0], before)
                    written[1] = step
                self._sync_request(request)
        # A record whose request was not allocated goes back; one waiting for a
        # connector's load keeps everything until the request is scheduled.
        self.admissions.end_step()
        self.resident_blocks_copied += len(scheduler_output.kv_cache_block_copies or ())
        copies = []
        if self.issue_plans:
            # Also in a step that schedules no token: the workers run every step's plan.
            copies = self.residency.plan_copies()
        for state, n in self.residency.requests_by_state().items():
            self.request_steps[state] += n
        for request_id in scheduler_output.scheduled_spec_decode_tokens:
            req = self.residency.requests.get(request_id)
            if req is not None and req.state is not RequestState.FULL:
                self.speculative_steps_with_host_pages += 1
        updates, self.blocks.updates = self.blocks.updates, []
        restores, self._restores = self._own_restores(self._restores), []
        if self._failed_load_blocks and restores:  # a restore fills its page whole
            self._failed_load_blocks.difference_update(r.block_ids[0] for r in restores)
        new_host_pages, new_leases = self.residency.drain_changes()
        k = len(self.mla_group_ids)
        staging, held = [], []
        for request_id in list(self._staging):
            if request_id not in scheduler_output.num_scheduled_tokens:
                self._return_staging(request_id)  # the chunk was not scheduled after all
                self._unplaced.add(request_id)
                continue
            blocks = self._staging.pop(request_id)
            held += blocks
            staging.append(
                StepStaging(
                    request_id,
                    len(blocks) // k * self.block_size,
                    tuple(tuple(blocks[g::k]) for g in range(k)),
                )
            )
        if held:
            self._staging_in_flight[step] = held
        self._unplaced.difference_update(scheduler_output.num_scheduled_tokens)
        self.residency.end_schedule()
        scheduler_output.hisparse_plan = HiSparseStepPlan(
            version=HISPARSE_PLAN_VERSION,
            step=step,
            mla_group_ids=self.mla_group_ids,
            copies=tuple(copies),
            block_table_updates=tuple(updates),
            restores=tuple(restores),
            host_pages=tuple(new_host_pages),
            leases=tuple(self._lease_update(rid, blocks) for rid, blocks in new_leases),
            staging=tuple(staging),
        )
        # Spare staging blocks stay for later steps' takes while some request has HOST pages
        # (only those stage); the pool takes them back whenever an allocation would fail
        # without them (`relieve_pressure`).
        if not self.residency.pages_by_state()[PageState.HOST]:
            self.blocks.release_spare()
        if self.check_each_step:
            self.check_ownership()
            check_plan(self.blocks, scheduler_output.hisparse_plan)

    def _note_loads(self, scheduler: Scheduler, scheduler_output: SchedulerOutput, step: int) -> None:
        """The step's connector loads that run in its forward (the requests it schedules
        for the first time; a request waiting for an asynchronous load is not scheduled,
        and its load is done when it is). Until the step's output confirms them, their
        pages are not copied or demoted, in this request or in any other whose prefix hit
        shares their blocks (`_sync_request`): a load can fail, and the scheduler then
        recomputes its pages or ends the request (upstream's `kv_load_failure_policy`),
        while a copy made after the forward would have put never-written KV in the host
        pool, published for other requests' hits."""
        loads, self._loads_this_step = self._loads_this_step, {}
        scheduled = scheduler_output.num_scheduled_tokens
        page = self.block_size
        for request_id, num_loaded in loads.items():
            if request_id in scheduled:  # its computed tokens count the step's tokens now
                written = scheduler.requests[request_id].num_computed_tokens
                computed = written - scheduled[request_id]
                first, end = (computed - num_loaded) // page, -(-computed // page)
                pages = self.blocks.page_block_sets(request_id, first, end)
                # The pages the step computes past the load attend over it.
                after = self.blocks.page_block_sets(request_id, end, -(-written // page))
                self._unconfirmed_loads[request_id] = UnconfirmedLoad(step, first, pages, after)
                null = self.blocks.null_block_id
                # A page landing in the host pool has no block in the first group.
                self._unconfirmed_blocks.update((b, step) for b, _ in pages if b != null)

    def _confirm_loads(self, step: int, output: ModelRunnerOutput) -> None:
        """The loads that ran in the forward of step `step` are done: their pages may be
        copied and demoted from now on, and their pages that landed in the host pool are
        published. A load the output names failed (blocks of its request among the
        invalid ones) is left to upstream's scan, which follows `kv_load_failure_policy`
        on the pages in the table; one with pages landed in the host pool ends its request
        with an error instead: those pages are placeholders in its table, which a
        recompute could not write, and their host pages were never filled.

        A failed load's pages, from its first failed one on, and the pages its step computed
        past the load (they attended over it), leave the prefix cache in every group (with
        "recompute" upstream leaves them cached, and a later request's hit would read them
        unwritten, or copy them to the host pool), and their blocks stay
        held back from copies and demotion until a forward writes them to their page's end
        (`_forget_rewritten_blocks`), a restore fills them, or they go back to the pool:
        upstream lets one request recompute a shared failed block while the others count
        it computed, and the recompute may take several steps."""
        transfer = getattr(output, "kv_connector_output", None)
        invalid = getattr(transfer, "invalid_block_ids", None) or set()
        self._unconfirmed_blocks = {b: s for b, s in self._unconfirmed_blocks.items() if s != step}
        null = self.blocks.null_block_id
        for request_id in [r for r, load in self._unconfirmed_loads.items() if load.step == step]:
            load = self._unconfirmed_loads.pop(request_id)
            pages = load.pages
            imports = self._unpublished_imports.pop(request_id, [])
            failed_at = next(
                (i for i, (_, blocks) in enumerate(pages) if not invalid.isdisjoint(blocks)), None
            )
            if failed_at is not None:
                failed = pages[failed_at:] + load.after
                self._failed_load_blocks.update(b for b, _ in failed if b != null)
                self.kv_cache_manager.evict_blocks({b for _, blocks in failed for b in blocks} - {null})
                request = self.scheduler.requests.get(request_id)
                if request is not None and self.host_prefix_hits:
                    # An offload tier beside the loading connector may have stored these
                    # pages' indexer keys from unwritten blocks: its hits stop before them.
                    first = load.first_page + failed_at
                    hashes = request.block_hashes[first : first + len(failed)]
                    self.residency.host_pool.withdraw(hashes, request_id)
                if imports:
                    self._fail(request_id, "its KV connector's load into the host pool failed")
                continue
            for start, host_pages in imports:
                self.residency.publish_imported(request_id, start, host_pages)

    def _own_restores(self, restores: list[PageRestore]) -> list[PageRestore]:
        """The step's restores whose page in their request's block table still holds the
        blocks they fill. A page restored early in the schedule may be demoted again by a
        later relief of the same schedule (its blocks then back in the pool, and perhaps
        already another request's or a lease's), and the priority policy may preempt a
        request the step already scheduled: such restores must not reach the workers,
        which run them before the forward. (A connector hit's request waiting for its
        load is not in residency yet: its table is what owns the blocks.)"""
        kept = []
        for restore in restores:
            if self.blocks.page_in_table(restore.request_id, restore.page_index) == restore.block_ids:
                kept.append(restore)
            else:
                self.restores_dropped += 1
        return kept

    def _lease_update(self, request_id: str, blocks: list[BlockId]) -> HotLeaseUpdate:
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

        Workers report a copy, by its id, once it is known to be done, which on CUDA
        can be a step or more after the step that planned it: until then it stays
        in flight. Workers that report nothing do not run HiSparse: every copy in
        flight is cancelled and planning stops.
        """
        plan: HiSparseStepPlan | None = getattr(scheduler_output, "hisparse_plan", None)
        if plan is not None:
            self.residency.host_pool.settle(plan.step)
        if plan is not None and (self._unconfirmed_loads or self._unconfirmed_blocks):
            self._confirm_loads(plan.step, output)
        if plan is not None:
            staging = self._staging_in_flight.pop(plan.step, None)
            if staging:
                # Kept for later steps' takes while some request has HOST pages (see
                # `finish_step`, `release` and `relieve_pressure`).
                if self.residency.pages_by_state()[PageState.HOST]:
                    self.blocks.keep_spare(staging)
                else:
                    self.blocks.give_back(staging)
        counts = self.worker_counts
        for name, value in (getattr(output, "hisparse_counters", None) or {}).items():
            if name in counts:
                counts[name] = max(counts[name], value) if name.startswith("max_") else counts[name] + value
        for request_id, reason in (getattr(output, "hisparse_failed", None) or {}).items():
            self._withdraw_with_followers(request_id, reason)
        reported_step = getattr(output, "hisparse_reported_step", None)
        if reported_step is not None and self._ended_writes:
            self._forget_ended_writes(reported_step)
        reported = getattr(output, "hisparse_copied", None)
        if reported is not None:
            # Any step's output may carry reports, one without a plan too.
            self.residency.complete_copies(reported)
        elif plan is not None and plan.copies:
            self.residency.cancel_all_copies()
            if self.issue_plans:
                self.issue_plans = False
                logger.warning(
                    "Hybrid HiSparse: the workers did not execute the step's residency plan; "
                    "no further pages are copied or demoted and the sparse-MLA KV cache stays "
                    "resident on the device."
                )
        if self.issue_plans:
            self.residency.demote_settled()
        if self.check_each_step:
            self.check_ownership()

    def reset_prefix_cache(self) -> None:
        """vLLM's prefix cache was reset (every block free) with its connectors' tiers
        (`reset_connector`: new weights, RLHF's `pause_generation(clear_cache=True)`, the
        endpoint's `reset_external`): the host pool, an offload tier as theirs are, forgets
        its copies too. A copy made before would serve old KV."""
        self.residency.forget_host_copies()
        self.admissions.forget_lookups()

    def failed(self, request_id: str) -> bool:
        """Whether HiSparse could not serve the request: its step's output is dropped."""
        return request_id in self._failed

    def take_failed(self) -> set[str]:
        """The requests to end with an error now (once each)."""
        failed = set(self._failed)
        self._failed.clear()
        return failed

    def _withdraw_with_followers(self, request_id: str, reason: str) -> None:
        """Fail the request and withdraw what it wrote (`_withdraw`), and do the same for
        every request that took any of it for its own in the meantime (a prefix hit on its
        blocks, or on its own host copies, before the report came), from the first page it
        took, and for theirs in turn: they read the same wrong KV."""
        failing: list[tuple[str, str, int | None]] = [(request_id, reason, None)]
        seen = {request_id}
        while failing:
            failed_id, why, first_page = failing.pop()
            blocks, host_pages, withdrawn_from = self._withdraw(failed_id, first_page)
            request = self.scheduler.requests.get(failed_id)
            if failed_id == request_id or (request is not None and not request.is_finished()):
                self._fail(failed_id, why)
            if not blocks and not host_pages:
                continue
            # A prefix hit keeps page positions: what a follower took starts at that page or
            # later (a resident block covering earlier pages names its first page only).
            followers: dict[str, int | None] = {}
            if blocks:
                followers.update(self.blocks.first_pages_holding(blocks, withdrawn_from))
            if host_pages:
                for other, req in self.residency.requests.items():
                    for index, page in enumerate(req.pages.host_page):
                        if page is not None and page in host_pages:
                            before = followers.get(other)
                            followers[other] = index if before is None else min(before, index)
                            break
            # Followers that ended, or were preempted, since: what they wrote is withdrawn
            # too, and one preempted fails when it would resume.
            for other, ended in self._ended_writes.items():
                if other not in followers and (
                    any(block.block_id in blocks for block in ended.taken_blocks)
                    or any(page in host_pages for page in ended.taken_host_pages if page is not None)
                ):
                    followers[other] = None
            for follower, first in sorted(followers.items()):
                if follower in seen:
                    continue
                request = self.scheduler.requests.get(follower)
                if (request is None or request.is_finished()) and follower not in self._ended_writes:
                    continue
                seen.add(follower)
                took = f"its prefix hit took KV of request {failed_id}, which failed"
                failing.append((follower, took, first))

    def _withdraw(
        self, request_id: str, first_page: int | None = None
    ) -> tuple[set[int], set[HostPage], int]:
        """A step of the request failed on the workers: its attention read wrong rows, and
        the KV it wrote from then on is wrong past the first layer that did. Which step
        is not known (a CUDA report comes a step or more late), so everything the request
        wrote itself, from the first page of the earliest step it was scheduled in (or
        from `first_page`, where it is earlier: a follower's prefix hit on a failed
        request's KV), leaves the prefix cache in every group and the host pool's index,
        and no copy of those pages is published (one in flight included). The blocks and
        host pages withdrawn (another request that holds one took it as its prefix hit in
        the meantime), and the first page withdrawn."""
        blocks: set[int] = set()
        host_pages: set[HostPage] = set()
        withdrawn_from = 1 << 62
        ended = self._ended_writes.pop(request_id, None)
        if ended is not None:  # it ended, or was preempted, before the report came
            pool = self.kv_cache_manager.block_pool.blocks
            still = {b for b, block_hash in ended.blocks if pool[b].block_hash == block_hash}
            self.kv_cache_manager.evict_blocks(still)
            blocks |= still
            host_pages.update(self.residency.withdraw_ended(request_id, ended.page_hashes))
            self.pages_withdrawn += len(ended.page_hashes)
            withdrawn_from = ended.first_page
        written = self._first_written.get(request_id)
        if self.scheduler.requests.get(request_id) is None:
            return blocks, host_pages, withdrawn_from
        if written is not None:
            own = written[0] // self.block_size
            first_page = own if first_page is None else min(first_page, own)
        if first_page is None:
            return blocks, host_pages, withdrawn_from
        host_pages.update(self.residency.withdraw(request_id, first_page))
        evicted: set[int] = set(self.blocks.blocks_from_page(request_id, first_page))
        self.kv_cache_manager.evict_blocks(evicted)
        blocks |= evicted
        self.pages_withdrawn += max(0, self.blocks.num_table_pages(request_id) - first_page)
        return blocks, host_pages, min(withdrawn_from, first_page)

    def _keep_ended_writes(self, request: Request, first: int, last_step: int) -> None:
        """What the request wrote from token `first` on, kept past its end until the workers
        have reported step `last_step` (`_withdraw` of a late failure): its blocks with the
        hashes they carry now, and its pages' hashes."""
        first_page = first // self.block_size
        pool = self.kv_cache_manager.block_pool.blocks
        own = self.blocks.blocks_from_page(request.request_id, first_page)
        blocks = [(b, pool[b].block_hash) for b in own]
        req = self.residency.requests.get(request.request_id)
        hashes = list(req.block_hashes[first_page : req.num_complete_pages]) if req is not None else []
        ended = self._ended_writes
        ended.pop(request.request_id, None)
        taken_host = req.pages.host_page[:first_page] if req is not None else []
        ended[request.request_id] = EndedWrites(
            last_step,
            first_page,
            [b for b in blocks if b[1] is not None],
            hashes,
            self.blocks.first_group_blocks(request.request_id, 0, first_page),
            taken_host,
        )
        if len(ended) > MAX_ENDED_WRITES:  # reports that stopped coming: the oldest go
            del ended[next(iter(ended))]

    def _forget_ended_writes(self, reported_step: int) -> None:
        """The workers have reported every step up to `reported_step`."""
        ended = self._ended_writes
        for request_id in [r for r, e in ended.items() if e.last_step <= reported_step]:
            del ended[request_id]

    def _fail(self, request_id: str, reason: str) -> None:
        """Fail one request, not the engine: it ends with an error when its step's output is
        processed, and returns everything it holds then."""
        if request_id in self._failed:
            return
        self._failed[request_id] = reason
        self.requests_failed += 1
        logger.error(
            "Hybrid HiSparse could not serve request %s (%s); it ends with an error and returns "
            "everything it holds, other requests go on",
            request_id,
            reason,
        )

    def check_ownership(self) -> None:
        """Assert that every device block, host page and copy has exactly its owners (ownership.py)."""
        self.ownership_checks += 1
        check_ownership(
            self.blocks,
            self.residency,
            self.admissions,
            self.staging_blocks(),
            self.histories.held_references(),
        )

    # -- state ---------------------------------------------------------------

    def _max_tokens(self, request: Request) -> int:
        """The most tokens the request's context can reach: what its hot lease must cover. A
        streaming-input session (`resumable`) takes more input after it stops, in the same
        request and with the same lease: up to the model's length."""
        if request.resumable:
            return self.max_model_len
        return min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)

    def staging_blocks(self) -> list[BlockId]:
        """Staging blocks held now: this step's chunks', every plan's still in flight, and the
        spare ones a finished step left for the next takes."""
        held = [b for blocks in self._staging.values() for b in blocks]
        held += [b for blocks in self._staging_in_flight.values() for b in blocks]
        held += self.blocks.spare_blocks()
        return held

    def _sync_request(self, request: Request) -> None:
        """Register the request's pages the KV cache manager added since the last step."""
        request_id = request.request_id
        residency = self.residency
        new_request = request_id not in residency.requests
        if new_request:
            # The request's own list: it grows as the request decodes.
            # One hash per page, whatever vLLM's hash block (`page_hashes`).
            hashes = page_hashes(request.block_hashes, self.hash_block_size, self.block_size)
            max_tokens = self._max_tokens(request)
            residency.add_request(request_id, hashes, max_tokens)
            if self.sends and (request.kv_transfer_params or {}).get("do_remote_decode"):
                # A P/D producer's request: its connector sends its blocks once it ends, and
                # a page demoted meanwhile is the null block there (the send is declined).
                # Mode "always" leaves it whole; pressure may still demote it, as a prompt
                # larger than the device must be.
                residency.requests[request_id].sends = True
        # What its admission holds passes to residency, page by page in table order.
        record = self.admissions.take(request_id)
        req = residency.requests[request_id]
        if record is not None or len(req.pages) < self.blocks.num_table_pages(request_id):
            record = record or PendingAdmission(request_id)
            try:
                self._register_pages(request_id, record)
            except (AssertionError, ValueError, KeyError) as error:
                # This request's bookkeeping alone is wrong: it fails, returning what it holds.
                self.admissions.give_back(record)
                residency.finish(request_id)
                self._fail(request_id, f"its pages could not be registered: {error}")
                return
        if new_request and req.state is RequestState.NONE:
            self.requests_started_none += 1
        residency.set_prefilling(request_id, request.num_computed_tokens < request.num_prompt_tokens)
        stable = min(request.num_computed_tokens, request.num_tokens)
        load = self._unconfirmed_loads.get(request_id) if self._unconfirmed_loads else None
        if load is not None:  # a page landing in the host pool has no block to hold back
            stable = min(stable, load.first_page * self.block_size)
        if self._unconfirmed_blocks or self._failed_load_blocks:
            stable = min(stable, self._before_unconfirmed_pages(request_id, req.num_complete_pages, stable))
        if self.enable_caching:
            self.blocks.cache_pages(request, stable)
            stable = min(stable, self.blocks.num_cached_pages(request_id) * self.block_size)
        residency.advance(request_id, stable)

    def _before_unconfirmed_pages(self, request_id: str, first: int, num_tokens: int) -> int:
        """`num_tokens`, or fewer: up to the first of the request's pages from page `first` on
        whose blocks a load not yet confirmed fills (`_note_loads`), or a failed load
        left unwritten (`_confirm_loads`)."""
        unconfirmed, failed = self._unconfirmed_blocks, self._failed_load_blocks
        end = -(-num_tokens // self.block_size)
        for index, block in enumerate(self.blocks.first_group_blocks(request_id, first, end), first):
            if block.block_id in unconfirmed or block.block_id in failed:
                return index * self.block_size
        return num_tokens

    def _forget_rewritten_blocks(self, scheduler: Scheduler, scheduler_output: SchedulerOutput) -> None:
        """Failed loads' blocks this step's forward writes to their page's end leave the
        set: the request recomputing them has written them whole by then (it recomputes
        from the failed page on, page by page), and a copy planned now runs after it."""
        page, failed = self.block_size, self._failed_load_blocks
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            end = scheduler.requests[request_id].num_computed_tokens  # this step's tokens counted
            first = (end - num_tokens) // page
            for block in self.blocks.first_group_blocks(request_id, first, end // page):
                failed.discard(block.block_id)

    def _register_pages(self, request_id: str, record: PendingAdmission) -> None:
        """The request's new table pages, registered with residency; the admission's host
        pages, restores and lease pass over as their pages are (the record keeps the rest)."""
        residency = self.residency
        req = residency.requests[request_id]
        start, end = len(req.pages), self.blocks.num_table_pages(request_id)
        if end > start:
            # Each page's block ids, one per sparse-MLA group (a new turn's history is
            # thousands of pages: one pass per group, not one call per page).
            # A group whose table is shorter than the first's raises ValueError.
            rows = self.blocks.page_rows(request_id, start, end)
            if not record.host_pages and not record.restores:
                self._append_device_pages(request_id, start, rows)
            else:
                self._register_mixed_pages(request_id, record, start, rows)
        assert not record.host_pages, f"{request_id}: host pages {record.host_pages} beyond its block table"
        assert not record.restores, f"{request_id}: restored pages {record.restores} beyond its block table"
        if record.lease:  # no HOST page after all
            lease, record.lease = record.lease, []
            residency.allocator.give_back(lease)

    def _append_device_pages(self, request_id: str, start: int, rows: list[tuple[BlockId, ...]]) -> None:
        """Pages `start`, `start + 1`, ... computed or hit on the device, registered in one call."""
        if not rows:
            return
        null = self.null_block_id
        if any(null in row for row in rows):
            # A null placeholder always comes with its host page (the admission's).
            position = start + next(i for i, row in enumerate(rows) if null in row)
            raise AssertionError(f"{request_id}: page {position} has no copy")
        self.residency.append_pages(request_id, rows)

    def _register_mixed_pages(
        self, request_id: str, record: PendingAdmission, start: int, rows: list[tuple[BlockId, ...]]
    ) -> None:
        """As `_register_pages`, for new pages among which the admission placed host pages or
        restores: consecutive pages of one kind pass over in one run each."""
        if self._register_one_host_run(request_id, record, start, rows):
            return
        residency = self.residency
        # The pending run of host pages, by position: each stays the record's until residency
        # has taken it (a registration that fails gives back what the record still holds).
        run: list[PageIndex] = []
        run_imported = False
        device_from = start  # the first page of the pending run of device pages

        def pass_device_run(position: int) -> None:
            self._append_device_pages(request_id, device_from, rows[device_from - start : position - start])

        def pass_run() -> None:
            if run:
                pages = [record.host_pages[position] for position in run]
                unconfirmed = run_imported and request_id in self._unconfirmed_loads
                residency.append_host_pages(
                    request_id, pages, record.lease, imported=run_imported, publish=not unconfirmed
                )
                if unconfirmed:  # published once the load is confirmed (`_confirm_loads`)
                    self._unpublished_imports.setdefault(request_id, []).append((run[0], pages))
                record.lease = []
                for position in run:
                    del record.host_pages[position]
                run.clear()

        for position in range(start, start + len(rows)):
            host = position in record.host_pages
            if not host and position not in record.restores:
                if run:
                    pass_run()
                    device_from = position
                continue
            if device_from < position:
                pass_device_run(position)
            device_from = position + 1
            if host:
                imported = position in record.landed
                if run and imported != run_imported:
                    pass_run()
                run_imported = imported
                run.append(PageIndex(position))
                continue
            pass_run()
            residency.append_restored_page(
                request_id, rows[position - start], record.restores[PageIndex(position)]
            )
            del record.restores[PageIndex(position)]
        pass_run()
        pass_device_run(start + len(rows))

    def _register_one_host_run(
        self, request_id: str, record: PendingAdmission, start: int, rows: list[tuple[BlockId, ...]]
    ) -> bool:
        """`_register_mixed_pages` where the admission's host pages are one run of
        consecutive pages among the new ones, with no restore and no import: the device
        pages before the run, the run, the device pages after it, each in one call, and no
        loop over the pages in Python (a turn's history under pressure: a run of thousands).
        False, registering nothing, where the pages are laid out otherwise."""
        host = record.host_pages
        if not host or record.restores or record.landed:
            return False
        first, last = min(host), max(host)
        if first < start or last >= start + len(rows) or last - first + 1 != len(host):
            return False
        self._append_device_pages(request_id, start, rows[: first - start])
        # Taken by residency before the record lets them go (a failure gives back the rest).
        pages = [page for _, page in sorted(host.items())]
        self.residency.append_host_pages(request_id, pages, record.lease, imported=False)
        record.lease = []
        host.clear()
        self._append_device_pages(request_id, last + 1, rows[last + 1 - start :])
        return True

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
            pages_restored=self.admissions.counters.pages_restored,
            # KV connector hits cut to the pages the host pool held of them.
            connector_hits_cut=self.admissions.counters.hits_cut,
            # KV connector hits refused: which connector loads them was not known.
            connector_hits_refused=self.admissions.counters.hits_refused,
            # Admission tries whose host pages found no room for a hot lease.
            host_hits_without_lease=self.admissions.counters.hits_without_lease,
            # Steps such a request waited for room instead of recomputing its host pages.
            lease_waits=self.admissions.counters.lease_waits,
            # Released host-backed sparse-MLA blocks put first in the eviction order.
            blocks_evicted_first=self.blocks_evicted_first,
            # Resident blocks copied for prefix hits ending inside one (the page layout).
            resident_blocks_copied=self.resident_blocks_copied,
            # Finished sessions' indexer (and drafter) blocks held on the device, and those
            # given back because demotion could not free enough.
            history_blocks_held=len(self.histories),
            history_blocks_released=self.histories.blocks_released_under_pressure,
            preemptions_avoided=counters.preemptions_avoided,
            # Proactive copies not made because the host pool already held the page.
            copies_avoided=counters.copies_avoided,
            victims_skipped=counters.victims_skipped,
            deferrals_exhausted=counters.deferrals_exhausted,
            hot_lease_blocks=sum(len(req.hot_blocks) for req in self.residency.requests.values()),
            copies_in_flight=self.residency.num_copies_in_flight(),
            # Requests ended with an error because HiSparse could not serve them.
            requests_failed=self.requests_failed,
            pages_withdrawn=self.pages_withdrawn,
            # Rows leased for one step to stage misses beyond hot buffers, and rows of the
            # budget the pool could not spare (those chunks took more passes instead).
            staging_rows_leased=self.staging_rows_leased,
            staging_rows_short=self.staging_rows_short,
            # Prefill chunks that restored their request's HOST pages instead of staging
            # rows, and the pages they restored.
            prefill_restores=self.prefill_restores,
            pages_restored_for_prefill=counters.pages_restored_for_prefill,
            # Rows the workers' resolvers loaded host -> device (hot-buffer misses), and
            # selected non-resident rows already in a hot buffer (hits).
            **self.worker_counts,
            request_steps_mixed=self.request_steps[RequestState.MIXED],
            request_steps_none=self.request_steps[RequestState.NONE],
            requests_started_none=self.requests_started_none,
            speculative_steps_with_host_pages=self.speculative_steps_with_host_pages,
            bytes_to_host=counters.pages_copied_to_host
            * self._page_bytes
            * max(self.worker_counts["max_host_pools"], 1),
            bytes_from_host=self._readers
            * (
                (self.admissions.counters.pages_restored + counters.pages_restored_for_prefill)
                * self._page_bytes
                + self.worker_counts["rows_loaded"] * self._row_bytes
            ),
        )
        return out


def attach_hisparse(scheduler: Scheduler) -> HiSparseScheduling | None:
    """HiSparse's scheduler state when `hisparse_config` is set and plans can run, else None."""
    if not hisparse_active(scheduler.vllm_config):
        return None
    return HiSparseScheduling(scheduler)
