# SPDX-License-Identifier: Apache-2.0
"""The Hybrid HiSparse top-K resolver, torch reference: positions -> physical rows.

Owns the semantics every resolver implementation must match exactly: for the
sparse-MLA layers that share one top-K selection and one step, map the
indexer's selected token positions to the rows attention reads, in the same
order, so attention reads exactly the rows it would read with everything
resident. Resolution works on all query tokens of the step at once (decode,
draft verification, prefill chunks), per request:

- a position on a resident page is read in place (the backend's own
  conversion through the block table);
- the request's selected positions on HOST pages form one set, U, for the
  whole step (a position picked by several tokens, or twice by one, is one
  row);
- a position of U held in the request's hot buffer is a hit: its slot's LRU
  stamp becomes this step;
- the other positions of U are misses. Taken in ascending position order, the
  i-th miss goes to the i-th slot of the request's eligible slots, the slots
  holding no position of U ordered by (stamp, slot), empty slots (stamp -1)
  first; the slot then holds that position with this step's stamp;
- misses beyond the eligible slots are staged for this step only: the j-th
  such miss goes to staging slot j, rows the scheduler leased for the step
  (`staging_slots` per request). They never enter the hot state. A step that
  needs more staging slots than it was given is a scheduler accounting error:
  it is counted in `error` and in that request's own `request_error`, not
  silently served (the worker fails that request alone).

Every miss copies one row from the host pool into its slot's row. Decisions
depend only on the selections and the hot state at the start of the step, so
one `ResolutionPlan` serves every layer that shares the selection: each layer
replays it over its own cache, hot-buffer rows and host pool (`apply`); only
the row copies repeat.

Passes. A request's misses fit its hot and staging slots exactly when the
union U of its positions on HOST pages has at most H + S rows (hot rows plus
its staging rows), whatever the hot state holds. A step whose request selects
more (a prefill chunk over a long host-resident context, with staging sized by
a budget rather than by tokens x top-K) is split into passes
(`partition_passes`): each request's tokens, in order, are cut greedily into
the longest runs whose union fits; pass p holds every request's p-th run
(requests that fit at once are all in pass 0). Each pass is planned as a step
of its own over its tokens, the hot state carried from pass to pass
(`plan_passes`), and the layer attends once per pass, keeping each token's
output from its own pass. No row is ever served wrong and the chunk keeps its
length.

The plan is computed with fixed-shape tensor operations (sorts, scans,
scatters over the step's T x K entries), and the row copies take its per-entry
arrays with a mask (`copy_host_rows`: a CUDA kernel on CUDA caches), so nothing
on the path reads a value back from the device; counters and the error flag
stay tensors.

It never allocates hot buffers or host memory; it reads and updates the state
it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm.v1.hisparse.ops import cuda_kernels_available, require_cuda_kernels

# Keys are request * KEY_STRIDE + position: positions stay far below 2**40.
KEY_STRIDE = 1 << 40
# Bits of a step's error word (`ResolutionPlan.error`, the kernels' `error` argument).
# The kernels' bits are csrc/hisparse_errors.h's, kept equal by a test.
ERROR_STAGING_OVERFLOW = 1
ERROR_NOT_IN_HOST_POOL = 2
ERROR_ROW_OUT_OF_BOUNDS = 4
ERROR_PAGE_OUT_OF_BOUNDS = 8
ERROR_REQUEST_OUT_OF_BOUNDS = 16


# The fused plan kernel (csrc/hisparse_plan.h) serves a step whose requests each select
# at most this many entries (tokens x top-K: decode with up to 3 drafts at top-K 2048)
# from a hot buffer of at most this many rows; larger steps use the torch operations.
FUSED_PLAN_MAX_ENTRIES = 8192
FUSED_PLAN_MAX_HOT_ROWS = 8192


class ResolverError(RuntimeError):
    """A step could not be resolved as planned (a scheduler/worker accounting error)."""


@dataclass
class HotState:
    """The hot buffers of the step's requests with HOST pages, for one top-K selection.

    Row m is request m's buffer: `positions[m, s]` is the token position slot s
    holds (-1 empty), `stamps[m, s]` the step that last selected it (-1 never).
    Slot s is the same slot index in every layer that shares the selection;
    each layer maps it to rows of its own cache.
    """

    positions: torch.Tensor  # [M, H] int64
    stamps: torch.Tensor  # [M, H] int64

    @classmethod
    def empty(cls, num_requests: int, hot_slots: int, device: torch.device | str = "cpu") -> HotState:
        positions = torch.full((num_requests, hot_slots), -1, dtype=torch.int64, device=device)
        return cls(positions, positions.clone())

    def validate(self) -> None:
        for name in ("positions", "stamps"):
            tensor = getattr(self, name)
            if tensor.dtype != torch.int64 or tensor.dim() != 2:
                raise ValueError(
                    f"hot state {name} must be 2-D int64, got {tuple(tensor.shape)} {tensor.dtype}"
                )
        if self.positions.shape != self.stamps.shape:
            raise ValueError(
                f"hot state positions {tuple(self.positions.shape)} and stamps "
                f"{tuple(self.stamps.shape)} differ"
            )


@dataclass
class ResolutionPlan:
    """One step's resolution of one top-K selection, to replay for every layer sharing it.

    Entry tensors are [T, K] like the selection; distinct-row tensors are [T * K]
    with `load` masking the rows to copy.
    """

    on_host: torch.Tensor  # [T, K] bool: the entry is a position on a HOST page
    entry_request: torch.Tensor  # [T, K] int64: its request row m (0 where not on host)
    entry_slot: torch.Tensor  # [T, K] int64: its slot, hot (< H) or staging (>= H)
    load: torch.Tensor  # [T * K] bool: this distinct row is copied from the host pool
    load_request: torch.Tensor  # [T * K] int64
    load_slot: torch.Tensor  # [T * K] int64
    load_host_row: torch.Tensor  # [T * K] int64: row of the layer's host pool
    counts: torch.Tensor  # [3] int64: distinct rows copied, found in a hot buffer, staged
    error: torch.Tensor  # [] int64: ERROR_* bits
    # [M] int64: the ERROR_* bits each request raised on its own (staging overflow, a row
    # not in the host pool); bits only `error` has belong to no one request.
    request_error: torch.Tensor

    @property
    def rows_loaded(self) -> torch.Tensor:
        return self.counts[0]

    @property
    def rows_hit(self) -> torch.Tensor:
        return self.counts[1]


def plan_resolution(
    positions: torch.Tensor,
    token_requests: torch.Tensor,
    host_page_table: torch.Tensor,
    block_size: int,
    hot: HotState,
    staging_slots: torch.Tensor,
    step: int,
    table_rows: torch.Tensor | None = None,
    max_tokens_per_request: int | None = None,
) -> ResolutionPlan:
    """Resolve the selections [T, K] (-1 padded) of one step; updates `hot` in place.

    token_requests [T]: each token's request m (a row of `hot`), -1 for a
    request without HOST pages (all its entries are resident).
    host_page_table [R, P]: host page of each HOST page, -1 for a resident page
    (pages past P are resident); request m's row is `table_rows[m]` (default m).
    staging_slots [M]: staging rows leased to each request for this step.
    `step` stamps the slots selected now. `max_tokens_per_request`: the most tokens
    any request has in the step, known on the host; with it, CUDA tensors and the
    extension, a step that fits is planned by the fused kernel (one launch), which
    decides exactly what the operations below decide; its per-entry load arrays mark
    each distinct miss at its first entry rather than in sorted order.
    """
    num_requests = hot.positions.shape[0]
    if table_rows is None:
        table_rows = torch.arange(num_requests, device=positions.device)
    _validate(positions, token_requests, host_page_table, hot, staging_slots, table_rows)
    if max_tokens_per_request is not None and positions.is_cuda and cuda_kernels_available():
        plan = _plan_fused(
            positions,
            token_requests,
            host_page_table,
            block_size,
            hot,
            staging_slots,
            step,
            table_rows,
            max_tokens_per_request,
        )
        if plan is not None:
            return plan
    return _plan_with_torch(
        positions, token_requests, host_page_table, block_size, hot, staging_slots, step, table_rows
    )


def _plan_fused(
    positions: torch.Tensor,
    token_requests: torch.Tensor,
    host_page_table: torch.Tensor,
    block_size: int,
    hot: HotState,
    staging_slots: torch.Tensor,
    step: int,
    table_rows: torch.Tensor,
    max_tokens_per_request: int,
) -> ResolutionPlan | None:
    """The step planned by the fused kernel in one launch; None when it does not fit it."""
    shape = fused_plan_shape(max_tokens_per_request, positions.shape[1], hot.positions.shape[1])
    if shape is None or not (hot.positions.is_contiguous() and hot.stamps.is_contiguous()):
        return None
    plan, inputs, outputs = fused_plan_buffers(
        positions, token_requests, host_page_table, table_rows, staging_slots
    )
    torch.ops._hisparse_C.plan_resolution(
        *inputs, hot.positions, hot.stamps, block_size, step, *shape, *outputs
    )
    return plan


def _plan_with_torch(
    positions: torch.Tensor,
    token_requests: torch.Tensor,
    host_page_table: torch.Tensor,
    block_size: int,
    hot: HotState,
    staging_slots: torch.Tensor,
    step: int,
    table_rows: torch.Tensor,
) -> ResolutionPlan:
    """The step planned with fixed-shape torch operations, phase by phase (the module
    docstring's rules). Each phase's temporaries go when it returns: the peak beside the
    plan is a few [T * K] int64 arrays (docs/architecture.md, "Plan memory")."""
    num_requests = hot.positions.shape[0]
    token_requests, table_rows, out_of_bounds = _bounded_requests(
        token_requests, table_rows, num_requests, host_page_table.shape[0]
    )
    on_host, entry_request = _entries_on_host(
        positions, token_requests, host_page_table, table_rows, block_size
    )
    unique_key, distinct_of_entry = _distinct_rows(positions, on_host, entry_request, num_requests)
    valid = unique_key != num_requests * KEY_STRIDE
    hit, hit_flat = _hits(hot, unique_key, valid, num_requests)
    request = torch.where(valid, unique_key // KEY_STRIDE, 0)
    position = torch.where(valid, unique_key % KEY_STRIDE, 0)
    del unique_key
    slots = _assign_slots(hot, request, position, valid, hit, hit_flat, staging_slots)
    del valid, hit, hit_flat
    _advance_hot_state(hot, slots, step)
    num_tokens, topk = positions.shape
    entry_slot = torch.where(on_host, slots.slot[distinct_of_entry.view(num_tokens, topk)], 0)
    del distinct_of_entry
    return _loads_and_errors(
        on_host,
        entry_request,
        entry_slot,
        slots,
        host_page_table,
        table_rows,
        block_size,
        num_requests,
        out_of_bounds,
    )


@dataclass
class _Slots:
    """Each distinct row of the step and what happens to it ([T * K] each; past the
    distinct rows, padding that is neither hit nor miss)."""

    request: torch.Tensor  # its request (0 for padding)
    position: torch.Tensor  # its position (0 for padding)
    slot: torch.Tensor  # hot (< H) or staging (>= H); 0 for padding and overflow
    hit: torch.Tensor  # held in the request's hot buffer
    miss: torch.Tensor
    to_hot: torch.Tensor  # a miss that takes an eligible hot slot
    overflow: torch.Tensor  # a miss beyond the hot and staging slots


def _bounded_requests(
    token_requests: torch.Tensor, table_rows: torch.Tensor, num_requests: int, num_table_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | int]:
    """Token requests and table rows made safe to index with, and the out-of-bounds flag.

    A request row outside the hot state, or a table row outside the page table, is an
    accounting error: flagged, and read as resident so every gather stays in bounds.
    """
    if token_requests.is_cuda:  # device tensors: flagged without reading anything back
        out_of_bounds = (
            ((token_requests < -1) | (token_requests >= num_requests)).any()
            | ((table_rows < 0) | (table_rows >= num_table_rows)).any()
        ).long()
        token_requests = torch.where(token_requests < num_requests, token_requests.long(), -1)
        return token_requests, table_rows.clamp(min=0, max=max(num_table_rows - 1, 0)), out_of_bounds
    # Host tensors: two reads, and the clamps only when needed.
    low, high = (int(v) for v in torch.aminmax(token_requests)) if token_requests.numel() else (-1, -1)
    rows_low, rows_high = (int(v) for v in torch.aminmax(table_rows))
    flagged = int(low < -1 or high >= num_requests or rows_low < 0 or rows_high >= num_table_rows)
    token_requests = token_requests.long()
    if flagged:
        token_requests = torch.where(token_requests < num_requests, token_requests, -1)
        table_rows = table_rows.clamp(min=0, max=max(num_table_rows - 1, 0))
    return token_requests, table_rows, flagged


def _entries_on_host(
    positions: torch.Tensor,
    token_requests: torch.Tensor,
    host_page_table: torch.Tensor,
    table_rows: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, K] bool, [T, K] int64): the entries on HOST pages, and their request (0 elsewhere)."""
    num_pages = host_page_table.shape[1]
    pos = positions.long()
    entry_request = token_requests.unsqueeze(1).expand_as(pos)
    page = pos.clamp(min=0) // block_size
    on_host = (pos >= 0) & (entry_request >= 0) & (page < num_pages)
    page.clamp_(max=max(num_pages - 1, 0))
    on_host &= host_page_table[table_rows[entry_request.clamp(min=0)], page] >= 0
    return on_host, torch.where(on_host, entry_request, 0)


def _distinct_rows(
    positions: torch.Tensor, on_host: torch.Tensor, entry_request: torch.Tensor, num_requests: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """([T * K], [T * K]): the distinct (request, position) keys on HOST pages ascending,
    padded with the sentinel M * KEY_STRIDE, and each entry's number among them."""
    num_entries = on_host.numel()
    sentinel = num_requests * KEY_STRIDE
    key = torch.where(on_host, entry_request * KEY_STRIDE + positions.long(), sentinel).flatten()
    sorted_key, order = torch.sort(key)
    del key
    first = torch.ones_like(sorted_key, dtype=torch.bool)
    first[1:] = sorted_key[1:] != sorted_key[:-1]
    first &= sorted_key != sentinel
    distinct_of_sorted = torch.cumsum(first, 0) - 1
    unique_key = torch.full((num_entries + 1,), sentinel, dtype=torch.int64, device=on_host.device)
    unique_key.scatter_(0, torch.where(first, distinct_of_sorted, num_entries), sorted_key)
    del first, sorted_key
    unique_key = unique_key[:num_entries]
    # Back to entry order: each entry's distinct row (the sort's order is no longer needed).
    distinct_of_entry = torch.empty_like(distinct_of_sorted)
    distinct_of_entry[order] = distinct_of_sorted
    del order, distinct_of_sorted
    distinct_of_entry.clamp_(min=0)
    return unique_key, distinct_of_entry


def _hits(
    hot: HotState, unique_key: torch.Tensor, valid: torch.Tensor, num_requests: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """([T * K] bool, [T * K] int64): the distinct rows a hot buffer holds, and where
    (request * H + slot)."""
    held = hot.positions.flatten()
    if not held.numel():
        return torch.zeros_like(valid), torch.zeros_like(unique_key)
    hot_slots = hot.positions.shape[1]
    held_request = torch.arange(num_requests, device=held.device).repeat_interleave(hot_slots)
    held_key = torch.where(held >= 0, held_request * KEY_STRIDE + held, num_requests * KEY_STRIDE + 1)
    sorted_held, held_order = torch.sort(held_key)
    at = torch.searchsorted(sorted_held, unique_key).clamp_(max=held.numel() - 1)
    return valid & (sorted_held[at] == unique_key), held_order[at]


def _assign_slots(
    hot: HotState,
    request: torch.Tensor,
    position: torch.Tensor,
    valid: torch.Tensor,
    hit: torch.Tensor,
    hit_flat: torch.Tensor,
    staging_slots: torch.Tensor,
) -> _Slots:
    """Hits keep their slot; misses, ranked by position within their request, take its
    eligible slots in LRU order (unselected first, then (stamp, slot)), then its staging
    slots; what is left over is an overflow."""
    num_requests, hot_slots = hot.positions.shape
    device = hit.device
    dummy = num_requests * hot_slots
    selected = torch.zeros(dummy + 1, dtype=torch.bool, device=device)
    selected[torch.where(hit, hit_flat, dummy)] = True
    selected = selected[:dummy].view(num_requests, hot_slots)
    _, by_stamp = torch.sort(hot.stamps, dim=1, stable=True)
    _, by_selected = torch.sort(selected.gather(1, by_stamp).to(torch.int8), dim=1, stable=True)
    lru_order = by_stamp.gather(1, by_selected)
    num_eligible = hot_slots - selected.sum(dim=1)
    del selected, by_stamp, by_selected

    miss = valid & ~hit
    misses_per_request = torch.zeros(num_requests + 1, dtype=torch.int64, device=device)
    misses_per_request.scatter_add_(0, torch.where(miss, request, num_requests), miss.long())
    miss_start = torch.cumsum(misses_per_request, 0) - misses_per_request
    rank = torch.cumsum(miss.long(), 0)
    rank -= 1 + miss_start[request]
    rank -= num_eligible[request]  # from here: the rank among the request's staged misses
    to_hot = miss & (rank < 0)
    overflow = miss & ~to_hot & (rank >= staging_slots.long()[request])
    if hot_slots:
        slot = lru_order[request, (rank + num_eligible[request]).clamp_(min=0, max=hot_slots - 1)]
    else:
        slot = torch.zeros_like(rank)
    slot = torch.where(to_hot, slot, hot_slots + rank)
    del rank
    slot = torch.where(hit, hit_flat % max(hot_slots, 1), slot)
    # Slot 0 for what has no slot (padding past the distinct rows, an overflowing miss,
    # counted in `error`), so every gather by slot stays in bounds.
    slot.masked_fill_(~(hit | miss) | overflow, 0)
    return _Slots(request, position, slot, hit, miss, to_hot, overflow)


def _advance_hot_state(hot: HotState, slots: _Slots, step: int) -> None:
    """Stamp the slots selected now, and put each miss that took a hot slot there."""
    num_requests, hot_slots = hot.positions.shape
    dummy = num_requests * hot_slots
    flat = torch.where(slots.hit | slots.to_hot, slots.request * hot_slots + slots.slot, dummy)
    stamps = torch.cat([hot.stamps.flatten(), hot.stamps.new_zeros(1)])
    stamps[flat] = step
    positions_after = torch.cat([hot.positions.flatten(), hot.positions.new_zeros(1)])
    positions_after[torch.where(slots.to_hot, flat, dummy)] = slots.position
    del flat
    hot.stamps.copy_(stamps[:dummy].view_as(hot.stamps))
    hot.positions.copy_(positions_after[:dummy].view_as(hot.positions))


def _loads_and_errors(
    on_host: torch.Tensor,
    entry_request: torch.Tensor,
    entry_slot: torch.Tensor,
    slots: _Slots,
    host_page_table: torch.Tensor,
    table_rows: torch.Tensor,
    block_size: int,
    num_requests: int,
    out_of_bounds: torch.Tensor | int,
) -> ResolutionPlan:
    """The rows to copy from the host pool, the counters and the error words, as a plan."""
    request, position = slots.request, slots.position
    load = slots.miss & ~slots.overflow
    staged = load & ~slots.to_hot
    last_page = max(host_page_table.shape[1] - 1, 0)
    source_page = host_page_table[table_rows[request], (position // block_size).clamp_(max=last_page)]
    not_in_pool = load & (source_page < 0)
    error = (
        slots.overflow.any().long() * ERROR_STAGING_OVERFLOW
        + not_in_pool.any().long() * ERROR_NOT_IN_HOST_POOL
        + out_of_bounds * ERROR_REQUEST_OUT_OF_BOUNDS
    )
    # The same bits per request (`request` is 0 where no entry is, and neither flag is set).
    overflowed = torch.zeros(num_requests, dtype=torch.int64, device=request.device).scatter_add_(
        0, request, slots.overflow.long()
    )
    missing = torch.zeros_like(overflowed).scatter_add_(0, request, not_in_pool.long())
    request_error = (overflowed > 0).long() * ERROR_STAGING_OVERFLOW
    request_error += (missing > 0).long() * ERROR_NOT_IN_HOST_POOL
    load &= ~not_in_pool
    load_host_row = source_page.clamp_(min=0) * block_size
    del source_page
    load_host_row += position % block_size
    return ResolutionPlan(
        on_host=on_host,
        entry_request=entry_request,
        entry_slot=entry_slot,
        load=load,
        load_request=request,
        load_slot=slots.slot,
        load_host_row=load_host_row,
        counts=torch.stack([load.sum(), slots.hit.sum(), (staged & ~not_in_pool).sum()]),
        error=error,
        request_error=request_error,
    )


def host_entries(
    positions: torch.Tensor,
    token_requests: torch.Tensor,
    host_page_table: torch.Tensor,
    table_rows: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """[T, K] bool: the entries that are positions on HOST pages of their token's request
    (token_requests and table_rows in bounds: `plan_resolution` flags the others)."""
    num_pages = host_page_table.shape[1]
    pos = positions.long()
    request = token_requests.long().unsqueeze(1).expand_as(pos)
    page = pos.clamp(min=0) // block_size
    candidate = (pos >= 0) & (request >= 0) & (page < num_pages)
    rows = table_rows[request.clamp(min=0, max=max(table_rows.shape[0] - 1, 0))]
    host_page = host_page_table[rows, page.clamp(max=max(num_pages - 1, 0))]
    return candidate & (host_page >= 0)


def partition_passes(
    positions: torch.Tensor,
    token_requests: torch.Tensor,
    host_page_table: torch.Tensor,
    table_rows: torch.Tensor,
    block_size: int,
    capacity: torch.Tensor | Sequence[int],
) -> tuple[torch.Tensor, int]:
    """([T] int64, P): the pass of each token (see the module docstring), and the passes.

    Request m's tokens, in order, are cut into the longest runs whose distinct
    positions on HOST pages number at most capacity[m] (its hot rows plus its
    staging rows); a token of a request without HOST pages is in pass 0. Every
    request's runs are cut together with fixed-shape operations; the host reads one
    [M] vector per pass (where each request's run ends), so a step of P passes reads
    back P times. The caller calls it only for a step that may need passes (what some
    request may select above its capacity).
    """
    device = positions.device
    num_tokens, topk = positions.shape
    limits = capacity.tolist() if isinstance(capacity, torch.Tensor) else list(capacity)
    num_requests = len(limits)
    if not num_tokens or not num_requests:
        return torch.zeros(num_tokens, dtype=torch.int64, device=device), 1
    on_host = host_entries(positions, token_requests, host_page_table, table_rows, block_size)
    request = torch.where(
        (token_requests >= 0) & (token_requests < num_requests), token_requests.long(), num_requests
    )
    # Each token's rank among its request's tokens (their order kept).
    by_request = torch.sort(request, stable=True).indices
    tokens_of = torch.zeros(num_requests + 1, dtype=torch.int64, device=device).scatter_add_(
        0, request, torch.ones_like(request)
    )
    local = torch.empty_like(request)
    local[by_request] = (
        torch.arange(num_tokens, device=device)
        - (torch.cumsum(tokens_of, 0) - tokens_of)[request[by_request]]
    )
    # The distinct (request, position) keys on HOST pages, numbered; the rest share the last.
    entry_request = request.unsqueeze(1).expand(num_tokens, topk).flatten()
    entry_local = local.unsqueeze(1).expand(num_tokens, topk).flatten()
    on_host = on_host.flatten()
    sentinel = (num_requests + 1) * KEY_STRIDE
    key = torch.where(on_host, entry_request * KEY_STRIDE + positions.long().flatten(), sentinel)
    sorted_key, order = torch.sort(key)
    new = torch.ones_like(sorted_key, dtype=torch.bool)
    new[1:] = sorted_key[1:] != sorted_key[:-1]
    key_id = torch.empty_like(order)
    key_id[order] = torch.cumsum(new, 0) - 1
    num_keys = num_entries = num_tokens * topk
    id_request = torch.full((num_keys,), num_requests, dtype=torch.int64, device=device)
    id_request.scatter_(0, key_id, torch.where(on_host, entry_request, num_requests))
    limit = torch.tensor(limits, dtype=torch.int64).to(device, non_blocking=True)
    span = num_tokens + 1  # composite (request, first token) keys, request-major
    absent = (num_requests + 1) * span
    start = torch.zeros(num_requests + 1, dtype=torch.int64, device=device)
    ends: list[list[int]] = [[] for _ in range(num_requests)]
    while True:
        # Each key's first token at or after its request's run start, then the keys of each
        # request in that order: the run ends before the token of the (limit + 1)-th.
        later = on_host & (entry_local >= start[entry_request])
        first = torch.full((num_keys + 1,), num_tokens, dtype=torch.int64, device=device)
        first.scatter_reduce_(0, torch.where(later, key_id, num_keys), entry_local, reduce="amin")
        present = first[:num_keys] < num_tokens
        composite = torch.sort(torch.where(present, id_request * span + first[:num_keys], absent)).values
        keys_of = torch.zeros(num_requests + 1, dtype=torch.int64, device=device).scatter_add_(
            0, torch.where(present, id_request, num_requests), present.long()
        )[:num_requests]
        at = (torch.cumsum(keys_of, 0) - keys_of + limit).clamp_(max=num_entries - 1)
        boundary = composite[at] - torch.arange(num_requests, device=device) * span
        end = torch.where(keys_of > limit, torch.maximum(boundary, start[:num_requests] + 1), -1)
        cut = end.tolist()  # the pass's one read
        if all(e < 0 for e in cut):
            break
        for m, e in enumerate(cut):
            if e >= 0:
                ends[m].append(e)
        start[:num_requests] = torch.where(end >= 0, end, num_tokens)
    # A token's pass: how many of its request's runs end at or before it.
    widest = max(len(e) for e in ends)
    if not widest:
        return torch.zeros(num_tokens, dtype=torch.int64, device=device), 1
    table = torch.full((num_requests + 1, widest), num_tokens, dtype=torch.int64)
    for m, e in enumerate(ends):
        table[m, : len(e)] = torch.tensor(e, dtype=torch.int64)
    table = table.to(device, non_blocking=True)
    return (table[request] <= local.unsqueeze(1)).sum(dim=1), widest + 1


def plan_passes(
    positions: torch.Tensor,
    token_requests: torch.Tensor,
    host_page_table: torch.Tensor,
    block_size: int,
    hot: HotState,
    staging_slots: torch.Tensor,
    step: int,
    table_rows: torch.Tensor,
    token_pass: torch.Tensor,
    num_passes: int,
) -> list[tuple[torch.Tensor, ResolutionPlan]]:
    """The step as passes: for each, its tokens (indices into the step's) and its plan,
    made in order from the hot state the previous pass left (updates `hot`)."""
    passes = []
    for p in range(num_passes):
        tokens = torch.nonzero(token_pass == p).squeeze(1)
        plan = plan_resolution(
            positions[tokens],
            token_requests[tokens],
            host_page_table,
            block_size,
            hot,
            staging_slots,
            step,
            table_rows,
        )
        passes.append((tokens, plan))
    return passes


def fused_plan_shape(max_tokens_per_request: int, topk: int, hot_rows: int) -> tuple[int, int] | None:
    """(entries, hot rows) padded to powers of two for the fused plan; None when it does not fit."""
    entries = max(max_tokens_per_request, 1) * topk
    if not 0 < entries <= FUSED_PLAN_MAX_ENTRIES or not 0 < hot_rows <= FUSED_PLAN_MAX_HOT_ROWS:
        return None
    return 1 << (entries - 1).bit_length(), 1 << (hot_rows - 1).bit_length()


def fused_plan_buffers(
    positions: torch.Tensor,
    token_requests: torch.Tensor,
    host_page_table: torch.Tensor,
    table_rows: torch.Tensor,
    staging_slots: torch.Tensor,
) -> tuple[ResolutionPlan, tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]:
    """A zeroed plan for the fused kernel to fill, its inputs in the dtypes and layout
    the kernel reads, and the two buffers behind the plan that the kernel writes:
    flags [2, T * K] (on_host, load) and ints [5 * T * K + 4 + M] (entry_request,
    entry_slot, load_request, load_slot, load_host_row, then counts, the step's error
    word and each request's)."""
    num_tokens, topk = positions.shape
    num_requests = table_rows.shape[0]
    device = positions.device
    entries = num_tokens * topk
    flags = torch.zeros((2, entries), dtype=torch.bool, device=device)
    ints = torch.zeros((5 * entries + 4 + num_requests), dtype=torch.int64, device=device)
    rows = ints[: 5 * entries].view(5, entries)
    plan = ResolutionPlan(
        on_host=flags[0].view(num_tokens, topk),
        entry_request=rows[0].view(num_tokens, topk),
        entry_slot=rows[1].view(num_tokens, topk),
        load=flags[1],
        load_request=rows[2],
        load_slot=rows[3],
        load_host_row=rows[4],
        counts=ints[5 * entries : 5 * entries + 3],
        error=ints[5 * entries + 3],
        request_error=ints[5 * entries + 4 :],
    )
    inputs = (
        positions.to(torch.int32).contiguous(),
        token_requests.to(torch.int64).contiguous(),
        host_page_table.contiguous(),
        table_rows.to(torch.int64).contiguous(),
        staging_slots.to(torch.int64).contiguous(),
    )
    return plan, inputs, (flags, ints)


def apply_resolution(
    plan: ResolutionPlan,
    rows: torch.Tensor,
    slot_rows: torch.Tensor,
    kv_rows: torch.Tensor,
    host_rows: torch.Tensor,
    copy_rows: torch.Tensor | None = None,
    error: torch.Tensor | None = None,
    block_stride_rows: int | None = None,
    block_rows: int | None = None,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """Replay `plan` for one layer: copy its misses, return the rows attention reads.

    rows [T, K]: the backend's own conversion of the selections (resident
    entries are right; entries on HOST pages point at the null block).
    slot_rows [M, H + S]: each request's hot and staging slots in the index
    space of `rows`. copy_rows: the same slots as rows of `kv_rows` (default
    `slot_rows`: the same index space); misses are copied there from
    `host_rows`, this layer's host pool as rows. `error`: the step's error word
    the row copy kernel raises bits in (default: the plan's own). block_stride_rows,
    block_rows: the layer's rows within `kv_rows` (see `copy_host_rows`).

    On CUDA caches the extension does it all in one launch (csrc/hisparse_apply.cu: one
    thread per entry resolves, and each warp copies the misses among its entries); the
    torch operations below are its reference and serve everywhere else. `use_kernel`
    forces one.
    """
    copy_rows = slot_rows if copy_rows is None else copy_rows
    if use_kernel is None:
        use_kernel = kv_rows.is_cuda and cuda_kernels_available()
    if use_kernel:
        if block_stride_rows is None or block_rows is None:
            block_stride_rows = block_rows = max(kv_rows.shape[0], 1)
        return torch.ops._hisparse_C.apply_resolution(
            rows.contiguous(),
            plan.on_host.contiguous(),
            plan.entry_request.contiguous(),
            plan.entry_slot.contiguous(),
            slot_rows.long().contiguous(),
            kv_rows,
            copy_rows.long().contiguous(),
            host_rows,
            plan.load.contiguous(),
            plan.load_request.contiguous(),
            plan.load_slot.contiguous(),
            plan.load_host_row.contiguous(),
            plan.error if error is None else error,
            block_stride_rows,
            block_rows,
        )
    destination = copy_rows[plan.load_request, plan.load_slot]
    copy_host_rows(
        kv_rows,
        destination,
        host_rows,
        plan.load_host_row,
        plan.load,
        error=plan.error if error is None else error,
        block_stride_rows=block_stride_rows,
        block_rows=block_rows,
    )
    resolved = slot_rows[plan.entry_request, plan.entry_slot].to(rows.dtype)
    return torch.where(plan.on_host, resolved, rows)


def copy_host_rows(
    kv_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    host_rows: torch.Tensor,
    src_rows: torch.Tensor,
    copy: torch.Tensor,
    use_kernel: bool | None = None,
    error: torch.Tensor | None = None,
    block_stride_rows: int | None = None,
    block_rows: int | None = None,
) -> None:
    """For every i with copy[i]: device row dst_rows[i] of kv_rows = host row src_rows[i].

    The entries are a plan's fixed-size per-entry arrays, masked by `copy`, so
    nothing waits for a count. Copied entries must not share a destination and
    every row must lie in its table, and in its layer: where layers share a
    block-outermost allocation, kv_rows spans them all and block b's rows of this
    layer are b * block_stride_rows + [0, block_rows) (default: every row of
    kv_rows is the layer's). On CUDA caches the extension's kernel reads
    the pinned host pool through its device mapping, ordered on the current
    stream (csrc/hisparse_row_copy.cu): it skips an entry out of bounds and sets
    ERROR_ROW_OUT_OF_BOUNDS in `error`, the step's error word, which the worker
    reads once per step (without `error`, this call reads its own word back and
    raises: for tools and tests, not the serving path). The torch reference below
    serves everywhere else and raises `ResolverError` at once. `use_kernel` forces one.
    """
    if use_kernel is None:
        use_kernel = kv_rows.is_cuda and cuda_kernels_available()
    if block_stride_rows is None or block_rows is None:
        block_stride_rows = block_rows = max(kv_rows.shape[0], 1)
    if not 0 < block_rows <= block_stride_rows:
        raise ValueError(
            f"block_rows must be positive and at most block_stride_rows, got {block_rows} and "
            f"{block_stride_rows}"
        )
    if use_kernel:
        own_error = error is None
        word = torch.zeros((), dtype=torch.int64, device=kv_rows.device) if own_error else error
        torch.ops._hisparse_C.copy_host_rows(
            kv_rows,
            dst_rows.long().contiguous(),
            host_rows,
            src_rows.long().contiguous(),
            copy.contiguous(),
            word,
            block_stride_rows,
            block_rows,
        )
        if own_error:
            assert word is not None
            check_resolution_error(int(word))
        return
    if kv_rows.is_cuda:
        require_cuda_kernels()
    dst, src = dst_rows[copy].long(), src_rows[copy].long()
    if dst.numel():
        low, high = (int(v) for v in torch.aminmax(dst))
        if low < 0 or high >= kv_rows.shape[0]:
            raise ResolverError(f"HiSparse row copy: a destination row is outside [0, {kv_rows.shape[0]})")
        if block_rows < block_stride_rows and bool(((dst % block_stride_rows) >= block_rows).any()):
            raise ResolverError(
                f"HiSparse row copy: a destination row lies between this layer's blocks (rows "
                f"[{block_rows}, {block_stride_rows}) of a block stride belong to other layers)"
            )
        low, high = (int(v) for v in torch.aminmax(src))
        if low < 0 or high >= host_rows.shape[0]:
            raise ResolverError(f"HiSparse row copy: a host row is outside [0, {host_rows.shape[0]})")
        if torch.unique(dst).numel() != dst.numel():
            raise ResolverError("HiSparse row copy: two copies write one destination row")
    kv_rows[dst] = host_rows[src]


def resolve_topk_slots(
    positions: torch.Tensor,
    token_requests: torch.Tensor,
    rows: torch.Tensor,
    host_page_table: torch.Tensor,
    block_size: int,
    hot: HotState,
    slot_rows: torch.Tensor,
    staging_slots: torch.Tensor,
    kv_rows: torch.Tensor,
    host_rows: torch.Tensor,
    step: int,
    table_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ResolutionPlan]:
    """One layer, one step: `plan_resolution` then `apply_resolution`; raises on an error."""
    plan = plan_resolution(
        positions, token_requests, host_page_table, block_size, hot, staging_slots, step, table_rows
    )
    check_resolution_error(int(plan.error))
    return apply_resolution(plan, rows, slot_rows, kv_rows, host_rows), plan


def describe_resolution_error(error: int) -> str:
    """What the error bits of one request's own word say, for its error message."""
    reasons = []
    if error & ERROR_STAGING_OVERFLOW:
        reasons.append("its selections needed more distinct host rows than its hot buffer and staging hold")
    if error & ERROR_NOT_IN_HOST_POOL:
        reasons.append("a selected position was neither resident nor in the host pool")
    return "; ".join(reasons) or f"error bits {error:#x}"


def check_resolution_error(error: int) -> None:
    """Raise for the error bits a step's plans reported (read once per step, off the hot path)."""
    if error & ERROR_STAGING_OVERFLOW:
        raise ResolverError(
            "HiSparse: a request selected more distinct host rows in one step than its hot "
            "buffer and the staging rows the scheduler leased for the step hold"
        )
    if error & ERROR_NOT_IN_HOST_POOL:
        raise ResolverError("HiSparse: a selected position is neither resident nor in the host pool")
    if error & ERROR_REQUEST_OUT_OF_BOUNDS:
        raise ResolverError("HiSparse: a token's request row is outside the step's hot state")
    if error & ERROR_ROW_OUT_OF_BOUNDS:
        raise ResolverError("HiSparse row copy: a destination or host row was out of bounds (copy skipped)")
    if error & ERROR_PAGE_OUT_OF_BOUNDS:
        raise ResolverError("HiSparse page copy: a device block or host page was out of bounds (skipped)")


def _validate(
    positions: torch.Tensor,
    token_requests: torch.Tensor,
    host_page_table: torch.Tensor,
    hot: HotState,
    staging_slots: torch.Tensor,
    table_rows: torch.Tensor,
) -> None:
    if positions.dim() != 2 or positions.dtype not in (torch.int32, torch.int64) or positions.shape[1] < 1:
        raise ValueError(
            "positions must be [T, K] int32/int64 with K (the top-K) > 0, got "
            f"{tuple(positions.shape)} {positions.dtype}"
        )
    if token_requests.shape != (positions.shape[0],):
        raise ValueError(f"token_requests must be [{positions.shape[0]}], got {tuple(token_requests.shape)}")
    if host_page_table.dim() != 2 or host_page_table.dtype != torch.int64:
        raise ValueError(
            f"host_page_table must be [R, P] int64, got {tuple(host_page_table.shape)} "
            f"{host_page_table.dtype}"
        )
    hot.validate()
    num_requests = hot.positions.shape[0]
    if not num_requests:
        raise ValueError("resolution needs at least one request with HOST pages (hot state rows)")
    if staging_slots.shape != (num_requests,) or table_rows.shape != (num_requests,):
        raise ValueError(
            f"staging_slots and table_rows must be [{num_requests}] (one per hot state row), got "
            f"{tuple(staging_slots.shape)} and {tuple(table_rows.shape)}"
        )
