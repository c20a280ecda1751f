# SPDX-License-Identifier: Apache-2.0
"""Hybrid HiSparse resolution on the worker: hot buffers, and each step's resolved rows.

Owns, per worker:
- the residency maps the resolver reads, kept up to date from the plans'
  deltas: per request its HOST pages (a row of `host_page_table`, page index ->
  host page) and its hot lease (blocks per sparse-MLA group);
- per top-K selection (a layer that runs its indexer, with the layers that
  reuse its top-K, see `topk_owner_of_layer`), the hot state kept across steps
  (held position and LRU stamp of every slot);
- the step's staging rows (blocks the scheduler leased for this step only);
- `resolve_rows`: the rows one sparse-MLA layer reads this step, pass by pass.
  The first layer of a selection plans the step (`plan_resolution`, once for
  all query tokens of all requests; as passes, `plan_passes`, when a request's
  selections may not fit its hot and staging rows at once); every layer replays
  the plans over its own cache, copying its misses from the host pool
  (`apply_resolution`), one attention call per pass (`sparse_mla.py`);
- counters (rows loaded, hot hits) and the error bits, the step's and each
  request's own, kept as tensors on the cache's device and read once per step
  by the worker's reports (`end_step` hands them over);
- which resolution, if any, is active in this process (`active_resolution`),
  and the marker a resolving backend carries (`impl_resolves`).

On a step where no scheduled request has HOST pages it does nothing: the
backend's own conversion stands. It reads the host pool and writes hot and
staging rows of the KV cache; it never copies pages and never changes block
tables.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm.v1.hisparse.plan import (
    DEVICE_COUNTERS,
    HOST_COUNTERS,
    NOT_ON_HOST,
    HostPageRun,
    HotLeaseUpdate,
    StepStaging,
)
from vllm.v1.hisparse.resolver import (
    HotState,
    ResolutionPlan,
    apply_resolution,
    partition_passes,
    plan_passes,
    plan_resolution,
)

# The attribute a backend's resolving forward_mqa carries (see sparse_mla.py).
RESOLVING_MARKER = "resolves_through_hisparse"
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def host_to_device(
    values: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Host values (int64) on `device` without the host waiting for the device.

    Built on the host, pinned on CUDA and copied with `non_blocking`: a copy from pageable
    memory would make the host wait for the stream. Torch's pinned-memory allocator keeps
    the buffer until its copy has run, so the caller may drop it at once.
    """
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int64)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def topk_owner_of_layer(layers: Iterable[str], indexer_layers: Iterable[str]) -> dict[str, int]:
    """For each sparse-MLA layer, the decoder layer whose indexer computed its top-K.

    A layer with its own indexer owns its selection; a layer without one reuses
    the top-K buffer the nearest earlier indexer layer wrote (IndexCache:
    `index_topk_freq`, `index_topk_pattern`). Layers with one owner share one
    resolution plan per step.
    """
    with_indexer = sorted(_layer_index(name) for name in indexer_layers)
    owners: dict[str, int] = {}
    for name in layers:
        index = _layer_index(name)
        earlier = [i for i in with_indexer if i <= index]
        owners[name] = earlier[-1] if earlier else index
    return owners


def _layer_index(name: str) -> int:
    match = _LAYER_INDEX.search(name)
    if match is None:
        raise ValueError(f"cannot tell the decoder layer of KV cache layer {name!r}")
    return int(match[1])


class HiSparseResolution:
    """The resolver state of one worker's sparse-MLA layers."""

    def __init__(
        self,
        runner: Any,
        group_of_layer: dict[str, int],
        topk_owner: dict[str, int],
        block_size: int,
        hot_rows: int,
        host_pool: torch.Tensor,
        device: torch.device,
        max_pages: int,
        capacity: int = 8,
    ) -> None:
        """`group_of_layer`: each managed layer's KV cache group, in host pool order;
        `topk_owner`: see `topk_owner_of_layer`; `host_pool`: [layer, host page,
        block_size, width]; `max_pages`: pages of the longest request."""
        self.runner = runner
        self.group_of_layer = dict(group_of_layer)
        self.mla_group_ids = tuple(sorted(set(self.group_of_layer.values())))
        self.layer_index = {name: i for i, name in enumerate(self.group_of_layer)}
        self.topk_owner = dict(topk_owner)
        # Per top-K owner, the last of this worker's layers that reads its plans: they are
        # freed once it has resolved its last pass (decoder layers run in index order).
        self._last_layer_of_owner: dict[int, str] = {}
        for name in sorted(self.group_of_layer, key=_layer_index):
            if name in self.topk_owner:
                self._last_layer_of_owner[self.topk_owner[name]] = name
        self.block_size = block_size
        self.hot_rows = hot_rows
        self.host_pool = host_pool
        self.device = device
        self.max_pages = max_pages
        # Request -> its row of the tables below (rows of ended requests are reused).
        self._row: dict[str, int] = {}
        self._free_rows: list[int] = []
        self.host_page_table = torch.full((0, max_pages), -1, dtype=torch.int64, device=device)
        # Per sparse-MLA group: the first block of each page of every request's hot lease.
        self._lease_blocks = {
            g: torch.zeros((0, self._lease_pages()), dtype=torch.int64, device=device)
            for g in self.mla_group_ids
        }
        self._hot: dict[int, HotState] = {}  # top-K owner -> hot state, one row per table row
        self._with_host_pages: set[str] = set()
        # Request -> the page indices of its HOST pages (the host's copy of its table row).
        self._host_pages_of: dict[str, set[int]] = {}
        self._grow(capacity)
        self._stamp = 0
        self._num_scheduled_tokens: dict[str, int] = {}
        self._staging: dict[str, StepStaging] = {}
        self._step_state: _Step | None = None
        # Counted on the device, read once per step by the worker.
        self._device_counts = torch.zeros(len(DEVICE_COUNTERS), dtype=torch.int64, device=device)
        self.error = torch.zeros((), dtype=torch.int64, device=device)
        # Counted on the host: work items per step (they predict GPU cost where time cannot).
        self.counts = dict.fromkeys(HOST_COUNTERS, 0)
        self._resolved_layers: dict[str, int] = {}
        # The error bits each of the step's requests with HOST pages raised on its own.
        self._request_errors: torch.Tensor | None = None

    # -- the maps, from the plans' deltas -------------------------------------------

    def forget(self, request_id: str) -> None:
        """A finished or preempted request: its rows and hot state are free for reuse."""
        row = self._row.pop(request_id, None)
        if row is None:
            return
        self._with_host_pages.discard(request_id)
        self._host_pages_of.pop(request_id, None)
        self.host_page_table[row] = -1
        for hot in self._hot.values():
            hot.positions[row] = -1
            hot.stamps[row] = -1
        self._free_rows.append(row)

    def update(
        self,
        host_pages: Iterable[HostPageRun],
        leases: Iterable[HotLeaseUpdate],
        staging: Iterable[StepStaging],
    ) -> None:
        """Apply a plan's residency deltas before the step's forward: one non-blocking copy
        of each table's changed entries, nothing read back."""
        new_leases = {self._row_of(lease.request_id): lease.block_ids for lease in leases}
        if new_leases:
            rows = host_to_device(list(new_leases), self.device)
            for column, g in enumerate(self.mla_group_ids):
                blocks = host_to_device([block_ids[column] for block_ids in new_leases.values()], self.device)
                self._lease_blocks[g].index_copy_(0, rows, blocks)
            for hot in self._hot.values():  # a new lease starts empty
                hot.positions.index_fill_(0, rows, -1)
                hot.stamps.index_fill_(0, rows, -1)
        # In order, the last update of a page standing (a page may be restored and demoted
        # again within one plan).
        latest: dict[tuple[int, int], int] = {}
        for run in host_pages:
            row = self._row_of(run.request_id)
            held = self._host_pages_of.setdefault(run.request_id, set())
            for page_index, host_page in run.pages():
                latest[(row, page_index)] = host_page
                if host_page == NOT_ON_HOST:
                    held.discard(page_index)
                else:
                    held.add(page_index)
            if held:
                self._with_host_pages.add(run.request_id)
            else:
                self._with_host_pages.discard(run.request_id)
        if latest:
            latest_rows, latest_pages = zip(*latest, strict=True)
            self.host_page_table.index_put_(
                (host_to_device(latest_rows, self.device), host_to_device(latest_pages, self.device)),
                host_to_device(list(latest.values()), self.device),
            )
        self._staging = {entry.request_id: entry for entry in staging}

    def _row_of(self, request_id: str) -> int:
        row = self._row.get(request_id)
        if row is None:
            if not self._free_rows:
                self._grow(2 * len(self._lease_blocks[self.mla_group_ids[0]]))
            row = self._free_rows.pop()
            self._row[request_id] = row
        return row

    def _lease_pages(self) -> int:
        return -(-self.hot_rows // self.block_size)

    def _grow(self, capacity: int) -> None:
        old = self.host_page_table.shape[0]
        if capacity <= old:
            return
        extra = capacity - old
        self.host_page_table = torch.cat(
            [self.host_page_table, self.host_page_table.new_full((extra, self.max_pages), -1)]
        )
        for g, blocks in self._lease_blocks.items():
            self._lease_blocks[g] = torch.cat([blocks, blocks.new_zeros((extra, blocks.shape[1]))])
        for owner, hot in self._hot.items():
            grown = HotState.empty(extra, self.hot_rows, self.device)
            self._hot[owner] = HotState(
                torch.cat([hot.positions, grown.positions]), torch.cat([hot.stamps, grown.stamps])
            )
        self._free_rows.extend(range(capacity - 1, old - 1, -1))

    # -- per step ------------------------------------------------------------------

    def start_step(self, num_scheduled_tokens: dict[str, int] | None = None) -> None:
        """A step begins, after the plan's deltas. `num_scheduled_tokens`: each request's
        tokens in the step (the scheduler's), which sizes the fused plan on CUDA."""
        global _active
        self._step_state = None
        self._num_scheduled_tokens = num_scheduled_tokens or {}
        self._stamp += 1
        self._resolved_layers.clear()
        _active = self

    def end_step(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, int], StepRequestErrors]:
        """The step's device counters (DEVICE_COUNTERS) and error bits, as tensors, its host
        counters, and the error bits each request raised on its own (the request ids, and a
        tensor of their words); counting restarts. Forwards outside a step read everything
        in place."""
        global _active
        _active = None
        step = self._step_state
        request_errors = StepRequestErrors(
            step.request_ids if step is not None and step.request_error is not None else [],
            step.request_error if step is not None else None,
        )
        self._step_state = None
        self.counts["worker_steps"] += 1
        if self.counts["attention_calls"]:
            self.counts["forward_steps"] += 1
        if self._resolved_layers:
            self.counts["resolving_steps"] += 1
            self.counts["max_resolver_calls_per_layer_step"] = max(self._resolved_layers.values())
        device, error, host = self._device_counts, self.error, self.counts
        self._device_counts = torch.zeros_like(device)
        self.error = torch.zeros_like(error)
        self.counts = dict.fromkeys(HOST_COUNTERS, 0)
        return device, error, host, request_errors

    def resolves(self, layer_name: str) -> bool:
        """Whether this step's attention of `layer_name` goes through the resolver.

        False for a layer HiSparse does not manage, and on every step whose batch
        has no request with HOST pages: the backend's own path then runs
        untouched (Hybrid's point: no cost without pressure).
        """
        if layer_name not in self.layer_index:
            return False
        self.counts["attention_calls"] += 1
        return bool(self._with_host_pages) and self._step().requests.numel() > 0

    def resolve_rows(
        self,
        layer_name: str,
        positions: torch.Tensor,
        batch_rows: torch.Tensor,
        rows: torch.Tensor,
        kv_rows: torch.Tensor,
        stride_rows: int,
        index_stride: int | None = None,
        pass_index: int = 0,
    ) -> torch.Tensor:
        """The rows one sparse-MLA layer reads in one pass of this step, HOST pages resolved.

        positions [T, K]: the indexer's selection per query token (-1 padded);
        batch_rows [T]: each token's batch row; rows [T, K]: the backend's own
        conversion of the selection, block b's token i at b * index_stride + i
        (HOST pages point at the null block there; default stride_rows);
        kv_rows: the layer's cache as rows, block b's token i at
        b * stride_rows + i. Misses are copied into kv_rows. Only the tokens of
        `pass_index` (`pass_of_token`) read right rows from this call's result.
        """
        step = self._step()
        owner = self.topk_owner[layer_name]
        # The plans cover only the tokens of requests with HOST pages (a decode or a chunk
        # of a resident request would only add entries that resolve in place). Their
        # ranges in the batch are known on the host (one non-blocking index copy); where
        # they are not (a forward outside a scheduled step), CPU tensors find them with a
        # count and CUDA tensors plan the batch's whole fixed shape.
        planned = step.planned_tokens(rows.shape[0])
        tokens: torch.Tensor | None
        if planned is not None:
            tokens, token_requests = planned
            if step.plans_whole_batch(rows.shape[0]):
                tokens = None  # every token is planned, in order: no gather
            else:
                positions = positions[tokens]
        else:
            token_requests = step.token_requests(batch_rows)
            tokens = None if positions.is_cuda else step.tokens_with_host_pages(batch_rows, token_requests)
            if tokens is not None:
                positions, token_requests = positions[tokens], token_requests[tokens]
        passes = step.passes.get(owner)
        if passes is None:
            passes = step.passes[owner] = self._plan(step, owner, positions, token_requests)
            step.num_passes[owner] = len(passes)
            if len(passes) > 1:
                pass_of_token = torch.zeros(rows.shape[0], dtype=torch.int64, device=rows.device)
                for p, (pass_tokens, _) in enumerate(passes[1:], start=1):
                    pass_of_token[pass_tokens if tokens is None else tokens[pass_tokens]] = p
                step.pass_of_token[owner] = pass_of_token
            step.plan_bytes[owner] = sum(plan_nbytes(plan) for _, plan in passes)
            step.live_plan_bytes += step.plan_bytes[owner]
            self.counts["max_plan_bytes"] = max(self.counts["max_plan_bytes"], step.live_plan_bytes)
        pass_tokens, plan = passes[pass_index]
        if pass_index == len(passes) - 1 and self._last_layer_of_owner.get(owner) == layer_name:
            # The last layer that reads these plans: they go once its copies are queued.
            del step.passes[owner]
            step.live_plan_bytes -= step.plan_bytes.pop(owner)
        group = self.group_of_layer[layer_name]
        leases = self._lease_blocks[group]
        copy_rows = step.slot_rows(group, stride_rows, leases, self.block_size, self.hot_rows)
        index_stride = stride_rows if index_stride is None else index_stride
        slot_rows = step.slot_rows(group, index_stride, leases, self.block_size, self.hot_rows)
        host_rows = self.host_pool[self.layer_index[layer_name]].flatten(0, 1)
        if host_rows.dtype != kv_rows.dtype:
            # The backend may see the cache reinterpreted (e.g. uint8 storage as fp8).
            host_rows = host_rows.view(kv_rows.dtype)
        self._device_counts += plan.counts
        self.counts["resolver_calls"] += 1
        self.counts["extra_attention_passes"] += pass_index > 0
        self._resolved_layers[layer_name] = self._resolved_layers.get(layer_name, 0) + 1

        def replay(pass_rows: torch.Tensor) -> torch.Tensor:
            return apply_resolution(
                plan,
                pass_rows,
                slot_rows,
                kv_rows,
                host_rows,
                copy_rows,
                self.error,
                stride_rows,
                self.block_size,
            )

        if tokens is None:
            if len(passes) == 1:
                return replay(rows)
            selected = pass_tokens
        else:
            selected = tokens[pass_tokens]  # the pass's tokens among the call's
        resolved = rows.clone()
        resolved[selected] = replay(rows[selected])
        return resolved

    def _plan(
        self, step: _Step, owner: int, positions: torch.Tensor, token_requests: torch.Tensor
    ) -> list[tuple[torch.Tensor, ResolutionPlan]]:
        """Plan one top-K selection's step: one pass, or passes when what some request may
        select, its tokens x top-K or its HOST rows if fewer, exceeds its hot and staging
        rows. That bound is known on the host, so a step within it reads nothing back; a
        step beyond it reads its run boundaries back (`partitioned_plans`). Returns
        (tokens, plan) per pass; tokens index the planned ones."""
        hot = self._hot.get(owner)
        if hot is None:
            hot = self._hot[owner] = HotState.empty(len(self.host_page_table), self.hot_rows, self.device)
        active = HotState(hot.positions[step.requests], hot.stamps[step.requests])
        topk = positions.shape[1]
        may_overflow = any(
            min(self._num_scheduled_tokens.get(rid, 0) * topk, self.num_host_rows(rid))
            > self.hot_rows + slots
            for rid, slots in zip(step.request_ids, step.staging_counts, strict=True)
        )
        token_pass: torch.Tensor | None = None
        num_passes = 1
        if may_overflow:
            self.counts["partitioned_plans"] += 1
            token_pass, num_passes = partition_passes(
                positions,
                token_requests,
                self.host_page_table,
                step.requests,
                self.block_size,
                [self.hot_rows + n for n in step.staging_counts],
            )
        if num_passes == 1:
            plan = plan_resolution(
                positions,
                token_requests,
                self.host_page_table,
                self.block_size,
                active,
                step.staging_slots,
                self._stamp,
                table_rows=step.requests,
                max_tokens_per_request=step.max_tokens_per_request,
            )
            passes = [(torch.arange(positions.shape[0], device=positions.device), plan)]
        else:
            assert token_pass is not None
            passes = plan_passes(
                positions,
                token_requests,
                self.host_page_table,
                self.block_size,
                active,
                step.staging_slots,
                self._stamp,
                step.requests,
                token_pass,
                num_passes,
            )
        hot.positions[step.requests] = active.positions
        hot.stamps[step.requests] = active.stamps
        for _, plan in passes:
            self.error |= plan.error
            step.request_error = (
                plan.request_error
                if step.request_error is None
                else (step.request_error | plan.request_error)
            )
        self.counts["resolution_plans"] += len(passes)
        return passes

    def num_host_rows(self, request_id: str) -> int:
        """Rows of the request's HOST pages: the most distinct rows its step can stage."""
        return len(self._host_pages_of.get(request_id, ())) * self.block_size

    def num_passes(self, layer_name: str) -> int:
        """How many passes this step's attention of `layer_name` takes (1 before it resolved)."""
        step = self._step_state
        return step.num_passes.get(self.topk_owner[layer_name], 1) if step is not None else 1

    def pass_of_token(self, layer_name: str) -> torch.Tensor:
        """[T] the pass each of the layer's query tokens reads its rows in (0: the first)."""
        assert self._step_state is not None
        return self._step_state.pass_of_token[self.topk_owner[layer_name]]

    def _step(self) -> _Step:
        if self._step_state is None:
            input_batch = self.runner.input_batch
            batch = input_batch.req_id_to_index
            mixed = sorted((rid for rid in self._with_host_pages if rid in batch), key=batch.__getitem__)
            step = self._step_state = _Step(self, mixed, [batch[rid] for rid in mixed])
            known = [n for rid in mixed if (n := self._num_scheduled_tokens.get(rid)) is not None]
            # Known for every request with HOST pages (from the scheduler), else unknown.
            step.max_tokens_per_request = max(known, default=1) if len(known) == len(mixed) else None
            # The batch lays out each request's tokens in batch order (the runner's
            # query_start_loc): the ranges of the requests with HOST pages follow from the
            # scheduler's counts.
            order = list(getattr(input_batch, "req_ids", ()))
            counts = [n for rid in order if (n := self._num_scheduled_tokens.get(rid)) is not None]
            if mixed and order and len(counts) == len(order):
                starts = dict(zip(order, itertools.accumulate([0, *counts[:-1]]), strict=True))
                step.set_token_ranges(
                    [(starts[rid], self._num_scheduled_tokens[rid]) for rid in mixed], sum(counts)
                )
        return self._step_state


@dataclass
class StepRequestErrors:
    """The error bits each request with HOST pages raised on its own in one step."""

    request_ids: list[str]
    words: torch.Tensor | None  # [len(request_ids)] int64, on the cache's device


class _Step:
    """What every layer of one step shares: its requests with HOST pages, their slots, plans."""

    def __init__(self, resolution: HiSparseResolution, request_ids: list[str], batch_rows: list[int]) -> None:
        device = resolution.device
        self.request_ids = request_ids
        self.requests = host_to_device([resolution._row[rid] for rid in request_ids], device)
        self._batch_rows = batch_rows
        staging = [resolution._staging.get(rid) for rid in request_ids]
        self.staging_counts = [s.num_slots if s else 0 for s in staging]
        self.staging_slots = host_to_device(self.staging_counts, device)
        self._staging = staging
        self._mla_group_ids = resolution.mla_group_ids
        self._device = device
        self._token_requests: dict[tuple[int, int], torch.Tensor] = {}
        self._tokens: dict[tuple[int, int], torch.Tensor] = {}
        self._slot_rows: dict[tuple[int, int], torch.Tensor] = {}
        # Per top-K owner: (tokens, plan) of each pass, and the pass of every query token.
        self.passes: dict[int, list[tuple[torch.Tensor, ResolutionPlan]]] = {}
        self.pass_of_token: dict[int, torch.Tensor] = {}
        self.num_passes: dict[int, int] = {}
        # Bytes of each owner's live plans, and of all of them (freed after the last layer).
        self.plan_bytes: dict[int, int] = {}
        self.live_plan_bytes = 0
        # The tokens of the requests with HOST pages, from ranges known on the host.
        self._planned: tuple[torch.Tensor, torch.Tensor] | None = None
        self._planned_end = 0  # one past the last planned token
        self._batch_tokens = 0
        self.max_tokens_per_request: int | None = None
        # [M]: the error bits each request raised on its own in this step's plans.
        self.request_error: torch.Tensor | None = None

    def set_token_ranges(self, ranges: list[tuple[int, int]], batch_tokens: int) -> None:
        """(start, tokens) in the batch of each request with HOST pages, in row order."""
        starts = torch.tensor([start for start, _ in ranges], dtype=torch.int64)
        counts = torch.tensor([n for _, n in ranges], dtype=torch.int64)
        of_request = torch.repeat_interleave(torch.arange(len(ranges)), counts)
        # Token k of the planned ones is its request's start plus its rank within the request.
        first = torch.cumsum(counts, 0) - counts
        index = starts[of_request] + torch.arange(int(counts.sum())) - first[of_request]
        self._planned = (host_to_device(index, self._device), host_to_device(of_request, self._device))
        self._planned_end = max((start + n for start, n in ranges), default=0)
        self._batch_tokens = batch_tokens

    def planned_tokens(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(tokens, their request rows) of the requests with HOST pages among a call's
        `num_tokens` (the batch's, maybe padded); None where the ranges are unknown."""
        if self._planned is None or num_tokens < self._batch_tokens or num_tokens < self._planned_end:
            return None
        return self._planned

    def plans_whole_batch(self, num_tokens: int) -> bool:
        """Whether the planned tokens are exactly a call's `num_tokens`, in order."""
        return self._planned is not None and num_tokens == self._batch_tokens == self._planned[0].shape[0]

    def token_requests(self, batch_rows: torch.Tensor) -> torch.Tensor:
        """Each token's request row in this step's tables, -1 for requests without HOST pages."""
        key = (batch_rows.data_ptr(), batch_rows.numel())
        found = self._token_requests.get(key)
        if found is None:
            size = max(self._batch_rows, default=-1) + 1
            of_batch_row = torch.full((size + 1,), -1, dtype=torch.int64, device=self._device)
            rows = host_to_device(self._batch_rows, self._device)
            of_batch_row[rows] = torch.arange(len(self._batch_rows), device=self._device)
            found = of_batch_row[batch_rows.long().clamp(max=size)]
            self._token_requests[key] = found
        return found

    def tokens_with_host_pages(self, batch_rows: torch.Tensor, token_requests: torch.Tensor) -> torch.Tensor:
        """Indices of the tokens whose request has HOST pages (host tensors only: a count)."""
        key = (batch_rows.data_ptr(), batch_rows.numel())
        found = self._tokens.get(key)
        if found is None:
            found = self._tokens[key] = torch.nonzero(token_requests >= 0).squeeze(1)
        return found

    def slot_rows(
        self, group: int, stride_rows: int, lease_blocks: torch.Tensor, block_size: int, hot_rows: int
    ) -> torch.Tensor:
        """[M, H + S] rows of the hot and staging slots of the step's requests, in one layer group."""
        key = (group, stride_rows)
        found = self._slot_rows.get(key)
        if found is None:
            column = self._mla_group_ids.index(group)
            offsets = torch.arange(block_size, device=self._device)
            hot = (lease_blocks[self.requests].unsqueeze(-1) * stride_rows + offsets).flatten(1)[:, :hot_rows]
            widest = max((s.num_slots for s in self._staging if s), default=0)
            staged = torch.zeros((len(self._staging), widest), dtype=torch.int64, device=self._device)
            for m, entry in enumerate(self._staging):
                if entry is not None:
                    blocks = host_to_device(entry.block_ids[column], self._device)
                    staged[m, : entry.num_slots] = (blocks.unsqueeze(-1) * stride_rows + offsets).flatten()
            found = self._slot_rows[key] = torch.cat([hot, staged], dim=1)
        return found


def plan_nbytes(plan: ResolutionPlan) -> int:
    """Bytes a plan holds (its tensors may share storage, as the fused kernel's do)."""
    storages = {}
    for value in vars(plan).values():
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


# The resolution whose step is running in this process, for the attention backends.
_active: HiSparseResolution | None = None


def active_resolution() -> HiSparseResolution | None:
    return _active


def impl_resolves(impl: Any) -> bool:
    """Whether a layer's attention impl resolves HOST pages through HiSparse."""
    return bool(getattr(type(impl).forward_mqa, RESOLVING_MARKER, False))


# Bytes of a plan per (token x top-K) entry: two bool masks and five int64 arrays.
PLAN_BYTES_PER_ENTRY = 42
# The most that planning (the torch operations, with the gathered selections) or one
# layer's replay holds beside the live plans, per entry; the CUDA row copy allocates
# nothing (the CPU reference copy adds its copied rows, see `plan_memory_bound`).
WORK_BYTES_PER_ENTRY = 48


# Bytes planning holds per hot slot of the step's requests (a dozen [M, H] int64 arrays:
# the held keys, their sort, the LRU order).
HOT_WORK_BYTES_PER_SLOT = 96


def plan_memory_bound(
    planned_tokens: int,
    topk: int,
    num_requests: int,
    batch_tokens: int,
    hot_rows: int,
    copied_rows: int = 0,
    row_bytes: int = 0,
) -> int:
    """The most bytes the resolution allocates at once in one step, beyond its standing
    state (docs/architecture.md, "Plan memory"). E = planned_tokens x topk entries (the
    tokens of the step's M requests with HOST pages: their plans are the only ones made),
    B = batch_tokens x topk (a layer's call: its resolved rows), H = hot_rows. One top-K
    owner's plans live at a time:

        42 E + 8 M + 32  (the plans)  +  48 E + 96 M H  (planning or replay)  +  8 B

    plus, for the CPU reference copy only, 40 + row_bytes per row it copies in one layer."""
    entries, batch = planned_tokens * topk, batch_tokens * topk
    plans = PLAN_BYTES_PER_ENTRY * entries + 8 * num_requests + 32
    work = WORK_BYTES_PER_ENTRY * entries + HOT_WORK_BYTES_PER_SLOT * num_requests * hot_rows
    return plans + work + 8 * batch + copied_rows * (40 + row_bytes)


def standing_state_bytes(
    table_rows: int, hot_rows: int, num_owners: int, max_pages: int, lease_pages: int
) -> int:
    """Bytes of the resolution's state kept across steps: the host page table, each owner's
    hot state (positions and stamps) and the lease table, for `table_rows` request rows."""
    return table_rows * (8 * max_pages + 16 * hot_rows * num_owners + 8 * lease_pages)
