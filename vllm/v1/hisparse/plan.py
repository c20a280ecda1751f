# SPDX-License-Identifier: Apache-2.0
"""The messages Hybrid HiSparse's scheduler sends its workers, one plan per step.

Owns the types that cross from the scheduler process to the workers in
`SchedulerOutput.hisparse_plan`: frozen dataclasses of plain ints, strings and
tuples, so they pickle cheaply and mean the same on both sides. The version
number changes whenever a field changes meaning; workers refuse other versions.

A leaf: it imports nothing from HiSparse and holds no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

# Bump when a field of the plan changes meaning; workers refuse other versions.
HISPARSE_PLAN_VERSION = 2


@dataclass(frozen=True)
class PageCopy:
    """One page, all sparse-MLA layers, device -> host after the forward."""

    request_id: str
    page_index: int
    block_ids: tuple[int, ...]
    host_page: int


@dataclass(frozen=True)
class BlockTableUpdate:
    """Set one entry of a request's block table on the worker (tables are otherwise append-only)."""

    request_id: str
    group_id: int
    position: int  # block index in the request's table for that group
    block_id: int  # the null block for a demoted page


@dataclass(frozen=True)
class PageRestore:
    """One page, all sparse-MLA layers, host -> device before the forward (a KV connector hit)."""

    request_id: str
    page_index: int
    block_ids: tuple[int, ...]  # one per sparse-MLA group, in the plan's group order
    host_page: int


@dataclass(frozen=True)
class RequestResidencyMap:
    """What the resolver needs for one request that is not FULL."""

    request_id: str
    host_pages: tuple[tuple[int, int], ...]  # (page index, host page) of every HOST page
    hot_block_ids: tuple[tuple[int, ...], ...]  # per sparse-MLA group, its hot-buffer blocks


@dataclass(frozen=True)
class HiSparseStepPlan:
    """One step's residency work for the workers. Plain ints, strings and tuples."""

    version: int
    mla_group_ids: tuple[int, ...]
    # Device -> host, all sparse-MLA layers of each page, after this step's forward.
    copies: tuple[PageCopy, ...]
    # Applied before this step's forward, in order.
    block_table_updates: tuple[BlockTableUpdate, ...]
    # Host -> device, before this step's forward.
    restores: tuple[PageRestore, ...]
    # Only requests with HOST pages; empty means every request is FULL (the fast path).
    residency: tuple[RequestResidencyMap, ...]
