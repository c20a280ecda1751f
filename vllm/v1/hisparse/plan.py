# SPDX-License-Identifier: Apache-2.0
"""The messages between Hybrid HiSparse's scheduler and its workers.

Owns the types that cross from the scheduler process to the workers in
`SchedulerOutput.hisparse_plan`, one plan per step, and the names of the
counters that come back in `ModelRunnerOutput.hisparse_counters`. The plan's
types are frozen dataclasses (and named tuples) of plain ints, strings and
tuples, so they pickle cheaply and mean the same on both sides. The version number changes whenever
a field changes meaning; workers refuse other versions.

A leaf: it imports nothing from HiSparse and holds no behaviour.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, NewType

# Bump when a field of the plan changes meaning; workers refuse other versions.
HISPARSE_PLAN_VERSION = 9

# The ids that cross between scheduler and workers, typed so that a block id, a host
# page and a page index cannot be passed one for another.
BlockId = NewType("BlockId", int)  # a block of the device KV cache pool
HostPage = NewType("HostPage", int)  # a page of the host pool
PageIndex = NewType("PageIndex", int)  # a page's position in its request's block table
CopyId = NewType("CopyId", int)  # one device->host copy, unique for the scheduler's life
# A `HostPageRun`'s host page for a page resident again (restored for a prefill chunk).
NOT_ON_HOST = HostPage(-1)

# What the workers count on the data path, reported per step in
# ModelRunnerOutput.hisparse_counters. On the device: distinct rows loaded from the
# host pool, found in a hot buffer, and staged beyond it (each summed over layers).
DEVICE_COUNTERS = ("rows_loaded", "rows_hit", "rows_staged")
# On the host: steps the worker executed (with or without a forward), resolution
# plans made (one per top-K selection, step and pass), resolver calls (one per
# resolved layer, step and pass), attention passes beyond a layer's first in a step
# (a layer whose request selects more rows than its hot and staging rows hold attends
# in several), attention kernel calls of managed layers (one per layer and step),
# steps whose forward ran those layers, steps that resolved, the most resolver calls
# one layer made in one step, the most bytes a step's resolution plans held at once
# (docs/architecture.md, "Plan memory"), the host pools the engine's ranks write
# (one per node they span), and the copy launches that fell back to byte-by-byte
# copies for want of 16-byte alignment (CUDA).
HOST_COUNTERS = (
    "worker_steps",
    "resolution_plans",
    "resolver_calls",
    "extra_attention_passes",
    "partitioned_plans",
    "attention_calls",
    "forward_steps",
    "resolving_steps",
    "max_resolver_calls_per_layer_step",
    "max_plan_bytes",
    "max_host_pools",
    "narrow_copy_launches",
)
# All of them, and the host's reads of device-produced values. Names starting with
# "max_" are maxima; the rest add up over steps.
WORKER_COUNTERS = (*DEVICE_COUNTERS, *HOST_COUNTERS, "device_reads")


class PageCopy(NamedTuple):
    """One page, all sparse-MLA layers, device -> host after the forward.

    Workers report it by `copy_id`, never by request and page: a request that is
    preempted and resumes plans the same page again while the first copy may still
    be in flight, and each report must reach the copy it belongs to. A first turn's
    prefill plans a copy per page (1,160 for 74K tokens): a named tuple is made in
    less than half the time of a frozen dataclass.
    """

    copy_id: CopyId
    request_id: str
    page_index: PageIndex
    block_ids: tuple[BlockId, ...]
    host_page: HostPage


@dataclass(frozen=True)
class BlockTableUpdate:
    """Set one page's entries of a request's block tables on the worker, one in each
    sparse-MLA group's table (tables are otherwise append-only)."""

    request_id: str
    position: PageIndex  # the page's block index in the request's tables
    # One per sparse-MLA group, in the plan's group order; null blocks for a demoted page.
    block_ids: tuple[BlockId, ...]


@dataclass(frozen=True)
class PageRestore:
    """One page, all sparse-MLA layers, host -> device before the forward (a KV connector hit,
    or a HOST page a prefill chunk restores instead of staging its rows)."""

    request_id: str
    page_index: PageIndex
    block_ids: tuple[BlockId, ...]  # one per sparse-MLA group, in the plan's group order
    host_page: HostPage


class HostPageRun(NamedTuple):
    """Consecutive pages of a request that are now only in the host pool (demoted, or a
    host prefix hit), from `first_page` on, one host page each; with `NOT_ON_HOST`, a
    HOST page resident again (a prefill chunk restored it).

    The worker's map holds a request's HOST pages until the request ends (finishes,
    is aborted or preempted); a plan's runs apply in order. One run for a turn that
    starts from its history in the host pool (2,200 pages for a 142K-token session),
    not one record per page: the host pages are a tuple of ints, which pickles as one
    and which Python's garbage collector stops tracking, where 2,200 records would
    each be tracked (and promoted to its oldest generation, whose full passes walk every
    request's token lists).
    """

    request_id: str
    first_page: PageIndex
    host_pages: tuple[HostPage, ...]

    def pages(self) -> Iterator[tuple[PageIndex, HostPage]]:
        """(page index, host page) of each page of the run, in order."""
        for offset, host_page in enumerate(self.host_pages):
            yield PageIndex(self.first_page + offset), host_page


def host_page_runs(request_id: str, pages: Iterable[tuple[int, HostPage]]) -> list[HostPageRun]:
    """`pages` (page index, host page each, in order) as runs of consecutive indices."""
    runs: list[HostPageRun] = []
    first, last = -1, -2
    host_pages: list[HostPage] = []
    for index, host_page in pages:
        if index != last + 1 and host_pages:
            runs.append(HostPageRun(request_id, PageIndex(first), tuple(host_pages)))
            host_pages = []
        if not host_pages:
            first = index
        host_pages.append(host_page)
        last = index
    if host_pages:
        runs.append(HostPageRun(request_id, PageIndex(first), tuple(host_pages)))
    return runs


@dataclass(frozen=True)
class HotLeaseUpdate:
    """A request's new hot lease: its hot buffer starts empty in these blocks.

    Every lease has the default lease's width; a smaller one (a request whose whole
    context fits in fewer rows) ends in null blocks, slots its resolver never uses.
    """

    request_id: str
    block_ids: tuple[tuple[BlockId, ...], ...]  # per sparse-MLA group, in the plan's group order


@dataclass(frozen=True)
class StepStaging:
    """Rows a request may use this step only, for misses beyond its hot buffer."""

    request_id: str
    num_slots: int  # rows per sparse-MLA layer: the blocks' pages, whole
    block_ids: tuple[tuple[BlockId, ...], ...]  # per sparse-MLA group, in the plan's group order


@dataclass(frozen=True)
class HiSparseStepPlan:
    """One step's residency work for the workers. Plain ints, strings and tuples.

    Residency crosses as deltas: the workers keep every request's HOST pages and
    lease from earlier plans, so a plan's size follows what changed in the step,
    not the pages held.
    """

    version: int
    # The scheduler's step number (consecutive): what the step's reports refer to.
    step: int
    mla_group_ids: tuple[int, ...]
    # Device -> host, all sparse-MLA layers of each page, after this step's forward.
    copies: tuple[PageCopy, ...]
    # Applied before this step's forward, in order.
    block_table_updates: tuple[BlockTableUpdate, ...]
    # Host -> device, before this step's forward.
    restores: tuple[PageRestore, ...]
    # Pages that became HOST since the last plan.
    host_pages: tuple[HostPageRun, ...]
    # Hot leases taken since the last plan.
    leases: tuple[HotLeaseUpdate, ...]
    # This step's staging rows.
    staging: tuple[StepStaging, ...]
