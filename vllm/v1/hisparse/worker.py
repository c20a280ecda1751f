# SPDX-License-Identifier: Apache-2.0
"""Hybrid HiSparse on the worker: executes the scheduler's residency plans.

Owns, per worker:
- its view of the node's host pool: one allocation of `host_pool_gib` per node
  laid out [sparse-MLA layer, host page, 64 rows, latent width], so one page of
  every sparse-MLA layer is `pool[:, page]` and each layer's pool is plain rows
  for the resolver, in one mapping of exactly its size that the node's
  tensor-parallel ranks share (`pool_placement.py` says who shares and who
  writes, `host_memory.py` maps it: registered with CUDA on a GPU, plain memory
  on CPU); on a GPU the compiled kernels must load first
  (`ops.require_cuda_kernels`);
- before the step's metadata is built: the step's host->device restores (the
  sparse-MLA pages of a KV connector hit, into the blocks allocated for them),
  its block-table point updates (a demoted page's entries become the null
  block) to the runner's request states and persistent batch, and its
  residency deltas, handed to the resolution (`resolution.py`);
- after the forward, on the node's writing rank only, the step's planned
  device->host page copies for all sparse-MLA layers in one launch, on CUDA on a
  copy stream beside the next step's forward (`page_copy.PageCopyStream`); on every
  rank, the reports the scheduler reads from `ModelRunnerOutput`: the copies
  known durable, the resolver's counters, and the requests whose own error
  bits fail them (an error bit no request claims raises). On CUDA nothing
  here waits for the GPU: a copy is reported, and counters are read, once the
  CUDA event recorded after them has passed, which is a step or more later.

It never decides anything: what moves where comes from the plan. It touches
the KV cache only through the planned copies; the resolution loads rows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from copy import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.config.hisparse import (
    RESOLVING_BACKENDS,
    SPARSE_MLA_PAGE_TOKENS,
    host_pool_pages,
    plans_executable,
    sparse_mla_index_topk,
)
from vllm.logger import init_logger
from vllm.v1.hisparse.host_memory import HostPoolMemory
from vllm.v1.hisparse.kv_grouping import INDEXER_LAYER_SUFFIX, hisparse_managed_group_ids
from vllm.v1.hisparse.kv_import import register_host_pool_layers
from vllm.v1.hisparse.ops import narrow_copy_launches, require_cuda_kernels
from vllm.v1.hisparse.page_copy import CopiesOut, PageCopyStream, copy_pages
from vllm.v1.hisparse.plan import DEVICE_COUNTERS, HISPARSE_PLAN_VERSION, WORKER_COUNTERS
from vllm.v1.hisparse.pool_placement import PoolPlacement, pool_placement
from vllm.v1.hisparse.resolution import (
    HiSparseResolution,
    StepRequestErrors,
    impl_resolves,
    plan_memory_bound,
    standing_state_bytes,
    topk_owner_of_layer,
)
from vllm.v1.hisparse.resolver import check_resolution_error, describe_resolution_error

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.hisparse.plan import HiSparseStepPlan, PageCopy, PageRestore
    from vllm.v1.outputs import ModelRunnerOutput

logger = init_logger(__name__)


# With a host pool on each of several nodes, the steps a writer's page copy may still run
# after the step that launched it: its report waits that long, and the writer's next
# forward but one waits for the copy (`HiSparseWorker._fence_copies`).
COPY_FENCE_STEPS = 2


@dataclass
class _StepReport:
    """What one step leaves to report: its copies and counters, done once `event` has
    passed (and, for copies on the copy stream, `copies_out.event`)."""

    copies: Sequence[int]  # copy ids
    # DEVICE_COUNTERS, the step's error bits, then each of `request_ids`' own error bits.
    device_counts: torch.Tensor
    host_counts: dict[str, int]
    event: Any = None  # a CUDA event recorded after the step's work on the model's stream; None on CPU
    request_ids: list[str] = field(default_factory=list)
    copies_out: CopiesOut | None = None
    step: int = 0  # the worker's step that submitted it
    plan_step: int | None = None  # the scheduler's step of its plan

    def done(self) -> bool:
        return (self.event is None or self.event.query()) and (
            self.copies_out is None or self.copies_out.event.query()
        )


class StepReports:
    """Copies and counters of steps whose work may still be queued on the device.

    On CPU every step's work is done when its call returns. On CUDA each step
    records an event after its copy launch and starts a non-blocking copy of its
    device counters into pinned memory; `collect` reports, in order, the steps
    whose events have passed, so no report waits for the GPU.
    """

    def __init__(self, device: torch.device, min_age: int = 0) -> None:
        """`min_age`: steps a report waits at least, its work done or not (several host
        pools: `COPY_FENCE_STEPS`)."""
        self.device = device
        self.min_age = min_age
        self._pending: deque[_StepReport] = deque()
        # The scheduler's latest step whose report `collect` has returned.
        self.reported_plan_step: int | None = None

    def submit(
        self,
        copies: Sequence[int],
        device_counts: torch.Tensor,
        error: torch.Tensor,
        host_counts: dict[str, int],
        request_errors: StepRequestErrors | None = None,
        copies_out: CopiesOut | None = None,
        step: int = 0,
        plan_step: int | None = None,
    ) -> None:
        parts = [device_counts, error.reshape(1)]
        request_ids: list[str] = []
        if request_errors is not None and request_errors.words is not None:
            parts.append(request_errors.words)
            request_ids = request_errors.request_ids
        values = torch.cat(parts)
        if self.device.type != "cuda":
            report = _StepReport(copies, values, host_counts, None, request_ids, copies_out, step, plan_step)
            self._pending.append(report)
            return
        pinned = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        pinned.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append(
            _StepReport(copies, pinned, host_counts, event, request_ids, copies_out, step, plan_step)
        )

    def pending(self) -> bool:
        """Whether a submitted step's report has not been collected yet."""
        return bool(self._pending)

    def collect(self, step: int = 0) -> tuple[list[int], dict[str, int], int, dict[str, int]]:
        """(ids of durable copies, counters, error bits, each request's own error bits) of
        every step done since the last call (and, with `min_age`, submitted that many
        steps before `step` or earlier).

        Counters add up over the steps collected, except the maxima (`max_*`).
        `device_reads` counts the reads of device-produced values this makes: one
        per collected step, each after its work is done.
        """
        copies: list[int] = []
        counters = dict.fromkeys(WORKER_COUNTERS, 0)
        error = 0
        failed: dict[str, int] = {}
        num_counts = len(DEVICE_COUNTERS)
        pending, latest = self._pending, step - self.min_age if self.min_age else None
        while pending and (latest is None or pending[0].step <= latest) and pending[0].done():
            report = pending.popleft()
            if report.plan_step is not None:
                self.reported_plan_step = report.plan_step
            copies.extend(report.copies)
            read = report.device_counts.tolist()
            values, step_error = read[:num_counts], read[num_counts]
            if report.copies_out is not None:
                step_error |= int(report.copies_out.error[0])
                counters["device_reads"] += 1
            for request_id, bits in zip(report.request_ids, read[num_counts + 1 :], strict=True):
                if bits:
                    failed[request_id] = failed.get(request_id, 0) | bits
            counters["device_reads"] += 1
            error |= step_error
            step_counts = [*zip(DEVICE_COUNTERS, values, strict=True), *report.host_counts.items()]
            for name, value in step_counts:
                maximum = name.startswith("max_")
                counters[name] = max(counters[name], value) if maximum else counters[name] + value
        return copies, counters, error, failed


class HiSparseWorker:
    """The worker-side executor of Hybrid HiSparse plans for one model runner."""

    def __init__(
        self,
        runner: Any,
        kv_caches: dict[str, torch.Tensor],
        group_of_layer: dict[str, int],
        hot_rows: int,
        num_host_pages: int,
        topk_owner: dict[str, int] | None = None,
        max_pages: int | None = None,
        host_pool_gib: float | None = None,
        placement: PoolPlacement | None = None,
    ) -> None:
        """`group_of_layer`: the KV cache group of each layer whose pages move (the
        resident group, indexer and MTP drafter, reads in place); `hot_rows`: rows of
        a hot buffer; `num_host_pages`: pages of the host pool; `topk_owner`: the
        decoder layer whose top-K each layer reads (default: its own); `max_pages`:
        pages of the longest request (default: the host pool's); `host_pool_gib`: the
        configured pool size, named if the pool does not fit in host RAM; `placement`:
        which ranks share this rank's pool and whether it writes pages (default: a
        pool of its own that it writes)."""
        self.group_of_layer = dict(group_of_layer)
        self.mla_group_ids = tuple(sorted(set(self.group_of_layer.values())))
        self.layers = list(self.group_of_layer)
        # [num_blocks, 1 (latent head), block_size, width] -> [num_blocks, block_size, width]
        self.kv_caches = {
            name: kv_caches[name][:, 0] if kv_caches[name].dim() == 4 else kv_caches[name]
            for name in self.layers
        }
        self.kv_cache_list = [self.kv_caches[name] for name in self.layers]
        first = self.kv_caches[self.layers[0]]
        self.block_size = first.shape[1]
        width = first.shape[2]
        pin = first.is_cuda
        if pin:
            require_cuda_kernels()  # before the pool: no torch fallback on a GPU
        placement = placement if placement is not None else PoolPlacement.alone()
        self.writes_pages = placement.writer
        self.num_pools = placement.num_pools
        self._narrow_copy_launches = narrow_copy_launches()
        self.host_memory = HostPoolMemory(
            (len(self.layers), num_host_pages, self.block_size, width),
            first.dtype,
            register=pin,
            host_pool_gib=host_pool_gib,
            share=placement.share,
        )
        self.host_pool = self.host_memory.tensor
        # A KV connector's import lands sparse-MLA pages here (kv_import.py).
        register_host_pool_layers(self.host_pool, self.layers)
        self.runner = runner
        self._plan: HiSparseStepPlan | None = None
        self._layer_column: tuple[int, ...] | None = None
        self.resolution = HiSparseResolution(
            runner,
            self.group_of_layer,
            topk_owner if topk_owner is not None else {name: i for i, name in enumerate(self.layers)},
            self.block_size,
            hot_rows,
            self.host_pool,
            first.device,
            max_pages=max_pages if max_pages is not None else num_host_pages,
        )
        # Several nodes' pools: a page is written on each node by its own writer, and the
        # scheduler hears only of the first node's copy. The others' are fenced instead.
        self.fence_steps = COPY_FENCE_STEPS if self.num_pools > 1 else 0
        self.reports = StepReports(first.device, min_age=self.fence_steps)
        self.copy_stream = PageCopyStream(first.device)
        self._step = 0
        self._fences: deque[tuple[int, CopiesOut]] = deque()
        # Several nodes' pools: a step's restores wait for this (`begin_step`).
        self.node_barrier: Callable[[], None] = lambda: tensor_parallel_barrier(first.device)
        sharing = ""
        if len(placement.node_ranks) > 1:
            role = "written" if self.writes_pages else "read"
            sharing = f", shared by ranks {list(placement.node_ranks)}, {role} here"
        logger.info(
            "Hybrid HiSparse worker: host pool of %d pages x %d sparse-MLA layers (%.2f GiB%s%s)",
            num_host_pages,
            len(self.layers),
            self.host_pool.numel() * self.host_pool.element_size() / (1 << 30),
            ", pinned" if pin else "",
            sharing,
        )

    # -- per step ----------------------------------------------------------------

    def begin_step(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the plan's restores, block-table updates and residency deltas (before metadata)."""
        plan = scheduler_output.hisparse_plan
        self._plan = plan
        self._step += 1
        if self._fences:
            self._fence_copies()
        for rid in list(scheduler_output.finished_req_ids) + list(scheduler_output.preempted_req_ids or ()):
            self.resolution.forget(rid)
        if plan is not None:
            if plan.version != HISPARSE_PLAN_VERSION:
                raise RuntimeError(
                    f"HiSparse plan version {plan.version}, this worker executes version "
                    f"{HISPARSE_PLAN_VERSION}: scheduler and worker builds differ"
                )
            if plan.restores and self.num_pools > 1:
                self.node_barrier()
            self._run_restores(plan)
            self._update_block_tables(plan)
            self.resolution.update(plan.host_pages, plan.leases, plan.staging)
        self.resolution.start_step(scheduler_output.num_scheduled_tokens)

    def _fence_copies(self) -> None:
        """With a pool on each of several nodes: this step's work waits for the page copies
        this rank launched `fence_steps` steps ago or earlier.

        The scheduler turns a page HOST, frees its blocks and reads its host page once the
        output rank reports its own copy durable. Another node's writer copied the same
        page on its own copy stream, which nothing else waits for: its next forward could
        write the freed blocks for their new owner while the copy still read them, and its
        node's ranks could read the host page before it was written. The report waits
        `fence_steps` steps (`StepReports.min_age`), so the scheduler uses a page copied in
        step n from step n + 3 on; here the writer's step n + 2 waits for that copy before
        anything of it runs, and the node's other ranks, through that forward's
        collectives, before their step n + 3. The copy still runs beside the forward of
        step n + 1.

        A step without tokens has no forward and no collective (an idle engine steps while
        copies are in flight), and a step's restores run before its forward's first
        collective: a step with restores first meets every rank in a collective of its
        own (`node_barrier`), after this fence on the writers."""
        oldest = self._step - self.fence_steps
        while self._fences and self._fences[0][0] <= oldest:
            _, copies_out = self._fences.popleft()
            self.copy_stream.fence(copies_out)

    def _update_block_tables(self, plan: HiSparseStepPlan) -> None:
        runner = self.runner
        touched: set[str] = set()
        groups = plan.mla_group_ids
        for update in plan.block_table_updates:
            state = runner.requests.get(update.request_id)
            if state is None:
                continue  # ended before this step
            for group_id, block_id in zip(groups, update.block_ids, strict=True):
                state.block_ids[group_id][update.position] = block_id
            touched.add(update.request_id)
        batch = runner.input_batch
        for rid in touched:
            row = batch.req_id_to_index.get(rid)
            if row is not None:
                batch.block_table.add_row(runner.requests[rid].block_ids, row)

    def finish_step(self, output: ModelRunnerOutput) -> ModelRunnerOutput:
        """After the forward (or instead of one): launch the planned copies, report what is done."""
        device_counts, error, host_counts, request_errors = self.resolution.end_step()
        plan, self._plan = self._plan, None
        if plan is not None:
            copies_out = None
            if self.writes_pages and plan.copies:
                # The node's other ranks hold the same latent rows: one copy serves them all.
                copies_out = self.copy_stream.launch(
                    lambda word: self._copy_pages(plan, plan.copies, to_host=True, error=word), error
                )
            host_counts["max_host_pools"] = self.num_pools
            launches = narrow_copy_launches()  # a host counter: no device read
            host_counts["narrow_copy_launches"] = launches - self._narrow_copy_launches
            self._narrow_copy_launches = launches
            copies = [c.copy_id for c in plan.copies]
            if self.fence_steps and copies_out is not None:
                self._fences.append((self._step, copies_out))
            self.reports.submit(
                copies, device_counts, error, host_counts, request_errors, copies_out, self._step, plan.step
            )
        elif not self.reports.pending():
            return output
        # Every step collects what is done, a step without a plan too, so no report waits
        # for the next planned step.
        copied, counters, error_bits, failed = self.reports.collect(self._step)
        if output is _empty_output():
            output = copy(output)
        output.hisparse_copied = copied
        output.hisparse_counters = counters
        output.hisparse_failed = failed_requests(error_bits, failed)
        # Every step up to this one is reported: a request's failure can come no later.
        output.hisparse_reported_step = self.reports.reported_plan_step
        return output

    def _run_restores(self, plan: HiSparseStepPlan) -> None:
        """Host -> device into a connector hit's blocks, ordered before the forward."""
        self._copy_pages(plan, plan.restores, to_host=False, error=self.resolution.error)

    def _copy_pages(
        self,
        plan: HiSparseStepPlan,
        pages: Sequence[PageCopy | PageRestore],
        to_host: bool,
        error: torch.Tensor,
    ) -> None:
        """One batched copy; an index out of bounds raises a bit in the step's `error` word."""
        if not pages:
            return
        if self._layer_column is None:
            # Column l: the block of each page in layer l's sparse-MLA group.
            self._layer_column = tuple(plan.mla_group_ids.index(self.group_of_layer[n]) for n in self.layers)
        column = self._layer_column
        block_ids = torch.tensor([[page.block_ids[c] for c in column] for page in pages], dtype=torch.int64)
        host_pages = torch.tensor([page.host_page for page in pages], dtype=torch.int64)
        if self.kv_cache_list[0].is_cuda:
            # The op copies them to the device non-blocking: from pinned memory, so the host
            # does not wait for the stream.
            block_ids, host_pages = block_ids.pin_memory(), host_pages.pin_memory()
        copy_pages(self.kv_cache_list, self.host_pool, block_ids, host_pages, to_host, error=error)


def failed_requests(error_bits: int, request_bits: dict[str, int]) -> dict[str, str] | None:
    """The requests a step's errors fail, and why; raises for a bit no request raised on its own.

    A bit a request raised in its own word (its selections overflowed its rows) fails
    that request alone, and the scheduler ends it with an error; any other bit (a row or
    page copy out of bounds, a request row outside the hot state) stops the engine.
    """
    claimed = 0
    for bits in request_bits.values():
        claimed |= bits
    check_resolution_error(error_bits & ~claimed)
    return {request_id: describe_resolution_error(bits) for request_id, bits in request_bits.items()} or None


def _empty_output():
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    return EMPTY_MODEL_RUNNER_OUTPUT


def profile_reserve(runner: Any) -> torch.Tensor | None:
    """What vLLM's memory profile must see of the resolution, held across its dummy forward.

    The profiled forward resolves nothing (no request has HOST pages), so the bytes a
    serving step's plans hold beside the forward's activations and the resolution's
    standing state (`profile_reserve_bytes`) would come out of the KV cache's margin
    unseen. Allocating them for the profiled forward makes the KV cache that much smaller
    instead. None without hisparse_config or a DSA model, and on CPU, where the KV cache
    is sized by `VLLM_CPU_KVCACHE_SPACE`, not by a profile (its warm-up also runs it).
    """
    if torch.device(runner.device).type == "cpu":
        return None
    owners, row_bytes = resolver_layers(runner.get_kv_cache_spec())
    # At most as many requests hold a hot lease as the memory left after the weights holds.
    _, total = torch.cuda.mem_get_info(runner.device)
    utilization = runner.vllm_config.cache_config.gpu_memory_utilization
    left = total * utilization - torch.cuda.memory_allocated(runner.device)
    config = runner.vllm_config.attention_config.hisparse_config
    hot_rows = config.device_buffer_size if config is not None and config.device_buffer_size else 1
    leases = int(left // max(hot_rows * row_bytes, 1))
    nbytes = profile_reserve_bytes(runner.vllm_config, owners, leases)
    if nbytes is None:
        return None
    logger.info("Hybrid HiSparse: the memory profile holds %.2f GiB for the resolver", nbytes / (1 << 30))
    return torch.empty(nbytes, dtype=torch.uint8, device=runner.device)


def resolver_layers(specs: dict[str, Any]) -> tuple[int, int]:
    """From the KV cache specs: the top-K owners (indexer layers), and the bytes one row
    (token) takes in all sparse-MLA layers together, a hot lease's row."""
    owners = sum(1 for name in specs if name.endswith(INDEXER_LAYER_SUFFIX))
    row_bytes = sum(
        spec.page_size_bytes // spec.block_size
        for name, spec in specs.items()
        if not name.endswith(INDEXER_LAYER_SUFFIX)
    )
    return owners, row_bytes


def profile_reserve_bytes(vllm_config: Any, num_owners: int, max_leases: int | None = None) -> int | None:
    """`plan_memory_bound` at `max_num_batched_tokens` tokens, all of requests with HOST
    pages, plus `standing_state_bytes`, for `num_owners` top-K owners (indexer layers) and
    as many requests as may hold a hot lease: `max_num_seqs`, or `max_leases` if fewer
    (docs/architecture.md, "Plan memory"). None without hisparse_config, a DSA model or
    an indexer layer."""
    config = vllm_config.attention_config.hisparse_config
    topk = sparse_mla_index_topk(vllm_config)
    if config is None or topk is None or not num_owners or not plans_executable():
        return None
    hot_rows = config.device_buffer_size or 2 * topk
    tokens = vllm_config.scheduler_config.max_num_batched_tokens
    requests = vllm_config.scheduler_config.max_num_seqs
    if max_leases is not None:
        requests = max(min(requests, max_leases), 1)
    rows = 1 << max(requests - 1, 7).bit_length()  # the tables grow by doubling from 8 rows
    max_pages = -(-vllm_config.model_config.max_model_len // SPARSE_MLA_PAGE_TOKENS)
    lease_pages = -(-hot_rows // SPARSE_MLA_PAGE_TOKENS)
    return plan_memory_bound(tokens, topk, requests, tokens, hot_rows) + standing_state_bytes(
        rows, hot_rows, num_owners, max_pages, lease_pages
    )


def attach_hisparse_worker(runner: Any, kv_caches: dict[str, torch.Tensor]) -> HiSparseWorker | None:
    """The runner's HiSparse executor when `hisparse_config` is set and plans can run here."""
    if runner.vllm_config.attention_config.hisparse_config is None:
        return None
    if not plans_executable():
        logger.warning(
            "Hybrid HiSparse: the sparse-MLA attention backends on this platform do not "
            "resolve through HiSparse in this build; the worker reports no copies, so the "
            "scheduler keeps the sparse-MLA KV cache resident."
        )
        return None
    groups = runner.kv_cache_config.kv_cache_groups
    group_of_layer = {name: g for g in hisparse_managed_group_ids(groups) for name in groups[g].layer_names}
    _check_layers_resolve(runner, group_of_layer)
    if runner.vllm_config.compilation_config.cudagraph_mode.has_full_cudagraphs():
        raise RuntimeError(
            "Hybrid HiSparse: CUDA graph mode "
            f"{runner.vllm_config.compilation_config.cudagraph_mode.name} captures attention, "
            "so a replay would skip the resolver; a compilation pass that needs full graphs "
            "(sequence parallelism, attention-quant fusion) cannot run with hisparse_config"
        )
    config = runner.vllm_config.attention_config.hisparse_config
    assert config.device_buffer_size is not None
    indexers = [name for group in groups for name in group.layer_names if name.endswith(INDEXER_LAYER_SUFFIX)]
    max_len = runner.vllm_config.model_config.max_model_len
    return HiSparseWorker(
        runner,
        kv_caches,
        group_of_layer,
        hot_rows=config.device_buffer_size,
        num_host_pages=host_pool_pages(runner.vllm_config),
        topk_owner=topk_owner_of_layer(group_of_layer, indexers),
        max_pages=-(-max_len // SPARSE_MLA_PAGE_TOKENS) + 1,
        host_pool_gib=config.host_pool_gib,
        placement=pool_placement(runner.vllm_config),
    )


def tensor_parallel_barrier(device: torch.device) -> None:
    """Every rank of the tensor-parallel group meets in one collective on the current
    stream: work queued after it on a rank runs after what every rank queued before it."""
    from vllm.distributed.parallel_state import get_tp_group

    get_tp_group().all_reduce(torch.zeros(1, device=device))


def _check_layers_resolve(runner: Any, layers: Iterable[str]) -> None:
    """Refuse, before the host pool is allocated, a managed layer whose backend would not resolve."""
    context = runner.vllm_config.compilation_config.static_forward_context
    for name in layers:
        impl = getattr(context.get(name), "impl", None)
        if impl is None or not impl_resolves(impl):
            raise RuntimeError(
                f"Hybrid HiSparse: layer {name} attends through {type(impl).__name__}, which "
                f"does not resolve pages in the host pool; start with --attention-backend one "
                f"of {', '.join(RESOLVING_BACKENDS[1:])}, or without hisparse_config"
            )
