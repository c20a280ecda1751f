# SPDX-License-Identifier: Apache-2.0
"""The OffloadingConnector's view of the KV cache with Hybrid HiSparse on.

Owns which KV cache groups the OffloadingConnector handles when
`hisparse_config` is set: every group but the sparse-MLA groups HiSparse
manages (`hisparse_managed_group_ids`), so the connector stores and loads the
indexer K cache (and an MTP drafter's layers) block by block while HiSparse
alone moves sparse-MLA pages to and from its host pool. The connector sees a
KV cache config of its groups only, and every per-group list of block ids that
crosses into it is narrowed to those groups.

A connector hit then covers only the connector's groups; the scheduler side
of HiSparse (`HiSparseScheduling.cap_external_hit`) limits it to pages whose
sparse-MLA content the host pool holds and serves those pages from there.
Where residency plans do not run (see `plans_executable`), the connector
keeps every group, as upstream.

It never touches tensors or the connector's state; it only filters.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

from vllm.config.hisparse import hisparse_active
from vllm.v1.hisparse.kv_grouping import hisparse_managed_group_ids

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

T = TypeVar("T")


def hisparse_connector_view(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[tuple[int, ...] | None, KVCacheConfig]:
    """(the connector's group ids, its KV cache config); (None, unchanged) with HiSparse off.

    Where the workers do not execute residency plans (see `plans_executable`), the
    sparse-MLA cache stays resident and the connector keeps handling every group.
    """
    if not hisparse_active(vllm_config):
        return None, kv_cache_config
    groups = kv_cache_config.kv_cache_groups
    managed = set(hisparse_managed_group_ids(groups))
    if not managed:
        return None, kv_cache_config
    group_ids = tuple(g for g in range(len(groups)) if g not in managed)
    # The tensors describe the one shared allocation and stay as they are.
    view = dataclasses.replace(kv_cache_config, kv_cache_groups=[groups[g] for g in group_ids])
    return group_ids, view


def select_groups(group_ids: tuple[int, ...] | None, per_group: Sequence[T]) -> tuple[T, ...]:
    """The entries of a per-group sequence that belong to the connector's groups."""
    if group_ids is None:
        return tuple(per_group)
    return tuple(per_group[g] for g in group_ids)


def connector_blocks(group_ids: tuple[int, ...] | None, blocks: KVCacheBlocks) -> KVCacheBlocks:
    if group_ids is None:
        return blocks
    return dataclasses.replace(blocks, blocks=select_groups(group_ids, blocks.blocks))


def connector_scheduler_output(
    group_ids: tuple[int, ...] | None, scheduler_output: SchedulerOutput
) -> SchedulerOutput:
    """A shallow copy whose new block ids cover only the connector's groups."""
    if group_ids is None:
        return scheduler_output
    narrowed = copy.copy(scheduler_output)
    new_reqs = []
    for req in scheduler_output.scheduled_new_reqs:
        req = copy.copy(req)
        req.block_ids = select_groups(group_ids, req.block_ids)
        new_reqs.append(req)
    narrowed.scheduled_new_reqs = new_reqs
    cached = copy.copy(scheduler_output.scheduled_cached_reqs)
    cached.new_block_ids = [
        None if ids is None else select_groups(group_ids, ids) for ids in cached.new_block_ids
    ]
    narrowed.scheduled_cached_reqs = cached
    return narrowed
