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
- the step's residency view for the sparse-MLA backend (`StepResidency`): per
  request its HOST pages and hot-buffer rows, and per request and layer the hot
  state the resolver keeps across steps;
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
    from collections.abc import Sequence

    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.hisparse.residency import PageCopy
    from vllm.v1.hisparse.scheduling import HiSparseStepPlan, PageRestore
    from vllm.v1.outputs import ModelRunnerOutput

logger = init_logger(__name__)


@dataclass
class _HotRows:
    """One request's hot buffer in one layer: physical rows, held positions, LRU stamps."""

    lease: tuple[tuple[int, ...], ...]
    rows: torch.Tensor
    positions: torch.Tensor
    stamps: torch.Tensor


@dataclass
class StepResidency:
    """What the sparse-MLA backend needs this step, per request id."""

    host_pages: dict[str, dict[int, int]] = field(default_factory=dict)  # page index -> host page
    # Hot-lease blocks, one tuple per sparse-MLA group in the plan's group order.
    hot_blocks: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)


class HiSparseWorker:
    """The worker-side executor of Hybrid HiSparse plans for one model runner."""

    def __init__(self, runner: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        vllm_config = runner.vllm_config
        config = vllm_config.attention_config.hisparse_config
        assert config is not None and config.device_buffer_size is not None
        groups = runner.kv_cache_config.kv_cache_groups
        # The layers whose pages move; the resident group (indexer, MTP drafter) reads in place.
        self.group_of_layer: dict[str, int] = {
            name: g for g in hisparse_managed_group_ids(groups) for name in groups[g].layer_names
        }
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
        self.hot_rows = config.device_buffer_size
        num_host_pages = host_pool_pages(vllm_config)
        pin = first.is_cuda
        self.host_pool = torch.empty(
            (len(self.layers), num_host_pages, self.block_size, width),
            dtype=first.dtype,
            pin_memory=pin,
        )
        self.runner = runner
        self.step = StepResidency()
        self._plan: HiSparseStepPlan | None = None
        self._hot: dict[tuple[str, str], _HotRows] = {}  # (request id, layer) -> hot rows
        self._stamp = 0
        self.rows_loaded = 0
        self.rows_hit = 0
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
        output.hisparse_rows_loaded = self.rows_loaded
        output.hisparse_rows_hit = self.rows_hit
        self.rows_loaded = self.rows_hit = 0
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
        for key in [k for k in self._hot if k[0] == request_id]:
            del self._hot[key]

    # -- the resolver, for the sparse-MLA backend ----------------------------------

    def resolves(self, layer_name: str) -> bool:
        """Whether this step's attention of `layer_name` goes through the resolver."""
        return bool(self.step.host_pages) and layer_name in self.layer_index

    def resolve(
        self,
        layer_name: str,
        positions: torch.Tensor,
        req_ids: torch.Tensor,
        batch_req_ids: list[str],
        block_table: torch.Tensor,
        kv_rows: torch.Tensor,
        stride_rows: int,
    ) -> torch.Tensor:
        """Rows for one query token's selected positions [1, K] (one resolver sub-step).

        `block_table` holds the layer group's block ids per batch row (the null
        block, id 0, for a demoted page).
        """
        row = int(req_ids[0])
        request_id = batch_req_ids[row]
        host = self.step.host_pages.get(request_id)
        if host is None:
            raise AssertionError(f"{request_id} has no HOST page this step")
        num_pages = block_table.shape[1]
        page_table = block_table[row : row + 1].long().clone()
        page_table[page_table == 0] = -1
        host_table = torch.full((1, num_pages), -1, dtype=torch.long)
        for page, host_page in host.items():
            if page < num_pages:
                host_table[0, page] = host_page
        hot = self._hot_rows(request_id, layer_name, stride_rows)
        state = HotState(hot.rows.unsqueeze(0), hot.positions.unsqueeze(0), hot.stamps.unsqueeze(0))
        before = hot.positions.clone()
        self._stamp += 1
        host_rows = self.host_pool[self.layer_index[layer_name]].flatten(0, 1)
        slots = resolve_topk_slots(
            positions,
            torch.zeros(1, dtype=torch.long),
            page_table,
            self.block_size,
            kv_rows,
            host_rows,
            host_table,
            state,
            self._stamp,
            block_stride_rows=stride_rows,
        )
        hot.positions.copy_(state.positions[0])
        hot.stamps.copy_(state.stamps[0])
        loaded = int((before != hot.positions).sum())
        selected = positions[0].long()
        valid = selected >= 0
        on_host = valid & (page_table[0, selected.clamp(min=0) // self.block_size] < 0)
        self.rows_loaded += loaded
        self.rows_hit += int(on_host.sum()) - loaded
        return slots

    def _hot_rows(self, request_id: str, layer_name: str, stride_rows: int) -> _HotRows:
        lease = self.step.hot_blocks[request_id]
        key = (request_id, layer_name)
        hot = self._hot.get(key)
        if hot is None or hot.lease != lease:
            blocks = lease[self.mla_group_ids.index(self.group_of_layer[layer_name])]
            rows = torch.cat([torch.arange(self.block_size) + b * stride_rows for b in blocks])
            rows = rows[: self.hot_rows].long()
            hot = _HotRows(
                lease=lease,
                rows=rows,
                positions=torch.full_like(rows, -1),
                stamps=torch.full_like(rows, -1),
            )
            self._hot[key] = hot
        return hot


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
    return HiSparseWorker(runner, kv_caches)
