# SPDX-License-Identifier: Apache-2.0
"""Hybrid HiSparse on the worker: executes the scheduler's residency plans.

Owns, per worker:
- the host pool: one allocation of `host_pool_gib` laid out
  [sparse-MLA layer, host page, 64 rows, latent width], so one page of every
  sparse-MLA layer is `pool[:, page]` and each layer's pool is plain rows for
  the resolver (pinned memory on CUDA, plain memory on CPU);
- before the step's metadata is built: the step's host->device restores (the
  sparse-MLA pages of a KV connector hit, into the blocks allocated for them)
  and its block-table point updates (a demoted page's entries become the null
  block) to the runner's request states and persistent batch;
- the step's residency view for the sparse-MLA backends (`StepResidency`): per
  request its HOST pages and hot-buffer rows, and per layer the hot state the
  resolver keeps across steps for the requests with HOST pages;
- `attend`: a layer's attention with those requests' tokens resolved, for the
  backends wrapped by `vllm/v1/hisparse/sparse_mla.py`;
- after the forward, the step's planned device->host page copies for all
  sparse-MLA layers, reported back as `ModelRunnerOutput.hisparse_copied`.

It never decides anything: what moves where comes from the plan. It touches
the KV cache only through the planned copies and the resolver's row loads.
"""

from __future__ import annotations

from copy import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.config.hisparse import host_pool_pages
from vllm.logger import init_logger
from vllm.v1.hisparse import scheduling
from vllm.v1.hisparse.kv_grouping import hisparse_managed_group_ids
from vllm.v1.hisparse.page_copy import copy_pages
from vllm.v1.hisparse.resolver import HotState, resolve_topk_slots

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.hisparse.residency import PageCopy
    from vllm.v1.hisparse.scheduling import HiSparseStepPlan, PageRestore
    from vllm.v1.outputs import ModelRunnerOutput

logger = init_logger(__name__)


@dataclass
class _LayerHot:
    """One layer's hot state as of step `serial`: row m belongs to request `index` -> m."""

    serial: int
    state: HotState
    index: dict[str, int]
    leases: list[tuple[tuple[int, ...], ...]]


@dataclass
class StepResidency:
    """What the sparse-MLA backend needs this step, per request id."""

    host_pages: dict[str, dict[int, int]] = field(default_factory=dict)  # page index -> host page
    # Hot-lease blocks, one tuple per sparse-MLA group in the plan's group order.
    hot_blocks: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)


class HiSparseWorker:
    """The worker-side executor of Hybrid HiSparse plans for one model runner."""

    def __init__(
        self,
        runner: Any,
        kv_caches: dict[str, torch.Tensor],
        group_of_layer: dict[str, int],
        hot_rows: int,
        num_host_pages: int,
    ) -> None:
        """`group_of_layer`: the KV cache group of each layer whose pages move (the
        resident group, indexer and MTP drafter, reads in place); `hot_rows`: rows of
        a hot buffer; `num_host_pages`: pages of the host pool."""
        self.group_of_layer = dict(group_of_layer)
        self.mla_group_ids = tuple(sorted(set(self.group_of_layer.values())))
        self.layers = list(self.group_of_layer)
        self.layer_index = {name: i for i, name in enumerate(self.layers)}
        # [num_blocks, 1 (latent head), block_size, width] -> [num_blocks, block_size, width]
        self.kv_caches = {
            name: kv_caches[name][:, 0] if kv_caches[name].dim() == 4 else kv_caches[name]
            for name in self.layers
        }
        self.kv_cache_list = [self.kv_caches[name] for name in self.layers]
        first = self.kv_caches[self.layers[0]]
        self.block_size = first.shape[1]
        width = first.shape[2]
        self.hot_rows = hot_rows
        pin = first.is_cuda
        self.host_pool = torch.empty(
            (len(self.layers), num_host_pages, self.block_size, width),
            dtype=first.dtype,
            pin_memory=pin,
        )
        self.runner = runner
        self.step = StepResidency()
        self._plan: HiSparseStepPlan | None = None
        self._hot: dict[str, _LayerHot] = {}  # layer -> its hot state
        self._stamp = 0
        # Per step: the requests with HOST pages (rows of every layer's hot state)
        # and what every layer of the step shares.
        self._serial = 0
        self._mixed: list[str] = []
        self._substep_cache: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._page_table_cache: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
        self._host_table_cache: dict[int, torch.Tensor] = {}
        # Counted on the cache's device, read once per step.
        self._rows_loaded = torch.zeros((), dtype=torch.long, device=first.device)
        self._rows_hit = torch.zeros((), dtype=torch.long, device=first.device)
        logger.info(
            "Hybrid HiSparse worker: host pool of %d pages x %d sparse-MLA layers (%.2f GiB%s)",
            num_host_pages,
            len(self.layers),
            self.host_pool.numel() * self.host_pool.element_size() / (1 << 30),
            ", pinned" if pin else "",
        )

    # -- per step ----------------------------------------------------------------

    def batch_request_ids(self) -> list[str]:
        """Request ids in the persistent batch's row order (the metadata's rows)."""
        return self.runner.input_batch.req_ids

    def begin_step(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the plan's block-table updates and take its residency view (before metadata)."""
        global _active
        _active = self
        plan = scheduler_output.hisparse_plan
        self._plan = plan
        for rid in list(scheduler_output.finished_req_ids) + list(scheduler_output.preempted_req_ids or ()):
            self._forget(rid)
        if plan is None:
            self.step = StepResidency()
            self._start_resolution(self.step)
            return
        if plan.version != scheduling.HISPARSE_PLAN_VERSION:
            raise RuntimeError(
                f"HiSparse plan version {plan.version}, this worker executes version "
                f"{scheduling.HISPARSE_PLAN_VERSION}: scheduler and worker builds differ"
            )
        self._run_restores(plan)
        runner = self.runner
        touched: set[str] = set()
        for update in plan.block_table_updates:
            state = runner.requests.get(update.request_id)
            if state is None:
                continue  # ended before this step
            state.block_ids[update.group_id][update.position] = update.block_id
            touched.add(update.request_id)
        batch = runner.input_batch
        for rid in touched:
            row = batch.req_id_to_index.get(rid)
            if row is not None:
                batch.block_table.add_row(runner.requests[rid].block_ids, row)
        step = StepResidency()
        for entry in plan.residency:
            step.host_pages[entry.request_id] = dict(entry.host_pages)
            step.hot_blocks[entry.request_id] = entry.hot_block_ids
        self.step = step
        self._start_resolution(step)

    def _start_resolution(self, step: StepResidency) -> None:
        self._serial += 1
        self._mixed = list(step.host_pages)
        self._substep_cache.clear()
        self._page_table_cache.clear()
        self._host_table_cache.clear()

    def finish_step(self, output: ModelRunnerOutput) -> ModelRunnerOutput:
        """After the forward (or instead of one): run the planned copies, report them."""
        global _active
        _active = None  # forwards outside a planned step (dummy runs) read everything in place
        plan, self._plan = self._plan, None
        if plan is None:
            return output
        if output is _empty_output():
            output = copy(output)
        output.hisparse_copied = self._run_copies(plan)
        output.hisparse_rows_loaded = int(self._rows_loaded)
        output.hisparse_rows_hit = int(self._rows_hit)
        self._rows_loaded.zero_()
        self._rows_hit.zero_()
        return output

    def _run_copies(self, plan: HiSparseStepPlan) -> list[tuple[str, int]]:
        """Every planned page of every sparse-MLA layer to the host pool, in one batched copy."""
        self._copy_pages(plan, plan.copies, to_host=True)
        if plan.copies and self.host_pool.is_pinned() and torch.cuda.is_available():
            # Reported copies must be durable: wait for the launch on the model's stream.
            torch.cuda.current_stream().synchronize()
        return [(page_copy.request_id, page_copy.page_index) for page_copy in plan.copies]

    def _run_restores(self, plan: HiSparseStepPlan) -> None:
        """Host -> device into a connector hit's blocks, ordered before the forward."""
        self._copy_pages(plan, plan.restores, to_host=False)

    def _copy_pages(
        self, plan: HiSparseStepPlan, pages: Sequence[PageCopy | PageRestore], to_host: bool
    ) -> None:
        if not pages:
            return
        # Column l: the block of each page in layer l's sparse-MLA group.
        column = [plan.mla_group_ids.index(self.group_of_layer[name]) for name in self.layers]
        block_ids = torch.tensor([[page.block_ids[c] for c in column] for page in pages], dtype=torch.int64)
        host_pages = torch.tensor([page.host_page for page in pages], dtype=torch.int64)
        copy_pages(self.kv_cache_list, self.host_pool, block_ids, host_pages, to_host)

    def _forget(self, request_id: str) -> None:
        """A finished or preempted request's hot rows may be reused: never keep them."""
        for held in self._hot.values():
            held.index.pop(request_id, None)

    # -- the resolver, for the sparse-MLA backends ---------------------------------

    def resolves(self, layer_name: str) -> bool:
        """Whether this step's attention of `layer_name` goes through the resolver.

        False on every step without a HOST page: the backend's own path then runs
        untouched (Hybrid's point: no cost without pressure).
        """
        return bool(self.step.host_pages) and layer_name in self.layer_index

    def attend(
        self,
        layer_name: str,
        positions: torch.Tensor,
        req_ids: torch.Tensor,
        block_table: torch.Tensor,
        kv_rows: torch.Tensor,
        stride_rows: int,
        attend_all: Callable[[], torch.Tensor],
        attend_rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """One sparse-MLA layer's attention output with the step's HOST pages resolved.

        positions [T, K]: the indexer's selection per query token (-1 padded);
        req_ids [T]: each token's batch row; block_table: the layer group's block
        ids per batch row (the null block, id 0, for a demoted page); kv_rows
        [N, D]: the layer's cache as rows, block b's row i at b * stride_rows + i.

        `attend_all()` is the backend's own path for the whole batch (its metadata
        describes the whole batch); tokens of requests with HOST pages read the
        null block there, and their outputs are then replaced: `attend_rows(tokens,
        rows)` attends those tokens over `rows` [n, K] of `kv_rows`, same order as
        their selections, -1 where a selection is -1.

        The resolver runs in sub-steps: sub-step j resolves the j-th token of every
        such request in one call, and attention reads it before the next sub-step
        refills the hot slots. A prefill chunk or a multi-token decode may select
        far more distinct rows than a hot buffer holds, one token never more than
        top-K.
        """
        out = attend_all()
        substeps = self._substeps(req_ids)
        if not substeps:
            return out
        hot = self._layer_hot(layer_name, stride_rows, kv_rows.device)
        page_table = self._mixed_page_table(block_table)
        host_table = self._mixed_host_table(page_table.shape[1], kv_rows.device)
        host_rows = self.host_pool[self.layer_index[layer_name]].flatten(0, 1)
        if host_rows.dtype != kv_rows.dtype:
            # The backend may see the cache reinterpreted (e.g. uint8 storage as fp8).
            host_rows = host_rows.view(kv_rows.dtype)
        for tokens, mixed in substeps:
            selected = positions[tokens]
            before = hot.positions[mixed].clone()
            self._stamp += 1
            rows = resolve_topk_slots(
                selected, mixed, page_table, self.block_size, kv_rows, host_rows, host_table,
                hot, self._stamp, block_stride_rows=stride_rows,
            )
            loaded = (before != hot.positions[mixed]).sum()
            pages = selected.long().clamp(min=0) // self.block_size
            on_host = (selected >= 0) & (page_table[mixed.unsqueeze(1), pages] < 0)
            self._rows_loaded += loaded
            self._rows_hit += on_host.sum() - loaded
            out[tokens] = attend_rows(tokens, rows).to(out.dtype)
        return out

    def _substeps(self, req_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tokens, their rows in the stacked hot state) per sub-step; [] without such tokens.

        The same for every layer of the step, so it is computed once per token count.
        """
        key = int(req_ids.numel())
        cached = self._substep_cache.get(key)
        if cached is not None:
            return cached
        mixed_of_batch_row = {
            row: m for m, rid in enumerate(self._mixed) if (row := self._batch_row(rid)) is not None
        }
        rank: dict[int, int] = {}
        by_rank: dict[int, tuple[list[int], list[int]]] = {}
        for t, batch_row in enumerate(req_ids.tolist()):
            m = mixed_of_batch_row.get(batch_row)
            if m is None:
                continue
            j = rank.get(m, 0)
            rank[m] = j + 1
            tokens, mixed = by_rank.setdefault(j, ([], []))
            tokens.append(t)
            mixed.append(m)
        device = req_ids.device
        substeps = [
            (torch.tensor(tokens, dtype=torch.long, device=device),
             torch.tensor(mixed, dtype=torch.long, device=device))
            for tokens, mixed in (by_rank[j] for j in sorted(by_rank))
        ]
        self._substep_cache[key] = substeps
        return substeps

    def _batch_row(self, request_id: str) -> int | None:
        return self.runner.input_batch.req_id_to_index.get(request_id)

    def _mixed_page_table(self, block_table: torch.Tensor) -> torch.Tensor:
        """[M, P] device block of each page of the step's requests with HOST pages, -1 if none."""
        key = (block_table.data_ptr(), tuple(block_table.shape))
        table = self._page_table_cache.get(key)
        if table is None:
            # A request outside this batch gets any row: no token of the batch reads it.
            batch_rows = [self._batch_row(rid) or 0 for rid in self._mixed]
            rows = torch.tensor(batch_rows, dtype=torch.long, device=block_table.device)
            table = block_table[rows].long()
            table[table == 0] = -1  # the null block: the page is not resident
            self._page_table_cache[key] = table
        return table

    def _mixed_host_table(self, num_pages: int, device: torch.device) -> torch.Tensor:
        """[M, P] host page holding each page of the step's requests with HOST pages, -1 if none."""
        table = self._host_table_cache.get(num_pages)
        if table is None:
            table = torch.full((len(self._mixed), num_pages), -1, dtype=torch.long)
            for m, rid in enumerate(self._mixed):
                for page, host_page in self.step.host_pages[rid].items():
                    if page < num_pages:
                        table[m, page] = host_page
            table = table.to(device)
            self._host_table_cache[num_pages] = table
        return table

    def _layer_hot(self, layer_name: str, stride_rows: int, device: torch.device) -> HotState:
        """The layer's hot state for the step's requests with HOST pages, one row each.

        A request keeps its rows, held positions and stamps from earlier steps while
        its lease is unchanged; a new or changed lease starts empty.
        """
        held = self._hot.get(layer_name)
        if held is not None and held.serial == self._serial:
            return held.state
        group = self.mla_group_ids.index(self.group_of_layer[layer_name])
        leases = [self.step.hot_blocks[rid] for rid in self._mixed]
        offsets = torch.arange(self.block_size)
        rows = torch.stack([
            torch.cat([offsets + b * stride_rows for b in lease[group]])[: self.hot_rows]
            for lease in leases
        ]).long().to(device)
        state = HotState(rows, torch.full_like(rows, -1), torch.full_like(rows, -1))
        if held is not None:
            keep = [
                (m, held.index[rid]) for m, rid in enumerate(self._mixed)
                if rid in held.index and held.leases[held.index[rid]] == leases[m]
            ]
            if keep:
                new, old = (torch.tensor(c, dtype=torch.long, device=device) for c in zip(*keep, strict=True))
                state.positions[new] = held.state.positions[old]
                state.stamps[new] = held.state.stamps[old]
        self._hot[layer_name] = _LayerHot(
            self._serial, state, {rid: m for m, rid in enumerate(self._mixed)}, leases
        )
        return state


# The worker whose step is running in this process, for the attention backend.
_active: HiSparseWorker | None = None


def active_hisparse_worker() -> HiSparseWorker | None:
    return _active


def _empty_output():
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    return EMPTY_MODEL_RUNNER_OUTPUT


def attach_hisparse_worker(runner: Any, kv_caches: dict[str, torch.Tensor]) -> HiSparseWorker | None:
    """The runner's HiSparse executor when `hisparse_config` is set and plans can run here."""
    if runner.vllm_config.attention_config.hisparse_config is None:
        return None
    if not scheduling.plans_executable():
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
    return HiSparseWorker(
        runner,
        kv_caches,
        group_of_layer,
        hot_rows=config.device_buffer_size,
        num_host_pages=host_pool_pages(runner.vllm_config),
    )


def _check_layers_resolve(runner: Any, layers: Iterable[str]) -> None:
    """Refuse, before the host pool is allocated, a managed layer whose backend would not resolve."""
    from vllm.v1.hisparse.sparse_mla import RESOLVING_BACKENDS, impl_resolves

    context = runner.vllm_config.compilation_config.static_forward_context
    for name in layers:
        impl = getattr(context.get(name), "impl", None)
        if impl is None or not impl_resolves(impl):
            raise RuntimeError(
                f"Hybrid HiSparse: layer {name} attends through {type(impl).__name__}, which "
                f"does not resolve pages in the host pool; start with --attention-backend one "
                f"of {', '.join(RESOLVING_BACKENDS[1:])}, or without hisparse_config"
            )
