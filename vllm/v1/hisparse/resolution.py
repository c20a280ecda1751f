# SPDX-License-Identifier: Apache-2.0
"""Hybrid HiSparse resolution on the worker: the hot buffers and a step's resolved rows.

Owns, per worker:
- the step's residency view for the sparse-MLA backends (`StepResidency`): per
  request its HOST pages and hot-buffer rows;
- per layer, the hot state the resolver keeps across steps for the requests
  with HOST pages (slot rows, held positions, LRU stamps);
- `attend`: a layer's attention with those requests' tokens resolved, for the
  backends wrapped by `vllm/v1/hisparse/sparse_mla.py`, and the rows-loaded
  and hot-hit counters it keeps on the cache's device;
- which resolution, if any, is active in this process (`active_resolution`),
  and the marker a resolving backend carries (`impl_resolves`).

It reads the host pool and writes hot-buffer rows of the KV cache through the
resolver; it never copies pages, and never changes block tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.v1.hisparse.resolver import HotState, resolve_topk_slots

# The attribute a backend's resolving forward_mqa carries (see sparse_mla.py).
RESOLVING_MARKER = "resolves_through_hisparse"


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


class HiSparseResolution:
    """The hot buffers of one worker's sparse-MLA layers and the step's view of residency."""

    def __init__(
        self,
        runner: Any,
        group_of_layer: dict[str, int],
        block_size: int,
        hot_rows: int,
        host_pool: torch.Tensor,
    ) -> None:
        """`group_of_layer`: the KV cache group of each managed layer, in host pool
        order; `host_pool`: [layer, host page, block_size, width]."""
        self.runner = runner
        self.group_of_layer = dict(group_of_layer)
        self.mla_group_ids = tuple(sorted(set(self.group_of_layer.values())))
        self.layer_index = {name: i for i, name in enumerate(self.group_of_layer)}
        self.block_size = block_size
        self.hot_rows = hot_rows
        self.host_pool = host_pool
        self.step = StepResidency()
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
        self._rows_loaded = torch.zeros((), dtype=torch.long, device=host_pool.device)
        self._rows_hit = torch.zeros((), dtype=torch.long, device=host_pool.device)

    def start_step(self, step: StepResidency) -> None:
        """This step's residency view; hot state carries over for unchanged leases."""
        global _active
        _active = self
        self.step = step
        self._serial += 1
        self._mixed = list(step.host_pages)
        self._substep_cache.clear()
        self._page_table_cache.clear()
        self._host_table_cache.clear()

    def end_step(self) -> tuple[int, int]:
        """(rows loaded, hot hits) of the step; forwards outside a step read everything in place."""
        global _active
        _active = None
        counts = int(self._rows_loaded), int(self._rows_hit)
        self._rows_loaded.zero_()
        self._rows_hit.zero_()
        return counts

    def forget(self, request_id: str) -> None:
        """A finished or preempted request's hot rows may be reused: never keep them."""
        for held in self._hot.values():
            held.index.pop(request_id, None)

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


# The resolution whose step is running in this process, for the attention backends.
_active: HiSparseResolution | None = None


def active_resolution() -> HiSparseResolution | None:
    return _active


def impl_resolves(impl: Any) -> bool:
    """Whether a layer's attention impl resolves HOST pages through HiSparse."""
    return bool(getattr(type(impl).forward_mqa, RESOLVING_MARKER, False))
